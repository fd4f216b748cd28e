"""The sending side's plan: which ready requests share one message.

Requests whose KV became ready in the same engine step and go to the same peer travel
together: one gather of all their blocks (one `index_select` on the block-major cache),
one header, one payload. NCCL point-to-point runs far below the link for small messages
(about 18 GiB/s at 1 MiB against 260-340 GiB/s from 16 MiB on H100/H200 NVLink), so a
burst of 512-token prompts sent one by one would queue behind per-message costs. A
message is capped in entries (the header's capacity) and in bytes (so the gathered copy
stays a bounded share of device memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.transfer.handoff import MAX_ENTRIES, HandoffEntry, HandoffTarget

MAX_MESSAGE_BYTES = 1 << 30  # past ~256 MiB NCCL is at full speed already


@dataclass(frozen=True)
class ReadyKV:
    """One request whose KV is complete in this worker's blocks."""

    req_id: str
    target: HandoffTarget
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token: int

    def entry(self) -> HandoffEntry:
        return HandoffEntry(self.req_id, self.num_tokens, len(self.block_ids), self.first_token)


@dataclass(frozen=True)
class Message:
    """Requests that travel in one header + payload, in payload order."""

    target: HandoffTarget
    items: tuple[ReadyKV, ...]

    @property
    def block_ids(self) -> list[int]:
        return [b for item in self.items for b in item.block_ids]

    @property
    def entries(self) -> tuple[HandoffEntry, ...]:
        return tuple(item.entry() for item in self.items)


def plan_messages(
    ready: Sequence[ReadyKV],
    block_bytes: int,
    *,
    max_entries: int = MAX_ENTRIES,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> list[Message]:
    """Group one step's ready requests by target, in order, within the caps (a request
    larger than max_bytes still goes, alone)."""
    by_target: dict[HandoffTarget, list[list[ReadyKV]]] = {}
    for item in ready:
        groups = by_target.setdefault(item.target, [[]])
        current = groups[-1]
        size = sum(len(x.block_ids) for x in current) * block_bytes
        if current and (
            len(current) >= max_entries or size + len(item.block_ids) * block_bytes > max_bytes
        ):
            current = []
            groups.append(current)
        current.append(item)
    return [
        Message(target, tuple(group))
        for target, groups in by_target.items()
        for group in groups
        if group
    ]
