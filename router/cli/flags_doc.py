"""docs/flags.md, rendered from `pdserve`'s own parser: every subcommand's flags with their
defaults and help as `--help` prints them, so the reference cannot drift from the code.

`python -m router.cli.flags_doc` prints it; `--write` rewrites docs/flags.md
(`make flags-doc`).
The text depends on the parser alone: no wrapping, so no terminal width comes into it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from router.cli.flags import build_parser

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "flags.md"

HEADER = """\
# `pdserve` flags

Every flag of every `pdserve` subcommand, with its default and its help as `--help`
prints it. Generated from the parser by `python -m router.cli.flags_doc`: do not edit by
hand; `make flags-doc` rewrites it (a test fails when it is stale). The most used flags,
explained, are in the [README](../README.md#command-line).

Every command also takes `-h`, `--help`. `--log-level` may come before or after the
subcommand.
"""


def subcommands(
    parser: argparse.ArgumentParser,
) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """Each subcommand's name, one-line summary and parser, in the order `--help` lists them."""
    for action in parser._actions:  # argparse keeps no public handle on its subparsers
        if isinstance(action, argparse._SubParsersAction):
            summaries = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, sub.description or summaries.get(name, ""), sub


def flag_cell(action: argparse.Action) -> str:
    """The flag's spellings and its value's placeholder: `--policy {fcfs,priority}`."""
    names = ", ".join(action.option_strings) or str(action.metavar or action.dest)
    if action.nargs == 0 or not action.option_strings:
        return names
    if isinstance(action.metavar, str):
        value = action.metavar
    elif action.choices is not None:
        value = "{" + ",".join(str(c) for c in action.choices) + "}"
    else:
        value = action.dest.upper()
    return f"{names} {value}"


def default_cell(action: argparse.Action) -> str:
    """The value the flag has when it is not given, in words where it is a switch."""
    if action.required:
        return "required"
    if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x
        return "on" if action.default else "off"
    if action.nargs == 0:  # store_true, store_false (--no-compile): off until given
        return "off"
    if action.default is None or action.default is argparse.SUPPRESS:
        return ""
    return str(action.default)


def help_cell(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help as the parser's formatter prints it, `%(default)s` and the like expanded."""
    if not action.help:
        return ""
    # The formatter's own expansion: the help string its `_get_help_string` gives (ours
    # appends the default), with every `%(name)s` filled in as `--help` fills it.
    text = parser._get_formatter()._expand_help(action)
    return " ".join(text.split())


def escape(text: str) -> str:
    """Text safe in a Markdown table cell: no column breaks, no stray emphasis or code."""
    for char in ("\\", "|", "*", "`", "<"):
        text = text.replace(char, "\\" + char)
    return text


def code(text: str) -> str:
    return f"`{text}`" if text else ""


def action_table(parser: argparse.ArgumentParser, actions: Sequence[argparse.Action]) -> list[str]:
    """One row per flag (help and hidden flags left out, as `--help` leaves them)."""
    rows = [
        f"| {code(flag_cell(a))} | {code(default_cell(a))} | {escape(help_cell(parser, a))} |"
        for a in actions
        if not isinstance(a, argparse._HelpAction) and a.help is not argparse.SUPPRESS
    ]
    if not rows:
        return []
    return ["| flag | default | help |", "|---|---|---|", *rows, ""]


def parser_section(parser: argparse.ArgumentParser) -> list[str]:
    """A parser's flags, one table per argument group, in `--help`'s order."""
    lines: list[str] = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._SubParsersAction)]
        table = action_table(parser, actions)
        if table:
            lines += [f"### {group.title}", "", *table]
    return lines


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole of docs/flags.md."""
    parser = parser or build_parser()
    lines = [HEADER, f"## {parser.prog}", "", parser.description or "", ""]
    lines += parser_section(parser)
    for name, summary, sub in subcommands(parser):
        sentence = f"{summary[:1].upper()}{summary[1:]}".rstrip(".") + "."
        lines += [f"## {parser.prog} {name}", "", sentence, ""]
        lines += parser_section(sub)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog="python -m router.cli.flags_doc", description=__doc__)
    cli.add_argument("--write", action="store_true", help=f"rewrite {DOC_PATH.name}")
    args = cli.parse_args(argv)
    text = render()
    if args.write:
        DOC_PATH.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
