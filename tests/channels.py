"""A real KV channel pair on CPU (gloo), both ends in this process."""

from __future__ import annotations

import threading

import torch
from torch.distributed import TCPStore

from engine.transfer.channel import RECEIVER_RANK, SENDER_RANK, KVChannel
from engine.wire import ChannelSpec


def open_cpu_pair(
    sender_id: str, receiver_id: str, timeout_s: float
) -> tuple[TCPStore, KVChannel, KVChannel]:
    """(the rendezvous store, which must outlive the pair; the sending end; the receiving
    end), both open."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    spec = ChannelSpec("127.0.0.1", store.port, sender_id, 1, receiver_id, 2, timeout_s=timeout_s)
    sender = KVChannel(spec, SENDER_RANK, torch.device("cpu"))
    receiver = KVChannel(spec, RECEIVER_RANK, torch.device("cpu"))
    opener = threading.Thread(target=receiver.open)
    opener.start()
    sender.open()
    opener.join()
    return store, sender, receiver
