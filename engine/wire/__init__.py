"""Every type that crosses a process boundary: between the router and the workers, and
between two workers (a KV channel).

Immutable, typed, plain Python (no torch, no Ray, no protobuf): Ray and the workers'
call connections pickle them, and both sides import them from here. By job:

* `workers`: what a worker says about itself (`WorkerInfo`, `KVLayout`, `WorkerStats`,
  `EngineSpeed`, `KVEvents`) and what the router hands it as it starts (`CallSpec`,
  `TPGroupSpec`).
* `requests`: a request on its way (`GenerationInput`, `HandoffTarget`, `Reservation`,
  a live move's `Precopy`, `DetachedRequest`, `DetachedMove`) and the prefill pool's
  answer (`PrefillResult`), with where its time went (`PhaseReport`). A request's trace
  context (W3C `traceparent`/`tracestate`, empty when it is not traced) travels inside
  its `GenerationInput`, so a worker's spans join the router's trace (engine/tracing.py).
* `tokens`: a step's `TokenUpdate` per request, produced by the engine core itself (as
  vLLM's core produces `EngineCoreOutputs`), and the `TokenBatch` a decode worker
  sends them in.
* `transfer`: between two workers, the `ChannelSpec` both ends of a pair meet by and
  the `HandoffHeader` before each message's KV.
"""

from engine.wire.requests import (
    DetachedMove,
    DetachedRequest,
    GenerationInput,
    HandoffTarget,
    Handover,
    PhaseReport,
    Precopy,
    PrefillResult,
    Reservation,
)
from engine.wire.tokens import TokenBatch, TokenUpdate, coalesce, merge_updates, sampled_update
from engine.wire.transfer import (
    MAX_ENTRIES,
    MAX_REQ_ID_BYTES,
    NO_TOKEN,
    ChannelSpec,
    HandoffEntry,
    HandoffHeader,
    HeaderKind,
)
from engine.wire.workers import (
    EPOCH_HEX_DIGITS,
    POOLS,
    CallSpec,
    EngineSpeed,
    KVEvents,
    KVLayout,
    PoolName,
    TPGroupSpec,
    WorkerInfo,
    WorkerStats,
    epoch_hex,
)

__all__ = [
    "EPOCH_HEX_DIGITS",
    "MAX_ENTRIES",
    "MAX_REQ_ID_BYTES",
    "NO_TOKEN",
    "POOLS",
    "CallSpec",
    "ChannelSpec",
    "DetachedMove",
    "DetachedRequest",
    "EngineSpeed",
    "GenerationInput",
    "HandoffEntry",
    "HandoffHeader",
    "HandoffTarget",
    "Handover",
    "HeaderKind",
    "KVEvents",
    "KVLayout",
    "PhaseReport",
    "PoolName",
    "Precopy",
    "PrefillResult",
    "Reservation",
    "TPGroupSpec",
    "TokenBatch",
    "TokenUpdate",
    "WorkerInfo",
    "WorkerStats",
    "coalesce",
    "epoch_hex",
    "merge_updates",
    "sampled_update",
]
