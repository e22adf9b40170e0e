from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AgentMetadata(_message.Message):
    __slots__ = ("agent_name", "backend", "backend_metadata", "base_address", "block_bytes", "num_blocks", "memory_type", "device_id", "tcp_address", "shard", "tp_ranks")
    class MemoryType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        MEMORY_TYPE_UNSPECIFIED: _ClassVar[AgentMetadata.MemoryType]
        MEMORY_TYPE_DRAM: _ClassVar[AgentMetadata.MemoryType]
        MEMORY_TYPE_VRAM: _ClassVar[AgentMetadata.MemoryType]
    MEMORY_TYPE_UNSPECIFIED: AgentMetadata.MemoryType
    MEMORY_TYPE_DRAM: AgentMetadata.MemoryType
    MEMORY_TYPE_VRAM: AgentMetadata.MemoryType
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BACKEND_METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    TCP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    TP_RANKS_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    backend: str
    backend_metadata: bytes
    base_address: int
    block_bytes: int
    num_blocks: int
    memory_type: AgentMetadata.MemoryType
    device_id: int
    tcp_address: str
    shard: KVShard
    tp_ranks: _containers.RepeatedCompositeFieldContainer[AgentMetadata]
    def __init__(self, agent_name: _Optional[str] = ..., backend: _Optional[str] = ..., backend_metadata: _Optional[bytes] = ..., base_address: _Optional[int] = ..., block_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., memory_type: _Optional[_Union[AgentMetadata.MemoryType, str]] = ..., device_id: _Optional[int] = ..., tcp_address: _Optional[str] = ..., shard: _Optional[_Union[KVShard, _Mapping]] = ..., tp_ranks: _Optional[_Iterable[_Union[AgentMetadata, _Mapping]]] = ...) -> None: ...

class KVShard(_message.Message):
    __slots__ = ("tp_rank", "tp_size", "num_kv_heads", "head_start", "head_count", "head_bytes", "rows_per_token", "block_size", "dtype", "checksum_groups")
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_COUNT_FIELD_NUMBER: _ClassVar[int]
    HEAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROWS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    tp_size: int
    num_kv_heads: int
    head_start: int
    head_count: int
    head_bytes: int
    rows_per_token: int
    block_size: int
    dtype: str
    checksum_groups: int
    def __init__(self, tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_start: _Optional[int] = ..., head_count: _Optional[int] = ..., head_bytes: _Optional[int] = ..., rows_per_token: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., checksum_groups: _Optional[int] = ...) -> None: ...
