"""A decode worker's sending side: hand a running request, KV and all, to a peer decode
worker (live migration, when this worker drains).

A request's life here, once the router moves it: running (its full blocks may go to
the peer first, while it keeps decoding: `precopy`, the move's first round) → detached
(taken off the schedule at a step boundary; its blocks kept, its tokens so far returned
to the router) → sent (its blocks, past any a pre-copy sent, gathered with those of the
other requests moving to the same peer, released at once, and posted on this worker's
channel to the peer in as few messages as `plan_messages` allows, exactly like a
prefill hand-off: the peer checks the entry against the reservation the router made
there, and the request goes on from the last sampled token) or released (the router
gave up on moving it; it then continues by recompute). The channels are made lazily,
one per (this, peer) pair, with this worker as the sending end (rank 0).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.transfer.base import KVPoll, PairChannel
from engine.transfer.channel import SENDER_RANK
from engine.transfer.sender import Message, ReadyKV, plan_messages
from engine.wire import (
    NO_TOKEN,
    ChannelSpec,
    DetachedMove,
    DetachedRequest,
    HandoffTarget,
    HeaderKind,
    Precopy,
)


class KVExporter:
    """Mixin for DecodeWorker: detach, send, and the sending channels to peers."""

    worker_id: str
    epoch: int
    send_channels: dict[str, PairChannel]

    if TYPE_CHECKING:  # provided by WorkerBase

        @property
        def core(self) -> Any: ...

        @property
        def runner(self) -> Any: ...

        @property
        def block_bytes(self) -> int: ...

        async def on_engine(self, fn: Any) -> Any: ...

        def post_message(
            self, channel: PairChannel, message: Message, kind: HeaderKind = ...
        ) -> tuple[Any, Any]: ...

        def new_channel(self, spec: ChannelSpec, rank: int) -> PairChannel: ...

    async def connect_sender(self, spec: ChannelSpec) -> None:
        """Build this end (the sender) of a channel to a peer decode worker."""
        loop = asyncio.get_running_loop()
        old = self.send_channels.pop(spec.receiver_id, None)
        if old is not None:  # the peer restarted: its old channel is dead
            await loop.run_in_executor(None, old.close, False)
        channel = self.new_channel(spec, SENDER_RANK)
        await loop.run_in_executor(None, channel.open)
        self.send_channels[spec.receiver_id] = channel

    async def disconnect_sender(self, peer_id: str, notify_peer: bool = True) -> None:
        channel = self.send_channels.pop(peer_id, None)
        if channel is not None:
            await asyncio.get_running_loop().run_in_executor(None, channel.close, notify_peer)

    async def precopy(self, target: HandoffTarget, moves: Sequence[Precopy]) -> dict[str, int]:
        """A live move's first round: send each running request's full blocks (which no
        later step writes) to `target` while it keeps decoding here; the target holds
        them under `as_req_id` until the move's reservation adopts them. Blocks sent per
        `as_req_id` (a request not running here, or with no full block, is left out).
        RuntimeError when the transfer failed."""
        channel = self.send_channels.get(target.worker_id)
        if channel is None or channel.closed:
            raise RuntimeError(f"no channel from {self.worker_id} to {target.worker_id}")
        block_size = self.core.cache_config.block_size

        def post() -> tuple[list[Any], dict[str, int]]:
            ready = []
            for move in moves:
                blocks = self.core.full_kv_blocks(move.req_id)
                if blocks:
                    num_tokens = len(blocks) * block_size
                    ready.append(
                        ReadyKV(move.as_req_id, target, tuple(blocks), num_tokens, NO_TOKEN)
                    )
            handles, _ = self._post_all(channel, ready, HeaderKind.PRECOPY)
            return handles, {r.req_id: len(r.block_ids) for r in ready}

        handles, sent = await self.on_engine(post)
        await self._all_sent(handles, target)
        return sent

    async def detach(self, req_ids: Sequence[str]) -> list[DetachedRequest | None]:
        """Take running requests off the schedule at the next step boundary, all at the
        same one, keeping their KV; for each, None when it is not running here
        (finished, queued, or mid-recompute)."""
        detached: list[DetachedRequest | None] = await self.on_engine(
            lambda: [self.core.detach(req_id) for req_id in req_ids]
        )
        return detached

    async def send_detached(self, target: HandoffTarget, moves: Sequence[DetachedMove]) -> int:
        """Send detached requests' KV to `target` (which reserved blocks for each
        `as_req_id`) and free them here; the bytes sent. All of them travel together:
        one gather and one message per `plan_messages` group, so a drain moving many
        requests pays the per-message costs once, not per request. RuntimeError when
        the transfer failed."""
        channel = self.send_channels.get(target.worker_id)

        def post() -> tuple[list[Any], int]:
            # Engine thread: the gathers are ordered after every step that wrote this KV,
            # and the blocks go back right behind them (whatever happens here).
            try:
                if channel is None or channel.closed:
                    raise RuntimeError(f"no channel from {self.worker_id} to {target.worker_id}")
                return self._post_detached(channel, target, moves)
            finally:
                for move in moves:
                    self.core.release(move.req_id)

        handles, num_bytes = await self.on_engine(post)
        await self._all_sent(handles, target)
        return int(num_bytes)

    async def _all_sent(self, handles: list[Any], target: HandoffTarget) -> None:
        loop = asyncio.get_running_loop()
        for handle, done in [(h, _finished(h, loop)) for h in handles]:
            if await done is not KVPoll.SUCCESS:
                raise RuntimeError(f"KV to {target.worker_id} failed: {handle.failure}")

    def _post_detached(
        self, channel: PairChannel, target: HandoffTarget, moves: Sequence[DetachedMove]
    ) -> tuple[list[Any], int]:
        """Gather the moves' blocks and post them, in as few messages as the caps allow;
        the send handles and the bytes posted."""
        block_size = self.core.cache_config.block_size
        ready = []
        for move in moves:
            # Only the blocks that hold its KV: a step launched ahead, or speculation,
            # may have allocated the next one already; and not those a pre-copy sent.
            num_kv = move.detached.num_kv_tokens
            block_ids = self.core.block_ids(move.req_id)[: -(-num_kv // block_size)]
            block_ids = block_ids[move.skip_blocks :]
            ready.append(
                ReadyKV(move.as_req_id, target, tuple(block_ids), num_kv, move.detached.next_token)
            )
        return self._post_all(channel, ready, HeaderKind.HANDOFF)

    def _post_all(
        self, channel: PairChannel, ready: list[ReadyKV], kind: HeaderKind
    ) -> tuple[list[Any], int]:
        """Engine thread: post `ready` in as few messages as the caps allow; the send
        handles and the bytes posted."""
        handles, total = [], 0
        for message in plan_messages(ready, self.block_bytes):
            header, handle = self.post_message(channel, message, kind)
            handles.append(handle)
            total += header.num_bytes
        return handles, total


def _finished(handle: Any, loop: asyncio.AbstractEventLoop) -> asyncio.Future[KVPoll]:
    """A future of the loop that a send handle's final state completes."""
    done: asyncio.Future[KVPoll] = loop.create_future()
    handle.add_done_callback(lambda state: loop.call_soon_threadsafe(_set, done, state))
    return done


def _set(future: asyncio.Future[KVPoll], state: KVPoll) -> None:
    if not future.done():
        future.set_result(state)
