"""The soak's verdicts on its two end phases, from made-up results (no service): the only
decode worker killed (each stream completes as undisturbed, and resumes soon after the
replacement is live) and the group SIGTERM (one final message each, a clean, timely
exit, nothing left running)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from bench.harness.stopping import StopResult
from bench.harness.streams import StreamResult, TimedStream
from bench.soak import check_group_stop, check_sole_decode, parse_args, resumed_at
from pdserve.v1 import generation_pb2 as pb

GRACE_S = 10.0


def _stream(num_tokens: int, *finals: int, text: str = "", extra: int = 0) -> StreamResult:
    result = StreamResult(tokens=list(range(num_tokens)), text=text)
    for reason in finals:
        result.final = pb.GenerateResponse(finish_reason=reason)
        result.num_finals += 1
    result.num_after_final = extra
    return result


def _stop(*streams: StreamResult, **changes: Any) -> StopResult:
    clean = StopResult(
        mode="group",
        streams=list(streams),
        final_after_s=[GRACE_S + 0.2] * len(streams),
        exit_code=0,
        exit_after_s=GRACE_S + 1.1,
        survivors=[],
        tokens_at_signal=[3] * len(streams),
    )
    return dataclasses.replace(clean, **changes)


def test_a_clean_group_stop_with_finished_and_aborted_streams_passes() -> None:
    result = _stop(_stream(16, pb.FINISH_REASON_LENGTH), _stream(90, pb.FINISH_REASON_ABORT))
    assert check_group_stop(result, GRACE_S) == []


@pytest.mark.parametrize(
    ("stream", "expected"),
    [
        (_stream(90), "0 final messages"),
        (_stream(90, pb.FINISH_REASON_ABORT, pb.FINISH_REASON_ABORT), "2 final messages"),
        (_stream(90, pb.FINISH_REASON_ABORT, extra=1), "1 after the first"),
        (_stream(90, pb.FINISH_REASON_ERROR), "ended with final:FINISH_REASON_ERROR"),
        # The workers stopped decoding at the signal: the signal reached them.
        (_stream(3, pb.FINISH_REASON_ABORT), "no token during the drain's grace"),
    ],
)
def test_a_stream_without_exactly_one_final_message_fails_the_group_stop(
    stream: StreamResult, expected: str
) -> None:
    wrong = check_group_stop(_stop(_stream(16, pb.FINISH_REASON_LENGTH), stream), GRACE_S)
    assert len(wrong) == 1 and wrong[0].startswith("stream 1") and expected in wrong[0], wrong


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"exit_code": 1}, "exit status 1"),
        ({"exit_code": None}, "exit status None"),
        ({"exit_after_s": GRACE_S + 5.0}, "exited 15.00 s after the signal"),
        ({"survivors": [4242]}, "left running: [4242]"),
        ({"final_after_s": [GRACE_S + 1.0]}, "stream 0 ended 11.00 s after the signal"),
    ],
)
def test_a_late_or_unclean_exit_fails_the_group_stop(
    changes: dict[str, object], expected: str
) -> None:
    result = _stop(_stream(90, pb.FINISH_REASON_ABORT), **changes)
    wrong = check_group_stop(result, GRACE_S)
    assert len(wrong) == 1 and expected in wrong[0], wrong


def test_the_resume_is_the_first_token_after_the_stall_not_one_in_flight_at_the_kill() -> None:
    # Tokens at 1.0 s and 1.2 s; killed at 1.25 s; one already sent arrives at 1.3 s;
    # the replacement's first tokens at 9.4 s.
    arrivals = [(1.0, 8), (1.2, 9), (1.3, 10), (9.4, 11), (9.6, 12)]
    assert resumed_at(arrivals, killed_at=1.25) == 9.4
    assert resumed_at(arrivals[:2], killed_at=1.25) is None


def _timed(text: str, num_tokens: int = 64) -> TimedStream:
    return TimedStream([], _stream(num_tokens, pb.FINISH_REASON_LENGTH, text=text))


def test_the_only_decode_worker_phase_wants_the_undisturbed_stream_resumed_in_time() -> None:
    reference = [_stream(64, pb.FINISH_REASON_LENGTH, text=t) for t in ("a", "b", "c", "d")]
    streams = [_timed("a"), _timed("b", 60), _timed("x"), _timed("d")]
    wrong = check_sole_decode(reference, streams, [0.4, 0.5, 0.3, 2.6], 2.0)
    assert wrong == [
        "stream 1: 60 tokens, undisturbed 64",
        "stream 2: text differs from its undisturbed run",
        "stream 3 resumed 2.60 s after the replacement went live (bound 2 s)",
    ]
    aborted = TimedStream([], _stream(20, pb.FINISH_REASON_ABORT))
    wrong = check_sole_decode(reference[:2], [_timed("a"), aborted], [0.4, None], 2.0)
    assert len(wrong) == 1 and "stream 1 did not complete: final:FINISH_REASON_ABORT" in wrong[0]
    assert check_sole_decode(reference, [_timed(t) for t in "abcd"], [0.1] * 4, 2.0) == []


def test_quick_shortens_the_soak_and_explicit_flags_still_win() -> None:
    assert parse_args([]).duration_s == 600
    quick = parse_args(["--quick", "--calibrate-s", "20"])
    assert (quick.duration_s, quick.kill_every_s, quick.calibrate_s) == (120, 30, 20)
    assert parse_args(["--no-group-stop"]).group_stop is False
