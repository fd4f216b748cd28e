"""A decode worker sends the steps that piled up between two polls as one update per
request; nothing is merged past a finish or across an error. A batch crosses processes
as columns and comes back whole."""

from __future__ import annotations

import pickle
from collections.abc import Callable

import pytest
import ray.cloudpickle

from engine.core.batch import ScheduledSeq, plain_seq
from engine.core.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.wire import (
    KVEvents,
    PhaseReport,
    PoolName,
    TokenBatch,
    TokenUpdate,
    WorkerStats,
    coalesce,
    sampled_update,
)


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


def test_merged_plain_steps_keep_every_token_the_last_finish_and_the_cached_count() -> None:
    steps = [
        sampled_update("a", 1, None, 0, False, 5.0),
        sampled_update("a", 2, None, 16, False, 5.0),
        sampled_update("a", 3, FinishReason.STOP, 16, False, 5.0),
    ]
    (merged,) = coalesce(steps)
    assert merged == TokenUpdate("a", (1, 2, 3), FinishReason.STOP, 16)


@pytest.mark.parametrize("dumps", [pickle.dumps, ray.cloudpickle.dumps], ids=["pickle", "ray"])
def test_a_token_batch_arrives_as_it_was_sent(dumps: Callable[[object], bytes]) -> None:
    updates = (
        TokenUpdate("plain", (1, 2, 3), num_cached_tokens=32),
        TokenUpdate("arrived", (4,), kv_wire_s=0.001, kv_handoff_s=0.003),
        TokenUpdate("empty"),
        TokenUpdate("stopped", (5,), FinishReason.STOP),
        TokenUpdate("failed", finish_reason=FinishReason.ERROR, error="import failed"),
        TokenUpdate("first", (2**40,), phases=PhaseReport(queue_s=0.5), scheduled_at=12.5),
        TokenUpdate("long", tuple(range(1000, 1016)), FinishReason.LENGTH),
        TokenUpdate("handed", (7,), hand_off=True),
        TokenUpdate("aborted", finish_reason=FinishReason.ABORT),
    )
    stats = WorkerStats(PoolName.DECODE, 1, 100, 7, 3, 0, 16, 64)
    batch = TokenBatch(updates, (KVEvents(stored=(11, 12)),), stats)
    back = pickle.loads(dumps(batch))
    # Every field arrives but the worker's own `scheduled_at`, which stays behind.
    sent = TokenBatch(tuple(u._replace(scheduled_at=0.0) for u in updates), batch.kv_events, stats)
    assert back == sent
    assert [type(u) for u in back.updates] == [TokenUpdate] * len(updates)
    assert pickle.loads(dumps(TokenBatch(()))) == TokenBatch(())


@pytest.mark.parametrize("dumps", [pickle.dumps, ray.cloudpickle.dumps], ids=["pickle", "ray"])
def test_a_steps_updates_travel_as_columns_not_an_object_each(
    dumps: Callable[[object], bytes],
) -> None:
    """The engine stamps every update with when its request was first scheduled; that
    must not make a step's plain news travel as one pickled object per request."""
    updates = tuple(
        sampled_update(f"req-{i}", 1000 + i, None, 16, False, 100.0 + i) for i in range(128)
    )
    merged = coalesce([*updates, *(u._replace(new_token_ids=(7,)) for u in updates)])
    for batch in (TokenBatch(updates), TokenBatch(tuple(merged))):
        data = dumps(batch)
        assert b"TokenUpdate" not in data
        back = pickle.loads(data)
        assert [u.req_id for u in back.updates] == [u.req_id for u in updates]
    assert [u.new_token_ids for u in pickle.loads(data).updates] == [
        (1000 + i, 7) for i in range(128)
    ]


def test_the_schedulers_fast_builders_equal_the_named_tuples() -> None:
    """The scheduler builds its per-step sequences and updates without the NamedTuples'
    own constructors; what it builds must be the same value, field for field (a field
    added or moved would break this first)."""
    params = SamplingParams(max_tokens=3, temperature=0.5)
    fast_seq = plain_seq("r", (5, 6), 10, (1, 2, 3), True, params, 7)
    assert fast_seq == ScheduledSeq(
        req_id="r",
        token_ids=(5, 6),
        start_position=10,
        block_table=(1, 2, 3),
        sample=True,
        sampling=params,
        seed=7,
    )
    assert type(fast_seq) is ScheduledSeq and fast_seq.end_position == 12
    fast_update = sampled_update("r", 9, FinishReason.LENGTH, 16, True, 12.5)
    assert fast_update == TokenUpdate(
        req_id="r",
        new_token_ids=(9,),
        finish_reason=FinishReason.LENGTH,
        num_cached_tokens=16,
        hand_off=True,
        scheduled_at=12.5,
    )
    assert type(fast_update) is TokenUpdate and fast_update.error == ""
