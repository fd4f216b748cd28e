"""The other ranks of a tensor-parallel worker: a model runner each, replaying the calls
rank 0 publishes (engine.parallel.step_broadcast).

Rank 0 is the worker the router sees (`engine.worker.actor.WorkerBase`: scheduler, calls,
channels); a follower holds only its share of the model and of the KV cache, and runs
every step rank 0 runs, in the same order, so that their collectives pair up. When rank 0
goes away (its socket closes) a follower exits: the group lives and dies as a whole.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import threading
from multiprocessing.connection import Connection
from typing import Any

import torch

from engine.core.role import EngineRole
from engine.factory import EngineArgs, build_runner
from engine.parallel.step_broadcast import connect, replay
from engine.parallel.tensor_parallel import join_tp_group
from engine.transfer.tp_parts import RankParts, Verdict
from engine.wire import ChannelSpec, HandoffHeader, TPGroupSpec

log = logging.getLogger(__name__)


class TPFollower:
    """Rank `rank` (>= 1) of a tensor-parallel worker."""

    def __init__(self, args: EngineArgs, role: EngineRole, group: TPGroupSpec, rank: int) -> None:
        if not 1 <= rank < group.size:
            raise ValueError(f"a follower's rank is in [1, {group.size}), got {rank}")
        self.args = args
        self.role = role
        self.group = group
        self.rank = rank

    async def start(self) -> tuple[int, ...]:
        """Join the group, build this rank's runner, connect to rank 0 and start
        replaying; returns the GPUs this rank holds."""
        threads = int(os.environ.get("PDSERVE_TORCH_THREADS", "0"))
        if threads > 0:
            torch.set_num_threads(threads)
        loop = asyncio.get_running_loop()
        runner = await loop.run_in_executor(None, self._build_runner)
        conn = await loop.run_in_executor(
            None, connect, self.group.step_address, self.group.authkey
        )
        threading.Thread(
            target=self._replay, args=(conn, runner), daemon=True, name=f"tp-rank-{self.rank}"
        ).start()
        from engine.worker.actor import _gpu_ids

        return _gpu_ids()

    def _build_runner(self) -> Any:
        device = self.args.resolve_device()
        tp = join_tp_group(self.group.rendezvous_file, self.rank, self.group.size, device)
        return build_runner(self.args, self.role, tp)

    def _replay(self, conn: Connection, runner: Any) -> None:
        replay(conn, _RankCalls(runner, self.rank, conn))
        log.info("rank %d: rank 0 is gone; exiting", self.rank)
        logging.shutdown()
        os._exit(0)

    async def ping(self) -> int:
        return os.getpid()


class _RankCalls:
    """What rank 0 publishes, run on this rank: model steps, and this rank's parts of
    KV hand-offs (engine.transfer.tp_parts)."""

    def __init__(self, runner: Any, rank: int, conn: Connection) -> None:
        self.runner = runner
        self._conn = conn
        self._send_lock = threading.Lock()
        self.parts = RankParts(rank, runner, on_landed=self._landed)

    def _tell_rank0(self, *message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._conn.send_bytes(data)

    def _landed(self, pair: str, seq_no: int) -> None:
        self._tell_rank0("landed", pair, seq_no)

    def launch(self, *args: Any, **kwargs: Any) -> None:
        self.runner.launch(*args, **kwargs)

    def connect_parts(self, spec: ChannelSpec, sending: bool) -> None:
        # Opening waits for the peer's ranks: off the replay thread, which must keep
        # running steps meanwhile.
        def connect() -> None:
            try:
                self.parts.connect(spec, sending)
            except Exception:  # noqa: BLE001 - rank 0 times the pairing out
                log.exception("part channels of %s did not open", spec.prefix)
                return
            self._tell_rank0("connected", spec.receiver_id if sending else spec.sender_id)

        threading.Thread(target=connect, name="kv-part-connect", daemon=True).start()

    def disconnect_parts(self, peer_id: str, notify_peer: bool) -> None:
        threading.Thread(
            target=self.parts.disconnect, args=(peer_id, notify_peer), daemon=True
        ).start()

    def post_parts(self, peer_id: str, block_ids: list[int], template: HandoffHeader) -> None:
        self.parts.post(peer_id, block_ids, template)

    def part_verdict(self, verdict: Verdict) -> None:
        self.parts.verdict(verdict)
