"""The KV transfer backend of a worker's channels, chosen by the engine's arguments
(`EngineArgs.kv_transfer_backend`): "process_group" (engine.transfer.channel: a 2-rank
process group of the pair's own, NCCL between GPUs, gloo on CPU) or "fake"
(engine.transfer.fake: both workers in this process, joined by a queue; for tests of
whole workers without process groups)."""

from __future__ import annotations

import torch

from engine.args import KVTransferBackend
from engine.transfer.base import PairChannel
from engine.transfer.channel import SENDER_RANK, KVChannel
from engine.transfer.fake import FakeChannel
from engine.wire import ChannelSpec


def make_channel(
    backend: KVTransferBackend, spec: ChannelSpec, rank: int, device: torch.device
) -> PairChannel:
    """This worker's end (`rank`: SENDER_RANK or RECEIVER_RANK) of the pair `spec` names,
    not yet open: `open()` blocks until the pair is joined."""
    if backend == "process_group":
        return KVChannel(spec, rank, device)
    if backend == "fake":
        return FakeChannel.for_spec(spec, sending=rank == SENDER_RANK)
    raise ValueError(f"unknown KV transfer backend {backend!r}")
