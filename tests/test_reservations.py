"""The receiving side's reservation book and the hand-off header, without workers or torch
groups: every reservation ends exactly one way, and a header round-trips or is refused."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.transfer.handoff import decode_header, encode_header
from engine.transfer.reservations import AbortOutcome, ReservationBook
from engine.wire import (
    MAX_ENTRIES,
    GenerationInput,
    HandoffEntry,
    HandoffHeader,
    HeaderKind,
    Reservation,
)

EPOCH = 0xABC


def _inp(req_id: str, num_tokens: int) -> GenerationInput:
    return GenerationInput(req_id, tuple(range(num_tokens)), SamplingParams(max_tokens=4))


def _book_with(req_id: str = "r", num_tokens: int = 40, lease_s: float = 30.0) -> ReservationBook:
    book = ReservationBook(EPOCH, block_size=16)
    book.add(_inp(req_id, num_tokens), Reservation("decode-0", EPOCH, (7, 3, 9)), lease_s)
    return book


def _entry(
    req_id: str = "r", num_tokens: int = 40, num_blocks: int = 3, first_token: int = 11
) -> HandoffEntry:
    return HandoffEntry(req_id, num_tokens, num_blocks, first_token)


def test_a_matching_entry_is_claimed_then_admitted_once() -> None:
    book = _book_with()
    held, problem = book.claim(_entry(), EPOCH)
    assert problem is None and held is not None and held.inp is not None
    assert held.inp.req_id == "r"
    assert book.claim(_entry(), EPOCH)[1] == "already importing"
    admitted: list[str] = []
    assert book.complete("r", lambda: admitted.append("r"))
    assert admitted == ["r"] and not book.holds("r")


@pytest.mark.parametrize(
    ("epoch", "changes", "reason"),
    [
        (EPOCH + 1, {}, "epoch"),
        (EPOCH, {"req_id": "other"}, "no reservation"),
        (EPOCH, {"num_blocks": 2}, "reserved"),
        (EPOCH, {"num_tokens": 20, "num_blocks": 2}, "reserved"),
        (EPOCH, {"num_tokens": 33}, "prompt of 40"),
    ],
)
def test_a_stale_or_mismatched_entry_is_refused_and_the_reservation_kept(
    epoch: int, changes: dict[str, Any], reason: str
) -> None:
    book = _book_with()
    held, problem = book.claim(_entry(**changes), epoch)
    assert held is None and problem is not None and reason in problem
    assert book.holds("r")  # the real reservation still waits for its own hand-off


def test_abort_while_importing_drops_the_admission() -> None:
    book = _book_with()
    book.claim(_entry(), EPOCH)
    assert book.abort("r") is AbortOutcome.IMPORTING  # only marked: bytes still coming
    admitted: list[str] = []
    assert not book.complete("r", lambda: admitted.append("r"))
    assert admitted == [] and not book.holds("r")  # the caller releases the blocks


def test_abort_of_an_idle_reservation_and_lease_expiry() -> None:
    book = _book_with("a")
    assert book.abort("a") is AbortOutcome.DROPPED and not book.holds("a")
    assert book.abort("a") is AbortOutcome.NOT_HELD  # idempotent
    book.add(_inp("b", 40), Reservation("decode-0", EPOCH, (1, 2, 3)), lease_s=0.0)
    book.add(_inp("c", 40), Reservation("decode-0", EPOCH, (4, 5, 6)), lease_s=0.0)
    book.claim(_entry("c"), EPOCH)
    assert book.expire() == ["b"]  # "c" is importing: its lease no longer applies
    assert book.holds("c") and len(book) == 1


def test_a_renewed_lease_outlives_its_first_term() -> None:
    book = _book_with("q", lease_s=1.0)
    now = time.monotonic()
    assert book.renew(["q", "unknown"], lease_s=10.0, now=now + 0.9) == 1
    assert book.expire(now + 5.0) == []  # would have expired at +1 s without the renewal
    assert book.expire(now + 11.0) == ["q"]


def test_header_round_trips_and_garbage_is_refused() -> None:
    entries = (_entry("0123456789abcdef" * 4), _entry("b", num_tokens=7, num_blocks=1))
    header = HandoffHeader(
        HeaderKind.HANDOFF, 41, EPOCH, 5, entries, num_bytes=4096, posted_at_us=123
    )
    raw = encode_header(header)
    assert raw.numel() == HandoffHeader.size()
    assert decode_header(raw) == header
    assert header.num_blocks == 4
    with pytest.raises(ValueError, match="out of step"):
        decode_header(torch.zeros_like(raw))
    with pytest.raises(ValueError, match="exceed"):
        HandoffHeader(HeaderKind.HANDOFF, 0, entries=(_entry(),) * (MAX_ENTRIES + 1))
    with pytest.raises(ValueError, match="longer than"):
        _entry(req_id="x" * 65)


def test_a_headers_bytes_stay_as_they_were() -> None:
    """Both ends of a channel parse the same bytes: a header's encoding never changes
    (the digest of a header of every kind of field, as first encoded)."""
    entries = (HandoffEntry("req-é-1", 100, 7, 42), HandoffEntry("x" * 64, 3, 1, -1))
    header = HandoffHeader(
        HeaderKind.STREAM, 7, 123456789, 987654321, entries, 4096, 17 * 10**14, 3
    )
    raw = encode_header(header)
    assert raw.dtype == torch.int64 and raw.shape == (777,)
    digest = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
    assert digest == "0e310c6b0a12f20737ad868d3bbbdf5d5eaada7ef4c8ea1ff84e2238fd9514cd"
    assert decode_header(raw) == header
