"""The sending side's plan: which ready requests share one message.

Requests whose KV became ready in the same engine step and go to the same peer travel
together: one gather of all their blocks (one `index_select` on the block-major cache),
one header, one payload. NCCL point-to-point runs far below the link for small messages
(a MiB moves an order of magnitude slower than tens of MiB over NVLink), so a burst of
512-token prompts sent one by one would queue behind per-message costs. A
message is capped in entries (the header's capacity) and in bytes (so the gathered copy
stays a bounded share of device memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.wire import MAX_ENTRIES, HandoffEntry, HandoffTarget

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
    def num_tokens(self) -> int:
        """Prompt tokens whose KV it carries."""
        return sum(item.num_tokens for item in self.items)

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
    groups: dict[HandoffTarget, list[list[ReadyKV]]] = {}
    open_bytes: dict[HandoffTarget, int] = {}  # bytes of each target's last group
    for item in ready:
        target_groups = groups.setdefault(item.target, [[]])
        item_bytes = len(item.block_ids) * block_bytes
        size = open_bytes.get(item.target, 0)
        if target_groups[-1] and (
            len(target_groups[-1]) >= max_entries or size + item_bytes > max_bytes
        ):
            target_groups.append([])
            size = 0
        target_groups[-1].append(item)
        open_bytes[item.target] = size + item_bytes
    return [
        Message(target, tuple(group))
        for target, target_groups in groups.items()
        for group in target_groups
        if group
    ]
