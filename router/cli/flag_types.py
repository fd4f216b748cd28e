"""Building blocks of `pdserve`'s flags: value types that refuse bad values as usage
errors (one line, exit status 2), the help formatter, and the subcommand parser."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import NoReturn

from engine.spec.spec_config import SpeculativeConfig
from router.fleet.pool_sizes import pool_size_problem

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if "default" in text:
            return text
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x
            return f"{text} (default: {'on' if action.default else 'off'})"
        if action.nargs == 0:
            # A switch is off until given, whatever it stores (--no-compile stores False).
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


class SubcommandParser(argparse.ArgumentParser):
    """A subcommand: defaults in its help, exact option names, its own --log-level, and
    usage errors as one line (its usage runs to dozens of lines and would bury them)."""

    def __init__(self, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(**kwargs)  # type: ignore[arg-type]
        # SUPPRESS: given after the subcommand it overrides the top-level one, else not.
        self.add_argument(
            "--log-level",
            type=str.upper,
            choices=LOG_LEVELS,
            default=argparse.SUPPRESS,
            help="log verbosity (default: INFO)",
        )

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: an integer >= minimum."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {number}")
        return number

    return parse


def pool_size(value: str) -> int:
    """argparse type of `pdserve scale --POOL N`: a size AdminService accepts."""
    size = at_least(0)(value)
    problem = pool_size_problem(size)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return size


def auto_or_at_least(minimum: int) -> Callable[[str], int | str]:
    """argparse type: `auto`, or an integer >= minimum."""

    def parse(value: str) -> int | str:
        return "auto" if value == "auto" else at_least(minimum)(value)

    return parse


stream_interval = auto_or_at_least(1)  # --stream-interval


def number_in(
    low: float, high: float | None = None, *, open_low: bool = False
) -> Callable[[str], float]:
    """argparse type: a number >= low (> low with open_low), and <= high if given."""

    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
        too_low = number <= low if open_low else number < low
        if too_low or (high is not None and number > high) or math.isnan(number):
            bound = f"> {low:g}" if open_low else f">= {low:g}"
            where = f"{bound} and <= {high:g}" if high is not None else bound
            raise argparse.ArgumentTypeError(f"must be {where}, got {value}")
        return number

    return parse


def port(value: str) -> int:
    """argparse type of a TCP port; 0 means any free one (or off, where the help says)."""
    number = at_least(0)(value)
    if number > 65535:
        raise argparse.ArgumentTypeError(f"must be 0-65535, got {number}")
    return number


def host_port(value: str) -> str:
    """argparse type of a HOST:PORT address (a port from 1 to 65535)."""
    host, sep, number = value.rpartition(":")
    if not sep or not host or not number.isdigit() or not 0 < int(number) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return value


def device(value: str) -> str:
    """argparse type of --device: auto, cpu, cuda or cuda:N."""
    head, _, index = value.partition(":")
    if value in ("auto", "cpu", "cuda") or (head == "cuda" and index.isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {value!r}")


def resources(text: str) -> dict[str, float]:
    """A JSON object of Ray resource amounts, e.g. '{\"prefill_node\": 1}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and v >= 0 for k, v in value.items()
    ):
        raise argparse.ArgumentTypeError('expected an object of amounts, e.g. {"prefill_node": 1}')
    return {k: float(v) for k, v in value.items()}


def speculative_config(text: str) -> SpeculativeConfig:
    """argparse type of --speculative-config: vLLM's JSON object, checked."""
    try:
        return SpeculativeConfig.from_json(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def subcommand_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of `command` (errors are reported with its name), else `parser`."""
    for action in parser._actions:  # argparse keeps no public handle on its subparsers
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]  # type: ignore[no-any-return]
    return parser
