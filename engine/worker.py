"""What both pools' Ray actors share: engine thread, process group, stats, shutdown.

The classes here are plain Python; `router.cluster` wraps them with `ray.remote`.
CUDA state is created in `start()`, after Ray has assigned the actor its GPU.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from engine.core.engine_loop import EngineLoop
from engine.core.outputs import WorkerStats
from engine.core.scheduler import RequestUpdate
from engine.factory import BuiltEngine, EngineArgs, build_engine
from engine.transfer.kv_transfer import KVLayout, TransferAgent

log = logging.getLogger(__name__)
T = TypeVar("T")

TOMBSTONE_TTL_S = 300.0


@dataclass(frozen=True)
class WorkerInfo:
    """Returned by start(): what the router needs to pair and route."""

    role: str
    index: int
    rank: int
    epoch: str
    layout: KVLayout
    num_blocks: int
    max_model_len: int
    vocab_size: int
    model_name: str
    device: str
    pid: int


class WorkerBase:
    """Engine loop on its own thread plus this worker's end of the KV process group."""

    role = "worker"
    handoff_after_first_token = False

    def __init__(self, args: EngineArgs, index: int) -> None:
        self.args = args
        self.index = index
        # A new epoch per incarnation: a hand-off addressed to a previous one is refused.
        self.epoch = uuid.uuid4().hex[:12]
        self.built: BuiltEngine | None = None
        self.loop_thread: EngineLoop | None = None
        self.agent: TransferAgent | None = None
        self.rank = -1
        # Ids aborted here, remembered for a while: an abort may overtake the call it
        # cancels (the router aborts on every worker the request might have reached).
        self._tombstones: dict[str, float] = {}

    # ---------------------------------------------------------------- lifecycle
    async def rendezvous_address(self, loopback: bool) -> tuple[str, int]:
        """This host's address (loopback on a one-machine deployment) and a free port on it,
        for the process group's store."""
        import ray

        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        return host, port

    async def start(self, rank: int, world_size: int, init_method: str) -> WorkerInfo:
        """Load the model, allocate the cache, join the process group, start stepping."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        threads = int(os.environ.get("PDSERVE_TORCH_THREADS", "0"))
        if threads > 0:
            torch.set_num_threads(threads)
        self.rank = rank
        built = await loop.run_in_executor(
            None,
            lambda: build_engine(
                self.args, handoff_after_first_token=self.handoff_after_first_token
            ),
        )
        self.built = built
        device = torch.device(built.runner.device)
        self.agent = TransferAgent(rank, world_size, init_method, device)
        if world_size > 1:
            await loop.run_in_executor(None, self.agent.init)
        self.loop_thread = EngineLoop(
            built.core, self._updates_from_thread, name=f"{self.role}{self.index}"
        )
        self.loop_thread.start()
        return WorkerInfo(
            role=self.role,
            index=self.index,
            rank=rank,
            epoch=self.epoch,
            layout=built.layout,
            num_blocks=built.runner.num_blocks,
            max_model_len=built.spec.max_model_len,
            vocab_size=built.spec.vocab_size,
            model_name=built.spec.name,
            device=str(device),
            pid=os.getpid(),
        )

    async def shutdown(self) -> None:
        """Stop stepping and leave the process group."""
        if self.loop_thread is not None:
            self.loop_thread.stop()
        if self.agent is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.agent.close)

    def bury(self, req_id: str) -> None:
        """Remember an aborted id so a late-arriving call for it is refused."""
        now = time.monotonic()
        self._tombstones[req_id] = now
        if len(self._tombstones) > 4096:
            self._tombstones = {
                k: t for k, t in self._tombstones.items() if now - t < TOMBSTONE_TTL_S
            }

    def is_buried(self, req_id: str) -> bool:
        return req_id in self._tombstones

    # ---------------------------------------------------------------- engine access
    @property
    def core(self) -> Any:
        assert self.built is not None, "worker not started"
        return self.built.core

    @property
    def runner(self) -> Any:
        assert self.built is not None, "worker not started"
        return self.built.runner

    async def on_engine(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread between two steps and await its result."""
        assert self.loop_thread is not None, "worker not started"
        return await asyncio.wrap_future(self.loop_thread.submit(fn))

    def _updates_from_thread(self, updates: list[RequestUpdate]) -> None:
        self._loop.call_soon_threadsafe(self.on_updates, updates)

    def on_updates(self, updates: list[RequestUpdate]) -> None:
        """Called on the event loop with each step's updates."""
        raise NotImplementedError

    async def load(self) -> WorkerStats:
        """Blocks in use, queue lengths and prefix-cache counters."""

        def read() -> WorkerStats:
            sched = self.core.scheduler
            return WorkerStats(
                pool=self.role,  # type: ignore[arg-type]
                index=self.index,
                num_blocks_total=sched.kv.pool.num_blocks,
                num_blocks_in_use=sched.kv.num_blocks_in_use,
                num_running=sched.num_running,
                num_waiting=sched.num_waiting,
                prefix_hit_tokens=sched.kv.stats.hit_tokens,
                prefix_query_tokens=sched.kv.stats.query_tokens,
                num_preemptions=sched.num_preemptions,
            )

        return await self.on_engine(read)

    async def read_blocks(self, block_ids: list[int]) -> Any:
        """A copy of these blocks' KV as a CPU tensor (for hand-off verification)."""
        return await self.on_engine(lambda: self.runner.gather_blocks(block_ids).cpu())
