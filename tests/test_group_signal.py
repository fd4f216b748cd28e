"""Stopping a service with streams in flight, the ways service managers stop one.

A SIGTERM to the service's process group (`kill -- -PGID`) reaches the router alone:
the local Ray runs in a session of its own, so the drain runs as for a SIGTERM to the
router, and Ray stops after it. A stop that signals every process of the service
(systemd's control-group stop) takes Ray down with the router in whatever order the
processes get it: the router notices, ends the streams with their ABORT at once and
exits 0 within seconds, not after Ray's 60 s GCS reconnect timeout."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from bench.harness.stopping import StopResult, stop_fresh_service

# The targets: each stream has its final message within a second of the signal, the
# process exits 0 within five, and nothing of the service is left running.
FINAL_WITHIN_S = 1.0
EXIT_WITHIN_S = 5.0


def _stop(tmp_path: Path, mode: str, drain_grace_s: float) -> tuple[StopResult, str]:
    log = tmp_path / "serve.log"
    result = stop_fresh_service(log, mode, drain_grace_s, rng=random.Random(0))
    return result, log.read_text()


def _assert_fast_clean_stop(result: StopResult, log: str) -> None:
    assert result.exit_code == 0, log[-3000:]
    for stream in result.streams:
        assert stream.num_finals == 1 and stream.num_after_final == 0, stream.outcome
    assert result.worst_final_s < FINAL_WITHIN_S, (result.final_after_s, log[-3000:])
    assert result.exit_after_s < EXIT_WITHIN_S, (result.exit_after_s, log[-3000:])
    assert result.survivors == [], f"still running after the exit: {result.survivors}"
    assert "stopped" in log


@pytest.mark.slow  # about 30 s: `make test-slow`
def test_sigterm_to_the_process_group_drains_and_exits_0_within_seconds(
    tmp_path: Path,
) -> None:
    # The signal reaches the router only: a drain with its grace (short here), after
    # which Ray is stopped by the service, not by the signal.
    result, log = _stop(tmp_path, "group", drain_grace_s=0.5)
    _assert_fast_clean_stop(result, log)
    for stream, before in zip(result.streams, result.tokens_at_signal, strict=True):
        assert stream.outcome == "final:FINISH_REASON_ABORT", stream.outcome
        assert stream.final is not None and "drain grace" in stream.final.error
        # The workers kept decoding through the grace: the signal did not reach them.
        assert len(stream.tokens) > before, (before, len(stream.tokens), log[-3000:])
    assert "went down with the service" not in log  # Ray was not hit by the signal


@pytest.mark.slow  # about 30 s each: `make test-slow`
@pytest.mark.parametrize("mode", ["every-ray-first", "every-router-first"])
def test_sigterm_to_every_process_ends_streams_at_once_and_exits_0(
    tmp_path: Path, mode: str
) -> None:
    # The default grace (30 s): only noticing Ray going down ends the streams in time.
    result, log = _stop(tmp_path, mode, drain_grace_s=30)
    _assert_fast_clean_stop(result, log)
    for stream in result.streams:
        assert stream.outcome == "final:FINISH_REASON_ABORT", (stream.outcome, log[-3000:])
        assert stream.final is not None and stream.final.error, stream.final
