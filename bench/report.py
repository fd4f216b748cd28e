"""What every benchmark's JSON shares: one percentile definition and one provenance record.

* `percentile(values, q)`: linear interpolation between the two nearest ranks (numpy's
  default, and `statistics.median` at q = 50). Every script under bench/ uses it
  (docs/benchmarks.md says which older numbers were made with another definition).
* `provenance(module, args)`: the commit, whether the tree had uncommitted changes, the
  date (UTC), the machine (CPU model, GPU names) and the command line that reproduces
  the run. Benchmarks put it under the key "provenance" of their JSON
  (`write_result` writes such a JSON).
* `text_table(header, rows)`: the fixed-width tables the scripts print.
* `device_out()`: $OUT, the folder whose files come back from a GPU machine, when set.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]), linearly interpolated; NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(
    values: Iterable[float], quantiles: Sequence[float] = (50, 90, 99), *, scale: float = 1.0
) -> dict[str, float]:
    """{"mean", "p50", ...} of `values` times `scale` (1000: seconds to ms); NaN when empty."""
    scaled = [v * scale for v in values]
    out = {"mean": sum(scaled) / len(scaled) if scaled else math.nan}
    for q in quantiles:
        out[f"p{q:g}"] = percentile(scaled, q)
    return out


def int_list(text: str) -> list[int]:
    """A comma-separated flag as integers: "1,32,128" → [1, 32, 128]."""
    return [int(x) for x in text.split(",") if x.strip()]


def fmt(x: Any, nd: int = 1) -> str:
    """A table cell: "-" for None and NaN, a float to `nd` decimals, else str()."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def text_table(
    header: Sequence[str], rows: Iterable[Sequence[Any] | str], *, title: str = "", left: int = 1
) -> list[str]:
    """Lines of a table: each column as wide as its widest cell, the first `left` columns
    aligned left and the others right; cells that are not strings go through `fmt`, and
    a row given as one string (a note) is printed as it is. With a `title`, a blank line
    and "== title ==" come first."""
    body = [
        r if isinstance(r, str) else [c if isinstance(c, str) else fmt(c) for c in r] for r in rows
    ]
    grid = [list(header), *(r for r in body if not isinstance(r, str))]
    widths = [max(len(r[i]) for r in grid) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    lines = ["", f"== {title} =="] if title else []
    return [*lines, line(header), *(r if isinstance(r, str) else line(r) for r in body)]


def git_commit() -> str | None:
    """Short HEAD of this repository, or None outside a git checkout."""
    return _git("rev-parse", "--short", "HEAD")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=10, cwd=REPO, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def hardware() -> dict[str, Any]:
    """The machine: CPU model and count, and each GPU's name and memory (nvidia-smi)."""
    info: dict[str, Any] = {
        "cpu": _cpu_model() or platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "gpus": gpus(),
    }
    return info


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def gpus() -> list[str]:
    """'NVIDIA H100 80GB HBM3, 81559 MiB, driver 580.95.05' per GPU; [] without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return []
    query = "--query-gpu=name,memory.total,driver_version"
    try:
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.stdout.strip().splitlines():
        name, memory, driver = (part.strip() for part in line.split(",", 2))
        gpus.append(f"{name}, {memory}, driver {driver}")
    return gpus


def _versions() -> dict[str, str]:
    """Installed versions of the packages that decide the numbers (no imports)."""
    out = {"python": platform.python_version()}
    for name in ("torch", "triton", "transformers", "ray", "grpcio"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


def provenance(module: str, args: Sequence[str] | None = None) -> dict[str, Any]:
    """Where and how a run was made: `python -m <module> <args>` (default: this process's
    own arguments) on this machine, now."""
    args = sys.argv[1:] if args is None else args
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": git_commit(),
        "dirty": bool(status) if status is not None else None,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", module, *args]),
        "hardware": hardware(),
        "versions": _versions(),
    }


def device_out() -> Path | None:
    """$OUT, the folder whose files come back from a GPU machine, when it is set."""
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else None


def write_result(
    path: str | Path, module: str, argv: Sequence[str] | None, **fields: Any
) -> dict[str, Any]:
    """Write a run's JSON: its provenance (`argv`, or the process's own arguments) and
    `fields`; returns the record."""
    record = {"provenance": provenance(module, argv), **fields}
    Path(path).write_text(json.dumps(record, indent=1))
    return record
