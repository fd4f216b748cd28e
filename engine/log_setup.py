"""One logging set-up for every pdserve process.

Every module logs through `logging.getLogger(__name__)`, so a line names the module it
came from, and every logger hangs under the root logger, whose level `--log-level` sets.
The router sets it from the flag; a worker (a Ray actor, whose root logger Python leaves
without a handler) reads the level the router put in its environment.
"""

from __future__ import annotations

import logging
import os
import sys

LOG_LEVEL_ENV = "PDSERVE_LOG_LEVEL"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str | None = None) -> None:
    """Give the root logger a stderr handler (unless it has one) and `level`: the
    argument, else the environment's `PDSERVE_LOG_LEVEL`, else INFO."""
    chosen = (level or os.environ.get(LOG_LEVEL_ENV) or "INFO").upper()
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        root.addHandler(handler)
    root.setLevel(chosen)


def current_level() -> str:
    """The root logger's level by name: what a worker started now should log at."""
    return logging.getLevelName(logging.getLogger().getEffectiveLevel())
