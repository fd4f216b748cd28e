"""What both pools' Ray actors share: the engine thread, KV channels, stats, shutdown.

The classes here are plain Python; `router.fleet.cluster` wraps them with `ray.remote`.
CUDA state is created in `start()`, after Ray has assigned the actor its GPU. Each
incarnation draws a new epoch: whatever was addressed to a previous one (a reservation,
a hand-off, a channel) is refused instead of being read as data.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch

from engine import tracing
from engine.core.engine_loop import EngineLoop
from engine.core.role import EngineRole
from engine.factory import BuiltEngine, EngineArgs, build_engine
from engine.heap import freeze_startup_heap
from engine.log_setup import configure_logging
from engine.model.startup.startup_log import log as startup_log
from engine.model.startup.startup_log import startup_phase
from engine.parallel.step_broadcast import StepPublisher
from engine.parallel.tensor_parallel import SINGLE, join_tp_group
from engine.parallel.tp_rank0 import RankZero
from engine.tracing import TracingConfig
from engine.transfer.backends import make_channel
from engine.transfer.base import PairChannel
from engine.transfer.import_target import ImportMirror
from engine.transfer.sender import Message
from engine.wire import (
    CallSpec,
    ChannelSpec,
    EngineSpeed,
    HandoffHeader,
    HeaderKind,
    KVEvents,
    TokenUpdate,
    TPGroupSpec,
    WorkerInfo,
    WorkerStats,
)
from engine.worker.calls import CallServer, listen_host
from engine.worker.contract import EveryWorkerCalls, verbs
from engine.worker.kv_fanout import KVEventFanout
from engine.worker.warm_up import measure_speed

log = logging.getLogger(__name__)
T = TypeVar("T")

TOMBSTONE_TTL_S = 300.0


class WorkerBase:
    """Engine loop on its own thread plus this worker's ends of its KV channels."""

    pool = "worker"
    role = EngineRole.COLOCATED
    # The router's calls this worker answers (engine/worker/contract.py): each kind names
    # its own, and mypy checks the class against it where the class is defined.
    contract: ClassVar[type] = EveryWorkerCalls

    def __init__(
        self,
        args: EngineArgs,
        index: int,
        tracing_config: TracingConfig | None = None,
        tp_group: TPGroupSpec | None = None,
    ) -> None:
        self.args = args
        # Rank 0 of a tensor-parallel worker: the other ranks (engine.parallel.tp_follower) run
        # every model call this one publishes.
        self.tp_group = tp_group
        self.index = index
        self.tracing_config = tracing_config  # spans of traced requests go where it says
        self.worker_id = f"{self.pool}-{index}"
        self.epoch = random.getrandbits(62) | 1  # never 0: 0 means "no epoch" in a header
        self.built: BuiltEngine | None = None
        self.loop_thread: EngineLoop | None = None
        self.channels: dict[str, PairChannel] = {}  # peer worker id → channel
        # The prefix-cache events each router process has not read yet.
        self.kv_fanout = KVEventFanout(self._snapshot_kv_for)
        self._stopped = asyncio.Event()
        # Ids aborted here, remembered for a while: an abort may overtake the call it
        # cancels (the router aborts on every worker the request might have reached).
        self._tombstones: dict[str, float] = {}
        self._calls: CallServer | None = None
        self.rank0: RankZero | None = None  # the group's other ranks and part channels

    # ---------------------------------------------------------------- lifecycle
    async def start(self, calls: CallSpec | None = None) -> WorkerInfo:
        """Load the model, allocate the cache, start stepping; with `calls`, also take
        the router's calls on a connection of their own (engine/worker/calls.py)."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        tracing.configure(self.tracing_config, f"pdserve-{self.pool}")
        threads = int(os.environ.get("PDSERVE_TORCH_THREADS", "0"))
        if threads > 0:
            torch.set_num_threads(threads)
        configure_logging()
        group = self.tp_group
        # Listening before the model loads: the other ranks connect once theirs has.
        publisher = (
            None
            if group is None
            else StepPublisher(group.step_address, group.authkey, group.size - 1)
        )
        with startup_phase("engine", f"{self.worker_id}, every phase above"):
            built = await loop.run_in_executor(None, self._build_engine)
        rank0 = self.rank0 = RankZero(built.runner, publisher)
        if publisher is not None:
            await loop.run_in_executor(None, publisher.accept_all)
            built.runner.followers = publisher
            publisher.watch(self._on_rank_lost, rank0.on_rank_message)
        self.built = built
        started = time.perf_counter()
        speed = await loop.run_in_executor(
            None, measure_speed, built.runner, built.core.scheduler.config, self.role
        )
        _log_speed(self.worker_id, speed, time.perf_counter() - started)
        freeze_startup_heap()  # before the first step: no full collection walks the model
        self.loop_thread = EngineLoop(built.core, self._updates_from_thread, name=self.worker_id)
        self.loop_thread.start()
        self.on_started()
        node_ip = _node_ip()
        call_address = ""
        if calls is not None:
            self._calls = CallServer(self, calls.token, verbs(self.contract))
            call_address = await self._calls.start(listen_host(node_ip, calls.router_ip))
        return WorkerInfo(
            worker_id=self.worker_id,
            pool=self.pool,
            index=self.index,
            epoch=self.epoch,
            layout=built.layout,
            num_blocks=built.runner.num_blocks,
            max_model_len=built.spec.max_model_len,
            vocab_size=built.spec.vocab_size,
            model_name=built.spec.name,
            device=str(built.runner.device),
            pid=os.getpid(),
            node_ip=node_ip,
            call_address=call_address,
            tensor_parallel_size=built.spec.tensor_parallel_size,
            gpu_ids=_gpu_ids(),
            speed=speed,
        )

    def _build_engine(self) -> BuiltEngine:
        tp = SINGLE
        if self.tp_group is not None:
            device = self.args.resolve_device()
            tp = join_tp_group(self.tp_group.rendezvous_file, 0, self.tp_group.size, device)
        return build_engine(self.args, role=self.role, index=self.index, tp=tp)

    def import_target(self, channel: PairChannel) -> tuple[Any, ImportMirror | None]:
        """What a channel's receiver lands KV through, and the mirror that lands a
        message's other parts (engine.parallel.tp_rank0)."""
        assert self.rank0 is not None, "worker not started"
        return self.rank0.import_target(self, channel.spec)

    def _on_rank_lost(self, rank: int) -> None:
        """Another rank of this worker died: the next collective would hang, so the
        worker dies now, as a whole, and the router replaces it (its requests move as
        they do when a one-GPU worker dies)."""
        log.error("%s: rank %d of its tensor-parallel group died; exiting", self.worker_id, rank)
        logging.shutdown()
        os._exit(1)

    def on_started(self) -> None:
        """Hook for a pool's own set-up once the engine runs."""

    async def wait_stopped(self) -> None:
        """Returns when this worker shuts down; fails (RayActorError) when it dies, which
        is how the router learns of a death without polling."""
        await self._stopped.wait()

    async def shutdown(self) -> None:
        """Stop stepping and leave every channel."""
        await asyncio.gather(*(self.disconnect(peer_id) for peer_id in list(self.channels)))
        # The call connection stays open until the process ends: the router's long poll
        # must not read a stopping worker as a dead one (it drops the worker first).
        if self.loop_thread is not None:
            self.loop_thread.stop()
        # Send the spans still buffered (bounded: a collector that is down must not
        # hold up the stop).
        await asyncio.get_running_loop().run_in_executor(None, tracing.shutdown)
        self._stopped.set()

    # ---------------------------------------------------------------- channels
    def channel_rank(self) -> int:
        raise NotImplementedError

    def channel_peer(self, spec: ChannelSpec) -> str:
        raise NotImplementedError

    async def connect(self, spec: ChannelSpec) -> None:
        """Build this end of a pair's channel (the peer does the same at the same time)."""
        peer_id = self.channel_peer(spec)
        old = self.channels.pop(peer_id, None)
        if old is not None:  # the peer restarted: its old channel is dead
            await asyncio.get_running_loop().run_in_executor(None, old.close, False)
        channel = self.new_channel(spec, self.channel_rank())
        await asyncio.get_running_loop().run_in_executor(None, channel.open)
        self.channels[peer_id] = channel
        assert self.rank0 is not None, "worker not started"
        await self.rank0.connect(spec, peer_id, sending=spec.sender_id == self.worker_id)
        self.on_connected(channel)

    def new_channel(self, spec: ChannelSpec, rank: int) -> PairChannel:
        """This worker's end of a pair's channel, on the engine's transfer backend (not
        yet open)."""
        device = torch.device(self.runner.device)
        return make_channel(self.args.kv_transfer_backend, spec, rank, device)

    def on_connected(self, channel: PairChannel) -> None:
        """Hook: a channel is up."""

    async def disconnect(self, peer_id: str, notify_peer: bool = True) -> None:
        """Leave a pair (idempotent). Tell the peer when it is alive, so it stops listening."""
        channel = self.channels.pop(peer_id, None)
        if self.rank0 is not None:
            await self.rank0.disconnect(peer_id, notify_peer)
        if channel is not None:
            await asyncio.get_running_loop().run_in_executor(None, channel.close, notify_peer)

    # ---------------------------------------------------------------- tombstones
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

    def _updates_from_thread(self, updates: list[TokenUpdate]) -> None:
        events = self.core.take_kv_events()
        self._loop.call_soon_threadsafe(self._on_step, updates, events, time.monotonic())

    def _on_step(self, updates: list[TokenUpdate], events: KVEvents, stepped_at: float) -> None:
        # One callback for both: the cache changes are recorded before any reply or
        # token batch that the updates wake can leave, so the router's index keeps up.
        self.add_kv_events(events)
        self.on_updates(updates, stepped_at)

    def add_kv_events(self, events: KVEvents) -> None:
        """Event loop: keep a step's prefix-cache changes for the next message to each
        router process (a token batch, a prefill reply)."""
        self.kv_fanout.add(events)

    def take_kv_events(self, consumer: str = "") -> tuple[KVEvents, ...]:
        """Event loop: the prefix-cache changes `consumer` has not read, oldest first."""
        return self.kv_fanout.take(consumer)

    def _snapshot_kv_for(self, consumer: str) -> None:
        """Event loop: a router process new here gets the whole cache first, read on the
        engine thread and queued behind the events of the steps before it."""
        if self.loop_thread is None:
            return  # not started: its first take is the engine's own first snapshot

        def read() -> None:
            snapshot = self.core.kv_snapshot()
            self._loop.call_soon_threadsafe(self.kv_fanout.set_snapshot, consumer, snapshot)

        self.loop_thread.submit(read)

    def on_updates(self, updates: list[TokenUpdate], stepped_at: float) -> None:
        """Called on the event loop with each step's updates (and the time.monotonic()
        reading when the step's tokens were out)."""
        raise NotImplementedError

    async def load(self) -> WorkerStats:
        """Blocks in use, queue lengths and prefix-cache counters."""
        stats: WorkerStats = await self.on_engine(self.core.stats)
        return stats

    def latest_stats(self) -> WorkerStats:
        """The same, read from the event loop without waiting for a step boundary: a
        snapshot of plain counters for routing hints, not for accounting."""
        stats: WorkerStats = self.core.stats()
        return stats

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of KV, every layer (the unit a hand-off moves)."""
        return int(self.runner.block_bytes)

    def post_message(
        self, channel: PairChannel, message: Message, kind: HeaderKind = HeaderKind.HANDOFF
    ) -> tuple[HandoffHeader, Any]:
        """Engine thread: gather a message's blocks (ordered after every step that wrote
        them) and post header + payload on the channel; the header and the send's handle.
        The sender waits for the gather on its own stream, not the engine's; the caller
        may release the blocks right after."""
        # Other ranks' parts leave from their ranks; this one sends the main part.
        assert self.rank0 is not None, "worker not started"
        heads = self.rank0.post_parts(getattr(channel, "spec", None), message, kind, self.epoch)
        payload = self.runner.gather_blocks(message.block_ids, heads=heads)
        gathered = None
        if payload.is_cuda:
            gathered = torch.cuda.Event()
            gathered.record()
        header = HandoffHeader(
            kind=kind,
            seq_no=channel.next_seq(),  # taken and posted on this thread: in order
            dst_epoch=message.target.epoch,
            src_epoch=self.epoch,
            entries=message.entries,
            num_bytes=int(payload.numel() * payload.element_size()),
            posted_at_us=int(time.time() * 1e6),
        )
        return header, channel.send(header, payload, gathered)

    async def read_blocks(self, block_ids: list[int]) -> Any:
        """A copy of these blocks' KV as a CPU tensor (for hand-off verification)."""
        return await self.on_engine(lambda: self.runner.gather_blocks(block_ids).cpu())


def _log_speed(worker_id: str, speed: EngineSpeed, elapsed_s: float) -> None:
    """One start-up line: what the warm-up took, and what it measured."""
    step = (
        "" if speed.decode_step_s is None else f", a decode step {speed.decode_step_s * 1e3:.1f} ms"
    )
    startup_log.info(
        "start-up: speed %.2f s (%s: a prompt of %d tokens in %.1f ms, %.0f tokens/s%s)",
        elapsed_s,
        worker_id,
        speed.num_prompt_tokens,
        speed.prefill_s * 1e3,
        speed.prefill_tokens_per_s,
        step,
    )


def _gpu_ids() -> tuple[int, ...]:
    """The GPUs Ray gave this process (none outside Ray or on CPU)."""
    try:
        import ray

        if not ray.is_initialized():  # a worker driven directly (tests): asking would
            return ()  # start a Ray instance in this process
        return tuple(int(i) for i in ray.get_gpu_ids())
    except Exception:  # noqa: BLE001 - outside Ray
        return ()


def _node_ip() -> str:
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:  # noqa: BLE001 - outside Ray (tests drive workers directly)
        return "127.0.0.1"
