"""PNG plots of GPU suite results (bench.gpu_suite JSON), drawn after the run:

* `goodput_<shape>_<N>gpu.png`: for each TPOT SLO a panel of the fraction of requests
  meeting it (TTFT and TPOT) against the request rate, one line per system of N GPUs,
  the attainment target dashed;
* `latency_<shape>.png`: TTFT p50, TPOT p50 and output tok/s against concurrency, one
  line per system (b, cc, c at the steady state, i.e. their runs of most rounds; a, a2
  as their one batch), at the suite's main prompt length.

    python -m bench.plots RESULTS.json [MORE.json...] --out docs/img/

Goodput sections of several files (a 4-GPU sweep run one command per system) merge into
one figure. Needs matplotlib (not the suite: it never imports it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.suite_goodput import attainment, max_rate_sustained, points_for, slo_key
from bench.suite_report import merge, run_key, runs_of, sections_of


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        sys.exit("bench.plots needs matplotlib: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def with_slos(section: dict, tpots: list[float]) -> dict:
    """The section with each point's attainment (and each system's highest rate) at TPOT
    objectives the run did not report, from its per-request TTFT and TPOT lists."""
    slo = section.get("slo", {})
    ttft_ms = 1000 * slo.get("ttft_s", 1.0)
    target = slo.get("attainment", 0.9)
    for rec in section.get("systems", {}).values():
        for tpot in tpots:
            key = slo_key(tpot)
            for pt in rec.get("points", []):
                if key not in pt["attainment"]:
                    pt["attainment"][key] = attainment(pt["requests"], ttft_ms, tpot)
            if rec.get("points") and key not in rec["max_rate"]:
                rate, exact = max_rate_sustained(rec["points"], key, target)
                rec["max_rate"][key], rec["max_rate_exact"][key] = rate, exact
    return {**section, "slo": {**slo, "tpot_ms": tpots}}


def plot_goodput(section: dict, out_dir: Path) -> list[Path]:
    """One figure per GPU count: a panel per TPOT SLO, attainment against rate."""
    plt = _pyplot()
    slo = section.get("slo", {})
    tpots = slo.get("tpot_ms", [])
    target = slo.get("attainment", 0.9)
    by_gpus: dict[int, dict[str, dict]] = {}
    for name, rec in section.get("systems", {}).items():
        if rec.get("points"):
            by_gpus.setdefault(rec["gpus"], {})[name] = rec
    paths = []
    for gpus, systems in sorted(by_gpus.items()):
        fig, axes = plt.subplots(1, len(tpots), figsize=(4.2 * len(tpots), 3.6), squeeze=False)
        for ax, tpot in zip(axes[0], tpots, strict=True):
            key = slo_key(tpot)
            for name, rec in systems.items():
                points = sorted(points_for(rec["points"], key), key=lambda p: p["rate"])
                ax.plot(
                    [p["rate"] for p in points],
                    [p["attainment"][key] for p in points],
                    marker="o",
                    linestyle="--" if name.startswith("colocated") else "-",
                    label=f"{name} (max {rec['max_rate'][key]:g})",
                )
            ax.axhline(target, color="grey", linestyle=":", linewidth=1)
            ax.set_title(f"TTFT <= {slo.get('ttft_s')} s, TPOT <= {key} ms")
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        axes[0][0].set_ylabel("fraction of requests meeting the SLO")
        fig.suptitle(
            f"goodput, {section.get('shape')} on {gpus} GPUs: {section.get('prompt_len')} in / "
            f"{section.get('output_len')} out, Poisson arrivals"
        )
        fig.tight_layout()
        path = out_dir / f"goodput_{section.get('shape')}_{gpus}gpu.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def latency_series(rec: dict, main_len: int) -> dict[str, list[tuple[int, dict]]]:
    """system -> [(concurrency, run)] at the main prompt length, the run of most rounds
    at each concurrency (the steady state where there is one)."""
    series: dict[str, list[tuple[int, dict]]] = {}
    for section in sections_of(rec).values():
        best: dict[int, dict] = {}
        for r in runs_of(section):
            conc, rounds, plen = run_key(r, main_len)
            if plen == main_len and (conc not in best or rounds > run_key(best[conc], main_len)[1]):
                best[conc] = r
        if best:
            name = next(iter(best.values()))["system"]
            series[name] = sorted(best.items())
    return series


def plot_latency(result: dict, out_dir: Path, suffix: str = "") -> list[Path]:
    """Per shape: TTFT p50, TPOT p50 and tok/s against concurrency, a line per system."""
    plt = _pyplot()
    main_len = result.get("config", {}).get("prompt_len", 512)
    paths = []
    for shape, rec in result.get("shapes", {}).items():
        series = latency_series(rec, main_len)
        if not series:
            continue
        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        panels = (
            ("TTFT p50 (ms)", lambda r: r["ttft_ms"]["p50"]),
            ("TPOT p50 (ms)", lambda r: r["tpot_ms"]["p50"]),
            ("output tok/s", lambda r: r["output_tok_s"]),
        )
        for ax, (label, value) in zip(axes, panels, strict=True):
            for name, runs in series.items():
                ax.plot([c for c, _ in runs], [value(r) for _, r in runs], marker="o", label=name)
            ax.set_xscale("log", base=2)
            concs = sorted({c for runs in series.values() for c, _ in runs})
            ax.set_xticks(concs, [str(c) for c in concs])
            ax.set_xlabel("concurrency")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(
            f"{shape}: prompt {main_len}, output {result.get('config', {}).get('output_len')} "
            "tokens; closed loop at each concurrency (steady state where run)"
        )
        fig.tight_layout()
        path = out_dir / f"latency_{shape}{suffix}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("results", nargs="+", help="gpu_suite JSON files")
    p.add_argument("--out", default="docs/img", help="folder for the PNGs")
    p.add_argument(
        "--tpot-slos",
        help="ms, comma list: goodput panels for these TPOT objectives, computed from the "
        "per-request timings (default: those the run reported)",
    )
    ns = p.parse_args(argv)
    out_dir = Path(ns.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = [json.loads(Path(path).read_text()) for path in ns.results]
    written: list[Path] = []
    for i, result in enumerate(results):
        written += plot_latency(result, out_dir, f"_{i}" if len(results) > 1 else "")
    goodput = [r["goodput"] for r in results if "systems" in r.get("goodput", {})]
    for section in merge(goodput):
        if ns.tpot_slos:
            section = with_slos(section, [float(x) for x in ns.tpot_slos.split(",") if x])
        written += plot_goodput(section, out_dir)
    for path in written:
        print(path)
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
