from pdserve.protos import kv_transfer_pb2 as _kv_transfer_pb2
from pdserve.protos import pdserve_pb2 as _pdserve_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReleaseReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RELEASE_REASON_UNSPECIFIED: _ClassVar[ReleaseReason]
    RELEASE_REASON_ABORTED: _ClassVar[ReleaseReason]
    RELEASE_REASON_TRANSFER_FAILED: _ClassVar[ReleaseReason]
    RELEASE_REASON_RETURNED: _ClassVar[ReleaseReason]
RELEASE_REASON_UNSPECIFIED: ReleaseReason
RELEASE_REASON_ABORTED: ReleaseReason
RELEASE_REASON_TRANSFER_FAILED: ReleaseReason
RELEASE_REASON_RETURNED: ReleaseReason

class KVHandle(_message.Message):
    __slots__ = ("prefill_address", "block_ids", "num_tokens", "lease_token", "block_checksums", "kv_salt")
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    KV_SALT_FIELD_NUMBER: _ClassVar[int]
    prefill_address: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    lease_token: str
    block_checksums: _containers.RepeatedScalarFieldContainer[int]
    kv_salt: str
    def __init__(self, prefill_address: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., lease_token: _Optional[str] = ..., block_checksums: _Optional[_Iterable[int]] = ..., kv_salt: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "router_id", "prefix")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _pdserve_pb2.SamplingParams
    router_id: str
    prefix: KVHandle
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_pdserve_pb2.SamplingParams, _Mapping]] = ..., router_id: _Optional[str] = ..., prefix: _Optional[_Union[KVHandle, _Mapping]] = ...) -> None: ...

class HoldPrefixRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "cache_salt", "router_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    router_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., router_id: _Optional[str] = ...) -> None: ...

class HoldPrefixResponse(_message.Message):
    __slots__ = ("kv",)
    KV_FIELD_NUMBER: _ClassVar[int]
    kv: KVHandle
    def __init__(self, kv: _Optional[_Union[KVHandle, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_logprob", "finish_reason", "kv", "num_cached_tokens", "prefill_seconds", "queue_seconds", "first_top_logprobs", "prompt_logprobs", "prompt_top_logprobs", "kv_streaming")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_STREAMING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_logprob: float
    finish_reason: _pdserve_pb2.FinishReason
    kv: KVHandle
    num_cached_tokens: int
    prefill_seconds: float
    queue_seconds: float
    first_top_logprobs: _pdserve_pb2.TopLogprobs
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[_pdserve_pb2.TopLogprobs]
    kv_streaming: bool
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[float] = ..., finish_reason: _Optional[_Union[_pdserve_pb2.FinishReason, str]] = ..., kv: _Optional[_Union[KVHandle, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., first_top_logprobs: _Optional[_Union[_pdserve_pb2.TopLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[_pdserve_pb2.TopLogprobs, _Mapping]]] = ..., kv_streaming: _Optional[bool] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_token", "reason")
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    lease_token: str
    reason: ReleaseReason
    def __init__(self, lease_token: _Optional[str] = ..., reason: _Optional[_Union[ReleaseReason, str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("lease_token", "block_ids", "renew")
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    RENEW_FIELD_NUMBER: _ClassVar[int]
    lease_token: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    renew: bool
    def __init__(self, lease_token: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., renew: _Optional[bool] = ...) -> None: ...

class ClaimResponse(_message.Message):
    __slots__ = ("lease_seconds",)
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    def __init__(self, lease_seconds: _Optional[float] = ...) -> None: ...

class AgentMetadataRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchKVRequest(_message.Message):
    __slots__ = ("lease_token",)
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    lease_token: str
    def __init__(self, lease_token: _Optional[str] = ...) -> None: ...

class KVProgress(_message.Message):
    __slots__ = ("ready_tokens", "done", "first_token_id", "checksums_from", "block_checksums")
    READY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FROM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    ready_tokens: int
    done: bool
    first_token_id: int
    checksums_from: int
    block_checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ready_tokens: _Optional[int] = ..., done: _Optional[bool] = ..., first_token_id: _Optional[int] = ..., checksums_from: _Optional[int] = ..., block_checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "first_token_id", "sampling", "kv", "local_prefill", "kv_streamed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    KV_STREAMED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    sampling: _pdserve_pb2.SamplingParams
    kv: KVHandle
    local_prefill: bool
    kv_streamed: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_pdserve_pb2.SamplingParams, _Mapping]] = ..., kv: _Optional[_Union[KVHandle, _Mapping]] = ..., local_prefill: _Optional[bool] = ..., kv_streamed: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "kv_bytes", "kv_transfer_seconds", "top_logprobs", "kv_progress", "prefilled", "handed_over")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_FIELD_NUMBER: _ClassVar[int]
    HANDED_OVER_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: _pdserve_pb2.FinishReason
    kv_bytes: int
    kv_transfer_seconds: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_pdserve_pb2.TopLogprobs]
    kv_progress: bool
    prefilled: PrefillResponse
    handed_over: KVHandle
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[_pdserve_pb2.FinishReason, str]] = ..., kv_bytes: _Optional[int] = ..., kv_transfer_seconds: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[_pdserve_pb2.TopLogprobs, _Mapping]]] = ..., kv_progress: _Optional[bool] = ..., prefilled: _Optional[_Union[PrefillResponse, _Mapping]] = ..., handed_over: _Optional[_Union[KVHandle, _Mapping]] = ...) -> None: ...

class WorkerAbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class WorkerAbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("router_id", "cache_events", "cache_epoch", "cache_events_after")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVENTS_AFTER_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    cache_events: bool
    cache_epoch: str
    cache_events_after: int
    def __init__(self, router_id: _Optional[str] = ..., cache_events: _Optional[bool] = ..., cache_epoch: _Optional[str] = ..., cache_events_after: _Optional[int] = ...) -> None: ...

class CacheEvents(_message.Message):
    __slots__ = ("epoch", "last_seq", "snapshot", "block_hashes", "cached", "in_tier")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    IN_TIER_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    last_seq: int
    snapshot: bool
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    cached: _containers.RepeatedScalarFieldContainer[bool]
    in_tier: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, epoch: _Optional[str] = ..., last_seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., cached: _Optional[_Iterable[bool]] = ..., in_tier: _Optional[_Iterable[bool]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "num_running", "num_waiting", "num_waiting_tokens", "num_blocks_total", "num_blocks_used", "num_blocks_unbounded", "num_held_leases", "num_forward_tokens", "kv_transfer_bytes", "kv_transfers", "kv_transfer_failures", "kv_transfer_seconds", "prefix_cache_queries", "prefix_cache_hits", "kv_bytes_per_token", "leases_expired", "draining", "metrics_address", "engine_steps", "engine_busy", "num_claimed_leases", "num_preemptions", "block_size", "cache_events", "num_in_flight", "kv_verify_failures", "prefix_tokens_read", "prefix_reads_refused", "local_prefill_token_s", "kv_quarantined_blocks", "verify_kv", "kv_unverified_refused", "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_accepted_per_pos", "spec_num_speculative_tokens", "lora_names", "lora_enabled", "kv_tier_id", "kv_tier_bytes_used", "kv_tier_capacity_bytes", "kv_tier_blocks_offloaded", "kv_tier_blocks_loaded", "prefix_cache_tier_hits", "kv_tier_corrupt_blocks", "lora_fingerprints")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_UNBOUNDED_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_LEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_FORWARD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STEPS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BUSY_FIELD_NUMBER: _ClassVar[int]
    NUM_CLAIMED_LEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    KV_VERIFY_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_READ_FIELD_NUMBER: _ClassVar[int]
    PREFIX_READS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    KV_QUARANTINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_KV_FIELD_NUMBER: _ClassVar[int]
    KV_UNVERIFIED_REFUSED_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_PER_POS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAMES_FIELD_NUMBER: _ClassVar[int]
    LORA_ENABLED_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_BLOCKS_OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_BLOCKS_LOADED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_TIER_HITS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LORA_FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    num_running: int
    num_waiting: int
    num_waiting_tokens: int
    num_blocks_total: int
    num_blocks_used: int
    num_blocks_unbounded: int
    num_held_leases: int
    num_forward_tokens: int
    kv_transfer_bytes: int
    kv_transfers: int
    kv_transfer_failures: int
    kv_transfer_seconds: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_bytes_per_token: int
    leases_expired: int
    draining: bool
    metrics_address: str
    engine_steps: int
    engine_busy: bool
    num_claimed_leases: int
    num_preemptions: int
    block_size: int
    cache_events: CacheEvents
    num_in_flight: int
    kv_verify_failures: int
    prefix_tokens_read: int
    prefix_reads_refused: int
    local_prefill_token_s: float
    kv_quarantined_blocks: int
    verify_kv: bool
    kv_unverified_refused: int
    spec_num_drafts: int
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    spec_accepted_per_pos: _containers.RepeatedScalarFieldContainer[int]
    spec_num_speculative_tokens: int
    lora_names: _containers.RepeatedScalarFieldContainer[str]
    lora_enabled: bool
    kv_tier_id: str
    kv_tier_bytes_used: int
    kv_tier_capacity_bytes: int
    kv_tier_blocks_offloaded: int
    kv_tier_blocks_loaded: int
    prefix_cache_tier_hits: int
    kv_tier_corrupt_blocks: int
    lora_fingerprints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_waiting_tokens: _Optional[int] = ..., num_blocks_total: _Optional[int] = ..., num_blocks_used: _Optional[int] = ..., num_blocks_unbounded: _Optional[int] = ..., num_held_leases: _Optional[int] = ..., num_forward_tokens: _Optional[int] = ..., kv_transfer_bytes: _Optional[int] = ..., kv_transfers: _Optional[int] = ..., kv_transfer_failures: _Optional[int] = ..., kv_transfer_seconds: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., leases_expired: _Optional[int] = ..., draining: _Optional[bool] = ..., metrics_address: _Optional[str] = ..., engine_steps: _Optional[int] = ..., engine_busy: _Optional[bool] = ..., num_claimed_leases: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., block_size: _Optional[int] = ..., cache_events: _Optional[_Union[CacheEvents, _Mapping]] = ..., num_in_flight: _Optional[int] = ..., kv_verify_failures: _Optional[int] = ..., prefix_tokens_read: _Optional[int] = ..., prefix_reads_refused: _Optional[int] = ..., local_prefill_token_s: _Optional[float] = ..., kv_quarantined_blocks: _Optional[int] = ..., verify_kv: _Optional[bool] = ..., kv_unverified_refused: _Optional[int] = ..., spec_num_drafts: _Optional[int] = ..., spec_num_draft_tokens: _Optional[int] = ..., spec_num_accepted_tokens: _Optional[int] = ..., spec_accepted_per_pos: _Optional[_Iterable[int]] = ..., spec_num_speculative_tokens: _Optional[int] = ..., lora_names: _Optional[_Iterable[str]] = ..., lora_enabled: _Optional[bool] = ..., kv_tier_id: _Optional[str] = ..., kv_tier_bytes_used: _Optional[int] = ..., kv_tier_capacity_bytes: _Optional[int] = ..., kv_tier_blocks_offloaded: _Optional[int] = ..., kv_tier_blocks_loaded: _Optional[int] = ..., prefix_cache_tier_hits: _Optional[int] = ..., kv_tier_corrupt_blocks: _Optional[int] = ..., lora_fingerprints: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadLoRARequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LoadLoRAResponse(_message.Message):
    __slots__ = ("loaded", "lora_names")
    LOADED_FIELD_NUMBER: _ClassVar[int]
    LORA_NAMES_FIELD_NUMBER: _ClassVar[int]
    loaded: bool
    lora_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, loaded: _Optional[bool] = ..., lora_names: _Optional[_Iterable[str]] = ...) -> None: ...

class UnloadLoRARequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UnloadLoRAResponse(_message.Message):
    __slots__ = ("found", "lora_names")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    LORA_NAMES_FIELD_NUMBER: _ClassVar[int]
    found: bool
    lora_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, found: _Optional[bool] = ..., lora_names: _Optional[_Iterable[str]] = ...) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("role", "grace_s", "reason")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    role: str
    grace_s: float
    reason: str
    def __init__(self, role: _Optional[str] = ..., grace_s: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class SetRoleResponse(_message.Message):
    __slots__ = ("role", "previous", "idle", "handed_over", "leases_left", "seconds", "kv_moved")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    HANDED_OVER_FIELD_NUMBER: _ClassVar[int]
    LEASES_LEFT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_MOVED_FIELD_NUMBER: _ClassVar[int]
    role: str
    previous: str
    idle: bool
    handed_over: int
    leases_left: int
    seconds: float
    kv_moved: int
    def __init__(self, role: _Optional[str] = ..., previous: _Optional[str] = ..., idle: _Optional[bool] = ..., handed_over: _Optional[int] = ..., leases_left: _Optional[int] = ..., seconds: _Optional[float] = ..., kv_moved: _Optional[int] = ...) -> None: ...
