"""The workers' contract with the router (engine/worker/contract.py): each worker kind
answers its own verbs, on its call connection exactly those. mypy checks the signatures
where each class is defined; this checks what a worker's call server will run."""

from __future__ import annotations

import inspect

import pytest

from decode_worker.colocated import ColocatedWorker
from decode_worker.worker import DecodeWorker
from engine.worker.actor import WorkerBase
from engine.worker.contract import (
    COLOCATED_VERBS,
    DECODE_VERBS,
    PREFILL_VERBS,
    WORKER_VERBS,
    verbs,
)
from prefill_worker.worker import PrefillWorker


@pytest.mark.parametrize(
    ("worker", "expected"),
    [
        (PrefillWorker, PREFILL_VERBS),
        (DecodeWorker, DECODE_VERBS),
        (ColocatedWorker, COLOCATED_VERBS),
    ],
)
def test_each_worker_kind_answers_its_own_verbs(
    worker: type[WorkerBase], expected: frozenset[str]
) -> None:
    assert verbs(worker.contract) == expected
    for verb in expected:
        assert inspect.iscoroutinefunction(getattr(worker, verb, None)), f"{worker.__name__}.{verb}"


def test_the_kinds_verbs() -> None:
    assert {"prefill", "next_kv_events", "abort", "load", "connect", "disconnect"} == PREFILL_VERBS
    assert {
        "submit",
        "next_tokens",
        "abort",
        "load",
        "locate",
        "adopt",
        "let_go",
    } == COLOCATED_VERBS
    assert COLOCATED_VERBS < DECODE_VERBS
    assert "prefill" not in DECODE_VERBS
    assert PREFILL_VERBS | DECODE_VERBS == WORKER_VERBS
