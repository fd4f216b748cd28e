"""A KV channel that closes tells whoever waits on a message it will never send."""

from __future__ import annotations

import threading
import time

import torch
from torch.distributed import TCPStore

from engine.transfer.base import KVPoll
from engine.transfer.channel import RECEIVER_RANK, SENDER_RANK, ChannelSpec, KVChannel
from engine.transfer.handoff import HandoffEntry, HandoffHeader, HeaderKind


def test_messages_queued_behind_a_busy_lane_fail_when_the_channel_closes() -> None:
    # A drain's move waits for its transfer with no deadline of its own: a message left
    # in the lane's queue when the channel closes (its peer died) must end, FAILED with
    # the reason, instead of staying WAITING for good.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    spec = ChannelSpec("127.0.0.1", store.port, "decode-0", 1, "decode-1", 2, timeout_s=5.0)
    sender = KVChannel(spec, SENDER_RANK, torch.device("cpu"))
    receiver = KVChannel(spec, RECEIVER_RANK, torch.device("cpu"))
    opener = threading.Thread(target=receiver.open)
    opener.start()
    sender.open()
    opener.join()
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
