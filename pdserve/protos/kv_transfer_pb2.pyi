from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AgentMetadata(_message.Message):
    __slots__ = ("agent_name", "backend", "backend_metadata", "base_address", "block_bytes", "num_blocks", "memory_type", "device_id", "tcp_address", "tensor_parallel_size")
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
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    backend: str
    backend_metadata: bytes
    base_address: int
    block_bytes: int
    num_blocks: int
    memory_type: AgentMetadata.MemoryType
    device_id: int
    tcp_address: str
    tensor_parallel_size: int
    def __init__(self, agent_name: _Optional[str] = ..., backend: _Optional[str] = ..., backend_metadata: _Optional[bytes] = ..., base_address: _Optional[int] = ..., block_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., memory_type: _Optional[_Union[AgentMetadata.MemoryType, str]] = ..., device_id: _Optional[int] = ..., tcp_address: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...
