"""The transfer interface over its in-process backend: hand-off messages of several
requests, refusals, aborts racing a transfer, a peer that dies mid-message, and the
sender's plan. No process group, no model: a plain tensor stands in for the cache."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from bench.harness.polling import wait_until
from engine.sampling_params import SamplingParams
from engine.transfer.base import KVPoll
from engine.transfer.fake import FakeChannel
from engine.transfer.import_target import KVArrival
from engine.transfer.receiver import ChannelReceiver
from engine.transfer.reservations import (
    PRECOPY_LEASE_S,
    AbortOutcome,
    HeldReservation,
    ReservationBook,
)
from engine.transfer.sender import Message, ReadyKV, plan_messages
from engine.transfer.streaming import StepStream, layers_per_part, open_stream
from engine.wire import (
    NO_TOKEN,
    GenerationInput,
    HandoffEntry,
    HandoffHeader,
    HandoffTarget,
    HeaderKind,
    Reservation,
)

EPOCH = 0x77
BLOCK = 4  # tokens a block
LAYERS = 3
ROW = (LAYERS, 2, BLOCK, 3)  # one block of the fake cache: layers, K/V, tokens, width
Claim = tuple[HeldReservation | None, str | None]  # ReservationBook.claim's answer


class Worker:
    """The receiving worker's side of ImportTarget, over a tensor cache."""

    def __init__(self, num_blocks: int = 16) -> None:
        self.cache = torch.zeros((num_blocks, *ROW))
        self.free = list(range(num_blocks))
        self.held: dict[str, list[int]] = {}
        self.book = ReservationBook(EPOCH, BLOCK)
        self.admitted: dict[str, int] = {}
        self.errors: dict[str, str] = {}
        self.arrivals: list[str] = []
        self.signal_s: dict[str, float] = {}  # each arrival's last header's way
        self.buried: set[str] = set()
        # Set once the receiver found no reservation for an entry and asked about it.
        self.asked_if_buried = threading.Event()
        self.scattered_after: list[list[object]] = []  # each scatter's engine work to wait for

    def reserve_precopy(
        self, requests: list[tuple[str, int]]
    ) -> list[tuple[Reservation, None] | None]:
        made: list[tuple[Reservation, None] | None] = []
        for req_id, num_tokens in requests:
            if len(self.free) < -(-num_tokens // BLOCK):
                made.append(None)
                continue
            ids = [self.free.pop(0) for _ in range(-(-num_tokens // BLOCK))]
            self.held[req_id] = ids
            made.append((Reservation("decode-0", EPOCH, tuple(ids)), None))
        return made

    def adopt(self, req_id: str, num_tokens: int) -> Reservation:
        """What the decode worker's reserve does with a pre-copy: keep its blocks first,
        add blocks for the rest, and take the request over."""
        ids = self.held[req_id]
        num_precopied = len(ids)
        ids += [self.free.pop(0) for _ in range(-(-num_tokens // BLOCK) - num_precopied)]
        res = Reservation("decode-0", EPOCH, tuple(ids), num_precopied)
        inp = GenerationInput(req_id, tuple(range(num_tokens)), SamplingParams(max_tokens=4))
        assert self.book.adopt(inp, res, 30.0, None)
        return res

    def reserve(
        self, req_id: str, num_tokens: int, writable_after: object | None = None
    ) -> Reservation:
        ids = [self.free.pop(0) for _ in range(-(-num_tokens // BLOCK))]
        self.held[req_id] = ids
        res = Reservation("decode-0", EPOCH, tuple(ids))
        inp = GenerationInput(req_id, tuple(range(num_tokens)), SamplingParams(max_tokens=4))
        self.book.add(inp, res, lease_s=30.0, writable_after=writable_after)
        return res

    @property
    def blocks_in_use(self) -> int:
        return sum(len(ids) for ids in self.held.values())

    # ImportTarget
    @property
    def block_bytes(self) -> int:
        return self.cache[0].numel() * self.cache.element_size()

    @property
    def num_layers(self) -> int:
        return LAYERS

    def staging(self, num_blocks: int, layers: tuple[int, int]) -> torch.Tensor:
        return torch.empty((num_blocks, layers[1] - layers[0], *ROW[1:]))

    def scatter(
        self,
        block_ids: list[int],
        rows: torch.Tensor,
        row_ids: list[int] | None,
        layers: tuple[int, int],
        after: list[object],
    ) -> None:
        self.scattered_after.append(list(after))
        if row_ids is not None:
            rows = rows[row_ids]
        self.cache[block_ids, layers[0] : layers[1]] = rows

    def admit(self, inp: GenerationInput, first_token: int) -> None:
        self.admitted[inp.req_id] = first_token

    def arrived(self, arrival: KVArrival) -> None:
        assert arrival.handoff_s >= 0 and arrival.wire_s >= 0
        assert 0 <= arrival.signal_s <= arrival.handoff_s  # a part of the hand-off
        assert 0 < arrival.num_bytes <= arrival.header.num_bytes
        self.arrivals.append(arrival.inp.req_id)
        self.signal_s[arrival.inp.req_id] = arrival.signal_s

    def release(self, req_id: str) -> None:
        self.free += self.held.pop(req_id, [])

    def fail(self, req_id: str, error: str) -> None:
        self.errors[req_id] = error

    def is_buried(self, req_id: str) -> bool:
        self.asked_if_buried.set()
        return req_id in self.buried


def _blocks(*values: float) -> torch.Tensor:
    return torch.stack([torch.full(ROW, float(v)) for v in values])


def _send(
    channel: FakeChannel,
    entries: list[tuple[str, int, int]],
    payload: torch.Tensor,
    kind: HeaderKind = HeaderKind.HANDOFF,
    skip_blocks: int = 0,
    **kw: int,
) -> KVPoll:
    """entries: (req_id, num_tokens, first_token); each sends its blocks past the first
    `skip_blocks`."""
    ready = [
        ReadyKV(
            r, HandoffTarget("decode-0", EPOCH), tuple(range(-(-n // BLOCK)))[skip_blocks:], n, t
        )
        for r, n, t in entries
    ]
    header = HandoffHeader(
        kind,
        kw.get("seq", channel.next_seq()),
        kw.get("epoch", EPOCH),
        1,
        Message(ready[0].target, tuple(ready)).entries,
        num_bytes=kw.get("num_bytes", payload.numel() * payload.element_size()),
    )
    return channel.send(header, payload).poll()


def _run_receiver(
    channel: FakeChannel, worker: Worker, trailer_timeout_s: float = 60.0
) -> threading.Thread:
    receiver = ChannelReceiver(
        channel, worker.book, worker, reservation_grace_s=0.3, trailer_timeout_s=trailer_timeout_s
    )
    thread = threading.Thread(target=receiver.run, daemon=True)
    thread.start()
    return thread


def test_one_message_carries_several_requests_into_their_own_blocks() -> None:
    send, recv = FakeChannel.pair("prefill-0", "decode-0")
    worker = Worker()
    a, b = worker.reserve("a", 8), worker.reserve("b", 3)
    thread = _run_receiver(recv, worker)
    assert _send(send, [("a", 8, 11), ("b", 3, 22)], _blocks(1, 2, 3)) is KVPoll.SUCCESS
    send.close(notify_peer=True)
    thread.join(5)
    assert worker.admitted == {"a": 11, "b": 22} and worker.arrivals == ["a", "b"]
    assert torch.equal(worker.cache[list(a.block_ids)], _blocks(1, 2))
    assert torch.equal(worker.cache[list(b.block_ids)], _blocks(3))
    assert recv.closed  # the CLOSE header ended the receiver


def test_an_import_waits_for_the_engine_work_its_reservations_name_and_no_more() -> None:
    """Each reservation remembers the engine step launched when its blocks were handed
    out; the scatter waits for those (not for whatever step runs when the KV lands)."""
    send, recv = FakeChannel.pair("prefill-0", "decode-0")
    worker = Worker()
    step_a, step_b = object(), object()
    worker.reserve("a", 8, writable_after=step_a)
    worker.reserve("b", 3, writable_after=step_b)
    worker.reserve("c", 3)  # blocks no launched step could still write
    thread = _run_receiver(recv, worker)
    assert _send(send, [("a", 8, 11), ("b", 3, 22), ("c", 3, 33)], _blocks(1, 2, 3, 4)) is (
        KVPoll.SUCCESS
    )
    send.close(notify_peer=True)
    thread.join(5)
    assert worker.admitted == {"a": 11, "b": 22, "c": 33}
    assert worker.scattered_after == [[step_a, step_b]]


def test_a_pre_copy_lands_ahead_and_the_final_message_brings_only_the_rest() -> None:
    send, recv = FakeChannel.pair("decode-1", "decode-0")
    worker = Worker()
    thread = _run_receiver(recv, worker)
    # The first round: two full blocks, held under the move's id, nothing admitted.
    pre = _send(send, [("m", 2 * BLOCK, NO_TOKEN)], _blocks(1, 2), HeaderKind.PRECOPY)
    assert pre is KVPoll.SUCCESS
    wait_until(lambda: worker.book.precopied("m") == 2, 5)
    assert worker.admitted == {} and worker.arrivals == []
    res = worker.adopt("m", 2 * BLOCK + 3)  # the request ran on: one more block's worth
    # The final round: only the block after the pre-copied ones.
    assert _send(send, [("m", 2 * BLOCK + 3, 7)], _blocks(3), skip_blocks=2) is KVPoll.SUCCESS
    send.close(notify_peer=True)
    thread.join(5)
    assert worker.admitted == {"m": 7} and worker.arrivals == ["m"]
    assert torch.equal(worker.cache[list(res.block_ids)], _blocks(1, 2, 3))


def test_a_pre_copy_nobody_adopts_expires_and_one_that_finds_no_room_is_drained() -> None:
    send, recv = FakeChannel.pair("decode-1", "decode-0")
    worker = Worker(num_blocks=3)
    thread = _run_receiver(recv, worker)
    entries = [("a", 2 * BLOCK, NO_TOKEN), ("b", 2 * BLOCK, NO_TOKEN)]  # room for one
    pre = _send(send, entries, _blocks(1, 2, 3, 4), HeaderKind.PRECOPY)
    assert pre is KVPoll.SUCCESS
    wait_until(lambda: worker.book.precopied("a") == 2, 5)
    assert worker.book.precopied("b") is None and "b" not in worker.held
    # The channel stayed in step: a hand-off after it lands.
    worker.reserve("c", 3)
    assert _send(send, [("c", 3, 9)], _blocks(5)) is KVPoll.SUCCESS
    send.close(notify_peer=True)
    thread.join(5)
    assert worker.admitted == {"c": 9}
    # Never adopted: it expires like a reservation, and its blocks go back.
    later = time.monotonic() + PRECOPY_LEASE_S + 1
    assert worker.book.expire(now=later) == []  # no request waits on it: not a failure
    assert worker.book.expire_precopies(now=later) == ["a"]


def test_a_refused_entry_is_drained_while_its_neighbours_land() -> None:
    send, recv = FakeChannel.pair("prefill-0", "decode-0")
    worker = Worker()
    a, c = worker.reserve("a", 4), worker.reserve("c", 4)
    thread = _run_receiver(recv, worker)
    # "b" has no reservation: its rows must not land anywhere, the others' must.
    _send(send, [("a", 4, 1), ("b", 4, 2), ("c", 4, 3)], _blocks(5, 6, 7))
    # The channel stays in step: the next message is read as a message.
    d = worker.reserve("d", 4)
    _send(send, [("d", 4, 4)], _blocks(8))
    send.close(notify_peer=True)
    thread.join(5)
    assert worker.admitted == {"a": 1, "c": 3, "d": 4}
    assert "no reservation" in worker.errors["b"]
    assert torch.equal(
        worker.cache[[a.block_ids[0], c.block_ids[0], d.block_ids[0]]], _blocks(5, 7, 8)
    )
    assert (worker.cache == 6).sum() == 0


def test_a_stale_epoch_is_refused_and_an_aborted_request_is_not_reported() -> None:
    send, recv = FakeChannel.pair("prefill-0", "decode-0")
    worker = Worker()
    worker.reserve("old", 4)
    worker.buried.add("gone")  # aborted here: its router no longer waits
    thread = _run_receiver(recv, worker)
    _send(send, [("old", 4, 1)], _blocks(1), epoch=EPOCH + 1)
    _send(send, [("gone", 4, 1)], _blocks(2))
    send.close(notify_peer=True)
    thread.join(5)
    assert "epoch" in worker.errors["old"] and "gone" not in worker.errors
    assert worker.admitted == {} and worker.book.holds("old")  # the router aborts it


def test_abort_while_the_bytes_are_on_the_wire_frees_the_blocks() -> None:
    send, recv = FakeChannel.pair("prefill-0", "decode-0")
    worker = Worker()
    worker.reserve("r", 8)
    claimed = threading.Event()
    original_claim = worker.book.claim

    def claim_then_abort(entry: HandoffEntry, dst_epoch: int) -> Claim:
        out = original_claim(entry, dst_epoch)
        claimed.set()
        assert worker.book.abort(entry.req_id) is AbortOutcome.IMPORTING  # only marked
        return out

    worker.book.claim = claim_then_abort  # type: ignore[method-assign]
    thread = _run_receiver(recv, worker)
    _send(send, [("r", 8, 9)], _blocks(1, 2))
    send.close(notify_peer=True)
    thread.join(5)
    assert claimed.is_set() and worker.admitted == {}
    assert worker.blocks_in_use == 0 and len(worker.book) == 0


def test_a_peer_that_dies_mid_message_fails_its_claimed_requests() -> None:
    send, recv = FakeChannel.pair("prefill-0", "decode-0")
    worker = Worker()
    worker.reserve("r", 4)
    original_claim = worker.book.claim

    def claim_then_break(entry: HandoffEntry, dst_epoch: int) -> Claim:
        out = original_claim(entry, dst_epoch)
        send.break_()  # the sender dies after its header, before the payload
        return out

    worker.book.claim = claim_then_break  # type: ignore[method-assign]
    thread = _run_receiver(recv, worker)
    _send(send, [("r", 4, 9)], _blocks(1))
    thread.join(5)
    assert not thread.is_alive() and recv.closed
    assert "broke off" in worker.errors["r"]
    assert worker.blocks_in_use == 0 and len(worker.book) == 0


def test_a_wrong_byte_count_closes_the_channel_and_fails_its_entries() -> None:
    send, recv = FakeChannel.pair("prefill-0", "decode-0")
    worker = Worker()
    worker.reserve("r", 4)
    thread = _run_receiver(recv, worker)
    _send(send, [("r", 4, 9)], _blocks(1), num_bytes=3)
    thread.join(5)
    assert recv.closed and "byte count" in worker.errors["r"]


def test_an_out_of_step_header_closes_the_channel() -> None:
    send, recv = FakeChannel.pair("prefill-0", "decode-0")
    worker = Worker()
    worker.reserve("r", 4)
    thread = _run_receiver(recv, worker)
    _send(send, [("r", 4, 9)], _blocks(1), seq=5)
    thread.join(5)
    assert recv.closed and worker.admitted == {}


def test_send_states_waiting_then_success_and_failure_with_a_reason() -> None:
    send, recv = FakeChannel.pair("prefill-0", "decode-0")
    send.hold()
    header = HandoffHeader(HeaderKind.HANDOFF, send.next_seq())
    handle = send.send(header, None)
    assert handle.poll() is KVPoll.WAITING
    seen: list[KVPoll] = []
    handle.add_done_callback(seen.append)
    send.release()
    assert handle.wait(1) is KVPoll.SUCCESS and seen == [KVPoll.SUCCESS]
    send.fail_next("link down")
    failed = send.send(HandoffHeader(HeaderKind.HANDOFF, send.next_seq()), None)
    assert failed.poll() is KVPoll.FAILED and failed.failure == "link down"
    recv.close(notify_peer=False)


def _ready(req_id: str, target: str, num_blocks: int) -> ReadyKV:
    return ReadyKV(req_id, HandoffTarget(target, 1), tuple(range(num_blocks)), num_blocks * 4, 0)


def test_one_steps_hand_offs_are_one_message_per_target_within_the_caps() -> None:
    ready = [_ready("a", "d0", 2), _ready("b", "d1", 1), _ready("c", "d0", 3)]
    plan = plan_messages(ready, block_bytes=100)
    assert [(m.target.worker_id, [i.req_id for i in m.items]) for m in plan] == [
        ("d0", ["a", "c"]),
        ("d1", ["b"]),
    ]
    assert plan[0].block_ids == [0, 1, 0, 1, 2]
    by_entries = plan_messages([_ready(str(i), "d0", 1) for i in range(5)], 100, max_entries=2)
    assert [len(m.items) for m in by_entries] == [2, 2, 1]
    by_bytes = plan_messages(ready, block_bytes=100, max_bytes=250)
    assert [[i.req_id for i in m.items] for m in by_bytes] == [["a"], ["c"], ["b"]]


@pytest.mark.parametrize("num_blocks", [0, 5])
def test_a_message_too_large_for_the_byte_cap_still_goes_alone(num_blocks: int) -> None:
    plan = plan_messages([_ready("big", "d0", 9), _ready("s", "d0", num_blocks)], 100, max_bytes=50)
    assert [[i.req_id for i in m.items] for m in plan] == [["big"], ["s"]]


def test_kv_that_overtakes_its_reservation_waits_for_it() -> None:
    send, recv = FakeChannel.pair("prefill-0", "decode-0")
    worker = Worker()
    thread = _run_receiver(recv, worker)
    _send(send, [("late", 4, 7)], _blocks(3))  # the reservation is still on its way
    assert worker.asked_if_buried.wait(5), "the receiver never waited for the reservation"
    res = worker.reserve("late", 4)
    send.close(notify_peer=True)
    thread.join(5)
    assert worker.admitted == {"late": 7} and "late" not in worker.errors
    assert torch.equal(worker.cache[list(res.block_ids)], _blocks(3))


def test_kv_for_an_aborted_request_is_dropped_without_waiting_out_the_grace() -> None:
    send, recv = FakeChannel.pair("prefill-0", "decode-0")
    worker = Worker()
    worker.buried.add("gone")
    receiver = ChannelReceiver(recv, worker.book, worker, reservation_grace_s=30.0)
    thread = threading.Thread(target=receiver.run, daemon=True)
    thread.start()
    _send(send, [("gone", 4, 7)], _blocks(3))
    send.close(notify_peer=True)
    thread.join(5)
    assert not thread.is_alive() and worker.admitted == {} and worker.errors == {}


# ---------------------------------------------------------------- layer-wise streaming
class SenderCache:
    """The sending worker's cache and the gather a streamed message's parts use."""

    def __init__(self, *values: float) -> None:
        self.cache = _blocks(*values)
        self.gathered: list[tuple[int, int]] = []

    def gather(self, block_ids: list[int], layers: tuple[int, int]) -> tuple[torch.Tensor, None]:
        self.gathered.append(layers)
        return self.cache[block_ids, layers[0] : layers[1]].clone(), None


def _message(*items: tuple[str, int, tuple[int, ...]]) -> Message:
    """items: (req_id, num_tokens, sender block ids)."""
    target = HandoffTarget("decode-0", EPOCH)
    return Message(target, tuple(ReadyKV(r, target, ids, n, NO_TOKEN) for r, n, ids in items))


def _open(send: FakeChannel, sender: SenderCache, message: Message, part_bytes: int) -> StepStream:
    return open_stream(
        [(message, send)],
        src_epoch=1,
        num_layers=LAYERS,
        block_bytes=sender.cache[0].numel() * 4,
        gather=sender.gather,
        min_part_bytes=part_bytes,
    )


def _stream_one_block(send: FakeChannel) -> StepStream:
    """Request "a" (4 tokens, one block) streamed layer by layer, every part sent; its
    trailer not yet."""
    stream = _open(send, SenderCache(1), _message(("a", 4, (0,))), part_bytes=1)
    for layer in range(LAYERS):
        stream.layer_written(layer)
    return stream


@pytest.mark.parametrize("posted_ahead", [False, True], ids=["in-turn", "posted-ahead"])
def test_a_streamed_message_lands_part_by_part_and_its_trailer_admits(posted_ahead: bool) -> None:
    # posted-ahead: the parts' receives land only when waited for, in order, as on a
    # device (all through one staging buffer).
    send, recv = FakeChannel.pair("prefill-0", "decode-0")
    if posted_ahead:
        recv.defer_posted()
    worker = Worker()
    a, b = worker.reserve("a", 8), worker.reserve("b", 4)
    thread = _run_receiver(recv, worker)
    sender = SenderCache(1, 2, 3)
    stream = _open(send, sender, _message(("a", 8, (0, 1)), ("b", 4, (2,))), part_bytes=1)
    for layer in range(LAYERS):  # the forward pass writes the layers in order
        stream.layer_written(layer)
        assert sender.gathered[-1] == (layer, layer + 1)  # each part leaves at once
    # "b"'s first token ended it: no token for it in the trailer.
    handles = stream.close({"a": 11})
    assert handles["a"].wait(1) is KVPoll.SUCCESS and handles["b"] is handles["a"]
    send.close(notify_peer=True)
    thread.join(5)
    assert worker.admitted == {"a": 11} and worker.errors == {}
    assert torch.equal(worker.cache[list(a.block_ids)], _blocks(1, 2))
    assert worker.held.keys() == {"a"} and len(worker.book) == 0  # b's blocks came back
    assert b.block_ids[0] in worker.free


@pytest.mark.parametrize("posted_ahead", [False, True], ids=["in-turn", "posted-ahead"])
def test_parts_merge_layers_below_the_part_size_and_missed_ones_go_at_close(
    posted_ahead: bool,
) -> None:
    assert layers_per_part(message_bytes=300, num_layers=3, min_part_bytes=150) == 2
    assert layers_per_part(message_bytes=300, num_layers=3, min_part_bytes=10**9) == 3
    # Many layers of large KV: a few parts of several layers, not one part a layer.
    assert layers_per_part(message_bytes=16 << 24, num_layers=16, min_part_bytes=1) == 4
    assert layers_per_part(16 << 24, 16, min_part_bytes=1, max_parts=16) == 1
    send, recv = FakeChannel.pair("prefill-0", "decode-0")
    if posted_ahead:  # the narrower last part lands through the front of one buffer
        recv.defer_posted()
    worker = Worker()
    res = worker.reserve("a", 4)
    thread = _run_receiver(recv, worker)
    sender = SenderCache(7)
    block_bytes = sender.cache[0].numel() * 4
    stream = _open(send, sender, _message(("a", 4, (0,))), part_bytes=2 * block_bytes // LAYERS)
    stream.layer_written(0)
    assert sender.gathered == []  # layers 0-1 are one part: not complete yet
    stream.layer_written(1)
    assert sender.gathered == [(0, 2)]
    stream.close({"a": 5})  # layer 2's part was never announced: sent at close
    assert sender.gathered == [(0, 2), (2, 3)]
    send.close(notify_peer=True)
    thread.join(5)
    assert worker.admitted == {"a": 5}
    assert torch.equal(worker.cache[list(res.block_ids)], _blocks(7))


def test_an_aborted_pass_frees_every_reservation_and_keeps_the_channel_in_step() -> None:
    send, recv = FakeChannel.pair("prefill-0", "decode-0")
    worker = Worker()
    worker.reserve("a", 4)
    thread = _run_receiver(recv, worker)
    stream = _open(send, SenderCache(1), _message(("a", 4, (0,))), part_bytes=1)
    stream.layer_written(0)
    stream.abort()  # the pass raised
    stream.abort()  # idempotent
    res = worker.reserve("next", 4)
    _send(send, [("next", 4, 3)], _blocks(9))
    send.close(notify_peer=True)
    thread.join(5)
    assert worker.admitted == {"next": 3} and worker.errors == {}
    assert worker.held.keys() == {"next"} and len(worker.book) == 0
    assert torch.equal(worker.cache[list(res.block_ids)], _blocks(9))


def test_a_sender_that_dies_mid_stream_fails_its_requests_and_frees_their_blocks() -> None:
    send, recv = FakeChannel.pair("prefill-0", "decode-0")
    worker = Worker()
    worker.reserve("a", 4)
    thread = _run_receiver(recv, worker)
    receiving = threading.Event()
    staging = worker.staging

    def staging_then_signal(num_blocks: int, layers: tuple[int, int]) -> torch.Tensor:
        receiving.set()  # the entry is claimed: its parts are being received
        return staging(num_blocks, layers)

    worker.staging = staging_then_signal  # type: ignore[method-assign]
    stream = _open(send, SenderCache(1), _message(("a", 4, (0,))), part_bytes=1)
    stream.layer_written(0)
    assert receiving.wait(5)
    send.break_()  # the prefill worker died during its pass
    thread.join(5)
    assert not thread.is_alive() and recv.closed
    assert "broke off" in worker.errors["a"]
    assert worker.blocks_in_use == 0 and len(worker.book) == 0


def test_a_trailer_out_of_step_closes_the_channel_and_fails_the_message() -> None:
    send, recv = FakeChannel.pair("prefill-0", "decode-0")
    worker = Worker()
    worker.reserve("a", 4)
    thread = _run_receiver(recv, worker)
    sender = SenderCache(1)
    header = HandoffHeader(
        HeaderKind.STREAM,
        send.next_seq(),
        EPOCH,
        1,
        _message(("a", 4, (0,))).entries,
        num_bytes=sender.cache[0].numel() * 4,
        layers_per_part=LAYERS,
    )
    send.send(header, None)
    send.send(None, sender.cache[[0]])
    send.send(HandoffHeader(HeaderKind.TRAILER, header.seq_no + 1, entries=header.entries), None)
    thread.join(5)
    assert recv.closed and "broke off" in worker.errors["a"]
    assert worker.blocks_in_use == 0 and len(worker.book) == 0


def test_by_default_a_hand_off_streams_from_256_mib_of_kv_whatever_the_model() -> None:
    from engine.factory import EngineArgs, kv_stream_min_tokens

    llama_8b = 32 * 2 * 8 * 128 * 2  # layers × (K, V) × KV heads × head dim × bf16 bytes
    llama_1b = 16 * 2 * 8 * 64 * 2
    assert kv_stream_min_tokens("auto", llama_8b) == 2048  # the crossover measured at 8B
    assert kv_stream_min_tokens("auto", llama_1b) == 8192
    assert kv_stream_min_tokens(0, llama_1b) == 0 and kv_stream_min_tokens(512, llama_8b) == 512
    assert EngineArgs().kv_stream_min_tokens == "auto"
    with pytest.raises(ValueError, match="kv_stream_min_tokens must be 'auto' or >= 0"):
        EngineArgs(kv_stream_min_tokens=-1)


def test_a_message_that_breaks_off_frees_its_blocks_only_once_its_posted_parts_landed() -> None:
    # The receiver posts every part of a streamed message at once and waits once; on a
    # device those parts may still be landing when the message breaks off. A block
    # freed before then could go to another request and be overwritten by them.
    send, recv = FakeChannel.pair("prefill-0", "decode-0")
    recv.defer_posted()
    worker = Worker()
    worker.reserve("a", 4)
    order: list[str] = []
    scatter, release = worker.scatter, worker.release

    def scatter_logged(
        block_ids: list[int],
        rows: torch.Tensor,
        row_ids: list[int] | None,
        layers: tuple[int, int],
        after: list[object],
    ) -> None:
        order.append("scatter")
        scatter(block_ids, rows, row_ids, layers, after)

    def release_logged(req_id: str) -> None:
        order.append("release")
        release(req_id)

    worker.scatter = scatter_logged  # type: ignore[method-assign]
    worker.release = release_logged  # type: ignore[method-assign]
    thread = _run_receiver(recv, worker)
    stream = _stream_one_block(send)
    # A trailer out of step: the message breaks off after all its parts were posted.
    send.send(
        HandoffHeader(HeaderKind.TRAILER, 99, entries=stream.messages[0].header.entries), None
    )
    thread.join(5)
    assert recv.closed and "broke off" in worker.errors["a"]
    assert order == ["scatter"] * LAYERS + ["release"]
    assert worker.blocks_in_use == 0 and len(worker.book) == 0


def test_a_trailer_that_never_comes_fails_the_message_and_frees_its_blocks() -> None:
    # A sender that hangs mid-stream (alive, its connection open) must not hold the
    # receiver's blocks for as long as it lives.
    send, recv = FakeChannel.pair("prefill-0", "decode-0")
    worker = Worker()
    worker.reserve("a", 4)
    thread = _run_receiver(recv, worker, trailer_timeout_s=0.3)
    _stream_one_block(send)  # every part sent; the pass never ends
    thread.join(5)
    assert not thread.is_alive() and recv.closed
    assert "trailer" in worker.errors["a"] and "0.3 s" in worker.errors["a"]
    assert worker.blocks_in_use == 0 and len(worker.book) == 0


def test_a_trailer_held_up_on_its_way_shows_as_the_hand_offs_signal_time() -> None:
    # The hand-off's time splits into the last header's way (sending lane, control
    # channel, the receiving thread's wake-up) and the last bytes' landing: a trailer
    # held up after it was posted is the first kind.
    send, recv = FakeChannel.pair("prefill-0", "decode-0")
    worker = Worker()
    worker.reserve("a", 4)
    thread = _run_receiver(recv, worker)
    stream = _stream_one_block(send)
    send.hold()
    stream.close({"a": 3})  # the trailer is posted now, and held on its way
    time.sleep(0.2)
    send.release()
    assert wait_until(lambda: "a" in worker.signal_s, timeout=5)
    assert worker.signal_s["a"] >= 0.2
    send.close(notify_peer=True)
    thread.join(5)
