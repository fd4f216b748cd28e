"""`pdserve`: serve (the disaggregated service) and generate (offline, or against a server).

The entry point only: flags live in `router.cli.flags` (one engine's in
`router.cli.engine_flags`, their types in `router.cli.flag_types`, checks across them in
`router.cli.flag_checks`), what each command does in `router.cli.commands` (and
`router.cli.admin_client` for scale and workers).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from engine.log_setup import configure_logging
from router.cli.flag_checks import (
    check_generate_flags,
    check_scale_flags,
    check_serve_flags,
    given_flags,
)
from router.cli.flag_types import subcommand_parser
from router.cli.flags import build_parser

__all__ = ["build_parser", "main"]

T = TypeVar("T")


def _or_usage_error(sub: argparse.ArgumentParser, make: Callable[[], T]) -> T:
    """`make()`, with a ValueError (a refused flag value) reported as a usage error."""
    try:
        return make()
    except ValueError as exc:
        sub.error(str(exc))


def _run(ns: argparse.Namespace, sub: argparse.ArgumentParser, given: set[str]) -> int:
    from router.cli import commands

    if ns.command == "serve":
        _or_usage_error(sub, lambda: check_serve_flags(ns, given))
        config = _or_usage_error(sub, lambda: commands.serve_config(ns))
        return commands.serve(config)
    if ns.command in ("scale", "workers", "prefill-policy"):
        from router.cli.admin_client import run_admin

        if ns.command == "scale":
            _or_usage_error(sub, lambda: check_scale_flags(ns))
        security = _or_usage_error(sub, lambda: commands.client_security(ns))
        return asyncio.run(run_admin(ns, security))
    if ns.command == "generate":
        _or_usage_error(sub, lambda: check_generate_flags(ns, given))
        params = _or_usage_error(sub, lambda: commands.sampling_params(ns))
        if ns.server:
            security = _or_usage_error(sub, lambda: commands.client_security(ns))
            return asyncio.run(commands.generate_from_server(ns, params, security))
        args = _or_usage_error(sub, lambda: commands.offline_engine_args(ns))
        return commands.generate_offline(args, params, ns)
    sub.error(f"unknown command {ns.command}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pdserve` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # parse_known_args: an unknown flag is reported by its subcommand.
    ns, unknown = parser.parse_known_args(argv)
    sub = subcommand_parser(parser, ns.command)
    if unknown:
        sub.error(f"unrecognized arguments: {' '.join(unknown)}")
    configure_logging(ns.log_level)
    try:
        return _run(ns, sub, given_flags(argv))
    except KeyboardInterrupt:
        # Ctrl-C: the user knows why it stopped; no traceback.
        print("\npdserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
