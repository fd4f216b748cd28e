"""Run one self-contained measuring function against another checkout of the project,
in a child process of its own: a benchmark's baseline tree, measured in turn with this
one in the same run (`--baseline-tree`)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
