"""A KV channel stays usable however long it sits idle between hand-offs."""

from __future__ import annotations

import threading
import time

import torch

from engine.transfer.base import KVPoll
from engine.wire import HandoffEntry, HandoffHeader, HeaderKind
from tests.channels import open_cpu_pair


def test_a_channel_idle_past_its_timeout_still_delivers_the_next_hand_off() -> None:
    # The timeout bounds pairing and each transfer; waiting for the next header is not a
    # transfer: a receiver idle for longer must still be there when a header comes.
    _store, sender, receiver = open_cpu_pair("prefill-0", "decode-0", timeout_s=1.0)
    received: list[object] = []
    payload = torch.empty(4)

    def receive() -> None:  # as a decode worker's standing receiver: header, then payload
        try:
            received.append(receiver.recv_header().entries[0].req_id)
            receiver.recv_into(payload)
            received.append(payload.tolist())
        except BaseException as exc:  # noqa: BLE001 - reported below
            received.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    time.sleep(2.0)  # twice the timeout, with nothing on the wire
    entry = HandoffEntry("r1", num_tokens=1, num_blocks=1, first_token=0)
    header = HandoffHeader(HeaderKind.HANDOFF, sender.next_seq(), entries=(entry,))
    assert sender.send(header, torch.arange(4.0)).wait(10) is KVPoll.SUCCESS
    thread.join(10)
    assert received == ["r1", [0.0, 1.0, 2.0, 3.0]]
    sender.close(notify_peer=False)
    receiver.close(notify_peer=False)
