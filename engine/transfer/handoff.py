"""What travels with a request's KV: the reservation it fills and the header before the bytes.

A hand-off needs no control call: the decode worker reserved blocks and handed the router
a `Reservation`; the prefill worker sends a fixed-size `HandoffHeader` (request id,
decode epoch, per-channel sequence number, destination block ids, byte count) and then
the payload on the pair's channel. The receiver checks the header against its
reservation before a single byte lands in the cache.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

MAGIC = 0x5044_534B_5631  # "PDSKV1": a header that does not start with this is not one
MAX_REQ_ID_BYTES = 64
_FIXED = 10 + MAX_REQ_ID_BYTES // 8  # int64 fields before the block ids


class HeaderKind(enum.IntEnum):
    HANDOFF = 1
    CLOSE = 2  # the sender is leaving: the receiver stops listening on this channel


@dataclass(frozen=True)
class Reservation:
    """Blocks a decode worker holds for one request's incoming KV (the one type on both
    sides of the seam: returned by the decode worker, carried by the router to prefill)."""

    worker_id: str
    epoch: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class HandoffHeader:
    """The fixed-size message that precedes every payload on a channel."""

    kind: HeaderKind
    seq_no: int
    req_id: str = ""
    dst_epoch: int = 0
    src_epoch: int = 0
    dst_block_ids: tuple[int, ...] = ()
    num_bytes: int = 0
    num_computed_tokens: int = 0
    first_token: int = 0

    @staticmethod
    def size(max_blocks: int) -> int:
        """Number of int64 elements of a header on a channel of this block capacity."""
        return _FIXED + max_blocks

    def encode(self, max_blocks: int) -> torch.Tensor:
        """The header as a host tensor (headers travel host to host)."""
        raw = self.req_id.encode()
        if len(raw) > MAX_REQ_ID_BYTES:
            raise ValueError(f"request id longer than {MAX_REQ_ID_BYTES} bytes: {self.req_id!r}")
        if len(self.dst_block_ids) > max_blocks:
            raise ValueError(
                f"{len(self.dst_block_ids)} blocks exceed the channel's {max_blocks} per request"
            )
        fields = [
            MAGIC,
            int(self.kind),
            self.seq_no,
            self.dst_epoch,
            self.src_epoch,
            len(self.dst_block_ids),
            self.num_bytes,
            self.num_computed_tokens,
            self.first_token,
            len(raw),
        ]
        padded = raw.ljust(MAX_REQ_ID_BYTES, b"\0")
        fields += [
            int.from_bytes(padded[i : i + 8], "little", signed=True) for i in range(0, 64, 8)
        ]
        fields += list(self.dst_block_ids)
        out = torch.zeros(self.size(max_blocks), dtype=torch.int64)
        out[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
        return out

    @classmethod
    def decode(cls, raw: torch.Tensor) -> HandoffHeader:
        """Parse a received header; raises ValueError when it is not one."""
        values = raw.cpu().tolist()
        if len(values) < _FIXED or values[0] != MAGIC:
            raise ValueError("not a hand-off header: the channel is out of step")
        kind = HeaderKind(values[1])
        num_blocks, id_len = values[5], values[9]
        if not 0 <= num_blocks <= len(values) - _FIXED or not 0 <= id_len <= MAX_REQ_ID_BYTES:
            raise ValueError("corrupt hand-off header")
        id_bytes = b"".join(v.to_bytes(8, "little", signed=True) for v in values[10:_FIXED])
        return cls(
            kind=kind,
            seq_no=values[2],
            req_id=id_bytes[:id_len].decode(),
            dst_epoch=values[3],
            src_epoch=values[4],
            dst_block_ids=tuple(values[_FIXED : _FIXED + num_blocks]),
            num_bytes=values[6],
            num_computed_tokens=values[7],
            first_token=values[8],
        )
