"""Sum py-spy's collapsed stacks (`--format raw`) by function: where each process spent
its samples, per thread, as self time (the innermost frame) and as inclusive time.

    python -m bench.stack_report bench/results/profile/*.txt --top 25
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_ADDRESS = re.compile(r"\s*\(0x[0-9a-f]+\)")


def _frame(frame: str) -> str:
    """`fn (path/to/file.py:12)` as `fn (file.py)`; lines are dropped so a function's
    samples add up."""
    name, _, where = frame.partition(" (")
    file = where.rstrip(")").rsplit(":", 1)[0].rsplit("/", 1)[-1]
    return f"{name} ({file})" if file else name


def summarize(path: Path, top: int) -> str:
    threads: Counter[str] = Counter()
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        thread = _ADDRESS.sub("", frames[0])
        names = [_frame(f) for f in frames[1:]] or ["(no python frame)"]
        total += count
        threads[thread] += count
        own[f"{thread}: {names[-1]}"] += count
        for name in set(names):
            inclusive[f"{thread}: {name}"] += count
    lines = [f"== {path.name}: {total} samples"]
    lines += [f"  thread {n:6d} {100 * n / total:5.1f}%  {t}" for t, n in threads.most_common(8)]
    lines.append("  -- self")
    lines += [f"  {n:6d} {100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top)]
    lines.append("  -- inclusive")
    lines += [f"  {n:6d} {100 * n / total:5.1f}%  {f}" for f, n in inclusive.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args()
    for path in args.files:
        print(summarize(path, args.top))


if __name__ == "__main__":
    main()
