"""The receiving side's book of reservations: which blocks wait for which request's KV.

Plain Python and thread-safe: the worker's event loop reserves, renews and aborts, each
channel's receiving thread claims and completes. Every reservation ends exactly one
way: filled (the request runs), refused/expired/aborted (the caller releases its
blocks). A lease counts from the last sign of progress: the router renews the
reservations of requests still queued or prefilling, so waiting is never a failure.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from engine.wire import GenerationInput, HandoffEntry, Reservation, epoch_hex


@dataclass
class HeldReservation:
    reservation: Reservation
    # The request as the router validated it; decode continues it. None: blocks a live
    # move's pre-copy brought, not yet adopted by the move's reservation.
    inp: GenerationInput | None
    expires_at: float
    importing: bool = False
    aborted: bool = False
    # What the blocks' KV may be written after: the last step the engine had launched
    # when it handed them out (a CUDA event; None on CPU). A step launched later never
    # touches them, so the import waits for that one step, not for whatever runs now.
    writable_after: Any = None


class AbortOutcome(Enum):
    """What aborting a request did to its reservation, and so who frees its blocks."""

    DROPPED = "dropped"  # it was idle and is gone: the caller releases its blocks
    IMPORTING = "importing"  # its bytes are landing: marked, the receiver releases them
    NOT_HELD = "not held"  # nothing reserved under that id (never, or no longer)


NO_RESERVATION = "no reservation (expired, aborted or never made)"
# How long a pre-copy's blocks wait for the move's reservation to adopt them.
PRECOPY_LEASE_S = 30.0


class ReservationBook:
    def __init__(self, epoch: int, block_size: int) -> None:
        self.epoch = epoch
        self.block_size = block_size
        self._held: dict[str, HeldReservation] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def add(
        self,
        inp: GenerationInput,
        reservation: Reservation,
        lease_s: float,
        writable_after: Any = None,
    ) -> None:
        with self._lock:
            self._held[inp.req_id] = HeldReservation(
                reservation, inp, time.monotonic() + lease_s, writable_after=writable_after
            )

    def add_precopy(self, reservation: Reservation, req_id: str, writable_after: Any) -> bool:
        """Hold blocks reserved on a pre-copy's arrival, landing now (`importing`);
        False when the id is held already (the caller releases the blocks)."""
        with self._lock:
            if req_id in self._held:
                return False
            self._held[req_id] = HeldReservation(
                reservation,
                None,
                time.monotonic() + PRECOPY_LEASE_S,
                importing=True,
                writable_after=writable_after,
            )
            return True

    def precopy_landed(self, req_id: str) -> bool:
        """A pre-copy's blocks are in place: they wait for adoption. False when it was
        aborted meanwhile (dropped: the caller releases the blocks)."""
        with self._lock:
            held = self._held.get(req_id)
            if held is None:
                return False
            if held.aborted:
                del self._held[req_id]
                return False
            held.importing = False
            return True

    def precopied(self, req_id: str) -> int | None:
        """Blocks a pre-copy brought for this id and nothing adopted yet; else None."""
        with self._lock:
            held = self._held.get(req_id)
            if held is None or held.inp is not None:
                return None
            return len(held.reservation.block_ids)

    def adopt(
        self, inp: GenerationInput, reservation: Reservation, lease_s: float, writable_after: Any
    ) -> bool:
        """The move's reservation takes over its pre-copy's blocks: `reservation` lists
        them first (`num_precopied`), then blocks for the rest. False when the pre-copy
        is gone (expired or aborted meanwhile)."""
        with self._lock:
            held = self._held.get(inp.req_id)
            if held is None or held.inp is not None or held.aborted:
                return False
            held.reservation = reservation
            held.inp = inp
            held.expires_at = time.monotonic() + lease_s
            held.writable_after = writable_after
            return True

    def claim(
        self, entry: HandoffEntry, dst_epoch: int
    ) -> tuple[HeldReservation | None, str | None]:
        """Match an arriving entry to its reservation and mark it importing; on a
        mismatch (None, reason): its bytes must be drained and discarded."""
        with self._lock:
            if dst_epoch != self.epoch:
                return None, (
                    f"addressed to epoch {epoch_hex(dst_epoch)}, "
                    f"this worker is epoch {epoch_hex(self.epoch)}"
                )
            held = self._held.get(entry.req_id)
            if held is None or held.inp is None:  # a pre-copy waits for its adoption
                return None, NO_RESERVATION
            if held.importing:
                return None, "already importing"
            reserved = held.reservation.block_ids
            needed = -(-entry.num_tokens // self.block_size)
            num_prompt = len(held.inp.prompt_token_ids)
            num_sent = len(reserved) - held.reservation.num_precopied
            if entry.num_blocks != num_sent or needed != len(reserved):
                return None, (
                    f"{entry.num_blocks} blocks for {entry.num_tokens} tokens of KV, "
                    f"{num_sent} of {len(reserved)} reserved expected"
                )
            if entry.num_tokens != num_prompt:
                return None, f"{entry.num_tokens} tokens of KV for a prompt of {num_prompt}"
            held.importing = True
            return held, None

    def complete(self, req_id: str, admit: Callable[[], None]) -> bool:
        """The KV is in place: unless aborted meanwhile, run `admit` (which must enqueue the
        admission on the engine) under the book's lock, so a later abort is ordered after
        it. Returns False when the request was aborted: the caller releases its blocks."""
        with self._lock:
            held = self._held.pop(req_id, None)
            if held is None or held.aborted:
                return False
            admit()
            return True

    def fail(self, req_id: str) -> None:
        """The import failed after claim(): forget it (the caller releases the blocks)."""
        with self._lock:
            self._held.pop(req_id, None)

    def abort(self, req_id: str) -> AbortOutcome:
        """Drop an idle reservation (the caller releases its blocks); an importing one is
        only marked, and dropped when its payload lands (the receiver releases them)."""
        with self._lock:
            held = self._held.get(req_id)
            if held is None:
                return AbortOutcome.NOT_HELD
            if held.importing:
                held.aborted = True
                return AbortOutcome.IMPORTING
            del self._held[req_id]
            return AbortOutcome.DROPPED

    def renew(self, req_ids: list[str], lease_s: float, now: float | None = None) -> int:
        """Push these idle reservations' leases to `lease_s` from now; how many were held."""
        now = time.monotonic() if now is None else now
        renewed = 0
        with self._lock:
            for req_id in req_ids:
                held = self._held.get(req_id)
                if held is not None:
                    held.expires_at = max(held.expires_at, now + lease_s)
                    renewed += 1
        return renewed

    def holds(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._held

    def expire(self, now: float | None = None) -> list[str]:
        """Drop idle reservations past their lease; their blocks must be released."""
        return self._expire(now, precopies=False)

    def expire_precopies(self, now: float | None = None) -> list[str]:
        """Drop pre-copies no reservation adopted within their lease (a move given up
        without an abort reaching here); their blocks must be released."""
        return self._expire(now, precopies=True)

    def _expire(self, now: float | None, precopies: bool) -> list[str]:
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [
                req_id
                for req_id, held in self._held.items()
                if not held.importing and held.expires_at <= now and (held.inp is None) == precopies
            ]
            for req_id in expired:
                del self._held[req_id]
            return expired
