"""What the planner sees each interval: plain, immutable values the router fills in (and
the unit tests make up). Times are in seconds."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PoolSnapshot:
    """One pool's size and queues when the snapshot was taken."""

    # The size the pool is kept at: a dead worker that is being replaced still counts
    # (its replacement is on the way), so it is never counted twice.
    target: int
    live: int = 0  # routable
    starting: int = 0  # added or replacing a dead one, not yet routable
    draining: int = 0  # leaving: no new work, but still holding a device
    queued_tokens: int = 0  # prefill: uncached prompt tokens sent and not yet answered
    running: int = 0  # requests in the workers' running batches
    waiting: int = 0  # requests waiting in the workers' schedulers
    kv_usage: float = 0.0  # the highest share of KV blocks in use on one worker

    @property
    def replacing(self) -> int:
        """Workers the pool is short of while dead ones are replaced (in back-off)."""
        return max(0, self.target - self.live - self.starting)

    @property
    def settled(self) -> bool:
        """Every worker counted is live: measurements show the pool at its size."""
        return self.live == self.target and not self.starting and not self.draining


@dataclass(frozen=True)
class PrefillSample:
    """A span in which one prefill worker was busy throughout, and the prompts it ran."""

    num_prompts: int
    num_tokens: int  # uncached prompt tokens
    sum_sq_tokens: int  # Σ (tokens per prompt)²: attention grows with a prompt's square
    seconds: float


@dataclass(frozen=True)
class DecodeSample:
    """One decode step of one worker."""

    batch_size: int
    context_tokens: int  # tokens held in the batch's KV cache, all requests together
    step_s: float


@dataclass(frozen=True)
class Traffic:
    """What the router saw of requests over one interval."""

    seconds: float
    num_arrivals: int = 0
    # Prompts that are the prefill pool's work (sent there, or run on a decode worker
    # because the prefill pool was saturated): their uncached tokens.
    num_prompts: int = 0
    prompt_tokens: int = 0
    sum_sq_prompt_tokens: int = 0
    num_finished: int = 0  # completed requests, with their output tokens
    output_tokens: int = 0
    ttft_s: tuple[float, ...] = ()  # first tokens sent in the interval
    tpot_s: tuple[float, ...] = ()  # requests completed in the interval, 2 tokens or more
    # Requests in flight still waiting for their first token: how long the oldest has
    # waited, and how many have waited past the TTFT target (misses not yet measured).
    oldest_waiting_s: float = 0.0
    num_waiting_past_ttft: int = 0


@dataclass(frozen=True)
class Snapshot:
    """Everything one planning step reads."""

    now: float
    pools: Mapping[str, PoolSnapshot]  # "prefill", "decode"
    traffic: Traffic
    slo_ttft_s: float
    slo_tpot_s: float
    prefill_samples: tuple[PrefillSample, ...] = ()
    decode_samples: tuple[DecodeSample, ...] = ()
    # Measured start-up of a new worker, per pool (placement, model load, pairing).
    startup_s: Mapping[str, float | None] = field(default_factory=dict)
    # Decode limits per worker: requests at once, KV blocks and their size.
    max_num_seqs: int = 128
    num_blocks: int = 0  # 0: unknown
    block_size: int = 16
