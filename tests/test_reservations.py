"""The decode side's reservation book and the hand-off header, without workers or torch
groups: every reservation ends exactly one way, and a header round-trips or is refused."""

from __future__ import annotations

import pytest
import torch

from engine.core.outputs import GenerationInput
from engine.sampling_params import SamplingParams
from engine.transfer.handoff import HandoffHeader, HeaderKind, Reservation
from engine.transfer.reservations import ReservationBook

EPOCH = 0xABC


def _inp(req_id: str, num_tokens: int) -> GenerationInput:
    return GenerationInput(req_id, tuple(range(num_tokens)), SamplingParams(max_tokens=4))


def _book_with(req_id: str = "r", num_tokens: int = 40, lease_s: float = 30.0) -> ReservationBook:
    book = ReservationBook(EPOCH, block_size=16)
    book.add(_inp(req_id, num_tokens), Reservation("decode-0", EPOCH, (7, 3, 9)), lease_s)
    return book


def _header(req_id: str = "r", **changes: object) -> HandoffHeader:
    fields: dict[str, object] = dict(
        kind=HeaderKind.HANDOFF,
        seq_no=0,
        req_id=req_id,
        dst_epoch=EPOCH,
        src_epoch=5,
        dst_block_ids=(7, 3, 9),
        num_bytes=3 * 1024,
        num_computed_tokens=40,
        first_token=11,
    )
    fields.update(changes)
    return HandoffHeader(**fields)  # type: ignore[arg-type]


def test_a_matching_header_is_claimed_then_admitted_once() -> None:
    book = _book_with()
    held, problem = book.claim(_header())
    assert problem is None and held is not None and held.inp.req_id == "r"
    assert book.claim(_header())[1] == "already importing"
    admitted: list[str] = []
    assert book.complete("r", lambda: admitted.append("r"))
    assert admitted == ["r"] and not book.holds("r")


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"dst_epoch": EPOCH + 1}, "epoch"),
        ({"req_id": "other"}, "no reservation"),
        ({"dst_block_ids": (3, 7, 9)}, "not the reserved"),
        ({"num_computed_tokens": 20}, "tokens of KV"),
    ],
)
def test_a_stale_or_mismatched_header_is_refused_and_the_reservation_kept(
    changes: dict[str, object], reason: str
) -> None:
    book = _book_with()
    held, problem = book.claim(_header(**changes))
    assert held is None and problem is not None and reason in problem
    assert book.holds("r")  # the real reservation still waits for its own hand-off


def test_abort_while_importing_drops_the_admission() -> None:
    book = _book_with()
    book.claim(_header())
    assert not book.abort("r")  # importing: only marked, the bytes are still coming
    admitted: list[str] = []
    assert not book.complete("r", lambda: admitted.append("r"))
    assert admitted == [] and not book.holds("r")  # the caller releases the blocks


def test_abort_of_an_idle_reservation_and_lease_expiry() -> None:
    book = _book_with("a")
    assert book.abort("a") and not book.holds("a")
    assert not book.abort("a")  # idempotent
    book.add(_inp("b", 40), Reservation("decode-0", EPOCH, (1, 2, 3)), lease_s=0.0)
    book.add(_inp("c", 40), Reservation("decode-0", EPOCH, (4, 5, 6)), lease_s=0.0)
    book.claim(_header("c", dst_block_ids=(4, 5, 6)))
    assert book.expire() == ["b"]  # "c" is importing: its lease no longer applies
    assert book.holds("c") and len(book) == 1


def test_header_round_trips_and_garbage_is_refused() -> None:
    header = _header(req_id="0123456789abcdef" * 4, seq_no=41)
    raw = header.encode(max_blocks=8)
    assert raw.numel() == HandoffHeader.size(8)
    assert HandoffHeader.decode(raw) == header
    with pytest.raises(ValueError, match="out of step"):
        HandoffHeader.decode(torch.zeros_like(raw))
    with pytest.raises(ValueError, match="exceed"):
        _header(dst_block_ids=tuple(range(9))).encode(8)
    with pytest.raises(ValueError, match="longer than"):
        _header(req_id="x" * 65).encode(8)
