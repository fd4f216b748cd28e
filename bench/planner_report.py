"""What `bench.planner` measured, per phase and over time: SLO attainment, goodput, the
planner's pool sizes; a table and a plot.

A request meets the SLO when it completed with its first token within the TTFT target
and its mean time per output token within the TPOT target; one that did not complete
misses it. Attainment is the share of a phase's requests (by send time) that meet it;
goodput the number that meet it per second of the phase.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from bench import goodput
from bench.report import percentile, text_table

# One request as recorded: (sent_s, ttft_s or None, tpot_s or None, ok, phase).
Request = list[Any]


def meets(req: Request, ttft_slo_s: float, tpot_slo_s: float) -> bool:
    _, ttft, tpot, ok, _ = req
    return goodput.meets(ok, ttft, tpot, ttft_slo_s, tpot_slo_s)


def phase_stats(system: dict, trace: dict) -> list[dict[str, Any]]:
    """Per phase of the trace: requests, attainment, goodput, p90 TTFT and TPOT."""
    ttft_slo, tpot_slo = trace["slo_ttft_ms"] / 1e3, trace["slo_tpot_ms"] / 1e3
    out = []
    for number, phase in enumerate(trace["phases"]):
        reqs = [r for r in system["requests"] if r[4] == number]
        good = sum(meets(r, ttft_slo, tpot_slo) for r in reqs)
        ttfts = [r[1] for r in reqs if r[3] and r[1] is not None]
        tpots = [r[2] for r in reqs if r[3] and r[2] is not None]
        out.append(
            {
                "phase": phase["name"],
                "num_requests": len(reqs),
                "num_failed": sum(not r[3] for r in reqs),
                "attainment": good / len(reqs) if reqs else math.nan,
                "goodput": good / phase["seconds"],
                "ttft_p90_ms": percentile(ttfts, 90) * 1e3 if ttfts else math.nan,
                "tpot_p90_ms": percentile(tpots, 90) * 1e3 if tpots else math.nan,
                "mean_workers": _mean_workers(system, phase),
            }
        )
    return out


def _mean_workers(system: dict, phase: dict) -> float:
    """Live workers over the phase, averaged over the pool samples taken in it."""
    samples = [p for p in system.get("pools", []) if phase["start_s"] <= p[0] < phase["end_s"]]
    if not samples:
        return math.nan
    return sum(p[1] + p[2] for p in samples) / len(samples)


def attainment_series(system: dict, trace: dict, bucket_s: float) -> list[tuple[float, float]]:
    """(bucket start, attainment of the requests sent in it) over the whole trace."""
    ttft_slo, tpot_slo = trace["slo_ttft_ms"] / 1e3, trace["slo_tpot_ms"] / 1e3
    buckets: dict[int, list[bool]] = {}
    for r in system["requests"]:
        buckets.setdefault(int(r[0] // bucket_s), []).append(meets(r, ttft_slo, tpot_slo))
    return [(k * bucket_s, sum(v) / len(v)) for k, v in sorted(buckets.items())]


def table(result: dict) -> str:
    """Per phase: each system's attainment and goodput, and the planner's goodput over
    the best static split's."""
    trace = result["trace"]
    stats = {name: phase_stats(s, trace) for name, s in result["systems"].items()}
    rows = []
    for number, phase in enumerate(trace["phases"]):
        statics = [s[number]["goodput"] for name, s in stats.items() if name != "planner"]
        best = max(statics, default=math.nan)
        for name, per_phase in stats.items():
            p = per_phase[number]
            ratio = (
                f"{p['goodput'] / best:.2f}x best static" if name == "planner" and best > 0 else ""
            )
            rows.append(
                [phase["name"], name, p["num_requests"], p["num_failed"], f"{p['attainment']:.1%}",
                 f"{p['goodput']:.2f}/s", f"{p['ttft_p90_ms']:.0f}ms", f"{p['tpot_p90_ms']:.0f}ms",
                 f"{p['mean_workers']:.2f}", ratio]
            )  # fmt: skip
    head = ["phase", "system", "reqs", "failed", "attain", "goodput", "TTFT p90", "TPOT p90"]
    slo = f"SLO: TTFT <= {trace['slo_ttft_ms']:g} ms, TPOT <= {trace['slo_tpot_ms']:g} ms"
    return "\n".join([slo, *text_table([*head, "workers", ""], rows, left=2)])


def plot(result: dict, path: Path, bucket_s: float | None = None) -> Path | None:
    """Pool sizes (the planner's) and attainment (every system) over time, as a PNG;
    None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = result["trace"]
    bucket_s = bucket_s or max(trace["phases"][0]["seconds"] / 6, 1.0)
    fig, (sizes, attain) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    planner = result["systems"].get("planner")
    if planner is not None and planner.get("pools"):
        t = [p[0] for p in planner["pools"]]
        sizes.step(t, [p[1] for p in planner["pools"]], where="post", label="prefill live")
        sizes.step(t, [p[2] for p in planner["pools"]], where="post", label="decode live")
        sizes.step(t, [p[3] for p in planner["pools"]], "--", where="post", label="prefill target")
        sizes.step(t, [p[4] for p in planner["pools"]], "--", where="post", label="decode target")
    sizes.set_ylabel("planner's workers")
    sizes.legend(loc="upper left", fontsize=8)
    for name, system in result["systems"].items():
        series = attainment_series(system, trace, bucket_s)
        attain.plot(
            [x + bucket_s / 2 for x, _ in series],
            [y for _, y in series],
            marker="o",
            linewidth=2.5 if name == "planner" else 1,
            label=name,
        )
    attain.axhline(0.9, color="grey", linestyle=":", linewidth=1)
    attain.set_ylabel(f"SLO attainment ({bucket_s:.0f} s buckets)")
    attain.set_xlabel("seconds since the trace started")
    attain.set_ylim(-0.05, 1.05)
    attain.legend(loc="lower left", fontsize=8)
    for ax in (sizes, attain):
        for phase in trace["phases"][1:]:
            ax.axvline(phase["start_s"], color="black", linewidth=0.8)
    sizes.set_title(" | ".join(p["name"] for p in trace["phases"]))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def merge(paths: list[Path]) -> dict:
    """Results of several runs of one trace (e.g. one system per GPU call) as one."""
    results = [json.loads(p.read_text()) for p in paths]
    merged = dict(results[0])
    merged["systems"] = {k: v for r in results for k, v in r["systems"].items()}
    for r in results[1:]:
        if r["trace"]["phases"] != merged["trace"]["phases"]:
            raise ValueError("the runs used different traces: not comparable")
    return merged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Tables and a plot from bench.planner results.")
    p.add_argument("results", nargs="+", type=Path, help="bench.planner JSON files")
    p.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    ns = p.parse_args(argv)
    result = merge(ns.results)
    print(table(result))
    if ns.plot is not None:
        written = plot(result, ns.plot)
        print(f"plot: {written}" if written else "no plot: matplotlib is not installed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
