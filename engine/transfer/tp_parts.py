"""A hand-off between tensor-parallel groups, in parts: one per rank pair of the plan.

The workers' own channel (rank 0 to rank 0) carries every message's header and rank 0's
part. Each other rank pair of the plan (engine.parallel.tp_heads.handoff_plan) has a channel
of its own that carries that pair's part of every message, in the same order: the KV
heads the receiving rank holds and the sending rank sends, one contiguous buffer. So each
prefill rank sends its own heads straight to the decode ranks that hold them; nothing is
gathered through rank 0.

Only the receiving group's rank 0 holds reservations, so it decides: when a message's
header has been checked it publishes a verdict (which rows go to which blocks; none when
refused), every other part's receiver lands its rows by it and acknowledges, and rank 0
admits the requests (or gives their blocks back) only once every part has landed or
failed. No part lands in a block after it went back to the pool. A sending rank that no
receiver reads from owns no blocks (the blocks are rank 0's): nothing waits on it.

Layer-wise streaming is off for these messages (each message moves after its pass).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.model.staging import to_device
from engine.parallel.tp_heads import HeadSlice, handoff_plan, num_local_kv_heads
from engine.transfer.base import ChannelClosed
from engine.transfer.channel import RECEIVER_RANK, SENDER_RANK, KVChannel
from engine.wire import ChannelSpec, HandoffHeader

log = logging.getLogger(__name__)

# How long a part's receiver waits for rank 0's verdict, and rank 0 for every part to
# land, before giving the message up (rank 0 reads its own header first: seconds at most).
VERDICT_TIMEOUT_S = 60.0


def plan_for(spec: ChannelSpec) -> tuple[HeadSlice, ...]:
    """The parts of every message on this pair of workers."""
    return handoff_plan(spec.num_kv_heads, spec.sender_tp, spec.receiver_tp)


def main_part(spec: ChannelSpec) -> HeadSlice:
    """The part the workers' own channel carries (prefill rank 0 to decode rank 0)."""
    return next(p for p in plan_for(spec) if p.src_rank == 0 and p.dst_rank == 0)


def side_parts(spec: ChannelSpec) -> list[HeadSlice]:
    """Every part but the main one: each on a channel of its own."""
    return [p for p in plan_for(spec) if (p.src_rank, p.dst_rank) != (0, 0)]


def pair_key(spec: ChannelSpec) -> str:
    """Names one pairing of two workers' incarnations (their ids and epochs): verdicts
    and acknowledgements are keyed by it, so nothing of a restarted peer's earlier
    pairing is ever matched to the new one's messages."""
    return dataclasses.replace(spec, src_rank=0, dst_rank=0).prefix


def heads_at(part: HeadSlice, sending: bool) -> tuple[int, int]:
    """The part's heads in this side's cache numbering, as [start, stop)."""
    start = part.src_offset if sending else part.dst_offset
    return start, start + len(part.heads)


@dataclass(frozen=True)
class Verdict:
    """Rank 0's decision on one message of a pairing (`pair_key`): its rows `row_ids`
    land in `block_ids`."""

    pair: str
    seq_no: int
    block_ids: tuple[int, ...]
    row_ids: tuple[int, ...]


class _Verdicts:
    """Verdicts by (peer, sequence number), each kept until every part's receiver on
    this rank that waits for it has taken it."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, int], list[Any]] = {}  # [verdict, takers left]
        self._changed = threading.Condition()

    def put(self, verdict: Verdict, num_takers: int) -> None:
        if num_takers < 1:
            return
        with self._changed:
            self._by_key[(verdict.pair, verdict.seq_no)] = [verdict, num_takers]
            self._changed.notify_all()

    def take(self, pair: str, seq_no: int, timeout_s: float) -> Verdict | None:
        key = (pair, seq_no)
        with self._changed:
            if not self._changed.wait_for(lambda: key in self._by_key, timeout_s):
                return None
            entry = self._by_key[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self._by_key[key]
            verdict: Verdict = entry[0]
            return verdict


@dataclass
class _PartChannel:
    part: HeadSlice
    channel: KVChannel
    sending: bool
    opened: threading.Event = dataclasses.field(default_factory=threading.Event)


class RankParts:
    """One rank's part channels, by peer worker: opened when the workers pair, closed
    when they part; sends this rank's parts of each message, receives those for it."""

    def __init__(
        self, rank: int, runner: Any, on_landed: Callable[[str, int], None] | None = None
    ) -> None:
        self.rank = rank
        self.runner = runner  # gather_blocks / scatter_blocks / kv_cache / device
        # Told (pair key, sequence number) when a part is done with a message.
        self.on_landed = on_landed or (lambda pair, seq_no: None)
        self._channels: dict[str, list[_PartChannel]] = {}
        self._verdicts = _Verdicts()
        self._lock = threading.Lock()

    def connect(self, spec: ChannelSpec, sending: bool) -> None:
        """Open this rank's channels of the pair (blocks until their other ends open
        them too) and start receiving on those that come here."""
        peer_id = spec.receiver_id if sending else spec.sender_id
        mine = [p for p in side_parts(spec) if (p.src_rank if sending else p.dst_rank) == self.rank]
        channels = [
            _PartChannel(
                p,
                KVChannel(
                    dataclasses.replace(spec, src_rank=p.src_rank, dst_rank=p.dst_rank),
                    SENDER_RANK if sending else RECEIVER_RANK,
                    torch.device(self.runner.device),
                ),
                sending,
            )
            for p in mine
        ]
        with self._lock:
            for old in self._channels.pop(peer_id, []):
                old.channel.close(False)
            self._channels[peer_id] = channels
        for pc in channels:
            pc.channel.open()
            pc.opened.set()
            if not sending:
                threading.Thread(
                    target=self._receive,
                    args=(peer_id, pc),
                    name=f"kv-part-{peer_id}-{pc.part.src_rank}",
                    daemon=True,
                ).start()

    def disconnect(self, peer_id: str, notify_peer: bool = True) -> None:
        with self._lock:
            channels = self._channels.pop(peer_id, [])
        for pc in channels:
            pc.channel.close(notify_peer)

    def post(self, peer_id: str, block_ids: list[int], template: HandoffHeader) -> None:
        """Engine or replay thread: gather and post this rank's parts of a message (after
        the steps that wrote its blocks: the gather is queued behind them)."""
        with self._lock:
            channels = list(self._channels.get(peer_id, []))
        for pc in channels:
            if not pc.opened.wait(VERDICT_TIMEOUT_S):
                log.error("part channel to %s rank %d never opened", peer_id, pc.part.dst_rank)
                continue
            payload = self.runner.gather_blocks(block_ids, heads=heads_at(pc.part, True))
            gathered = None
            if payload.is_cuda:
                gathered = torch.cuda.Event()
                gathered.record()
            header = dataclasses.replace(
                template,
                seq_no=pc.channel.next_seq(),
                num_bytes=int(payload.numel() * payload.element_size()),
            )
            pc.channel.send(header, payload, gathered)

    def verdict(self, verdict: Verdict) -> None:
        """Rank 0's decision on a message; its parts' receivers land rows by it."""
        with self._lock:
            num_receivers = sum(
                1
                for channels in self._channels.values()
                for pc in channels
                if not pc.sending and pair_key(pc.channel.spec) == verdict.pair
            )
        self._verdicts.put(verdict, num_receivers)

    def _receive(self, peer_id: str, pc: _PartChannel) -> None:
        """One incoming part channel: header, verdict, payload (scattered into its
        heads of the blocks the verdict names), acknowledgement; repeat."""
        channel, heads = pc.channel, heads_at(pc.part, False)
        pair = pair_key(channel.spec)
        cache = self.runner.kv_cache
        expected_seq = 0
        while not channel.closed:
            try:
                header = channel.recv_header()
            except ChannelClosed:
                break
            except Exception as exc:  # noqa: BLE001 - the peer died or the channel broke
                if not channel.closed:
                    log.warning("part channel from %s broke: %s", peer_id, exc)
                break
            if header.seq_no != expected_seq:
                log.error("part channel from %s out of step; closing it", peer_id)
                break
            expected_seq += 1
            shape = (header.num_blocks, *cache.shape[1:4], heads[1] - heads[0], cache.shape[5])
            staging = torch.empty(shape, dtype=cache.dtype, device=cache.device)
            verdict = self._verdicts.take(pair, header.seq_no, VERDICT_TIMEOUT_S)
            scatter = None
            if verdict is not None and verdict.block_ids:
                scatter = self._scatter_into(verdict, staging, heads)
            try:
                channel.recv_into(staging, scatter)
            except Exception as exc:  # noqa: BLE001 - the peer died mid-payload
                log.warning("part from %s broke off: %s", peer_id, exc)
                self.on_landed(pair, header.seq_no)
                break
            self.on_landed(pair, header.seq_no)
        channel.close(notify_peer=False)

    def _scatter_into(
        self, verdict: Verdict, staging: torch.Tensor, heads: tuple[int, int]
    ) -> Callable[[], None]:
        def scatter() -> None:
            rows = staging
            if len(verdict.row_ids) != staging.shape[0]:
                rows = staging.index_select(
                    0, to_device(list(verdict.row_ids), torch.long, staging.device)
                )
            # After every step this rank launched so far: rank 0 published the verdict
            # after the steps before the blocks were reserved, and this rank ran them.
            self.runner.scatter_blocks(list(verdict.block_ids), rows, heads=heads)

        return scatter


class PartsMirror:
    """Rank 0 of a receiving group: publishes each message's verdict to every part's
    receiver and waits until all have landed (ChannelReceiver's `mirror`)."""

    def __init__(
        self,
        publish: Callable[[Verdict], None],
        parts_for: Callable[[str], int],
    ) -> None:
        """`parts_for(pair)`: how many parts of each message of that pairing arrive off
        rank 0's main channel. Messages are keyed by (pair key, sequence number)."""
        self._publish = publish
        self._parts_for = parts_for  # peer id → parts of each of its messages off rank 0
        self._pending: dict[tuple[str, int], int] = {}
        self._landed: dict[tuple[str, int], int] = {}
        self._changed = threading.Condition()

    def started(self, pair: str, seq_no: int, block_ids: list[int], row_ids: list[int]) -> None:
        """The message's header is checked: tell every part's receiver where its rows go."""
        with self._changed:
            self._pending[(pair, seq_no)] = self._parts_for(pair)
        self._publish(Verdict(pair, seq_no, tuple(block_ids), tuple(row_ids)))

    def landed(self, pair: str, seq_no: int) -> None:
        """A part's receiver is done with the message (landed or failed)."""
        key = (pair, seq_no)
        with self._changed:
            self._landed[key] = self._landed.get(key, 0) + 1
            self._changed.notify_all()

    def settled(self, pair: str, seq_no: int) -> None:
        """Block until every part of the message has landed or failed. A rank that does
        not answer in VERDICT_TIMEOUT_S leaves the group in an unknown state: raise."""
        key = (pair, seq_no)
        deadline = time.monotonic() + VERDICT_TIMEOUT_S
        with self._changed:
            done = self._changed.wait_for(
                lambda: self._landed.get(key, 0) >= self._pending.get(key, 0),
                max(0.0, deadline - time.monotonic()),
            )
            self._pending.pop(key, None)
            self._landed.pop(key, None)
        if not done:
            raise RuntimeError(f"message {seq_no} of {pair}: a part did not land in time")


def receiving_parts(spec: ChannelSpec) -> int:
    """How many parts of each message from this pair arrive off the main channel."""
    return len(side_parts(spec))


def local_heads(spec: ChannelSpec, sending: bool) -> int:
    """KV heads each rank of this side holds."""
    return num_local_kv_heads(spec.num_kv_heads, spec.sender_tp if sending else spec.receiver_tp)


class MainPartTarget:
    """A receiving worker as the main channel's receiver sees it when the workers split
    heads differently: its bytes per block, staging and scatter are those of the main
    part's heads; the rest is the worker's."""

    def __init__(self, worker: Any, spec: ChannelSpec) -> None:
        part = main_part(spec)
        self._worker = worker
        self.heads = heads_at(part, False)
        self._num_heads = len(part.heads)
        self._local_heads = local_heads(spec, False)

    @property
    def block_bytes(self) -> int:
        return int(self._worker.block_bytes) * self._num_heads // self._local_heads

    @property
    def num_layers(self) -> int:
        return int(self._worker.num_layers)

    def staging(self, num_blocks: int, layers: tuple[int, int]) -> torch.Tensor:
        return self._worker.staging(num_blocks, layers, num_heads=self._num_heads)

    def scatter(
        self,
        block_ids: list[int],
        rows: torch.Tensor,
        row_ids: list[int] | None,
        layers: tuple[int, int],
        after: list[Any],
    ) -> None:
        self._worker.scatter(block_ids, rows, row_ids, layers, after, heads=self.heads)

    def reserve_precopy(self, requests: list[tuple[str, int]]) -> Any:
        return self._worker.reserve_precopy(requests)

    def admit(self, inp: Any, first_token: int) -> None:
        self._worker.admit(inp, first_token)

    def arrived(self, arrival: Any) -> None:
        self._worker.arrived(arrival)

    def release(self, req_id: str) -> None:
        self._worker.release(req_id)

    def fail(self, req_id: str, error: str) -> None:
        self._worker.fail(req_id, error)

    def is_buried(self, req_id: str) -> bool:
        return bool(self._worker.is_buried(req_id))


class PairMirror:
    """The mirror as one main channel's receiver calls it (by peer id): its messages are
    keyed by the pairing's key."""

    def __init__(self, mirror: PartsMirror, pair: str) -> None:
        self._mirror = mirror
        self._pair = pair

    def started(self, peer_id: str, seq_no: int, block_ids: list[int], row_ids: list[int]) -> None:
        self._mirror.started(self._pair, seq_no, block_ids, row_ids)

    def settled(self, peer_id: str, seq_no: int) -> None:
        self._mirror.settled(self._pair, seq_no)
