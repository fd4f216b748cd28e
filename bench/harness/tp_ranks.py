"""The end of a tensor-parallel rank that a benchmark or a test spawned itself."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch.distributed as dist


def end_rank() -> NoReturn:
    """Leave the group once every rank is done, then exit at once with status 0.

    The barrier comes first: gloo aborts a process whose peer destroys the group while
    it still has a collective in flight. The exit skips the interpreter's teardown, which
    can abort a gloo rank whose work is done ("terminate called without an active
    exception", no Python frame left: a C++ thread of the collectives still joinable),
    turning a finished rank into a failed one."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
