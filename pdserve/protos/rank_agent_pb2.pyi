from pdserve.protos import kv_transfer_pb2 as _kv_transfer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NoArgs(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CreateRankAgent(_message.Message):
    __slots__ = ("backend", "name", "shard", "inject_delay_s", "read_timeout_s", "host", "advertise_host", "net_devices", "tls_cert_pem", "tls_key_pem", "tls_ca_pem", "has_tls", "has_tls_ca")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    INJECT_DELAY_S_FIELD_NUMBER: _ClassVar[int]
    READ_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    ADVERTISE_HOST_FIELD_NUMBER: _ClassVar[int]
    NET_DEVICES_FIELD_NUMBER: _ClassVar[int]
    TLS_CERT_PEM_FIELD_NUMBER: _ClassVar[int]
    TLS_KEY_PEM_FIELD_NUMBER: _ClassVar[int]
    TLS_CA_PEM_FIELD_NUMBER: _ClassVar[int]
    HAS_TLS_FIELD_NUMBER: _ClassVar[int]
    HAS_TLS_CA_FIELD_NUMBER: _ClassVar[int]
    backend: str
    name: str
    shard: _kv_transfer_pb2.KVShard
    inject_delay_s: float
    read_timeout_s: float
    host: str
    advertise_host: str
    net_devices: str
    tls_cert_pem: bytes
    tls_key_pem: bytes
    tls_ca_pem: bytes
    has_tls: bool
    has_tls_ca: bool
    def __init__(self, backend: _Optional[str] = ..., name: _Optional[str] = ..., shard: _Optional[_Union[_kv_transfer_pb2.KVShard, _Mapping]] = ..., inject_delay_s: _Optional[float] = ..., read_timeout_s: _Optional[float] = ..., host: _Optional[str] = ..., advertise_host: _Optional[str] = ..., net_devices: _Optional[str] = ..., tls_cert_pem: _Optional[bytes] = ..., tls_key_pem: _Optional[bytes] = ..., tls_ca_pem: _Optional[bytes] = ..., has_tls: _Optional[bool] = ..., has_tls_ca: _Optional[bool] = ...) -> None: ...

class ChecksumsCall(_message.Message):
    __slots__ = ("block_ids", "last_block_bytes")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LAST_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    last_block_bytes: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., last_block_bytes: _Optional[int] = ...) -> None: ...

class ExpectReadsCall(_message.Message):
    __slots__ = ("expected", "urgent")
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    URGENT_FIELD_NUMBER: _ClassVar[int]
    expected: bool
    urgent: bool
    def __init__(self, expected: _Optional[bool] = ..., urgent: _Optional[bool] = ...) -> None: ...

class StartReadCall(_message.Message):
    __slots__ = ("peer", "remote_block_ids", "local_block_ids", "notify", "last_block_bytes", "checksums", "has_checksums")
    PEER_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NOTIFY_FIELD_NUMBER: _ClassVar[int]
    LAST_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    peer: str
    remote_block_ids: _containers.RepeatedScalarFieldContainer[int]
    local_block_ids: _containers.RepeatedScalarFieldContainer[int]
    notify: bytes
    last_block_bytes: int
    checksums: _containers.RepeatedScalarFieldContainer[int]
    has_checksums: bool
    def __init__(self, peer: _Optional[str] = ..., remote_block_ids: _Optional[_Iterable[int]] = ..., local_block_ids: _Optional[_Iterable[int]] = ..., notify: _Optional[bytes] = ..., last_block_bytes: _Optional[int] = ..., checksums: _Optional[_Iterable[int]] = ..., has_checksums: _Optional[bool] = ...) -> None: ...

class ReadCall(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    def __init__(self, transfer_id: _Optional[int] = ...) -> None: ...

class GuardCall(_message.Message):
    __slots__ = ("on",)
    ON_FIELD_NUMBER: _ClassVar[int]
    on: bool
    def __init__(self, on: _Optional[bool] = ...) -> None: ...

class RankAgentCall(_message.Message):
    __slots__ = ("create", "metadata", "checksums", "notifications", "expect_reads", "add_remote", "start_read", "poll", "cancel", "guard", "close")
    CREATE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    NOTIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    EXPECT_READS_FIELD_NUMBER: _ClassVar[int]
    ADD_REMOTE_FIELD_NUMBER: _ClassVar[int]
    START_READ_FIELD_NUMBER: _ClassVar[int]
    POLL_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    GUARD_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    create: CreateRankAgent
    metadata: NoArgs
    checksums: ChecksumsCall
    notifications: NoArgs
    expect_reads: ExpectReadsCall
    add_remote: _kv_transfer_pb2.AgentMetadata
    start_read: StartReadCall
    poll: ReadCall
    cancel: ReadCall
    guard: GuardCall
    close: NoArgs
    def __init__(self, create: _Optional[_Union[CreateRankAgent, _Mapping]] = ..., metadata: _Optional[_Union[NoArgs, _Mapping]] = ..., checksums: _Optional[_Union[ChecksumsCall, _Mapping]] = ..., notifications: _Optional[_Union[NoArgs, _Mapping]] = ..., expect_reads: _Optional[_Union[ExpectReadsCall, _Mapping]] = ..., add_remote: _Optional[_Union[_kv_transfer_pb2.AgentMetadata, _Mapping]] = ..., start_read: _Optional[_Union[StartReadCall, _Mapping]] = ..., poll: _Optional[_Union[ReadCall, _Mapping]] = ..., cancel: _Optional[_Union[ReadCall, _Mapping]] = ..., guard: _Optional[_Union[GuardCall, _Mapping]] = ..., close: _Optional[_Union[NoArgs, _Mapping]] = ...) -> None: ...

class ReadState(_message.Message):
    __slots__ = ("transfer_id", "state", "error", "verify_failed", "nbytes", "started_at", "finished_at", "finished", "descriptors", "over")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FAILED_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    OVER_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    state: int
    error: str
    verify_failed: bool
    nbytes: int
    started_at: float
    finished_at: float
    finished: bool
    descriptors: int
    over: bool
    def __init__(self, transfer_id: _Optional[int] = ..., state: _Optional[int] = ..., error: _Optional[str] = ..., verify_failed: _Optional[bool] = ..., nbytes: _Optional[int] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., finished: _Optional[bool] = ..., descriptors: _Optional[int] = ..., over: _Optional[bool] = ...) -> None: ...

class RankAgentError(_message.Message):
    __slots__ = ("kind", "message", "field", "limit", "has_limit", "peer", "backend")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    HAS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    kind: str
    message: str
    field: str
    limit: str
    has_limit: bool
    peer: str
    backend: str
    def __init__(self, kind: _Optional[str] = ..., message: _Optional[str] = ..., field: _Optional[str] = ..., limit: _Optional[str] = ..., has_limit: _Optional[bool] = ..., peer: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class Checksums(_message.Message):
    __slots__ = ("values", "per_block")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[int]
    per_block: int
    def __init__(self, values: _Optional[_Iterable[int]] = ..., per_block: _Optional[int] = ...) -> None: ...

class Notifications(_message.Message):
    __slots__ = ("notes",)
    NOTES_FIELD_NUMBER: _ClassVar[int]
    notes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, notes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RankAgentReply(_message.Message):
    __slots__ = ("ok", "metadata", "checksums", "notifications", "peer", "read", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    NOTIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    READ_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: NoArgs
    metadata: _kv_transfer_pb2.AgentMetadata
    checksums: Checksums
    notifications: Notifications
    peer: str
    read: ReadState
    error: RankAgentError
    def __init__(self, ok: _Optional[_Union[NoArgs, _Mapping]] = ..., metadata: _Optional[_Union[_kv_transfer_pb2.AgentMetadata, _Mapping]] = ..., checksums: _Optional[_Union[Checksums, _Mapping]] = ..., notifications: _Optional[_Union[Notifications, _Mapping]] = ..., peer: _Optional[str] = ..., read: _Optional[_Union[ReadState, _Mapping]] = ..., error: _Optional[_Union[RankAgentError, _Mapping]] = ...) -> None: ...

class GuardQuery(_message.Message):
    __slots__ = ("note", "block_ids")
    NOTE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    note: bytes
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, note: _Optional[bytes] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GuardAnswer(_message.Message):
    __slots__ = ("allowed",)
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    allowed: bool
    def __init__(self, allowed: _Optional[bool] = ...) -> None: ...
