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

ENGINE_SECTIONS = ("b", "b0", "bs", "bt")


def _fmt(x: Any, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


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
    out = {name: off.get(name) for name in ("a", "a2", *ENGINE_SECTIONS) if name in off}
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


def _throughput(shapes: dict, main_len: int) -> list[str]:
    head = f"{'shape':<6}{'system':<28}{'conc':>5}{'rnds':>5}{'prompt':>7}{'tok/s':>10}"
    head += f"{'TTFT p50':>10}{'p99':>9}{'acc p50':>9}{'TPOT p50':>10}{'p99':>8}{'ITL p50':>9}"
    head += f"{'ok':>9}"
    lines = ["", "== throughput and latency (ms) ==", head]
    for shape, rec in shapes.items():
        if rec.get("skipped"):
            lines.append(f"{shape:<6} skipped: {rec['skipped']}")
        for name, section in sections_of(rec).items():
            for r in runs_of(section):
                conc, rounds, plen = run_key(r, main_len)
                lines.append(
                    f"{shape:<6}{r['system']:<28}{conc:>5}{rounds:>5}{plen:>7}"
                    f"{_fmt(r['output_tok_s']):>10}"
                    f"{_fmt(r['ttft_ms']['p50']):>10}{_fmt(r['ttft_ms']['p99']):>9}"
                    f"{_fmt(r.get('accept_ms', {}).get('p50'), 1):>9}"
                    f"{_fmt(r['tpot_ms']['p50'], 2):>10}{_fmt(r['tpot_ms']['p99'], 2):>8}"
                    f"{_fmt(r.get('itl_ms', {}).get('p50'), 2):>9}"
                    f"{r['num_ok']:>5}/{r['num_requests']:<4}"
                )
            if isinstance(section, dict) and ("error" in section or "skipped" in section):
                why = str(section.get("error") or section.get("skipped"))
                lines.append(f"{shape:<6}{name:<28} {why[:110]}")
    return lines


def _floor(shapes: dict, main_len: int) -> list[str]:
    lines = [
        "",
        "== decode step vs memory floor (b, full-batch decode-only steps) ==",
        f"{'shape':<6}{'batch':>6}{'rnds':>5}{'step ms':>10}{'exec ms':>10}{'floor ms':>10}"
        f"{'x floor':>9}",
    ]
    for shape, rec in shapes.items():
        for r in runs_of(rec.get("offline", {}).get("b")):
            conc, rounds, plen = run_key(r, main_len)
            d = r.get("decode_step", {})
            if plen != main_len or not d.get("steps"):
                continue
            lines.append(
                f"{shape:<6}{conc:>6}{rounds:>5}{_fmt(d.get('step_ms'), 2):>10}"
                f"{_fmt(d.get('execute_ms'), 2):>10}{_fmt(d.get('floor_ms'), 3):>10}"
                f"{_fmt(d.get('step_over_floor'), 1):>9}"
            )
        bw = rec.get("offline", {}).get("copy_bandwidth", {})
        if bw.get("read_write_gb_s"):
            lines.append(f"{shape:<6} copy bandwidth {bw['read_write_gb_s']} GB/s (read+write)")
    return lines


def _handoff_under_load(shapes: dict, main_len: int) -> list[str]:
    """c's hand-off p50 (the requests' timings.kv_transfer_seconds) in each run against
    the same prompt length's run at concurrency 1: how much hand-offs wait on a busy pair
    (rounds 1 at concurrency > 1 is the burst)."""
    lines = [
        "",
        "== KV hand-off p50 in the 1P1D service (c) against the same hand-off alone "
        "(concurrency 1); rounds 1 above concurrency 1 is the burst ==",
        f"{'shape':<6}{'conc':>5}{'rnds':>5}{'prompt':>7}{'ms p50':>9}{'alone':>8}{'÷ alone':>9}",
    ]
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
            if conc == 1 or ms is None:
                continue
            lines.append(
                f"{shape:<6}{conc:>5}{rounds:>5}{plen:>7}{_fmt(ms, 2):>9}{_fmt(base, 2):>8}"
                f"{_ratio(ms, base):>9}"
            )
    return lines


def _tpot_over_step(shapes: dict, main_len: int) -> list[str]:
    lines = [
        "",
        "== TPOT p50 / ITL p50 over b's full-batch decode step (same run shape) ==",
        f"{'shape':<6}{'system':<28}{'conc':>5}{'rnds':>5}{'step ms':>9}{'TPOT/step':>11}"
        f"{'ITL/step':>10}{'tok/msg':>9}",
    ]
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
                itl = r.get("itl_ms", {}).get("p50")
                lines.append(
                    f"{shape:<6}{r['system']:<28}{key[0]:>5}{key[1]:>5}{_fmt(step, 2):>9}"
                    f"{_fmt(r['tpot_ms']['p50'] / step, 2):>11}"
                    f"{_fmt(itl / step if itl else None, 2):>10}"
                    f"{_fmt(r.get('tokens_per_message'), 2):>9}"
                )
    return lines


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b and a == a and b == b else "-"


def _ttft_c1(shapes: dict, main_len: int) -> list[str]:
    lines = [
        "",
        "== TTFT p50 at concurrency 1 (ms): engine in-process (b), colocated worker behind "
        "the router (cc), 1P1D (c); of c: the router's own TTFT (c rtr) and the prefill "
        "worker's, call to first token (c wkr) ==",
        f"{'shape':<6}{'prompt':>7}{'b':>9}{'cc':>9}{'c':>9}{'c/cc':>7}{'c/b':>7}{'cc/b':>7}"
        f"{'c-cc':>8}{'c rtr':>8}{'c wkr':>8}",
    ]

    def p50(run: dict, key: str) -> float | None:
        value = (run.get(key) or {}).get("p50")
        return None if value is None or math.isnan(value) else value

    for shape, rec in shapes.items():
        by_part = {
            name: {run_key(r, main_len)[2]: r for r in runs_of(sec) if r["concurrency"] == 1}
            for name, sec in sections_of(rec).items()
        }
        lengths = sorted({n for name in ("b", "cc", "c") for n in by_part.get(name, {})})
        for n in lengths:
            runs = {name: by_part.get(name, {}).get(n) for name in ("b", "cc", "c")}
            b, cc, c = (p50(r, "ttft_ms") if r else None for r in runs.values())
            diff = c - cc if c is not None and cc is not None else None
            router = p50(runs["c"], "router_ttft_ms") if runs["c"] else None
            worker = p50(runs["c"], "worker_prefill_ms") if runs["c"] else None
            lines.append(
                f"{shape:<6}{n:>7}{_fmt(b, 2):>9}{_fmt(cc, 2):>9}{_fmt(c, 2):>9}"
                f"{_ratio(c, cc):>7}{_ratio(c, b):>7}{_ratio(cc, b):>7}{_fmt(diff, 2):>8}"
                f"{_fmt(router, 2):>8}{_fmt(worker, 2):>8}"
            )
    return lines


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
    head = f"{'shape':<6}{'system':<28}{'conc':>5}{'rnds':>5}{'prompt':>7}"
    head += "".join(f"{label:>11}" for _, label in PHASE_COLUMNS) + f"{'local':>7}"
    lines = [
        "",
        "== worker phases, mean ms per request (the service's phase histograms); local: the "
        "share of prompts the decode workers prefilled themselves ==",
        head,
    ]
    for shape, rec in shapes.items():
        for section in (rec.get("colocated"), rec.get("service")):
            for r in runs_of(section):
                phases = r.get("phases_ms")
                if not phases:
                    continue
                conc, rounds, plen = run_key(r, main_len)
                cells = "".join(f"{_fmt(phases.get(key), 2):>11}" for key, _ in PHASE_COLUMNS)
                cells += f"{_local_share(r.get('prefill_paths')):>7}"
                lines.append(f"{shape:<6}{r['system']:<28}{conc:>5}{rounds:>5}{plen:>7}{cells}")
    return lines


def _steady(shapes: dict, main_len: int) -> list[str]:
    lines = [
        "",
        "== output tok/s: burst (1 round of `conc` prompts) vs steady state (closed loop "
        "over rounds x conc prompts), and against the engine (b) ==",
        f"{'shape':<6}{'system':<28}{'conc':>5}{'burst':>10}{'steady':>10}{'rnds':>5}"
        f"{'st/bu':>7}{'burst/b':>9}{'steady/b':>9}{'mid':>10}{'mid/b':>7}",
    ]
    # mid: the steady run between its ramps (the first wave of prompts, the last
    # requests' drain), where a long run's rate tends to.
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
                lines.append(
                    f"{shape:<6}{system:<28}{conc:>5}{_fmt(burst):>10}{_fmt(steady):>10}"
                    f"{rounds:>5}{_ratio(steady, burst):>7}{_ratio(burst, b_burst):>9}"
                    f"{_ratio(steady, b_steady):>9}{_fmt(my_mid):>10}{_ratio(my_mid, b_mid):>7}"
                )
    return lines


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
