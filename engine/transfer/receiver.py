"""The receiving loop of one channel: header, checks, payload, scatter, admit; repeat.

An entry's life here, as named states of the reservation book:
* reserved: the worker allocated its blocks under a lease;
* importing: its header arrived and matched the reservation (epoch, request, tokens,
  blocks); its rows land in a staging buffer, then in the reserved blocks (a streamed
  message: part by part, a few layers each, while the sender's forward pass runs; its
  trailer brings the first tokens);
* admitted: handed to the engine at its next step boundary;
* refused/broken: its rows are drained (the channel stays in step) and dropped, its
  blocks released, and the request ends with an error its router reads as a token
  update.

Plain logic over three seams: a `KVReceiver` (channel or fake), the `ReservationBook`,
and an `ImportTarget` (the worker: staging, scatter, admission, errors; in
engine.transfer.import_target, with the `KVArrival` it reports), so it is tested
without process groups or a model.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import Any

from engine.transfer.base import ChannelClosed, KVReceiver
from engine.transfer.import_target import ImportMirror, ImportTarget, KVArrival
from engine.transfer.reservations import NO_RESERVATION, HeldReservation, ReservationBook
from engine.wire import (
    NO_TOKEN,
    HandoffEntry,
    HandoffHeader,
    HeaderKind,
    Reservation,
)

log = logging.getLogger(__name__)
# A sender may post a request's KV as soon as its prompt ran, while the router's
# reservation call, sent at the same time, is still on its way here: an entry with no
# reservation waits this long for it (or for the request's abort) before it is refused.
RESERVATION_GRACE_S = 2.0
# A streamed message's trailer follows the pass that completes its prompts. A sender
# that has not sent it by then is hung: the message is given up (its requests fail and
# their blocks come back) instead of holding them while the sender lives.
TRAILER_TIMEOUT_S = 60.0


# One entry of a message: its reservation when claimed, else why not.
_Claim = tuple[HandoffEntry, HeldReservation | None, str | None]


def _claimed_rows(claims: list[_Claim]) -> tuple[list[int], list[int], list[Any]]:
    """Where the claimed entries' rows of the payload land: the blocks (past any a
    pre-copy brought, which are there already), the payload rows, in order, and the
    engine work each reservation's blocks must wait for."""
    block_ids: list[int] = []
    row_ids: list[int] = []
    after: list[Any] = []
    row = 0
    for entry, held, _ in claims:
        if held is not None:
            block_ids += held.reservation.block_ids[held.reservation.num_precopied :]
            row_ids += range(row, row + entry.num_blocks)
            if held.writable_after is not None:
                after.append(held.writable_after)
        row += entry.num_blocks
    return block_ids, row_ids, after


def _part_of(buffer: Any, layers: tuple[int, int]) -> Any:
    """The front of a staging buffer ([blocks, widest part's layers, ...]) shaped for the
    part `layers`: contiguous, as a receive wants it."""
    width = layers[1] - layers[0]
    if buffer.shape[1] == width:
        return buffer
    shape = (buffer.shape[0], width, *buffer.shape[2:])
    return buffer.view(-1)[: math.prod(shape)].view(shape)


class ChannelReceiver:
    """Drives one KVReceiver until the peer leaves or the channel breaks."""

    def __init__(
        self,
        channel: KVReceiver,
        book: ReservationBook,
        target: ImportTarget,
        reservation_grace_s: float = RESERVATION_GRACE_S,
        trailer_timeout_s: float = TRAILER_TIMEOUT_S,
        mirror: ImportMirror | None = None,
    ) -> None:
        self.channel = channel
        # Tensor-parallel groups: the other parts of each message, landed by this verdict
        # (engine.transfer.tp_parts); None when the whole message comes on this channel.
        self.mirror = mirror
        self.book = book
        self.target = target
        self.reservation_grace_s = reservation_grace_s
        self.trailer_timeout_s = trailer_timeout_s
        self.expected_seq = 0
        self._last_header_at = 0.0  # time.time() when the last header was read

    def run(self) -> None:
        """Receive until the channel ends; then close this end."""
        while not self.channel.closed:
            try:
                header = self.channel.recv_header()
                self._last_header_at = time.time()
            except ChannelClosed:
                break
            except Exception as exc:  # noqa: BLE001 - the peer died or the channel broke
                if not self.channel.closed:
                    log.warning("channel from %s broke: %s", self.channel.peer_id, exc)
                break
            if header.seq_no != self.expected_seq:
                log.error(
                    "channel from %s out of step: header %d, expected %d; closing it",
                    self.channel.peer_id,
                    header.seq_no,
                    self.expected_seq,
                )
                break
            self.expected_seq += 1
            if not self.receive(header):
                break
        self.channel.close(notify_peer=False)

    def receive(self, header: HandoffHeader) -> bool:
        """One message; False when the channel can no longer be trusted."""
        if not self._fits_layout(header):
            return False
        if header.kind is HeaderKind.PRECOPY:
            return self._receive_precopy(header)
        deadline = time.monotonic() + self.reservation_grace_s
        claims: list[_Claim] = [
            (entry, *self._claim(entry, header.dst_epoch, deadline)) for entry in header.entries
        ]
        block_ids, row_ids, after = _claimed_rows(claims)
        posted = time.perf_counter()
        if self.mirror is not None:
            self.mirror.started(self.channel.peer_id, header.seq_no, block_ids, row_ids)
        try:
            first_tokens, posted_at_us = self._land(header, block_ids, row_ids, after)
        except Exception as exc:  # noqa: BLE001 - the peer died mid-payload
            held = [entry.req_id for entry, claimed, _ in claims if claimed is not None]
            self._broke_off(header, held, f"KV hand-off broke off: {exc}")
            return False
        self._conclude(header, claims, first_tokens, time.perf_counter() - posted, posted_at_us)
        return True

    def _fits_layout(self, header: HandoffHeader) -> bool:
        """Does the message's byte count match its blocks? If not, nothing of it can be
        trusted: its requests are refused and the channel is given up."""
        expected_bytes = header.num_blocks * self.target.block_bytes
        if header.num_bytes == expected_bytes:
            return True
        log.error(
            "%s from %s: %d bytes for %d blocks of %d bytes; closing",
            header.kind.name,
            self.channel.peer_id,
            header.num_bytes,
            header.num_blocks,
            self.target.block_bytes,
        )
        if header.kind is not HeaderKind.PRECOPY:  # no request waits on a pre-copy
            for entry in header.entries:
                self._refuse(entry, "byte count does not match the layout")
        if self.mirror is not None:  # the other parts land nowhere
            self.mirror.started(self.channel.peer_id, header.seq_no, [], [])
        return False

    def _land(
        self, header: HandoffHeader, block_ids: list[int], row_ids: list[int], after: list[Any]
    ) -> tuple[list[int], int]:
        """Receive the message's payload into the claimed blocks; each entry's first token
        and when the sender had the KV ready.

        Drained even when refused (the channel stays in step); scattered into the
        reserved blocks right behind each receive when accepted. Every part is posted at
        once, through one buffer sized for the widest (each receive is ordered after the
        scatter before it), and waited for once: no wake-up of this thread per part (each
        may wait for the interpreter's lock under load)."""
        parts = header.parts(self.target.num_layers)
        buffer = self.target.staging(header.num_blocks, (0, max(b - a for a, b in parts)))
        for layers in parts:
            part = _part_of(buffer, layers)
            self._receive_part(part, layers, block_ids, row_ids, after, wait=False)
        first_tokens, posted_at_us = self._first_tokens(header)
        self.channel.settle()
        self._settle_parts(header)
        return first_tokens, posted_at_us

    def _conclude(
        self,
        header: HandoffHeader,
        claims: list[_Claim],
        first_tokens: list[int],
        wire_s: float,
        posted_at_us: int,
    ) -> None:
        """The message is in: each entry refused, dropped (its first token ended it) or
        admitted, with its arrival's timings."""
        received_at = time.monotonic()
        # Sender's clock to ours: exact on one node, as good as the clocks across nodes.
        # A streamed message's KV was mostly here before its first token was sampled:
        # what counts is how long after that the rest arrived.
        since_ready = time.time() - posted_at_us / 1e6
        streamed = header.kind is HeaderKind.STREAM
        handoff_s = max(0.0, since_ready) if streamed else max(wire_s, since_ready)
        signal_s = min(handoff_s, max(0.0, self._last_header_at - posted_at_us / 1e6))
        for (entry, held, problem), first_token in zip(claims, first_tokens, strict=True):
            if held is None:
                log.warning("refused hand-off of %s: %s", entry.req_id, problem)
                self._refuse(entry, problem or "refused")
            elif first_token == NO_TOKEN:  # its first token ended it: nothing to decode
                self.book.fail(entry.req_id)
                self.target.release(entry.req_id)
            else:
                num_bytes = entry.num_blocks * self.target.block_bytes
                assert held.inp is not None  # claimed: adopted, not a bare pre-copy
                arrival = KVArrival(
                    held.inp,
                    self.channel.peer_id,
                    header,
                    num_bytes,
                    wire_s,
                    handoff_s,
                    received_at,
                    signal_s,
                )
                self._admit(held, replace(entry, first_token=first_token), arrival)

    def _broke_off(self, header: HandoffHeader, held: list[str], error: str | None) -> None:
        """A message broke off mid-payload: its held requests fail (with `error` to their
        router, unless None), and their blocks go back once nothing lands in them."""
        for req_id in held:
            self.book.fail(req_id)
            if error is not None:
                self.target.fail(req_id, error)
        self._drain_broken()
        self._settle_parts(header)
        for req_id in held:
            self.target.release(req_id)

    def _receive_precopy(self, header: HandoffHeader) -> bool:
        """A live move's first round: hold each entry's blocks under its id, reserved
        now; nothing is admitted (the move's HANDOFF message follows). An entry that
        finds no room or an id in use is drained and dropped: the move then sends it
        whole."""
        held: list[str] = []
        block_ids: list[int] = []
        row_ids: list[int] = []
        after: list[Any] = []
        row = 0
        wanted = [
            (e.req_id, e.num_tokens)
            for e in header.entries
            if header.dst_epoch == self.book.epoch and not self.book.holds(e.req_id)
        ]
        made_for: dict[str, tuple[Reservation, Any] | None] = {}
        try:
            made_for = dict(
                zip((r for r, _ in wanted), self.target.reserve_precopy(wanted), strict=True)
            )
        except Exception as exc:  # noqa: BLE001 - the engine is gone: drain it all
            log.warning("pre-copy from %s not held: %s", self.channel.peer_id, exc)
        for entry in header.entries:
            made = made_for.get(entry.req_id)
            if made is not None:
                reservation, writable_after = made
                if self.book.add_precopy(reservation, entry.req_id, writable_after):
                    held.append(entry.req_id)
                    block_ids += reservation.block_ids
                    row_ids += range(row, row + entry.num_blocks)
                    if writable_after is not None:
                        after.append(writable_after)
                else:
                    self.target.release(entry.req_id)
            row += entry.num_blocks
        if self.mirror is not None:
            self.mirror.started(self.channel.peer_id, header.seq_no, block_ids, row_ids)
        try:
            layers = (0, self.target.num_layers)
            buffer = self.target.staging(header.num_blocks, layers)
            self._receive_part(buffer, layers, block_ids, row_ids, after)
            self._settle_parts(header)
        except Exception as exc:  # noqa: BLE001 - the peer died mid-payload
            log.warning("pre-copy from %s broke off: %s", self.channel.peer_id, exc)
            self._broke_off(header, held, None)  # no request waits on a pre-copy
            return False
        for req_id in held:
            if not self.book.precopy_landed(req_id):  # aborted while landing
                self.target.release(req_id)
        return True

    def _settle_parts(self, header: HandoffHeader) -> None:
        """Wait until every other part of the message has landed or failed: only then
        may its blocks be admitted or given back."""
        if self.mirror is not None:
            self.mirror.settled(self.channel.peer_id, header.seq_no)

    def _drain_broken(self) -> None:
        """After a message broke off: close the channel (which ends the receives still
        pending on it) and wait for what was posted, so no part lands in blocks after
        they went back to the pool and on to another request."""
        self.channel.close(notify_peer=False)
        try:
            self.channel.settle()
        except Exception as exc:  # noqa: BLE001 - the device reports the aborted receive
            log.warning("channel from %s: draining its receives: %s", self.channel.peer_id, exc)

    def _receive_part(
        self,
        staging: Any,
        layers: tuple[int, int],
        block_ids: list[int],
        row_ids: list[int],
        after: list[Any],
        wait: bool = True,
    ) -> None:
        def scatter() -> None:
            if block_ids:
                rows = None if len(row_ids) == staging.shape[0] else row_ids
                self.target.scatter(block_ids, staging, rows, layers, after)

        self.channel.recv_into(staging, scatter, wait=wait)

    def _first_tokens(self, header: HandoffHeader) -> tuple[list[int], int]:
        """Each entry's first token and when the sender had the KV ready: from the
        header, or for a streamed message from its trailer (checked against it)."""
        if header.kind is not HeaderKind.STREAM:
            return [e.first_token for e in header.entries], header.posted_at_us
        try:
            trailer = self.channel.recv_header(self.trailer_timeout_s)
            self._last_header_at = time.time()
        except ChannelClosed:
            raise
        except Exception as exc:
            raise RuntimeError(
                f"waiting for its trailer (at most {self.trailer_timeout_s:g} s): {exc}"
            ) from exc
        ids = [e.req_id for e in trailer.entries]
        if (
            trailer.kind is not HeaderKind.TRAILER
            or trailer.seq_no != header.seq_no
            or ids != [e.req_id for e in header.entries]
        ):
            raise ValueError(
                f"streamed message {header.seq_no} ended by {trailer.kind.name} "
                f"{trailer.seq_no} for {len(ids)} entries: out of step"
            )
        return [e.first_token for e in trailer.entries], trailer.posted_at_us

    def _claim(
        self, entry: HandoffEntry, dst_epoch: int, deadline: float
    ) -> tuple[HeldReservation | None, str | None]:
        held, problem = self.book.claim(entry, dst_epoch)
        while (
            problem == NO_RESERVATION
            and not self.target.is_buried(entry.req_id)
            and time.monotonic() < deadline
        ):
            time.sleep(0.0005)
            held, problem = self.book.claim(entry, dst_epoch)
        return held, problem

    def _refuse(self, entry: HandoffEntry, problem: str) -> None:
        if not self.target.is_buried(entry.req_id):
            self.target.fail(entry.req_id, f"KV hand-off refused: {problem}")

    def _admit(self, held: HeldReservation, entry: HandoffEntry, arrival: KVArrival) -> None:
        def admit() -> None:
            self.target.admit(arrival.inp, entry.first_token)

        if self.book.complete(entry.req_id, admit):
            self.target.arrived(arrival)
        else:  # aborted while its bytes were on the wire
            self.target.release(entry.req_id)
