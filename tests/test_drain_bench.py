"""`bench.drain` reads the router's own account of a drain from the service log: each
moved request's pause, the moves, closing the peers' channels and stopping the worker;
and it fails a run whose drain moved nothing, or lost or recomputed a request."""

from __future__ import annotations

import logging

import pytest

from bench.drain import drain_phases, problems


def _router_lines(caplog: pytest.LogCaptureFixture) -> str:
    """The lines, as the router's loggers format them for a drain of two requests."""
    with caplog.at_level(logging.INFO):
        router = logging.getLogger("router.serving.live_migration")
        for req_id, paused_ms in (("a", 32.4), ("b", 66.7)):
            router.info(
                "request %s moved from %s to %s with its KV (%d tokens, %.1f ms paused; "
                "%d bytes for the %d requests sent together)",
                req_id, "decode-1", "decode-0", 1861, paused_ms, 25690112, 2,
            )  # fmt: skip
        router.info("%s: %d of %d requests moved with their KV in %.3f s", "decode-1", 2, 2, 0.121)
        logging.getLogger("router.fleet.pools").info(
            "%s drained and stopped (%d peer channels closed in %.3f s, stopped in %.3f s)",
            "decode-1", 1, 0.552, 0.579,
        )  # fmt: skip
    return "\n".join(
        f"2026-11-27 16:13:28,754 INFO {r.name}: {r.getMessage()}" for r in caplog.records
    )


def test_the_drains_phases_come_from_its_log(caplog: pytest.LogCaptureFixture) -> None:
    phases = drain_phases(_router_lines(caplog))
    assert phases["paused_ms"]["max"] == 66.7
    assert phases["paused_ms"]["p50"] == pytest.approx((32.4 + 66.7) / 2)
    assert phases["moves_s"] == 0.121
    assert (phases["close_peer_channels_s"], phases["stop_worker_s"]) == (0.552, 0.579)


def test_a_log_without_a_drain_gives_nothing() -> None:
    assert drain_phases("2026-11-27 INFO pdserve: pools warm; SERVING\n") == {}


def _summary(**overrides: float) -> dict[str, float]:
    summary = {
        "moved_with_kv": 4.0,
        "moved_by_recompute": 0.0,
        "completed": 8,
        "ended_before_drain": 0,
        "tokens_per_s_per_stream_before": 310.0,
    }
    return {**summary, **overrides}


def test_a_drain_that_moved_every_request_with_its_kv_passes() -> None:
    assert problems(_summary(), num_requests=8, max_tokens=200) == []


def test_a_drain_that_moved_nothing_fails_and_says_to_raise_the_output_tokens() -> None:
    """Every request ended before the drain began: the run measured nothing and must
    not report success."""
    found = problems(_summary(moved_with_kv=0.0, ended_before_drain=8), 8, 1024)
    assert len(found) == 1
    assert "moved no request" in found[0]
    assert "8 of 8 requests had ended before it began" in found[0]
    assert "310 tokens/s" in found[0] and "--max-tokens above 1024" in found[0]


def test_requests_lost_or_moved_by_recompute_fail_the_drain() -> None:
    found = problems(_summary(completed=7, moved_by_recompute=1.0), 8, 200)
    assert found == ["1 of 8 did not complete", "1 requests moved by recompute, not KV"]
