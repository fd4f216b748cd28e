from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_STARTING: _ClassVar[WorkerState]
    WORKER_STATE_LIVE: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_STARTING: WorkerState
WORKER_STATE_LIVE: WorkerState
WORKER_STATE_DRAINING: WorkerState

class WorkerDescription(_message.Message):
    __slots__ = ("worker_id", "pool", "index", "state", "epoch", "device", "node_ip", "pid", "num_in_flight", "peers", "tensor_parallel_size", "gpu_ids")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NODE_IP_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    GPU_IDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    pool: str
    index: int
    state: WorkerState
    epoch: str
    device: str
    node_ip: str
    pid: int
    num_in_flight: int
    peers: _containers.RepeatedScalarFieldContainer[str]
    tensor_parallel_size: int
    gpu_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., pool: _Optional[str] = ..., index: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., epoch: _Optional[str] = ..., device: _Optional[str] = ..., node_ip: _Optional[str] = ..., pid: _Optional[int] = ..., num_in_flight: _Optional[int] = ..., peers: _Optional[_Iterable[str]] = ..., tensor_parallel_size: _Optional[int] = ..., gpu_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers", "targets", "num_restarts", "planner")
    class TargetsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    PLANNER_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerDescription]
    targets: _containers.ScalarMap[str, int]
    num_restarts: int
    planner: PlannerStatus
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerDescription, _Mapping]]] = ..., targets: _Optional[_Mapping[str, int]] = ..., num_restarts: _Optional[int] = ..., planner: _Optional[_Union[PlannerStatus, _Mapping]] = ...) -> None: ...

class PlannerPoolDecision(_message.Message):
    __slots__ = ("pool", "current", "target", "action", "reason", "load_workers", "detail")
    POOL_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LOAD_WORKERS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    current: int
    target: int
    action: str
    reason: str
    load_workers: float
    detail: str
    def __init__(self, pool: _Optional[str] = ..., current: _Optional[int] = ..., target: _Optional[int] = ..., action: _Optional[str] = ..., reason: _Optional[str] = ..., load_workers: _Optional[float] = ..., detail: _Optional[str] = ...) -> None: ...

class PlannerStatus(_message.Message):
    __slots__ = ("max_workers", "interval_seconds", "seconds_since_decision", "traffic", "pools")
    MAX_WORKERS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_DECISION_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    max_workers: int
    interval_seconds: float
    seconds_since_decision: float
    traffic: str
    pools: _containers.RepeatedCompositeFieldContainer[PlannerPoolDecision]
    def __init__(self, max_workers: _Optional[int] = ..., interval_seconds: _Optional[float] = ..., seconds_since_decision: _Optional[float] = ..., traffic: _Optional[str] = ..., pools: _Optional[_Iterable[_Union[PlannerPoolDecision, _Mapping]]] = ...) -> None: ...

class ScalePoolRequest(_message.Message):
    __slots__ = ("pool", "size")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    size: int
    def __init__(self, pool: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class ScalePoolResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerDescription]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerDescription, _Mapping]]] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DrainWorkerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MigrateRequestsRequest(_message.Message):
    __slots__ = ("worker_id", "max_requests")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    max_requests: int
    def __init__(self, worker_id: _Optional[str] = ..., max_requests: _Optional[int] = ...) -> None: ...

class MigrateRequestsResponse(_message.Message):
    __slots__ = ("num_candidates", "moved_with_kv", "moved_by_recompute")
    NUM_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    MOVED_WITH_KV_FIELD_NUMBER: _ClassVar[int]
    MOVED_BY_RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    num_candidates: int
    moved_with_kv: int
    moved_by_recompute: int
    def __init__(self, num_candidates: _Optional[int] = ..., moved_with_kv: _Optional[int] = ..., moved_by_recompute: _Optional[int] = ...) -> None: ...

class PrefillPolicy(_message.Message):
    __slots__ = ("local_prefill_max_tokens", "slo_ttft_ms", "slo_tpot_ms")
    LOCAL_PREFILL_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLO_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    local_prefill_max_tokens: int
    slo_ttft_ms: float
    slo_tpot_ms: float
    def __init__(self, local_prefill_max_tokens: _Optional[int] = ..., slo_ttft_ms: _Optional[float] = ..., slo_tpot_ms: _Optional[float] = ...) -> None: ...

class SetPrefillPolicyRequest(_message.Message):
    __slots__ = ("local_prefill_max_tokens", "slo_ttft_ms", "slo_tpot_ms")
    LOCAL_PREFILL_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLO_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    local_prefill_max_tokens: int
    slo_ttft_ms: float
    slo_tpot_ms: float
    def __init__(self, local_prefill_max_tokens: _Optional[int] = ..., slo_ttft_ms: _Optional[float] = ..., slo_tpot_ms: _Optional[float] = ...) -> None: ...

class SetPrefillPolicyResponse(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: PrefillPolicy
    def __init__(self, policy: _Optional[_Union[PrefillPolicy, _Mapping]] = ...) -> None: ...
