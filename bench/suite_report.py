"""The GPU suite's tables, from its JSON: throughput and latency of every system, the
decode step against the memory floor, the KV hand-off under load against alone, TTFT at
concurrency 1 (engine, colocated service, 1P1D), worker phases, burst against steady-state
throughput.

    python -m bench.suite_report RESULTS.json [MORE.json...]

prints the tables of each file.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from bench.report import fmt, text_table


def runs_of(section: Any) -> list[dict]:
    if isinstance(section, list):
        return section
    if isinstance(section, dict):
        return section.get("runs", [])
    return []


def run_key(run: dict, main_len: int) -> tuple[int, int, int]:
    """(concurrency, rounds, prompt_len) of a run; older JSONs lack the last two."""
    return run["concurrency"], run.get("rounds", 1), run.get("prompt_len", main_len)


def sections_of(rec: dict) -> dict[str, Any]:
    """A shape's systems by part name, in report order."""
    off = rec.get("offline", {})
    out = {name: off.get(name) for name in ("a", "b") if name in off}
    if "colocated" in rec:
        out["cc"] = rec["colocated"]
    if "service" in rec:
        out["c"] = rec["service"]
    return out


def format_tables(result: dict) -> str:
    """Every table of one suite result that has rows."""
    main_len = result.get("config", {}).get("prompt_len", 512)
    shapes = result.get("shapes", {})
    tables = [
        _throughput(shapes, main_len),
        _floor(shapes, main_len),
        _handoff_under_load(shapes, main_len),
        _tpot_over_step(shapes, main_len),
        _ttft_c1(shapes, main_len),
        _phases(shapes, main_len),
        _steady(shapes, main_len),
    ]
    lines = [line for table in tables if len(table) > 3 for line in table]
    return "\n".join(lines).strip("\n")


def _p50(run: dict, key: str) -> Any:
    return (run.get(key) or {}).get("p50")


def _throughput(shapes: dict, main_len: int) -> list[str]:
    rows: list[Any] = []
    for shape, rec in shapes.items():
        if rec.get("skipped"):
            rows.append(f"{shape} skipped: {rec['skipped']}")
        for name, section in sections_of(rec).items():
            for r in runs_of(section):
                ttft, tpot = r["ttft_ms"], r["tpot_ms"]
                rows.append(
                    [shape, r["system"], *run_key(r, main_len), fmt(r["output_tok_s"]),
                     fmt(ttft["p50"]), fmt(ttft["p99"]), fmt(_p50(r, "accept_ms")),
                     fmt(tpot["p50"], 2), fmt(tpot["p99"], 2), fmt(_p50(r, "itl_ms"), 2),
                     f"{r['num_ok']}/{r['num_requests']}"]
                )  # fmt: skip
            if isinstance(section, dict) and ("error" in section or "skipped" in section):
                rows.append(
                    f"{shape} {name}: {str(section.get('error') or section['skipped'])[:110]}"
                )
    head = ["shape", "system", "conc", "rnds", "prompt", "tok/s", "TTFT p50", "p99", "acc p50"]
    head += ["TPOT p50", "p99", "ITL p50", "ok"]
    return text_table(head, rows, title="throughput and latency (ms)", left=2)


def _floor(shapes: dict, main_len: int) -> list[str]:
    rows: list[Any] = []
    for shape, rec in shapes.items():
        for r in runs_of(rec.get("offline", {}).get("b")):
            conc, rounds, plen = run_key(r, main_len)
            d = r.get("decode_step", {})
            if plen == main_len and d.get("steps"):
                rows.append(
                    [shape, conc, rounds, fmt(d.get("step_ms"), 2), fmt(d.get("execute_ms"), 2),
                     fmt(d.get("floor_ms"), 3), fmt(d.get("step_over_floor"))]
                )  # fmt: skip
        bw = rec.get("offline", {}).get("copy_bandwidth", {})
        if bw.get("read_write_gb_s"):
            rows.append(f"{shape} copy bandwidth {bw['read_write_gb_s']} GB/s (read+write)")
    return text_table(
        ["shape", "batch", "rnds", "step ms", "exec ms", "floor ms", "x floor"], rows,
        title="decode step vs memory floor (b, full-batch decode-only steps)",
    )  # fmt: skip


def _handoff_under_load(shapes: dict, main_len: int) -> list[str]:
    """c's hand-off p50 (the requests' timings.kv_transfer_seconds) in each run against
    the same prompt length's run at concurrency 1: how much hand-offs wait on a busy pair
    (rounds 1 at concurrency > 1 is the burst)."""
    rows = []
    for shape, rec in shapes.items():
        runs = runs_of(rec.get("service"))
        alone = {
            run_key(r, main_len)[2]: r.get("kv_transfer_ms_p50")
            for r in runs
            if r["concurrency"] == 1
        }
        for r in runs:
            conc, rounds, plen = run_key(r, main_len)
            ms, base = r.get("kv_transfer_ms_p50"), alone.get(plen)
            if conc != 1 and ms is not None:
                rows.append([shape, conc, rounds, plen, fmt(ms, 2), fmt(base, 2), _ratio(ms, base)])
    return text_table(
        ["shape", "conc", "rnds", "prompt", "ms p50", "alone", "÷ alone"], rows,
        title="KV hand-off p50 in the 1P1D service (c) against the same hand-off alone "
        "(concurrency 1); rounds 1 above concurrency 1 is the burst",
    )  # fmt: skip


def _tpot_over_step(shapes: dict, main_len: int) -> list[str]:
    rows = []
    for shape, rec in shapes.items():
        b_runs = {run_key(r, main_len): r for r in runs_of(rec.get("offline", {}).get("b"))}
        sections = sections_of(rec)
        for name in ("b", "cc", "c"):
            for r in runs_of(sections.get(name)):
                key = run_key(r, main_len)
                # A steady state may have no full-batch decode-only step: the burst's then.
                step = b_runs.get(key, {}).get("decode_step", {}).get("step_ms")
                burst = (key[0], 1, key[2])
                step = step or b_runs.get(burst, {}).get("decode_step", {}).get("step_ms")
                if not step or key[0] == 1:
                    continue
                itl = _p50(r, "itl_ms")
                rows.append(
                    [shape, r["system"], key[0], key[1], fmt(step, 2),
                     fmt(r["tpot_ms"]["p50"] / step, 2), fmt(itl / step if itl else None, 2),
                     fmt(r.get("tokens_per_message"), 2)]
                )  # fmt: skip
    return text_table(
        ["shape", "system", "conc", "rnds", "step ms", "TPOT/step", "ITL/step", "tok/msg"], rows,
        title="TPOT p50 / ITL p50 over b's full-batch decode step (same run shape)", left=2,
    )  # fmt: skip


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b and a == a and b == b else "-"


def _ttft_c1(shapes: dict, main_len: int) -> list[str]:
    def p50(run: dict | None, key: str) -> float | None:
        value = _p50(run, key) if run else None
        return None if value is None or math.isnan(value) else value

    rows = []
    for shape, rec in shapes.items():
        by_part = {
            name: {run_key(r, main_len)[2]: r for r in runs_of(sec) if r["concurrency"] == 1}
            for name, sec in sections_of(rec).items()
        }
        lengths = sorted({n for name in ("b", "cc", "c") for n in by_part.get(name, {})})
        for n in lengths:
            runs = {name: by_part.get(name, {}).get(n) for name in ("b", "cc", "c")}
            b, cc, c = (p50(r, "ttft_ms") for r in runs.values())
            diff = c - cc if c is not None and cc is not None else None
            rows.append(
                [shape, n, fmt(b, 2), fmt(cc, 2), fmt(c, 2), _ratio(c, cc), _ratio(c, b),
                 _ratio(cc, b), fmt(diff, 2), fmt(p50(runs["c"], "router_ttft_ms"), 2),
                 fmt(p50(runs["c"], "worker_prefill_ms"), 2)]
            )  # fmt: skip
    head = ["shape", "prompt", "b", "cc", "c", "c/cc", "c/b", "cc/b", "c-cc", "c rtr", "c wkr"]
    return text_table(
        head, rows,
        title="TTFT p50 at concurrency 1 (ms): engine in-process (b), colocated worker behind "
        "the router (cc), 1P1D (c); of c: the router's own TTFT (c rtr) and the prefill "
        "worker's, call to first token (c wkr)",
    )  # fmt: skip


PHASE_COLUMNS = (
    ("prefill.queue", "P queue"),
    ("prefill.compute", "P compute"),
    ("decode.kv_transfer", "KV"),
    ("decode.kv_signal", "KV sig"),  # of KV: the last header's way, not the bytes
    ("decode.queue", "D queue"),  # prompts the decode worker prefilled itself
    ("decode.compute", "D prefill"),
    ("decode.decode_admission", "D admit"),
    ("decode.first_decode_step", "D step1"),
    ("colocated.queue", "C queue"),
    ("colocated.compute", "C compute"),
)


def _local_share(paths: dict[str, int] | None) -> str:
    """The share of a run's prompts prefilled on the decode worker ("-": not recorded, or
    a colocated service, which has no paths)."""
    total = sum((paths or {}).values())
    if not total:
        return "-"
    local = sum(n for key, n in (paths or {}).items() if key.startswith("local/"))
    return f"{100 * local / total:.0f}%"


def _phases(shapes: dict, main_len: int) -> list[str]:
    """Mean time per request in each worker phase (the service's phase histograms over
    the run): whether a slow first token waited in a queue or in a pass."""
    rows = []
    for shape, rec in shapes.items():
        for section in (rec.get("colocated"), rec.get("service")):
            for r in runs_of(section):
                if phases := r.get("phases_ms"):
                    cells = [fmt(phases.get(key), 2) for key, _ in PHASE_COLUMNS]
                    local = _local_share(r.get("prefill_paths"))
                    rows.append([shape, r["system"], *run_key(r, main_len), *cells, local])
    head = ["shape", "system", "conc", "rnds", "prompt", *(label for _, label in PHASE_COLUMNS)]
    return text_table(
        [*head, "local"], rows, left=2,
        title="worker phases, mean ms per request (the service's phase histograms); local: the "
        "share of prompts the decode workers prefilled themselves",
    )  # fmt: skip


def _steady(shapes: dict, main_len: int) -> list[str]:
    # mid: the steady run between its ramps (the first wave of prompts, the last
    # requests' drain), where a long run's rate tends to.
    rows = []
    for shape, rec in shapes.items():
        sections = sections_of(rec)
        tok = {
            name: {run_key(r, main_len): r["output_tok_s"] for r in runs_of(sec)}
            for name, sec in sections.items()
        }
        mid = {
            name: {run_key(r, main_len): r.get("output_tok_s_mid") for r in runs_of(sec)}
            for name, sec in sections.items()
        }
        for name in ("b", "cc", "c"):
            mine = tok.get(name, {})
            for conc in sorted({k[0] for k in mine if k[0] > 1 and k[2] == main_len}):
                rounds = max(k[1] for k in mine if k[0] == conc and k[2] == main_len)
                burst = mine.get((conc, 1, main_len))
                steady = mine.get((conc, rounds, main_len)) if rounds > 1 else None
                b_burst = tok.get("b", {}).get((conc, 1, main_len))
                b_steady = tok.get("b", {}).get((conc, rounds, main_len))
                my_mid = mid.get(name, {}).get((conc, rounds, main_len))
                b_mid = mid.get("b", {}).get((conc, rounds, main_len))
                system = next(r["system"] for r in runs_of(sections[name]))
                rows.append(
                    [shape, system, conc, fmt(burst), fmt(steady), rounds, _ratio(steady, burst),
                     _ratio(burst, b_burst), _ratio(steady, b_steady), fmt(my_mid),
                     _ratio(my_mid, b_mid)]
                )  # fmt: skip
    head = ["shape", "system", "conc", "burst", "steady", "rnds", "st/bu", "burst/b", "steady/b"]
    return text_table(
        [*head, "mid", "mid/b"], rows, left=2,
        title="output tok/s: burst (1 round of `conc` prompts) vs steady state (closed loop "
        "over rounds x conc prompts), and against the engine (b)",
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Print each file's tables."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("results", nargs="+", help="gpu_suite JSON files")
    ns = p.parse_args(argv)
    for path in ns.results:
        print(f"#### {path}\n{format_tables(json.loads(Path(path).read_text()))}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
