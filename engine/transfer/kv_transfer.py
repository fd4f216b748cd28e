"""KV-block hand-off between workers over torch.distributed point-to-point.

One message per request: the sender gathers the request's blocks (block-major
cache, so one index_select) into a contiguous tensor and sends it; the receiver
receives into a staging tensor and scatters it into the blocks it reserved.

Ordering: NCCL matches point-to-point messages by order per peer pair (it ignores
tags), so each side posts a pair's messages from one thread per peer, in the
order of a per-pair sequence number that travels in the hand-off metadata.
Gloo also gets the sequence number as the tag.
"""

from __future__ import annotations

import datetime
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVLayout:
    """What two workers must agree on before they can exchange blocks."""

    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def mismatch(self, other: KVLayout) -> str | None:
        """A message naming the first field that differs, or None if compatible."""
        for name in ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} differs: {mine!r} vs {theirs!r}"
        return None


@dataclass(frozen=True)
class Handoff:
    """Addresses one transfer; validated by both sides, never read as data when stale."""

    req_id: str
    src_rank: int
    dst_rank: int
    seq_no: int  # per (src, dst) pair; order in which messages are posted
    dst_epoch: str  # the decode worker incarnation that made the reservation
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    num_computed_tokens: int  # tokens whose KV the blocks hold (the prompt)
    # The request continues on the decode side exactly where prefill stopped.
    prompt_token_ids: tuple[int, ...]
    first_token: int
    sampling: SamplingParams
    seed: int
    priority: int = 0


class TransferAgent:
    """This worker's end of the process group, with one ordered lane per peer."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        init_method: str,
        device: torch.device,
        timeout_s: float = 120.0,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.init_method = init_method
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._lanes: dict[int, ThreadPoolExecutor] = {}
        self._seq: dict[int, int] = {}
        self._lock = threading.Lock()

    def init(self) -> None:
        """Join the process group (blocks until every worker has joined)."""
        kwargs = {}
        if self.backend == "nccl":
            # NCCL wants an indexed device; a worker's runner may just say "cuda".
            index = self.device.index
            kwargs["device_id"] = torch.device(
                "cuda", torch.cuda.current_device() if index is None else index
            )
        dist.init_process_group(
            self.backend,
            init_method=self.init_method,
            rank=self.rank,
            world_size=self.world_size,
            timeout=self.timeout,
            **kwargs,  # type: ignore[arg-type]
        )

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)
        if dist.is_initialized():
            dist.destroy_process_group()

    def _lane(self, peer: int) -> ThreadPoolExecutor:
        with self._lock:
            lane = self._lanes.get(peer)
            if lane is None:
                lane = ThreadPoolExecutor(1, thread_name_prefix=f"kv-peer{peer}")
                self._lanes[peer] = lane
            return lane

    def next_seq(self, peer: int) -> int:
        """Reserve the next sequence number towards a peer (the send must follow)."""
        with self._lock:
            seq = self._seq.get(peer, 0)
            self._seq[peer] = seq + 1
            return seq

    def send(self, peer: int, tensor: torch.Tensor, seq_no: int) -> Future[None]:
        """Post a send on the peer's lane; lanes keep the order of submission."""

        def run() -> None:
            if tensor.is_cuda:
                torch.cuda.set_device(tensor.device)
            dist.send(tensor, dst=peer, tag=seq_no if self.backend == "gloo" else 0)

        return self._lane(peer).submit(run)

    def recv(self, peer: int, staging: torch.Tensor, seq_no: int) -> Future[torch.Tensor]:
        """Post a receive into a staging tensor on the peer's lane."""

        def run() -> torch.Tensor:
            if staging.is_cuda:
                torch.cuda.set_device(staging.device)
            dist.recv(staging, src=peer, tag=seq_no if self.backend == "gloo" else 0)
            return staging

        return self._lane(peer).submit(run)
