"""Large CPU tensors on transparent huge pages, where the kernel offers them.

A decode step streams every weight and every attended K/V block through the CPU once;
on 4 KiB pages that is one TLB entry per 4 KiB read, on 2 MiB pages one per 2 MiB.
Linux backs an anonymous mapping with huge pages at its first touch when it is asked to
(`madvise(MADV_HUGEPAGE)`, which is all that the common `transparent_hugepage=madvise`
setting allows); torch's allocator does not ask. Elsewhere (another OS, THP off) these
are plain tensors.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import sys

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor whose bytes start on a huge page boundary and
    are advised onto huge pages before anything touches them (below one huge page, or
    where that cannot be asked, a plain `torch.empty`)."""
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise()
    if madvise is None or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    # A refusal (THP compiled out) leaves ordinary pages: nothing to handle.
    madvise(raw.data_ptr() + start, nbytes, _MADV_HUGEPAGE)
    return raw[start : start + nbytes].view(dtype).view(shape)
