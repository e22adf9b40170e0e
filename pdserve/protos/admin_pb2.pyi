from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Member(_message.Message):
    __slots__ = ("role", "address", "worker_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    worker_id: str
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...

class Membership(_message.Message):
    __slots__ = ("members", "desired_replicas", "signal_targets", "role_changes", "budget_pressure")
    class DesiredReplicasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class SignalTargetsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class BudgetPressureEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    DESIRED_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_TARGETS_FIELD_NUMBER: _ClassVar[int]
    ROLE_CHANGES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[Member]
    desired_replicas: _containers.ScalarMap[str, int]
    signal_targets: _containers.ScalarMap[str, float]
    role_changes: _containers.RepeatedCompositeFieldContainer[RoleChange]
    budget_pressure: _containers.ScalarMap[str, float]
    def __init__(self, members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., desired_replicas: _Optional[_Mapping[str, int]] = ..., signal_targets: _Optional[_Mapping[str, float]] = ..., role_changes: _Optional[_Iterable[_Union[RoleChange, _Mapping]]] = ..., budget_pressure: _Optional[_Mapping[str, float]] = ...) -> None: ...

class RoleChange(_message.Message):
    __slots__ = ("address", "from_role", "to_role", "reason", "seconds", "handed_over", "leases_left", "kv_moved")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FROM_ROLE_FIELD_NUMBER: _ClassVar[int]
    TO_ROLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    HANDED_OVER_FIELD_NUMBER: _ClassVar[int]
    LEASES_LEFT_FIELD_NUMBER: _ClassVar[int]
    KV_MOVED_FIELD_NUMBER: _ClassVar[int]
    address: str
    from_role: str
    to_role: str
    reason: str
    seconds: float
    handed_over: int
    leases_left: int
    kv_moved: int
    def __init__(self, address: _Optional[str] = ..., from_role: _Optional[str] = ..., to_role: _Optional[str] = ..., reason: _Optional[str] = ..., seconds: _Optional[float] = ..., handed_over: _Optional[int] = ..., leases_left: _Optional[int] = ..., kv_moved: _Optional[int] = ...) -> None: ...

class MembershipAck(_message.Message):
    __slots__ = ("prefill_workers", "decode_workers")
    PREFILL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    prefill_workers: int
    decode_workers: int
    def __init__(self, prefill_workers: _Optional[int] = ..., decode_workers: _Optional[int] = ...) -> None: ...

class JoinAck(_message.Message):
    __slots__ = ("changed",)
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    changed: bool
    def __init__(self, changed: _Optional[bool] = ...) -> None: ...

class LatencyRequest(_message.Message):
    __slots__ = ("window_s",)
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    window_s: float
    def __init__(self, window_s: _Optional[float] = ...) -> None: ...

class LatencySummary(_message.Message):
    __slots__ = ("ttft_p90_s", "itl_p90_s", "ttft_count", "itl_count")
    TTFT_P90_S_FIELD_NUMBER: _ClassVar[int]
    ITL_P90_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_COUNT_FIELD_NUMBER: _ClassVar[int]
    ITL_COUNT_FIELD_NUMBER: _ClassVar[int]
    ttft_p90_s: float
    itl_p90_s: float
    ttft_count: int
    itl_count: int
    def __init__(self, ttft_p90_s: _Optional[float] = ..., itl_p90_s: _Optional[float] = ..., ttft_count: _Optional[int] = ..., itl_count: _Optional[int] = ...) -> None: ...
