"""docs/flags.md is what the parser renders now: a flag added, removed or re-described
without `make flags-doc` fails here."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

from router.cli.flags import build_parser
from router.cli.flags_doc import DOC_PATH, render

STALE = "docs/flags.md is stale: run `make flags-doc`"


def every_parser(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """`parser` and each of its subcommands' parsers."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from every_parser(sub)


def test_flags_doc_is_current() -> None:
    assert render() == DOC_PATH.read_text(), STALE


def test_every_flag_is_in_the_doc() -> None:
    doc = DOC_PATH.read_text()
    missing = sorted(
        {
            flag
            for parser in every_parser(build_parser())
            for action in parser._actions
            for flag in action.option_strings
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", doc)
        }
    )
    assert not missing, f"{STALE} (missing {', '.join(missing)})"


def test_the_doc_does_not_depend_on_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    # argparse wraps --help to $COLUMNS; the doc must come out the same on any terminal.
    monkeypatch.setenv("COLUMNS", "40")
    narrow = render()
    monkeypatch.setenv("COLUMNS", "400")
    assert render() == narrow
