"""A hand-off header as a channel carries it: its int64 words in a host tensor.

The header itself (`engine.wire.HandoffHeader`) is plain Python; headers travel host to
host, on a gloo group of the pair's own (engine.transfer.channel).
"""

from __future__ import annotations

import torch

from engine.wire import HandoffHeader


def encode_header(header: HandoffHeader) -> torch.Tensor:
    """The header as a host tensor of `HandoffHeader.size()` int64 elements."""
    return torch.tensor(header.words(), dtype=torch.int64)


def empty_header() -> torch.Tensor:
    """A host buffer a header is received into."""
    return torch.empty(HandoffHeader.size(), dtype=torch.int64)


def decode_header(raw: torch.Tensor) -> HandoffHeader:
    """Parse a received header; raises ValueError when it is not one."""
    return HandoffHeader.from_words(raw.cpu().tolist())
