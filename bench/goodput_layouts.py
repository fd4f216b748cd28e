"""Serving layouts of a fixed set of GPUs, written as short strings, and the `pdserve
serve` flags that start each.

    colocated:2xtp2        2 colocated workers, each tensor-parallel over 2 GPUs
    disagg:3xtp1+1xtp1     3 prefill workers of 1 GPU, 1 decode worker of 1 GPU
    disagg:2xtp1+1xtp2     2 prefill workers of 1 GPU, 1 decode worker of 2 GPUs

A disaggregated layout names its prefill pool first, then its decode pool. Its router
keeps its rule for running a prompt on the decode worker (local prefill) when the
prefill pool cannot meet the TTFT objective: the layouts compared are the ones an
operator would deploy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_POOL = r"(\d+)xtp(\d+)"


@dataclass(frozen=True)
class Pool:
    """`workers` workers of `tp` GPUs each."""

    workers: int
    tp: int

    @property
    def gpus(self) -> int:
        return self.workers * self.tp

    def __str__(self) -> str:
        return f"{self.workers}xtp{self.tp}"


@dataclass(frozen=True)
class Layout:
    """A colocated pool (`decode` is None) or a prefill pool handing off to a decode pool."""

    first: Pool  # the colocated pool, or the prefill pool
    decode: Pool | None = None

    @property
    def disaggregated(self) -> bool:
        return self.decode is not None

    @property
    def gpus(self) -> int:
        return self.first.gpus + (self.decode.gpus if self.decode else 0)

    @property
    def name(self) -> str:
        if self.decode is None:
            return f"colocated:{self.first}"
        return f"disagg:{self.first}+{self.decode}"

    def __str__(self) -> str:
        return self.name

    def serve_flags(self) -> list[str]:
        """The pools' sizes and tensor-parallel sizes as `pdserve serve` flags."""
        if self.decode is None:
            return [
                "--colocated-workers", str(self.first.workers),
                "--colocated-tensor-parallel-size", str(self.first.tp),
            ]  # fmt: skip
        return [
            "--prefill-workers", str(self.first.workers),
            "--prefill-tensor-parallel-size", str(self.first.tp),
            "--decode-workers", str(self.decode.workers),
            "--decode-tensor-parallel-size", str(self.decode.tp),
        ]  # fmt: skip


def _pool(text: str, whole: str) -> Pool:
    m = re.fullmatch(_POOL, text)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise ValueError(f"layout {whole!r}: {text!r} is not WORKERSxtpSIZE (e.g. 2xtp1)")
    return Pool(int(m[1]), int(m[2]))


def parse_layout(text: str) -> Layout:
    """`colocated:NxtpT` or `disagg:PxtpA+DxtpB` (ValueError for anything else)."""
    kind, sep, pools = text.strip().partition(":")
    if sep and kind == "colocated":
        return Layout(_pool(pools, text))
    if sep and kind == "disagg":
        prefill, plus, decode = pools.partition("+")
        if plus:
            return Layout(_pool(prefill, text), _pool(decode, text))
    raise ValueError(
        f"unknown layout {text!r}: colocated:NxtpT (e.g. colocated:2xtp2) or "
        "disagg:PxtpA+DxtpB, prefill pool first (e.g. disagg:3xtp1+1xtp1)"
    )


def parse_layouts(text: str) -> list[Layout]:
    """A comma list of layouts, each once, in the order given."""
    layouts = [parse_layout(item) for item in text.split(",") if item.strip()]
    if not layouts:
        raise ValueError("no layout given")
    names = [layout.name for layout in layouts]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"layouts given twice: {', '.join(repeated)}")
    return layouts
