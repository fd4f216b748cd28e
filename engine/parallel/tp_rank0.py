"""Rank 0's side of a worker's tensor parallelism and of hand-offs in parts.

`RankZero` is what a worker (`engine.worker.actor.WorkerBase`) asks when it pairs with a peer,
posts a message, lands one and leaves a pair: it holds the other ranks of its own group
(the step publisher, engine.parallel.step_broadcast), this rank's part channels
(engine.transfer.tp_parts.RankParts) and the mirror that lands every part of an incoming
message before it is admitted. A one-GPU worker has one too: a peer group of several
GPUs still sends or receives parts on rank 0's own extra channels.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from engine.parallel.step_broadcast import StepPublisher
from engine.transfer.import_target import ImportMirror
from engine.transfer.sender import Message
from engine.transfer.tp_parts import (
    MainPartTarget,
    PairMirror,
    PartsMirror,
    RankParts,
    Verdict,
    heads_at,
    main_part,
    pair_key,
    receiving_parts,
)
from engine.wire import ChannelSpec, HandoffHeader, HeaderKind


class RankZero:
    """The other ranks, this rank's part channels, and the parts' mirror of one worker."""

    def __init__(self, runner: Any, publisher: StepPublisher | None) -> None:
        self._publisher = publisher
        self.parts = RankParts(0, runner, on_landed=self._landed)
        self.mirror = PartsMirror(self._publish_verdict, self._side_parts_of)
        self._specs: dict[str, ChannelSpec] = {}  # peer id → its pair's spec
        self._by_pair: dict[str, ChannelSpec] = {}  # pair key → the same
        # Per peer being paired: the other ranks' answers still awaited (a future and
        # how many have yet to say their channels are open).
        self._connecting: dict[str, list[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def on_rank_message(self, rank: int, message: tuple[Any, ...]) -> None:
        """Another rank's word (its socket's thread): a part landed, or its part channels
        to a peer are open."""
        if message[0] == "landed":
            self.mirror.landed(message[1], message[2])
        elif message[0] == "connected" and self._loop is not None:
            self._loop.call_soon_threadsafe(self._rank_connected, message[1])

    async def connect(self, spec: ChannelSpec, peer_id: str, sending: bool) -> None:
        """Once the workers' own channel is open: open every rank's part channels of the
        pair (when either side splits heads), returning once all are open."""
        self._specs[peer_id] = spec
        self._by_pair[pair_key(spec)] = spec
        if not spec.splits_heads:
            return
        loop = self._loop = asyncio.get_running_loop()
        others: asyncio.Future[None] | None = None
        if self._publisher is not None:
            others = loop.create_future()
            self._connecting[peer_id] = [others, self._publisher.num_followers]
            self._publisher.publish("connect_parts", spec, sending)
        try:
            await loop.run_in_executor(None, self.parts.connect, spec, sending)
            if others is not None:
                await asyncio.wait_for(others, spec.timeout_s)
        finally:
            self._connecting.pop(peer_id, None)

    async def disconnect(self, peer_id: str, notify_peer: bool) -> None:
        """Leave a pair's part channels on every rank (idempotent)."""
        spec = self._specs.pop(peer_id, None)
        if spec is not None:
            self._by_pair.pop(pair_key(spec), None)
        if spec is None or not spec.splits_heads:
            return
        if self._publisher is not None:
            self._publisher.publish("disconnect_parts", peer_id, notify_peer)
        await asyncio.get_running_loop().run_in_executor(
            None, self.parts.disconnect, peer_id, notify_peer
        )

    def post_parts(
        self,
        spec: ChannelSpec | None,
        message: Message,
        kind: HeaderKind,
        src_epoch: int,
    ) -> tuple[int, int] | None:
        """Engine thread: have every rank post its parts of `message` but the main one,
        whose heads (this rank's numbering) are returned; None when the message goes
        whole on the workers' own channel."""
        if spec is None or not spec.splits_heads:
            return None
        peer_id = spec.receiver_id
        template = HandoffHeader(
            kind=kind,
            seq_no=0,
            dst_epoch=message.target.epoch,
            src_epoch=src_epoch,
            entries=message.entries,
            num_bytes=0,
            posted_at_us=int(time.time() * 1e6),
        )
        block_ids = list(message.block_ids)
        # Published in step order: each rank gathers after the steps that wrote the KV.
        if self._publisher is not None:
            self._publisher.publish("post_parts", peer_id, block_ids, template)
        self.parts.post(peer_id, block_ids, template)
        return heads_at(main_part(spec), True)

    def import_target(self, worker: Any, spec: ChannelSpec) -> tuple[Any, ImportMirror | None]:
        """What the main channel's receiver lands KV through: the worker, or when the
        workers split heads its main part's view of it, and the mirror that lands the
        other parts (None when the whole message comes on the main channel)."""
        if not spec.splits_heads:
            return worker, None
        mirror = PairMirror(self.mirror, pair_key(spec)) if receiving_parts(spec) else None
        return MainPartTarget(worker, spec), mirror

    def _rank_connected(self, peer_id: str) -> None:
        waiting = self._connecting.get(peer_id)
        if waiting is None:
            return
        waiting[1] -= 1
        if waiting[1] <= 0 and not waiting[0].done():
            waiting[0].set_result(None)

    def _landed(self, pair: str, seq_no: int) -> None:
        self.mirror.landed(pair, seq_no)

    def _publish_verdict(self, verdict: Verdict) -> None:
        if self._publisher is not None:
            self._publisher.publish("part_verdict", verdict)
        self.parts.verdict(verdict)

    def _side_parts_of(self, pair: str) -> int:
        spec = self._by_pair.get(pair)
        return 0 if spec is None else receiving_parts(spec)
