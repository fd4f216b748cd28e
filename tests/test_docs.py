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


def test_benchmarks_are_named_by_a_command_that_runs() -> None:
    # `python bench/x.py` fails (the bench package is not on the path that way): the
    # docs name each Python benchmark as the module it runs as.
    for doc in DOCS:
        text = doc.read_text()
        paths = re.findall(r"bench/[a-z_]+\.py", text)
        assert not paths, f"{doc.relative_to(REPO)} names {paths}: say `python -m bench.x`"
        for module in set(re.findall(r"\bbench\.([a-z_]+)\b", text)):
            assert (REPO / "bench" / f"{module}.py").is_file(), f"{doc.name}: bench.{module}"
