"""Goodput of serving layouts side by side: each layout's brackets per TPOT objective,
and every disaggregated layout against the colocated layouts of as many GPUs.

A layout's goodput at an objective is the highest Poisson rate it sustained (the
bracket's lower bound); its bracket also holds the lowest rate it missed. A ratio is
disaggregated ÷ colocated goodput; its verdict reads both brackets, so that the search's
resolution is not mistaken for a difference:

* better: the disaggregated layout sustained a rate the colocated one missed;
* worse:  it missed a rate the colocated one sustained;
* tied:   the brackets overlap (equal within the search's resolution).

Three views, computed from the records of one run (or of several, merged):

* pairs:       each disaggregated layout ÷ each colocated layout of the same GPUs;
* best:        per GPU count, the best disaggregated ÷ the best colocated layout;
* never_worse: each disaggregated layout against the best colocated one of its GPUs;
               the rule holds where no verdict is "worse".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from bench.goodput_search import Bracket


def slo_key(tpot_ms: float) -> str:
    """The JSON key of a TPOT objective: 25.0 -> '25'."""
    return f"{tpot_ms:g}"


def layout_bracket(points: Iterable[dict[str, Any]], key: str, target: float) -> Bracket:
    """A layout's bracket at objective `key` from the points that count for it (its
    sweep aimed at it, or a sweep scored at every objective) and whose attainment at it
    is known (not cut short at a tighter objective)."""
    from bench.goodput_search import bracket

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
    width = max([len(r["layout"]) for r in records] + [24])
    lines = [
        "goodput, req/s: highest Poisson rate sustained (<R: rate R missed; +: none missed)",
        f"{'layout':<{width}} {'GPUs':>4} {'start s':>7} {'probes':>6}  "
        + "  ".join(f"{h:>16}" for h in heads),
    ]
    for r in records:
        if not r.get("goodput"):
            why = r.get("skipped") or r.get("error") or "no goodput"
            lines.append(f"{r['layout']:<{width}} {r.get('gpus', '-'):>4}  {why[:90]}")
            continue
        start = r.get("startup_s")
        cells = "  ".join(f"{_cell(_bracket(r, k)):>16}" for k in keys)
        lines.append(
            f"{r['layout']:<{width}} {r['gpus']:>4} {start if start is not None else '-':>7} "
            f"{len(r['points']):>6}  {cells}"
        )
    for r in records:
        if r.get("goodput") and r.get("error"):  # measured, then failed: say so
            lines.append(f"  {r['layout']}: stopped by {r['error'][:100]}")
    pair_width = 2 * width + 3
    if comp["pairs"]:
        lines += ["", "disaggregated ÷ colocated, same GPUs (ratio, verdict from the brackets)"]
        lines.append(f"{'':<{pair_width}} {'GPUs':>4}  " + "  ".join(f"{h:>16}" for h in heads))
        for row in comp["pairs"]:
            name = f"{row['disagg']} ÷ {row['colocated']}"
            cells = "  ".join(f"{_ratio_cell(row[k]):>16}" for k in keys)
            lines.append(f"{name:<{pair_width}} {row['gpus']:>4}  {cells}")
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
            cells = ", ".join(
                f"{k} ms: {_ratio_cell(row[k])} vs {row[k]['vs']}" for k in keys if row[k]
            )
            lines.append(f"{row['disagg']:<{width}} {holds:>3}  {cells}")
    return "\n".join(lines)
