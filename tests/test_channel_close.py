"""A KV channel that closes tells whoever waits on a message it will never send."""

from __future__ import annotations

import threading
import time

import torch

from engine.transfer.base import KVPoll
from engine.wire import HandoffEntry, HandoffHeader, HeaderKind
from tests.channels import open_cpu_pair


def test_messages_queued_behind_a_busy_lane_fail_when_the_channel_closes() -> None:
    # A drain's move waits for its transfer with no deadline of its own: a message left
    # in the lane's queue when the channel closes (its peer died) must end, FAILED with
    # the reason, instead of staying WAITING for good.
    _store, sender, receiver = open_cpu_pair("decode-0", "decode-1", timeout_s=5.0)
    gate = threading.Event()
    sender._lane.submit(gate.wait)  # the lane is busy with an earlier transfer
    entry = HandoffEntry("r1", num_tokens=1, num_blocks=1, first_token=0)
    header = HandoffHeader(HeaderKind.HANDOFF, sender.next_seq(), entries=(entry,))
    queued = sender.send(header, torch.arange(4.0))
    assert queued.poll() is KVPoll.WAITING
    started = time.monotonic()
    sender.close(notify_peer=False)
    assert queued.wait(5) is KVPoll.FAILED
    assert time.monotonic() - started < 5
    assert "closed before it was sent" in (queued.failure or "")
    gate.set()
    receiver.close(notify_peer=False)
