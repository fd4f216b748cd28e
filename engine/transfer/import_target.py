"""What a channel's receiving loop (engine.transfer.receiver) lands KV through: the
worker's side of an import (`ImportTarget`), the other ranks of a tensor-parallel
receiver (`ImportMirror`), and the record of one request's KV in place (`KVArrival`),
which the worker turns into its arrival update, phases and trace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from engine.wire import GenerationInput, HandoffHeader, HeaderKind, Reservation


@dataclass(frozen=True)
class KVArrival:
    """One request's KV in place on the receiver, and how it came (for its timings,
    the phase metrics and its trace)."""

    inp: GenerationInput  # as reserved: it carries the request's trace context
    peer_id: str
    header: HandoffHeader  # the message that carried it (epochs, sequence, entries)
    num_bytes: int  # this request's share of the payload
    wire_s: float  # the message's receive, header read to rows scattered
    handoff_s: float  # from the KV ready on the sender to in place here
    received_at: float  # time.monotonic() here when it was in place
    # Of handoff_s: the sender posting the message's last header (a streamed message's
    # trailer) to this thread reading it; the rest waited for the payload's last bytes.
    signal_s: float = 0.0

    @property
    def streamed(self) -> bool:
        """Sent in parts while the sender's pass ran: its receive time includes waiting
        for that pass, so it says nothing of the channel's speed."""
        return self.header.kind is HeaderKind.STREAM

    @property
    def active_s(self) -> float:
        """Its share, by bytes, of the time the channel spent receiving the message."""
        return self.wire_s * self.num_bytes / max(1, self.header.num_bytes)


class ImportTarget(Protocol):
    """What the receiving loop needs from its worker."""

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of KV (all layers)."""
        ...

    @property
    def num_layers(self) -> int: ...

    def staging(self, num_blocks: int, layers: tuple[int, int]) -> Any:
        """A buffer for layers [start, stop) of num_blocks blocks, where a payload (or
        one part of a streamed one) lands first."""
        ...

    def scatter(
        self,
        block_ids: list[int],
        rows: Any,
        row_ids: list[int] | None,
        layers: tuple[int, int],
        after: list[Any],
    ) -> None:
        """Write staging rows (all, or `row_ids` of them) into layers [start, stop) of
        these blocks, once the engine's work in `after` is done (the reservations'
        `writable_after`)."""
        ...

    def reserve_precopy(
        self, requests: list[tuple[str, int]]
    ) -> list[tuple[Reservation, Any] | None]:
        """Hold blocks for pre-copies' KV, (request id, tokens) each, all at one step
        boundary: per request its blocks and the engine work they must wait for (see
        HeldReservation.writable_after), or None where they do not fit or the id holds
        blocks already. Called from the receiving thread: it may wait for the engine."""
        ...

    def admit(self, inp: GenerationInput, first_token: int) -> None:
        """Queue the request to run from its imported KV (called under the book's lock,
        so an abort issued later is ordered after it; must not block)."""
        ...

    def arrived(self, arrival: KVArrival) -> None:
        """Tell the router the KV is in place (with the receive time)."""
        ...

    def release(self, req_id: str) -> None:
        """Give a reservation's blocks back (any thread)."""
        ...

    def fail(self, req_id: str, error: str) -> None:
        """End a request with an error its router sees (any thread)."""
        ...

    def is_buried(self, req_id: str) -> bool:
        """Was it aborted here (its router is no longer waiting)?"""
        ...


class ImportMirror(Protocol):
    """The other ranks of a tensor-parallel receiver (engine.transfer.tp_parts)."""

    def started(
        self, peer_id: str, seq_no: int, block_ids: list[int], row_ids: list[int]
    ) -> None: ...

    def settled(self, peer_id: str, seq_no: int) -> None: ...
