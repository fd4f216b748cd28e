"""What travels between two workers: how a pair's channel is found, and the header
before each message's KV.

The router hands both ends of a pair the same `ChannelSpec`. A hand-off needs no
control call: the receiving worker reserved blocks for each request (its own book knows
which); the sender posts one fixed-size `HandoffHeader` and then one payload on the
pair's channel. A header carries up to `MAX_ENTRIES` requests whose KV became ready in
the same engine step, so a burst moves as a few large messages, not one small message
per request. Each entry names the request, how many tokens of KV it brings and the
token that follows them; the payload holds the entries' blocks one after the other, in
entry order. The receiver checks every entry against its reservation (epoch, request,
token count, byte count) before a byte lands in the cache.

A streamed message (`HeaderKind.STREAM`) is posted before the forward pass that
completes its prompts: its payload follows in parts of `layers_per_part` layers each,
every part sent as soon as the pass has written those layers, and a `TRAILER` with the
same sequence number closes it with the token sampled after each prompt (`NO_TOKEN`
where the request does not continue: its first token ended it, or it was aborted).

A header travels as `HandoffHeader.size()` int64 words (`words`, `from_words`);
engine.transfer.handoff puts them in a host tensor for the channel.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from engine.wire.workers import epoch_hex


@dataclass(frozen=True)
class ChannelSpec:
    """How both ends of one pair find each other; the router hands it to both."""

    store_host: str
    store_port: int
    prefill_id: str
    prefill_epoch: int
    decode_id: str
    decode_epoch: int
    timeout_s: float = 60.0
    # Tensor parallelism: each side's group size and the model's KV heads (the hand-off
    # plan, engine.parallel.tp_heads.handoff_plan), and which rank pair this channel joins
    # (0, 0: the workers' own channel, headers included; others carry one part each).
    sender_tp: int = 1
    receiver_tp: int = 1
    num_kv_heads: int = 1
    src_rank: int = 0
    dst_rank: int = 0

    @property
    def sender_id(self) -> str:
        return self.prefill_id

    @property
    def receiver_id(self) -> str:
        return self.decode_id

    @property
    def prefix(self) -> str:
        return (
            f"kv/{self.prefill_id}.{epoch_hex(self.prefill_epoch)}/"
            f"{self.decode_id}.{epoch_hex(self.decode_epoch)}/"
            + (f"r{self.src_rank}-{self.dst_rank}/" if self.src_rank or self.dst_rank else "")
        )

    @property
    def splits_heads(self) -> bool:
        """True when either side is a tensor-parallel group: KV moves in parts, one per
        rank pair of the plan."""
        return self.sender_tp > 1 or self.receiver_tp > 1


MAGIC = 0x5044_534B_5633  # "PDSKV3": a header that does not start with this is not one
MAX_REQ_ID_BYTES = 64
MAX_ENTRIES = 64  # requests one message may carry; a larger step sends several
_ID_WORDS = MAX_REQ_ID_BYTES // 8
_FIXED = 9  # int64 fields before the entries
NO_TOKEN = -1  # a streamed entry whose request does not continue
_ENTRY = 4 + _ID_WORDS  # num_tokens, num_blocks, first_token, id length, id bytes


class HeaderKind(enum.IntEnum):
    HANDOFF = 1
    CLOSE = 2  # the sender is leaving: the receiver stops listening on this channel
    STREAM = 3  # entries now, payload in layer parts as the forward pass writes them
    TRAILER = 4  # ends a STREAM message: each entry's first token (or NO_TOKEN)
    # A live move's first round: each entry's full blocks, sent while the request still
    # runs on the sender. The receiver holds them under the entry's id (blocks reserved
    # on arrival) until a reservation adopts them; the move's final message, a HANDOFF,
    # then carries only the blocks after them.
    PRECOPY = 5


@dataclass(frozen=True)
class HandoffEntry:
    """One request's part of a hand-off message."""

    req_id: str
    num_tokens: int  # tokens of KV the blocks hold (the whole prompt, for a prefill)
    num_blocks: int
    first_token: int  # the token sampled after them: the receiver continues from it

    def __post_init__(self) -> None:
        if len(self.req_id.encode()) > MAX_REQ_ID_BYTES:
            raise ValueError(f"request id longer than {MAX_REQ_ID_BYTES} bytes: {self.req_id!r}")


@dataclass(frozen=True)
class HandoffHeader:
    """The fixed-size message that precedes every payload on a channel."""

    kind: HeaderKind
    seq_no: int
    dst_epoch: int = 0
    src_epoch: int = 0
    entries: tuple[HandoffEntry, ...] = ()
    num_bytes: int = 0  # the whole payload
    posted_at_us: int = 0  # sender's wall clock when the KV was ready (for timings)
    layers_per_part: int = 0  # STREAM: layers in each payload part (the last may hold fewer)

    def __post_init__(self) -> None:
        if len(self.entries) > MAX_ENTRIES:
            raise ValueError(f"{len(self.entries)} entries exceed {MAX_ENTRIES} per message")

    @property
    def num_blocks(self) -> int:
        return sum(e.num_blocks for e in self.entries)

    def parts(self, num_layers: int) -> list[tuple[int, int]]:
        """The payload's parts as layer ranges [start, stop): one part of every layer
        unless the message is streamed."""
        step = self.layers_per_part if self.kind is HeaderKind.STREAM else 0
        step = step if 0 < step < num_layers else num_layers
        return [(start, min(start + step, num_layers)) for start in range(0, num_layers, step)]

    @staticmethod
    def size() -> int:
        """Number of int64 elements of every header."""
        return _FIXED + MAX_ENTRIES * _ENTRY

    def words(self) -> list[int]:
        """The header as its `size()` int64 words, zero-padded."""
        fields = [
            MAGIC,
            int(self.kind),
            self.seq_no,
            self.dst_epoch,
            self.src_epoch,
            len(self.entries),
            self.num_bytes,
            self.posted_at_us,
            self.layers_per_part,
        ]
        for e in self.entries:
            raw = e.req_id.encode()
            padded = raw.ljust(MAX_REQ_ID_BYTES, b"\0")
            fields += [e.num_tokens, e.num_blocks, e.first_token, len(raw)]
            fields += [
                int.from_bytes(padded[i : i + 8], "little", signed=True)
                for i in range(0, MAX_REQ_ID_BYTES, 8)
            ]
        return fields + [0] * (self.size() - len(fields))

    @classmethod
    def from_words(cls, values: Sequence[int]) -> HandoffHeader:
        """Parse a received header's words; raises ValueError when it is not one."""
        if len(values) != cls.size() or values[0] != MAGIC:
            raise ValueError("not a hand-off header: the channel is out of step")
        num_entries = values[5]
        if not 0 <= num_entries <= MAX_ENTRIES:
            raise ValueError("corrupt hand-off header")
        entries = []
        for k in range(num_entries):
            at = _FIXED + k * _ENTRY
            num_tokens, num_blocks, first_token, id_len = values[at : at + 4]
            if not 0 <= id_len <= MAX_REQ_ID_BYTES or num_blocks < 0 or num_tokens < 0:
                raise ValueError("corrupt hand-off header")
            id_bytes = b"".join(
                v.to_bytes(8, "little", signed=True) for v in values[at + 4 : at + _ENTRY]
            )
            entries.append(
                HandoffEntry(id_bytes[:id_len].decode(), num_tokens, num_blocks, first_token)
            )
        return cls(
            kind=HeaderKind(values[1]),
            seq_no=values[2],
            dst_epoch=values[3],
            src_epoch=values[4],
            entries=tuple(entries),
            num_bytes=values[6],
            posted_at_us=values[7],
            layers_per_part=values[8],
        )
