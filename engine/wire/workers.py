"""What a worker says about itself, and what the router hands it as it starts.

A started worker answers with its `WorkerInfo` (its `KVLayout`, limits, address and
speed); afterwards it reports its occupancy as `WorkerStats` and its prefix cache's
changes as `KVEvents`. The router hands a worker a `CallSpec` (to take the router's
calls on a connection of its own) and, for a tensor-parallel worker, a `TPGroupSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

# A worker incarnation's epoch (62 random bits) as it is shown everywhere, logs, spans,
# errors and `pdserve workers` alike: 16 hex digits, leading zeros kept, so one epoch
# reads the same wherever it is grepped for.
EPOCH_HEX_DIGITS = 16


def epoch_hex(epoch: int) -> str:
    """An epoch as fixed-width hex (`06ca…`, never `6ca…`)."""
    return f"{epoch:0{EPOCH_HEX_DIGITS}x}"


class PoolName(StrEnum):
    """A pool's name; a member is its plain string everywhere (logs, labels, the API)."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


POOLS: tuple[PoolName, ...] = tuple(PoolName)


@dataclass(frozen=True)
class KVLayout:
    """What two workers must agree on before they can exchange blocks."""

    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # Ranks the worker's KV heads are split over. Not compared: workers of different
    # sizes hand KV off in parts (engine.transfer.tp_parts).
    tensor_parallel_size: int = 1

    def mismatch(self, other: KVLayout) -> str | None:
        """A message naming the first field that differs, or None if compatible."""
        for name in (
            "model",
            "dtype",
            "block_size",
            "num_layers",
            "num_kv_heads",
            "head_dim",
        ):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} differs: {mine!r} vs {theirs!r}"
        return None


@dataclass(frozen=True)
class KVEvents:
    """One batch of prefix-cache changes from one engine.

    `full` means the batch is a snapshot, not a delta: `stored` is every hash the
    cache holds and the consumer must forget anything else it knew. The first
    batch an engine gives out, and any batch after its buffer overflowed, is full.
    """

    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    full: bool = False

    @property
    def is_empty(self) -> bool:
        return not (self.stored or self.removed or self.full)


@dataclass(frozen=True)
class TPGroupSpec:
    """How the processes of one tensor-parallel worker find each other on their node: a
    file the ranks' process group meets at, and the Unix socket (abstract namespace)
    rank 0 hands each step's plan to the others through, with its key."""

    size: int
    rendezvous_file: str
    step_address: str
    authkey: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if self.size < 2:
            raise ValueError(f"a tensor-parallel group has 2 or more ranks, got {self.size}")


@dataclass(frozen=True)
class CallSpec:
    """What a worker needs to accept the router's calls (engine/worker/calls.py): the
    secret the router's connections authenticate with, and the router's node, to pick
    the address to listen on."""

    token: bytes
    router_ip: str


@dataclass(frozen=True)
class EngineSpeed:
    """What an engine's warm-up measured, alone on its device: one prompt's pass, and one
    decode step of that request (None on a prefill engine, which never decodes).

    A worker reports it as it starts (`WorkerInfo.speed`): the router's load-aware
    estimates start from it, so they hold from the first request, and traffic's own
    measurements replace it as they come.
    """

    num_prompt_tokens: int
    prefill_s: float
    decode_step_s: float | None = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1 or self.prefill_s <= 0:
            raise ValueError(
                f"a warm-up pass needs tokens and time, got {self.num_prompt_tokens} tokens "
                f"in {self.prefill_s} s"
            )

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.num_prompt_tokens / self.prefill_s

    @property
    def prefill_s_per_token(self) -> float:
        return self.prefill_s / self.num_prompt_tokens


@dataclass(frozen=True)
class WorkerInfo:
    """Returned by a worker's start(): what the router needs to pair and route."""

    worker_id: str  # "<pool>-<index>"; a replacement keeps the id and gets a new epoch
    pool: str
    index: int
    epoch: int
    layout: KVLayout
    num_blocks: int
    max_model_len: int
    vocab_size: int
    model_name: str
    device: str
    pid: int
    node_ip: str
    # "host:port" of the worker's call connection (engine/worker/calls.py); "" when the
    # router calls it through Ray only.
    call_address: str = ""
    # GPUs (processes) the worker's model is split over, and the GPUs it holds (rank order).
    tensor_parallel_size: int = 1
    gpu_ids: tuple[int, ...] = ()
    # Its engine's speed, measured as it warmed up: the router's estimates start there.
    speed: EngineSpeed | None = None


@dataclass(frozen=True)
class WorkerStats:
    """Occupancy of one engine's KV cache and scheduler, and its counters since start.

    The engine core reports it (`EngineCore.stats()`), naming itself by its pool and its
    index there; a worker sends it as it is.
    """

    pool: PoolName
    index: int
    num_blocks_total: int
    num_blocks_in_use: int
    num_running: int
    num_waiting: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    num_preemptions: int = 0  # since this worker started
    # Speculative decoding since this worker started: proposals verified, accepted, and
    # verifications (one per request per verifying step).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0

    @property
    def num_blocks_free(self) -> int:
        return self.num_blocks_total - self.num_blocks_in_use

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verifying step gave a request on average: its accepted proposals
        plus the one the target sampled after them (0 before any verification)."""
        if not self.spec_verifications:
            return 0.0
        return 1.0 + self.spec_accepted_tokens / self.spec_verifications
