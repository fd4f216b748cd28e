"""Run one self-contained measuring function against another checkout of the project,
in a child process of its own: a benchmark's baseline tree, measured in turn with this
one in the same run (`--baseline-tree`)."""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.report import write_result

THIS_TREE = Path(__file__).resolve().parent.parent


def measure_in(tree: Path, measure: Callable[..., Any], **kwargs: Any) -> Any:
    """`measure(**kwargs)`, its source run by a child process on `tree` (any checkout
    with the public API the function uses; it imports what it needs itself). Returns
    its result as JSON decodes it."""
    code = "from typing import Any\nimport json\n" + textwrap.dedent(inspect.getsource(measure))
    code += f"\nprint(json.dumps({measure.__name__}(**{kwargs!r})))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def keep_minimum(best: dict[str, float], got: dict[str, float]) -> None:
    """Fold one round into the best so far, key by key: a shared host's noise only ever
    adds time."""
    for key, value in got.items():
        best[key] = min(best.get(key, value), value)


Best = dict[str, dict[int, dict[str, float]]]  # tree name → point → each measure's minimum


def add_ab_args(p: argparse.ArgumentParser) -> None:
    """The flags every baseline-tree benchmark takes: rounds, the other tree, the JSON."""
    p.add_argument("--rounds", type=int, default=5, help="rounds per tree (minimum kept)")
    p.add_argument("--baseline-tree", type=Path, help="another checkout, measured in turn")
    p.add_argument("--out", type=Path, help="write the results as JSON here")


def trees(baseline: Path | None) -> dict[str, Path]:
    """This tree, and the baseline checkout when one is given."""
    named = {"this tree": THIS_TREE}
    if baseline is not None:
        named["baseline"] = baseline.resolve()
    return named


def best_of_rounds(
    named: dict[str, Path],
    points: Sequence[int],
    rounds: int,
    measure: Callable[..., Any],
    **kwargs: Any,
) -> Best:
    """`measure(point, **kwargs)` at every point on every tree, the trees in turn, for
    `rounds` rounds; the minimum of each measure."""
    best: Best = {name: {} for name in named}
    for _ in range(rounds):
        for name, tree in named.items():
            for point in points:
                got = measure_in(tree, measure, point=point, **kwargs)
                keep_minimum(best[name].setdefault(point, {}), got)
    return best


def write_ab_result(
    out: Path | None, script: str, argv: list[str] | None, named: dict[str, Path], best: Best
) -> None:
    """The results as JSON at `out` (nothing when None), with the trees they came from."""
    if out is not None:
        write_result(
            out,
            script,
            argv,
            trees={name: str(tree) for name, tree in named.items()},
            results={name: {str(k): r for k, r in rows.items()} for name, rows in best.items()},
        )


def print_ab_table(
    named: dict[str, Path],
    best: Best,
    point_title: str,
    columns: Sequence[tuple[str, str, str]],
    ratio_of: str,
) -> None:
    """One row per point and tree: the point, each (title, measure, format) column, and
    `ratio_of` divided by the baseline's (when there is one)."""
    widths = [max(len(title) + 2, 9) for title, _, _ in columns]
    header = "".join(f"{title:>{w}}" for (title, _, _), w in zip(columns, widths, strict=True))
    print(f"{'tree':<11}{point_title:>6}{header}{'÷ base':>8}")
    for point in next(iter(best.values())):
        base = best.get("baseline", {}).get(point)
        for name in named:
            r = best[name][point]
            cells = "".join(
                f"{r[key]:>{w}{fmt}}" for (_, key, fmt), w in zip(columns, widths, strict=True)
            )
            ratio = f"{r[ratio_of] / base[ratio_of]:.2f}" if base else "-"
            print(f"{name:<11}{point:>6}{cells}{ratio:>8}")
