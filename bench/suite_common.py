"""What the GPU suite's parts share: model shapes, workloads and the closed-loop runs every
system makes (so that the engine in-process and the services do exactly the same work),
per-request timings and their stats."""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.report import REPO, distribution
from engine.model.model_spec import kv_bytes_per_token

SHAPES = {
    "1b": REPO / "deploy" / "model_configs" / "llama-3.2-1b",
    "8b": REPO / "deploy" / "model_configs" / "llama-3.1-8b",
}
# A CPU-sized Llama for smoke runs of the suite itself (`--shapes tiny --device cpu`).
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 4096,
    "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False, "torch_dtype": "float32",
}  # fmt: skip


def model_path(name: str, workdir: Path) -> Path:
    """The model folder (config.json; weights are random) of a named shape (the tiny one
    is written under `workdir`), a folder under deploy/model_configs, or a folder."""
    if name == "tiny":
        path = workdir / "tiny-llama"
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(TINY_CONFIG))
        return path
    for path in (SHAPES.get(name, Path(name)), REPO / "deploy" / "model_configs" / name):
        if (path / "config.json").is_file():
            return path.resolve()
    raise SystemExit(f"model {name!r}: no config.json there nor under deploy/model_configs")


@dataclass(frozen=True)
class KVGeometry:
    """KV bytes of a model shape (bf16 on GPU, as the service runs it)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    itemsize: int = 2

    @classmethod
    def of(cls, path: Path, itemsize: int = 2) -> KVGeometry:
        cfg = json.loads((path / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        return cls(cfg["num_hidden_layers"], num_kv_heads, head_dim, cfg["vocab_size"], itemsize)

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.itemsize)


def make_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids, away from the low ids and the special tokens at the top."""
    rng = random.Random(seed)
    lo, hi = (1000, 120_000) if vocab_size > 120_000 else (10, vocab_size - 10)
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


def workload_seed(shape: str, concurrency: int, prompt_len: int) -> int:
    """The same prompts for every system at one (shape, concurrency); different across."""
    return sum(map(ord, shape)) * 1_000_003 + concurrency * 7919 + prompt_len


# ---------------------------------------------------------------- the runs

# A closed loop at concurrency C over `rounds` × C prompts: C requests start at once and
# each one that finishes is replaced by the next prompt. One round is a burst (all
# prefills, then the decode steps); several let the loop reach the steady state in which
# a prompt's prefill overlaps other requests' decode steps. Below STEADY_FROM_CONCURRENCY
# the two hardly differ, so the default is one round there; from it on, four.
STEADY_FROM_CONCURRENCY = 32
DEFAULT_STEADY_ROUNDS = 4


@dataclass(frozen=True)
class RunSpec:
    """One closed-loop run: `concurrency` in flight, `rounds` × `concurrency` prompts."""

    concurrency: int
    rounds: int
    prompt_len: int

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.rounds < 1 or self.prompt_len < 1:
            raise ValueError(f"concurrency, rounds and prompt_len must be >= 1: {self}")

    @property
    def num_prompts(self) -> int:
        return self.concurrency * self.rounds


def rounds_for(concurrency: int, rounds: int | None, rounds_at_c1: int) -> int:
    """Rounds at one concurrency: `rounds_at_c1` at 1; else `rounds` when given, else
    the steady-state default."""
    if concurrency == 1:
        return rounds_at_c1
    if rounds is not None:
        return rounds
    return DEFAULT_STEADY_ROUNDS if concurrency >= STEADY_FROM_CONCURRENCY else 1


def plan_runs(
    concurrency: list[int],
    prompt_len: int,
    *,
    rounds: int | None,
    rounds_at_c1: int,
    burst: bool,
    ttft_lens: Sequence[int] = (),
) -> list[RunSpec]:
    """Every run, in order: per concurrency the burst (when `burst` and the steady run has
    more than one round) then the steady run; then one run at concurrency 1 per
    `ttft_lens` length not already covered."""
    specs: list[RunSpec] = []
    for c in concurrency:
        n = rounds_for(c, rounds, rounds_at_c1)
        if c > 1 and n > 1 and burst:
            specs.append(RunSpec(c, 1, prompt_len))
        specs.append(RunSpec(c, n, prompt_len))
    for length in ttft_lens:
        spec = RunSpec(1, rounds_at_c1, length)
        if spec not in specs:
            specs.append(spec)
    return specs


def plan_from_args(ns: Any) -> list[RunSpec]:
    """`plan_runs` from the flags of `add_run_args` (gpu_suite and suite_offline)."""
    return plan_runs(
        ns.concurrency, ns.prompt_len, rounds=ns.rounds, rounds_at_c1=ns.rounds_at_c1,
        burst=ns.burst, ttft_lens=ns.ttft_lens,
    )  # fmt: skip


def prompts_for(shape: str, spec: RunSpec, vocab_size: int) -> list[list[int]]:
    """The run's prompts, the same for every system. A burst's prompts are those of the
    suite's earlier one-round runs; a run of several rounds draws a different set, so a
    burst that ran first on the same engine leaves nothing in its prefix cache for it."""
    length = spec.prompt_len
    seed = workload_seed(shape, spec.concurrency, length)
    if spec.concurrency == 1:
        return [make_prompts(1, length, vocab_size, seed + r)[0] for r in range(spec.rounds)]
    if spec.rounds == 1:
        return make_prompts(spec.concurrency, length, vocab_size, seed)
    return make_prompts(spec.num_prompts, length, vocab_size, seed ^ (0x5EED << spec.rounds))


def add_run_args(p: argparse.ArgumentParser, systems: str, ttft_lens: str) -> None:
    """The flags that shape the runs and the engine under them (`systems`: the parts they
    apply to)."""
    p.add_argument(
        "--rounds",
        type=int,
        help=f"{systems}: closed loop over ROUNDS x C prompts at each concurrency C > 1 "
        f"(default: {DEFAULT_STEADY_ROUNDS} from C = {STEADY_FROM_CONCURRENCY} on, 1 below; "
        "1 = a burst only)",
    )
    p.add_argument(
        "--burst",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"{systems}: also one round (a burst) where the closed loop has several",
    )
    p.add_argument(
        "--ttft-lens",
        default=ttft_lens,
        help=f"{systems}: prompt lengths also run alone (concurrency 1), for the TTFT table",
    )
    p.add_argument(
        "--prompt-graph-max-tokens",
        type=int,
        help=f"{systems}: the longest lone prompt chunk replayed from a CUDA graph "
        "(0 = every prompt eagerly; default: the engine's own)",
    )
    p.add_argument(
        "--no-compile",
        action="store_true",
        help=f"{systems} without torch.compile (8B shapes then start in about a minute "
        "instead of several on a fresh machine; compare runs of one setting only)",
    )


# ---------------------------------------------------------------- timings and stats


@dataclass
class ReqTiming:
    """One request, times in seconds on one clock."""

    sent_s: float
    # The response's headers arrived: the server started the call's handler (pdserve's
    # router sends them first). Sent → accepted is the wait to be taken in.
    accepted_s: float | None = None
    first_s: float | None = None
    last_s: float | None = None
    num_tokens: int = 0
    ok: bool = True
    kv_transfer_s: float | None = None
    kv_wire_s: float | None = None
    prefill_s: float | None = None
    # The router's own TTFT (from the call reaching its serving core), from the final
    # message's timings: client TTFT minus this is the edge (gRPC, the handler's entry).
    router_ttft_s: float | None = None
    error: str = ""
    # Seconds between consecutive arrivals of output: one long gap (a prefill step
    # between two decodes) lifts a request's TPOT while most tokens come at step pace.
    gaps_s: list[float] = field(default_factory=list)

    def add_tokens(self, now: float, count: int) -> None:
        """Output of `count` tokens arrived at `now`."""
        if self.last_s is not None:
            self.gaps_s.append(now - self.last_s)
        self.first_s = now if self.first_s is None else self.first_s
        self.last_s = now
        self.num_tokens += count

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_s is None or self.last_s is None or self.num_tokens < 2:
            return None
        return (self.last_s - self.first_s) / (self.num_tokens - 1)


def dist_ms(values_s: list[float]) -> dict[str, float]:
    """p50, p99 and mean of `values_s` in milliseconds (bench.report's percentile)."""
    return {k: round(v, 3) for k, v in distribution(values_s, (50, 99), scale=1000).items()}


def summarize(
    system: str, concurrency: int, timings: list[ReqTiming], wall_s: float, **extra: Any
) -> dict[str, Any]:
    """Output tokens/s over the wall time, TTFT and TPOT percentiles (ms)."""
    ok = [t for t in timings if t.ok]
    tokens = sum(t.num_tokens for t in ok)
    return {
        "system": system,
        "concurrency": concurrency,
        "num_requests": len(timings),
        "num_ok": len(ok),
        "output_tokens": tokens,
        "wall_s": round(wall_s, 4),
        "output_tok_s": round(tokens / wall_s, 2) if wall_s > 0 else math.nan,
        "output_tok_s_mid": mid_run_tok_s(ok, concurrency),
        "ttft_ms": dist_ms([t.ttft_s for t in ok if t.ttft_s is not None]),
        "accept_ms": dist_ms([t.accepted_s - t.sent_s for t in ok if t.accepted_s is not None]),
        "router_ttft_ms": dist_ms([t.router_ttft_s for t in ok if t.router_ttft_s]),
        # The prefill worker's own time, the call's arrival to its first token (hand-offs).
        "worker_prefill_ms": dist_ms([t.prefill_s for t in ok if t.prefill_s]),
        "tpot_ms": dist_ms([t.tpot_s for t in ok if t.tpot_s is not None]),
        "itl_ms": dist_ms([gap for t in ok for gap in t.gaps_s]),
        # Above 1 when the server sent several tokens in one message (it fell behind).
        "tokens_per_message": round(tokens / max(1, sum(len(t.gaps_s) + 1 for t in ok)), 2),
        "errors": sorted({t.error for t in timings if not t.ok})[:5],
        **extra,
    }


def mid_run_tok_s(ok: list[ReqTiming], concurrency: int) -> float | None:
    """Output tokens/s of a closed loop between its ramps: from the end of the first
    `concurrency` requests (sent together, so their prompts all queue at once) to the
    send of the last request (after it fewer than `concurrency` are in flight). A
    request counts at its last token. None when that window is empty (one round)."""
    ends = sorted(t.last_s for t in ok if t.last_s is not None)
    if concurrency < 2 or len(ends) <= concurrency:
        return None
    start, stop = ends[concurrency - 1], max(t.sent_s for t in ok)
    inside = [t.num_tokens for t in ok if t.last_s is not None and start < t.last_s <= stop]
    if stop <= start or len(inside) < concurrency:
        return None
    return round(sum(inside) / (stop - start), 2)


def error_record(exc: BaseException) -> dict[str, str]:
    return {"error": f"{type(exc).__name__}: {exc}"[:2000]}
