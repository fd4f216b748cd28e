"""A channel's headers leave from the posting thread when nothing ahead of them waits on
the sending lane, so a busy lane does not hold back the signal its receiver waits for;
they never pass a header that does wait there, and payloads land in posting order."""

from __future__ import annotations

import threading

import torch

from engine.transfer.base import ChannelClosed
from engine.wire import HandoffEntry, HandoffHeader, HeaderKind
from tests.channels import open_cpu_pair


def _handoff(seq_no: int, req_id: str) -> HandoffHeader:
    entry = HandoffEntry(req_id, num_tokens=1, num_blocks=1, first_token=7)
    return HandoffHeader(HeaderKind.HANDOFF, seq_no, entries=(entry,), num_bytes=16)


def test_a_header_reaches_the_receiver_while_the_lane_is_busy_and_payloads_keep_order() -> None:
    _store, sender, receiver = open_cpu_pair("prefill-0", "decode-0", timeout_s=10.0)
    try:
        gate = threading.Event()
        sender._lane.submit(gate.wait)  # the lane is busy with an earlier transfer
        first, second = torch.arange(4.0), torch.arange(4.0) + 10
        sent = [
            sender.send(_handoff(sender.next_seq(), "a"), first),
            sender.send(_handoff(sender.next_seq(), "b"), second),
        ]
        # The first header is here before the lane could send anything.
        header = receiver.recv_header(timeout_s=5.0)
        assert [e.req_id for e in header.entries] == ["a"] and not gate.is_set()
        gate.set()
        landed = torch.empty(4)
        receiver.recv_into(landed)
        assert torch.equal(landed, first)
        header = receiver.recv_header(timeout_s=5.0)
        assert [e.req_id for e in header.entries] == ["b"]
        receiver.recv_into(landed)
        assert torch.equal(landed, second)
        assert all(handle.wait(5) is not None and handle.failure is None for handle in sent)
    finally:
        sender.close(notify_peer=False)
        receiver.close(notify_peer=False)


def test_a_header_does_not_pass_one_waiting_on_the_lane() -> None:
    # CLOSE always waits its turn on the lane (after every payload queued before it): a
    # header posted after it must reach the receiver after it, not before.
    _store, sender, receiver = open_cpu_pair("prefill-0", "decode-0", timeout_s=10.0)
    try:
        gate = threading.Event()
        sender._lane.submit(gate.wait)
        sender.send(HandoffHeader(HeaderKind.CLOSE, sender.next_seq()), None)
        sender.send(_handoff(sender.next_seq(), "late"), torch.arange(4.0))
        got: list[object] = []

        def receive() -> None:
            try:
                got.append(receiver.recv_header(timeout_s=5.0))
            except ChannelClosed as exc:
                got.append(exc)

        thread = threading.Thread(target=receive)
        thread.start()
        thread.join(0.3)
        assert got == []  # nothing passed the CLOSE held on the lane
        gate.set()
        thread.join(5)
        assert len(got) == 1 and isinstance(got[0], ChannelClosed)
    finally:
        sender.close(notify_peer=False)
        receiver.close(notify_peer=False)
