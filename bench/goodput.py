"""What a goodput measurement is, with no service in it: the serving layouts compared,
which requests meet an SLO, which Poisson rate to probe next, and how layouts compare.

A request meets an SLO when it completed with TTFT and TPOT within their objectives (a
one-token answer has no TPOT to miss); a rate is sustained when >= `attainment` of its
requests (sent or not) meet it. Each objective keeps a bracket: the highest rate
sustained with no lower rate missed (the goodput) and the lowest rate missed. The search
grows the rate by `growth` until a miss, halves it while even the first rate misses,
then bisects until failed / sustained <= `resolution` (with a `grid`, only its rates).
A comparison's verdict reads both brackets ("better": the disaggregated layout sustained
a rate the colocated one missed; "worse": the reverse; else "tied").
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.report import text_table
from bench.suite_common import ReqTiming

# ---------------------------------------------------------------- layouts

# `colocated:2xtp2` (2 colocated workers of 2 GPUs each), `disagg:3xtp1+1xtp1` (3 prefill
# workers of 1 GPU, then 1 decode worker of 1 GPU: the prefill pool first). A
# disaggregated layout's router keeps its local-prefill rule: the layouts compared are
# the ones an operator would deploy.
_POOL = r"(\d+)xtp(\d+)"


@dataclass(frozen=True)
class Pool:
    """`workers` workers of `tp` GPUs each."""

    workers: int
    tp: int

    @property
    def gpus(self) -> int:
        return self.workers * self.tp

    def __str__(self) -> str:
        return f"{self.workers}xtp{self.tp}"


@dataclass(frozen=True)
class Layout:
    """A colocated pool (`decode` is None) or a prefill pool handing off to a decode pool."""

    first: Pool  # the colocated pool, or the prefill pool
    decode: Pool | None = None

    @property
    def disaggregated(self) -> bool:
        return self.decode is not None

    @property
    def gpus(self) -> int:
        return self.first.gpus + (self.decode.gpus if self.decode else 0)

    @property
    def name(self) -> str:
        if self.decode is None:
            return f"colocated:{self.first}"
        return f"disagg:{self.first}+{self.decode}"

    def __str__(self) -> str:
        return self.name

    def serve_flags(self) -> list[str]:
        """The pools' sizes and tensor-parallel sizes as `pdserve serve` flags."""
        if self.decode is None:
            return [
                "--colocated-workers", str(self.first.workers),
                "--colocated-tensor-parallel-size", str(self.first.tp),
            ]  # fmt: skip
        return [
            "--prefill-workers", str(self.first.workers),
            "--prefill-tensor-parallel-size", str(self.first.tp),
            "--decode-workers", str(self.decode.workers),
            "--decode-tensor-parallel-size", str(self.decode.tp),
        ]  # fmt: skip


def _pool(text: str, whole: str) -> Pool:
    m = re.fullmatch(_POOL, text)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise ValueError(f"layout {whole!r}: {text!r} is not WORKERSxtpSIZE (e.g. 2xtp1)")
    return Pool(int(m[1]), int(m[2]))


def parse_layout(text: str) -> Layout:
    """`colocated:NxtpT` or `disagg:PxtpA+DxtpB` (ValueError for anything else)."""
    kind, sep, pools = text.strip().partition(":")
    if sep and kind == "colocated":
        return Layout(_pool(pools, text))
    if sep and kind == "disagg":
        prefill, plus, decode = pools.partition("+")
        if plus:
            return Layout(_pool(prefill, text), _pool(decode, text))
    raise ValueError(
        f"unknown layout {text!r}: colocated:NxtpT (e.g. colocated:2xtp2) or "
        "disagg:PxtpA+DxtpB, prefill pool first (e.g. disagg:3xtp1+1xtp1)"
    )


def parse_layouts(text: str) -> list[Layout]:
    """A comma list of layouts, each once, in the order given."""
    layouts = [parse_layout(item) for item in text.split(",") if item.strip()]
    if not layouts:
        raise ValueError("no layout given")
    names = [layout.name for layout in layouts]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"layouts given twice: {', '.join(repeated)}")
    return layouts


# ---------------------------------------------------------------- SLO arithmetic


def slo_key(tpot_ms: float) -> str:
    """The JSON key of a TPOT objective: 25.0 -> '25'."""
    return f"{tpot_ms:g}"


def meets(
    ok: bool, ttft_ms: float | None, tpot_ms: float | None, ttft_slo_ms: float, tpot_slo_ms: float
) -> bool:
    """One request against one SLO; a one-token answer has no TPOT and cannot miss it."""
    if not ok or ttft_ms is None or ttft_ms > ttft_slo_ms:
        return False
    return tpot_ms is None or tpot_ms <= tpot_slo_ms


def attainment(requests: dict[str, list[Any]], ttft_slo_ms: float, tpot_slo_ms: float) -> float:
    """Fraction of a point's requests (sent or not) meeting the SLO, from its per-request
    lists `ok`, `ttft_ms`, `tpot_ms`."""
    rows = list(zip(requests["ok"], requests["ttft_ms"], requests["tpot_ms"], strict=True))
    if not rows:
        return 0.0
    return sum(meets(ok, a, b, ttft_slo_ms, tpot_slo_ms) for ok, a, b in rows) / len(rows)


def definitely_missed(
    t: ReqTiming, now: float, ttft_slo_s: float, tpot_slo_s: float, output_len: int
) -> bool:
    """Whether a request in flight can no longer meet the SLO, whatever comes next."""
    if not t.ok:
        return True
    if t.first_s is None:
        return now - t.sent_s > ttft_slo_s
    if t.first_s - t.sent_s > ttft_slo_s:
        return True
    if output_len < 2:
        return False
    last = t.last_s if t.num_tokens >= output_len else now  # the last token comes later
    return (last - t.first_s) / (output_len - 1) > tpot_slo_s  # type: ignore[operator]


def give_up_when_missed(
    n: int, target: float, ttft_slo_s: float, tpot_slo_s: float, output_len: int
) -> Callable[[list[ReqTiming], float], bool]:
    """`drive`'s give_up: True once more requests surely missed than `target` allows."""
    allowed = math.floor((1 - target) * n + 1e-9)

    def give_up(timings: list[ReqTiming], now: float) -> bool:
        missed = sum(
            1
            for t in timings
            if t.sent_s and definitely_missed(t, now, ttft_slo_s, tpot_slo_s, output_len)
        )
        return missed > allowed

    return give_up


# ---------------------------------------------------------------- the search

# A rate's result at each objective: True sustained, False missed, None unknown (the
# probe was cut short at a tighter objective, so what a looser one saw is incomplete).
Results = Mapping[float, Mapping[str, bool | None]]


@dataclass(frozen=True)
class Bracket:
    """What the probes so far say of one objective's goodput (req/s)."""

    sustained: float = 0.0  # highest rate sustained with every lower rate sustained
    failed: float | None = None  # lowest rate missed; None: none missed (a lower bound)

    @property
    def width(self) -> float:
        """failed / sustained: how far apart the bounds are (inf: open above or below)."""
        if self.failed is None or self.sustained <= 0:
            return math.inf
        return self.failed / self.sustained


def bracket(outcomes: Iterable[tuple[float, bool]]) -> Bracket:
    """The bracket of (rate, sustained) outcomes; a rate sustained above a missed one
    is noise and does not count."""
    rows = list(outcomes)
    failed = min((rate for rate, ok in rows if not ok), default=None)
    sustained = max(
        (rate for rate, ok in rows if ok and (failed is None or rate < failed)), default=0.0
    )
    return Bracket(sustained, failed)


def bracket_at(results: Results, key: str) -> Bracket:
    """The bracket of objective `key` from every rate whose result at it is known."""
    return bracket((rate, ok) for rate, by in results.items() if (ok := by.get(key)) is not None)


def nice(rate: float) -> float:
    """A rate to three significant digits (readable tables, stable prompt seeds)."""
    return float(f"{rate:.3g}")


@dataclass(frozen=True)
class Probe:
    rate: float
    aim: str  # the objective the rate was chosen for: the probe may be cut short at it


@dataclass(frozen=True)
class RateProbeSearch:
    """The next probe for objectives `keys` (TPOT in ms, as JSON keys: '25', '50')."""

    keys: tuple[str, ...]
    start: Mapping[str, float]  # per objective, the first rate (a seed, or the start rate)
    growth: float = 2.0
    resolution: float = 1.2
    min_rate: float = 0.25
    max_rate: float = 256.0
    max_probes: int = 6
    grid: tuple[float, ...] = ()  # when given, the only rates probed

    def candidate(self, key: str, b: Bracket) -> float | None:
        """The rate that narrows `key`'s bracket most; None once it is narrow enough."""
        if self.grid:
            return self._on_grid(key, b)
        if b.failed is None:
            if b.sustained <= 0:
                return self.start[key]
            if b.sustained >= self.max_rate:
                return None
            return min(nice(b.sustained * self.growth), self.max_rate)
        if b.sustained <= 0:
            lower = nice(b.failed / self.growth)
            return lower if lower >= self.min_rate else None
        if b.width <= self.resolution:
            return None
        return nice(math.sqrt(b.sustained * b.failed))

    def _on_grid(self, key: str, b: Bracket) -> float | None:
        inside = [
            r for r in sorted(self.grid) if r > b.sustained and (b.failed is None or r < b.failed)
        ]
        if not inside:
            return None
        if b.sustained <= 0 and b.failed is None:  # nothing known: the grid rate nearest the start
            aim = self.start[key]
        elif b.failed is None:  # growing: the next rate up
            return inside[0]
        elif b.sustained <= 0:  # even the lowest rate tried missed: the next rate down
            return inside[-1]
        else:
            aim = math.sqrt(b.sustained * b.failed)
        return min(inside, key=lambda r: abs(math.log(r / aim)))

    def next_probe(self, results: Results) -> Probe | None:
        if len(results) >= self.max_probes:
            return None
        open_keys = []
        for key in self.keys:
            b = bracket_at(results, key)
            rate = self.candidate(key, b)
            if rate is not None:
                open_keys.append((b.width, float(key), key, rate))
        if not open_keys:
            return None
        # Widest bracket first; on a tie the loosest objective.
        _, _, key, rate = max(open_keys)
        # Of the objectives wanting this very rate, aim at the loosest: a probe cut
        # short at it still tells every tighter one.
        same = [k for _, _, k, r in open_keys if r == rate]
        aim = max(same, key=float)
        while rate in results:  # already probed, its result here unknown: fresh prompts
            rate = nice(rate * 1.05)
        return Probe(rate, aim)


def looser_than(aim: str, keys: Iterable[str]) -> list[str]:
    """The objectives looser than `aim`: what a probe cut short at `aim` cannot tell."""
    return [k for k in keys if float(k) > float(aim)]


# ---------------------------------------------------------------- comparisons


def layout_bracket(points: Iterable[dict[str, Any]], key: str, target: float) -> Bracket:
    """A layout's bracket at objective `key` from the points that count for it (its
    sweep aimed at it, or a sweep scored at every objective) and whose attainment at it
    is known (not cut short at a tighter objective)."""
    return bracket(
        (p["rate"], p["attainment"][key] >= target)
        for p in points
        if key in p.get("counts_for", ()) and p["attainment"].get(key) is not None
    )


def _bracket(record: dict[str, Any], key: str) -> Bracket | None:
    got = record.get("goodput", {}).get(key)
    if got is None:
        return None
    return Bracket(got["sustained"], got["failed"])


def verdict(disagg: Bracket, colocated: Bracket) -> str:
    if colocated.failed is not None and disagg.sustained >= colocated.failed:
        return "better"
    if disagg.failed is not None and disagg.failed <= colocated.sustained:
        return "worse"
    return "tied"


def ratio(disagg: Bracket, colocated: Bracket) -> float | None:
    """Disaggregated ÷ colocated goodput; None when the colocated one sustained nothing."""
    if colocated.sustained <= 0:
        return None
    return round(disagg.sustained / colocated.sustained, 3)


def _compare(d: dict[str, Any], c: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"disagg": d["layout"], "colocated": c["layout"], "gpus": d["gpus"]}
    for key in keys:
        bd, bc = _bracket(d, key), _bracket(c, key)
        if bd is None or bc is None:
            out[key] = None
        else:
            out[key] = {"ratio": ratio(bd, bc), "verdict": verdict(bd, bc)}
    return out


def measured(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records that hold a goodput (not skipped, not failed before a probe)."""
    return [r for r in records if r.get("goodput")]


def _best(records: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    scored = [r for r in records if key in r["goodput"]]
    return max(scored, key=lambda r: r["goodput"][key]["sustained"], default=None)


def comparisons(records: Sequence[dict[str, Any]], keys: Sequence[str]) -> dict[str, Any]:
    """pairs, best and never_worse (see the module's docstring)."""
    done = measured(records)
    pairs, best, never_worse = [], [], []
    for gpus in sorted({r["gpus"] for r in done}):
        disagg = [r for r in done if r["gpus"] == gpus and r["disaggregated"]]
        colocated = [r for r in done if r["gpus"] == gpus and not r["disaggregated"]]
        pairs += [_compare(d, c, keys) for d in disagg for c in colocated]
        for key in keys:
            bd, bc = _best(disagg, key), _best(colocated, key)
            if bd is not None and bc is not None:
                best.append({"slo_tpot_ms": key, **_compare(bd, bc, [key])})
        for d in disagg:
            row: dict[str, Any] = {"disagg": d["layout"], "gpus": gpus}
            for key in keys:
                bc = _best(colocated, key)
                row[key] = (
                    None if bc is None else {"vs": bc["layout"], **_compare(d, bc, [key])[key]}
                )
            verdicts = [row[k]["verdict"] for k in keys if row[k]]
            row["holds"] = None if not verdicts else "worse" not in verdicts
            never_worse.append(row)
    return {"pairs": pairs, "best": best, "never_worse": never_worse}


# ---------------------------------------------------------------- tables


def _cell(b: Bracket | None) -> str:
    if b is None:
        return "-"
    above = f"<{b.failed:g}" if b.failed is not None else "+"  # missed at, or a lower bound
    return f"{b.sustained:g} ({above})"


def _ratio_cell(cell: dict[str, Any] | None) -> str:
    if not cell:
        return "-"
    value = "n/a" if cell["ratio"] is None else f"{cell['ratio']:.2f}"
    return f"{value} {cell['verdict']}"


def format_tables(
    records: Sequence[dict[str, Any]], keys: Sequence[str], comp: dict[str, Any]
) -> str:
    """The layouts' goodput, then the three views of `comparisons`."""
    heads = [f"TPOT<={k}ms" for k in keys]
    rows: list[Any] = []
    for r in records:
        if r.get("goodput"):
            cells = [_cell(_bracket(r, k)) for k in keys]
            rows.append([r["layout"], r["gpus"], r.get("startup_s"), len(r["points"]), *cells])
        else:
            why = r.get("skipped") or r.get("error") or "no goodput"
            rows.append(f"{r['layout']}  {r.get('gpus', '-')} GPUs  {why[:90]}")
    lines = [
        "goodput, req/s: highest Poisson rate sustained (<R: rate R missed; +: none missed)",
        *text_table(["layout", "GPUs", "start s", "probes", *heads], rows),
    ]
    for r in records:
        if r.get("goodput") and r.get("error"):  # measured, then failed: say so
            lines.append(f"  {r['layout']}: stopped by {r['error'][:100]}")
    if comp["pairs"]:
        lines += ["", "disaggregated ÷ colocated, same GPUs (ratio, verdict from the brackets)"]
        pairs = [
            [f"{r['disagg']} ÷ {r['colocated']}", r["gpus"], *(_ratio_cell(r[k]) for k in keys)]
            for r in comp["pairs"]
        ]
        lines += text_table(["", "GPUs", *heads], pairs)
    if comp["best"]:
        lines += ["", "best disaggregated ÷ best colocated, per GPU count and objective"]
        for row in comp["best"]:
            key = row["slo_tpot_ms"]
            lines.append(
                f"{row['gpus']} GPUs, TPOT<={key}ms: {row['disagg']} ÷ {row['colocated']} = "
                + _ratio_cell(row[key])
            )
    if comp["never_worse"]:
        lines += ["", "never worse than the best colocated layout of the same GPUs?"]
        for row in comp["never_worse"]:
            holds = {True: "yes", False: "NO", None: "-"}[row["holds"]]
            says = ", ".join(
                f"{k} ms: {_ratio_cell(row[k])} vs {row[k]['vs']}" for k in keys if row[k]
            )
            lines.append(f"{row['disagg']}  {holds}  {says}")
    return "\n".join(lines)
