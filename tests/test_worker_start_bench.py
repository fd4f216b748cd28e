"""bench.worker_start reads a worker's start-up phases from a service's log."""

from __future__ import annotations

import argparse

import pytest

from bench.worker_start import parse_runs, parse_startup_phases

LOG = """\
2026-01-05 10:00:01,002 INFO worker.py:1 -- Started a local Ray instance.
(ColocatedWorker pid=4242) 2026-01-05 10:00:09,120 INFO engine.model.startup_log: start-up: weights 12.41 s (deploy/model_configs/llama-3.1-8b, dummy)
(ColocatedWorker pid=4242) 2026-01-05 10:00:10,500 INFO engine.model.startup_log: start-up: kv_cache 1.38 s (4096 blocks of 16 tokens)
(ColocatedWorker pid=4242) 2026-01-05 10:00:31,000 INFO engine.model.startup_log: start-up: compile 20.50 s
(ColocatedWorker pid=4242) 2026-01-05 10:00:34,000 INFO engine.model.startup_log: start-up: cuda_graphs 3.00 s (batch sizes [1, 2, 4, 8])
(ColocatedWorker pid=4242) 2026-01-05 10:00:34,010 INFO engine.model.startup_log: start-up: engine 37.42 s (worker-0, every phase above)
2026-01-05 10:00:34,300 INFO router: start-up: the pools are up
the weights took 3 s, start-up: nothing to see
"""  # noqa: E501


def test_every_phase_with_its_seconds() -> None:
    assert parse_startup_phases(LOG) == {
        "weights": 12.41,
        "kv_cache": 1.38,
        "compile": 20.5,
        "cuda_graphs": 3.0,
        "engine": 37.42,
    }


def test_the_last_line_of_a_phase_wins() -> None:
    text = "start-up: weights 9.00 s (first try)\nINFO x: start-up: weights 2.50 s\n"
    assert parse_startup_phases(text) == {"weights": 2.5}


def test_no_phases_in_a_log_without_them() -> None:
    assert parse_startup_phases("service exited with 1\nTraceback ...\n") == {}


def test_runs_are_fresh_or_warm() -> None:
    assert parse_runs("fresh, warm,warm") == ["fresh", "warm", "warm"]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_runs("fresh,cold")
