"""What the README and docs tell a user to run: the Python example prints what they say it
prints, and every benchmark is named by a command that runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = (
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted(REPO.glob("deploy/**/*.md")),
)


def readme_python_example() -> tuple[str, str]:
    """The README's offline Python example and the output the text after it promises."""
    text = (REPO / "README.md").read_text()
    match = re.search(r"```python\n(.*?)```\n\nprints `([^`]+)`", text, re.S)
    assert match, "no Python example followed by what it prints in README.md"
    return match.group(1), match.group(2)


def test_readme_python_example_prints_what_it_promises(
    smollm2_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, promised = readme_python_example()
    exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - the README's own code
    assert capsys.readouterr().out == promised + "\n"


HISTORY = REPO / "docs" / "benchmarks-history.md"


def retired_benchmarks() -> set[str]:
    """The benchmarks the history lists as retired, each with the commit to restore it
    from: its records of past runs may name them."""
    retired = HISTORY.read_text().split("\n## Retired benchmark scripts", 1)[1]
    return set(re.findall(r"`bench\.([a-z_]+)`", retired))


def test_benchmarks_are_named_by_a_command_that_runs() -> None:
    # `python bench/x.py` fails (the bench package is not on the path that way): the
    # docs name each Python benchmark as the module it runs as.
    for doc in DOCS:
        text = doc.read_text()
        paths = re.findall(r"bench/[a-z_]+\.py", text)
        assert not paths, f"{doc.relative_to(REPO)} names {paths}: say `python -m bench.x`"
        allowed = retired_benchmarks() if doc == HISTORY else set()
        for module in set(re.findall(r"\bbench\.([a-z_]+)\b", text)) - allowed:
            assert (REPO / "bench" / f"{module}.py").is_file(), f"{doc.name}: bench.{module}"


def heading_anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: the text as rendered, lower
    case, every character but letters, digits, `_`, `-` and spaces dropped, spaces as
    `-`; a repeated anchor gets `-1`, `-2`, ... Lines in code fences are not headings."""
    seen: dict[str, int] = {}
    anchors: set[str] = set()
    in_fence = False
    for line in doc.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        heading = None if in_fence else re.match(r"#{1,6} +(.*?) *#*$", line)
        if heading is None:
            continue
        text = re.sub(r"`([^`]*)`", r"\1", heading.group(1))
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
        text = re.sub(r"[*_]{1,2}([^*_]+)[*_]{1,2}", r"\1", text)
        base = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        count = seen.get(base, 0)
        seen[base] = count + 1
        anchors.add(base if count == 0 else f"{base}-{count}")
    return anchors


def test_links_to_a_heading_reach_one() -> None:
    # Sections move between benchmarks.md and its history: a link into a Markdown file's
    # heading must still find it.
    for doc in DOCS:
        for target, anchor in re.findall(r"\]\(([^)\s#]*)#([^)\s]+)\)", doc.read_text()):
            linked = doc if not target else (doc.parent / target).resolve()
            if linked.suffix != ".md" or not linked.is_file():
                continue
            assert anchor in heading_anchors(linked), f"{doc.name}: ({target}#{anchor})"
