"""One log line per start-up phase of an engine, with its duration.

A new worker (a replacement, a scale-up) is only as useful as it is quick to start, so
each phase that can take long on a GPU is timed where it runs: loading the weights,
allocating the KV cache, compiling the decoder, capturing the decode CUDA graphs. The
lines read `start-up: weights 12.41 s (...)`; their sum against the worker's whole
start says where the rest went (Ray placement, imports, channel pairing).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


@contextmanager
def startup_phase(name: str, detail: str = "") -> Iterator[None]:
    """Log how long the block took, as start-up phase `name` (also when it fails)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        log.info("start-up: %s %.2f s%s", name, elapsed, f" ({detail})" if detail else "")
