"""Where a prompt runs: on the prefill pool (KV handed off) or on its decode worker.

A decision by estimated time to first token and cost to the decode batch, not by prompt
length alone. Inputs (`PathInputs`): the prompt's uncached tokens on the chosen decode
worker and on the best prefill worker, the tokens already queued on that prefill worker
(the router's own count) and its measured rate, the pair's recent hand-off time, and
the decode worker's running batch, step time, free blocks, its own queued prompts and
the time per token its own prompts took lately (a local prompt's estimate uses the
slower of that and the prefill worker's rate).

1. `no_prefill_worker`: no live prefill worker paired with the decode worker → local.
   `local_prefill_off`: `local_prefill_max_tokens` is 0 → remote, whatever the load
   (pure disaggregation, as benchmarks and tests of the hand-off want).
2. `short_prompt`: uncached on decode ≤ `local_prefill_max_tokens` → local (a hand-off
   costs more than it saves).
3. `decode_kv_pressure`: the decode worker lacks free blocks for the prompt twice over →
   remote (its own waiting queue would hold the prompt while blocks run out).
4. `no_estimate`: no prefill rate known → remote. Each worker measures its speed as it
   warms up (engine/worker/warm_up.py) and the router starts from that (`WorkerLoad.assume`),
   so this is left for a worker that reported none.
5. `prefill_within_slo`: estimated remote TTFT within half the TTFT target (the other
   half is headroom for the tail: the target is met by 90 % of requests, the estimate
   is a typical case) → remote: the decode batch keeps its pace, which is what
   disaggregation is for.
6. Otherwise the prefill pool is saturated. If running the prompt on the decode worker
   gives the first token sooner, within the TTFT target, and keeps its running
   requests within the TPOT target → local (`prefill_saturated`); else remote
   (`decode_at_tpot_slo`, `decode_past_ttft_slo` or `remote_sooner`). A prompt that
   misses its TTFT target on either path goes remote: it should not cost the decode
   batch its pace for a first token that is late anyway (under overload, a decode
   worker that took every such prompt would queue seconds of prefill between its
   steps). TPOT is a request's mean time per output token, so the stall of
   the prompts queued there (this one included) counts spread over an output's length:
   projected TPOT = step time + queued local prompt time / output tokens. The step time
   is the worker's mean over the last `STEP_WINDOW_S` (local prompts run before
   included: the pace its running requests get), and the projection must stay within
   `TPOT_HEADROOM` of the target: the target is met by 90 % of requests, and a mean at
   the target leaves half of them over it.

Pure functions and small estimators; no Ray, no gRPC.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

Path = Literal["local", "remote"]
DEFAULT_SLO_TTFT_MS = 1000.0
DEFAULT_SLO_TPOT_MS = 50.0
DEFAULT_LOCAL_PREFILL_MAX_TOKENS = 32
TTFT_HEADROOM = 0.5  # remote while its estimated TTFT is within this share of the target
TPOT_HEADROOM = 0.8  # local only while the projected TPOT is within this share of it
STEP_WINDOW_S = 2.0  # about one request's decode at a chat length (128 tokens, 15 ms)
REASONS = (
    "no_prefill_worker",
    "local_prefill_off",
    "short_prompt",
    "decode_kv_pressure",
    "no_estimate",
    "prefill_within_slo",
    "prefill_saturated",
    "decode_at_tpot_slo",
    "decode_past_ttft_slo",
    "remote_sooner",
    "prefill_failed",
)


@dataclass(frozen=True)
class PrefillPolicyConfig:
    """The service-level targets and the short-prompt floor (changeable while serving)."""

    local_prefill_max_tokens: int = DEFAULT_LOCAL_PREFILL_MAX_TOKENS
    slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS
    slo_tpot_ms: float = DEFAULT_SLO_TPOT_MS

    def __post_init__(self) -> None:
        if self.local_prefill_max_tokens < 0:
            raise ValueError(
                f"local_prefill_max_tokens must be >= 0, got {self.local_prefill_max_tokens}"
            )
        if self.slo_ttft_ms <= 0:
            raise ValueError(f"slo_ttft_ms must be > 0, got {self.slo_ttft_ms}")
        if self.slo_tpot_ms <= 0:
            raise ValueError(f"slo_tpot_ms must be > 0, got {self.slo_tpot_ms}")


@dataclass(frozen=True)
class PathInputs:
    """What the router knows when it places one prompt."""

    has_prefill: bool
    num_uncached_decode: int  # prompt tokens the decode worker's cache lacks
    num_uncached_prefill: int  # ... the chosen prefill worker's cache lacks
    prefill_queued_tokens: int  # uncached tokens already sent to that prefill worker
    prefill_tokens_per_s: float | None  # its measured rate (None: not measured yet)
    handoff_s: float  # the pair's recent hand-off time
    decode_running: int  # requests decoding there now
    decode_step_s: float | None  # its mean step time lately (`WorkerLoad.decode_step_s`)
    decode_queued_tokens: int  # prompt tokens queued there to run locally
    decode_free_blocks: int | None  # None: not reported yet
    num_prompt_blocks: int
    num_output_tokens: int  # the request's max_tokens: how long its decode runs
    # Seconds per uncached token of the prompts that decode worker ran itself lately
    # (`WorkerLoad.local_prefill_s_per_token`); None until it ran one.
    decode_local_s_per_token: float | None = None


@dataclass(frozen=True)
class PathDecision:
    path: Path
    reason: str
    ttft_remote_s: float | None = None
    ttft_local_s: float | None = None


def decide(inputs: PathInputs, config: PrefillPolicyConfig) -> PathDecision:
    """Local or remote prefill for one prompt, with the reason (see the module doc)."""
    if not inputs.has_prefill:
        return PathDecision("local", "no_prefill_worker")
    if config.local_prefill_max_tokens == 0:
        return PathDecision("remote", "local_prefill_off")
    if inputs.num_uncached_decode <= config.local_prefill_max_tokens:
        return PathDecision("local", "short_prompt")
    free = inputs.decode_free_blocks
    if free is not None and free < 2 * inputs.num_prompt_blocks:
        return PathDecision("remote", "decode_kv_pressure")
    rate = inputs.prefill_tokens_per_s
    if not rate:
        return PathDecision("remote", "no_estimate")
    ttft_remote = (
        inputs.prefill_queued_tokens + inputs.num_uncached_prefill
    ) / rate + inputs.handoff_s
    if ttft_remote * 1000 <= TTFT_HEADROOM * config.slo_ttft_ms:
        return PathDecision("remote", "prefill_within_slo", ttft_remote)
    # A prompt on the decode worker runs no faster than the prefill pool's rate (the same
    # engine on the same kind of device), and is often far slower: the pool's rate is a
    # loaded worker's, many prompts sharing each pass, while the decode worker runs one
    # or two in its steps, launch-bound (a short prompt of a small model takes many times
    # longer there than the pool's rate implies). What it took there lately is the better
    # estimate once there is one.
    s_per_token = max(1.0 / rate, inputs.decode_local_s_per_token or 0.0)
    step_s = inputs.decode_step_s or 0.0
    local_s = (inputs.decode_queued_tokens + inputs.num_uncached_decode) * s_per_token
    ttft_local = local_s + step_s
    tpot_local = step_s + local_s / max(inputs.num_output_tokens, 1)
    if inputs.decode_running and tpot_local * 1000 > TPOT_HEADROOM * config.slo_tpot_ms:
        return PathDecision("remote", "decode_at_tpot_slo", ttft_remote, ttft_local)
    if inputs.decode_running and ttft_local * 1000 > config.slo_ttft_ms:
        return PathDecision("remote", "decode_past_ttft_slo", ttft_remote, ttft_local)
    if ttft_local < ttft_remote:
        return PathDecision("local", "prefill_saturated", ttft_remote, ttft_local)
    return PathDecision("remote", "remote_sooner", ttft_remote, ttft_local)


class Ewma:
    """An exponentially weighted mean; None until the first sample, or until a value is
    assumed, which the first sample then replaces."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self.value: float | None = None
        self._assumed = False

    def assume(self, value: float) -> None:
        """Start from value until a sample comes (a measurement made before traffic)."""
        if self.value is None:
            self.value, self._assumed = value, True

    def add(self, sample: float) -> None:
        if self.value is None or self._assumed:
            self.value, self._assumed = sample, False
        else:
            self.value += self.weight * (sample - self.value)


class StepWindow:
    """A decode worker's mean step time over the last `window_s`: the wall time its
    token batches covered over the steps they reported, stalls for prompts it ran
    between steps included. A mean over time, not over batches: a batch after a long
    stall weighs its length, not one sample."""

    def __init__(self, window_s: float = STEP_WINDOW_S) -> None:
        self.window_s = window_s
        self._spans: deque[tuple[float, float, int]] = deque()  # (end, seconds, steps)
        self._seconds = 0.0
        self._steps = 0

    def add(self, now: float, seconds: float, num_steps: int) -> None:
        self._spans.append((now, seconds, num_steps))
        self._seconds += seconds
        self._steps += num_steps
        self._expire(now)

    def mean(self, now: float) -> float | None:
        """Seconds per step over the window ending now; None when it saw no step."""
        self._expire(now)
        return self._seconds / self._steps if self._steps else None

    def _expire(self, now: float) -> None:
        while self._spans and self._spans[0][0] < now - self.window_s:
            _, seconds, steps = self._spans.popleft()
            self._seconds -= seconds
            self._steps -= steps


class PrefillRate:
    """A prefill worker's tokens per second, from its replies.

    Over a window in which it was busy throughout, the uncached tokens its replies
    finished over the window's length is its throughput under load (replies of one
    engine step arrive together, so single replies say nothing). A request sent to an
    idle worker gives its own tokens over its prefill time.
    """

    def __init__(self, window_s: float = 0.1) -> None:
        self.window_s = window_s
        self.tokens_per_s = Ewma()
        self._start: float | None = None
        self._tokens = 0

    def observe(
        self, num_tokens: int, prefill_s: float, now: float, busy_since: float, was_idle: bool
    ) -> None:
        """A reply for num_tokens uncached tokens. busy_since: when the worker last went
        from idle to busy in the router's count; was_idle: the request found it idle."""
        if was_idle and prefill_s > 0:
            self.tokens_per_s.add(num_tokens / prefill_s)
        if self._start is None or busy_since > self._start:
            self._start, self._tokens = max(busy_since, now - prefill_s), 0
        self._tokens += num_tokens
        if now - self._start >= self.window_s:
            self.tokens_per_s.add(self._tokens / (now - self._start))
            self._start, self._tokens = now, 0
