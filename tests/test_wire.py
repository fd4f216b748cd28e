"""A decode worker sends the steps that piled up between two polls as one update per
request; nothing is merged past a finish or across an error."""

from __future__ import annotations

from engine.core.request import FinishReason
from engine.wire import PhaseReport, TokenUpdate, coalesce


def test_each_requests_steps_become_one_update_in_first_arrival_order() -> None:
    updates = [
        TokenUpdate("a", kv_wire_s=0.001, kv_handoff_s=0.002),
        TokenUpdate("b", (1,)),
        TokenUpdate("a", (10,)),
        TokenUpdate("b", (2,), num_cached_tokens=16),
        TokenUpdate("a", (11,), FinishReason.LENGTH),
    ]
    merged = coalesce(updates)
    assert [u.req_id for u in merged] == ["a", "b"]
    a, b = merged
    assert a.new_token_ids == (10, 11) and a.finish_reason is FinishReason.LENGTH
    assert a.kv_wire_s == 0.001 and a.kv_handoff_s == 0.002
    assert b.new_token_ids == (1, 2) and b.num_cached_tokens == 16 and b.finish_reason is None


def test_an_error_or_a_finish_ends_a_run() -> None:
    updates = [
        TokenUpdate("a", (1,)),
        TokenUpdate("a", finish_reason=FinishReason.ERROR, error="refused"),
        TokenUpdate("a", (2,)),  # a later attempt reusing nothing: kept apart
    ]
    merged = coalesce(updates)
    assert [(u.new_token_ids, u.finish_reason) for u in merged] == [
        ((1,), None),
        ((), FinishReason.ERROR),
        ((2,), None),
    ]
    assert merged[1].error == "refused"


def test_phases_of_merged_steps_are_all_kept() -> None:
    arrival = PhaseReport(transfer_s=0.002, wire_bytes=4096, wire_s=0.001)
    first = PhaseReport(admission_s=0.01, first_step_s=0.02)
    updates = [
        TokenUpdate("a", kv_wire_s=0.001, kv_handoff_s=0.002, phases=arrival),
        TokenUpdate("a", (10,), phases=first),
        TokenUpdate("a", (11,)),
    ]
    (merged,) = coalesce(updates)
    assert merged.phases == PhaseReport(
        transfer_s=0.002,
        wire_bytes=4096,
        wire_s=0.001,
        admission_s=0.01,
        first_step_s=0.02,
    )
    assert coalesce([TokenUpdate("b", (1,)), TokenUpdate("b", (2,))])[0].phases is None
