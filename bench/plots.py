"""PNG plots of benchmark results, drawn after the run: `latency_<shape>.png` from
bench.gpu_suite JSON (TTFT p50, TPOT p50 and output tok/s against concurrency, a line per
system at its steady state) and `goodput_<model>_<N>gpu.png` from bench.tp_goodput JSON
(per TPOT objective, the share of requests meeting it against the rate, a line per layout
of N GPUs; the layouts of several files merge, a later file's winning). Needs matplotlib.

    python -m bench.plots RESULTS.json [MORE.json...] --out docs/img/
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.goodput import slo_key
from bench.suite_report import run_key, runs_of, sections_of


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        sys.exit("bench.plots needs matplotlib: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_goodput(runs: list[dict], out_dir: Path) -> list[Path]:
    """One figure per GPU count of the layouts of bench.tp_goodput runs, merged: a panel
    per TPOT objective, each probe's attainment at it against its rate."""
    plt = _pyplot()
    config = runs[0]["config"]
    keys = sorted({slo_key(s) for run in runs for s in run["config"]["slos"]}, key=float)
    records = {r["layout"]: r for run in runs for r in run["layouts"] if r.get("points")}
    paths = []
    for gpus in sorted({r["gpus"] for r in records.values()}):
        fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
        for ax, key in zip(axes[0], keys, strict=True):
            for name, rec in records.items():
                points = sorted(
                    (p["rate"], p["attainment"][key])
                    for p in rec["points"]
                    if key in p.get("counts_for", ()) and p["attainment"].get(key) is not None
                )
                got = rec["goodput"].get(key)
                if rec["gpus"] != gpus or not points or got is None:
                    continue
                ax.plot(
                    *zip(*points, strict=True),
                    marker="o",
                    linestyle="-" if rec["disaggregated"] else "--",
                    label=f"{name} (goodput {got['sustained']:g})",
                )
            ax.axhline(config["attainment"], color="grey", linestyle=":", linewidth=1)
            ax.set_title(f"TTFT <= {config['slo_ttft_ms']:g} ms, TPOT <= {key} ms")
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        axes[0][0].set_ylabel("fraction of requests meeting the SLO")
        model = Path(config["model"]).name
        fig.suptitle(
            f"goodput, {model} on {gpus} GPUs: {config['prompt_len']} in / "
            f"{config['output_len']} out, Poisson arrivals"
        )
        paths.append(_save(plt, fig, out_dir / f"goodput_{model}_{gpus}gpu.png"))
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
        paths.append(_save(plt, fig, out_dir / f"latency_{shape}{suffix}.png"))
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("results", nargs="+", help="gpu_suite or tp_goodput JSON files")
    p.add_argument("--out", default="docs/img", help="folder for the PNGs")
    ns = p.parse_args(argv)
    out_dir = Path(ns.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = [json.loads(Path(path).read_text()) for path in ns.results]
    suites = [r for r in results if "shapes" in r]
    written: list[Path] = []
    for i, result in enumerate(suites):
        written += plot_latency(result, out_dir, f"_{i}" if len(suites) > 1 else "")
    goodput = [r for r in results if "layouts" in r]
    if goodput:
        written += plot_goodput(goodput, out_dir)
    for path in written:
        print(path)
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
