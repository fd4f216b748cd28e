"""bench.load as a user runs it: a clear error for a dead target, lengths in the report,
only requests that ran to their end counted as completed, fresh prompts on every run."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import grpc
import pytest

from bench.harness import wait_until_async
from bench.load import main, parse_args, run_load, summarize
from engine.core.request import FinishReason
from router.edge.grpc_server import GrpcServer
from router.serving.errors import QueueFullError
from tests.fake_core import FakeCore, run_with_server


async def run_main(argv: list[str]) -> int:
    """bench.load's main (it runs its own event loop) on a worker thread."""
    return await asyncio.get_running_loop().run_in_executor(None, main, argv)


def test_dead_target_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{s.getsockname()[1]}"
    rc = main(["--target", target, "--concurrency", "1", "--connect-timeout", "0.5"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip() == (
        f"bench.load: cannot connect to {target} within 0.5 s (is `pdserve serve` running there?)"
    )


def test_report_shows_the_lengths_it_used(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--concurrency", "2", "--num-requests", "4", "--prompt-len", "3:8"]
    argv += ["--output-len", "5"]

    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        assert await run_main(["--target", server.address, *argv]) == 0

    run_with_server(FakeCore(num_chunks=5), body)
    out = capsys.readouterr().out
    assert "requests          4/4 completed\n" in out
    assert "lengths           prompt 3-8 tokens (mean " in out
    assert "output 5-5 tokens (mean 5)" in out


def test_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # the help's lines re-wrapped
    assert text.startswith("usage: python -m bench.load ")
    for default in (
        "router HOST:PORT (default: 127.0.0.1:50051)",
        "requests sent in all (default: 100)",
        "MIN:MAX tokens (default: 128:512)",
        "MIN:MAX tokens (default: 64:128)",
        "(default: 1000:30000)",
        "per-request deadline, s (default: 120.0)",
        "(connections) (default: 1)",
    ):
        assert default in text
    # What is off unless given says so in its own words, not "(default: None)".
    assert "(default: None)" not in text and "(default: False)" not in text


def test_goodput_line_says_what_it_counted(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--concurrency", "2", "--num-requests", "2", "--prompt-len", "3", "--output-len", "2"]
    lines: dict[str, str] = {}

    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        for name, slos in (
            ("none", []),
            ("both", ["--ttft-slo", "0.5", "--tpot-slo", "0.05"]),
        ):
            assert await run_main(["--target", server.address, *argv, *slos]) == 0
            (lines[name],) = [
                line for line in capsys.readouterr().out.splitlines() if line.startswith("goodput")
            ]

    run_with_server(FakeCore(num_chunks=2), body)
    assert lines["none"].endswith(
        "req/s (no --ttft-slo or --tpot-slo: every completed request, = request tput)"
    )
    assert lines["both"].endswith("req/s (completed with TTFT <= 500 ms and TPOT <= 50 ms)")


def test_every_request_is_counted_with_exact_lengths() -> None:
    argv = ["--rate", "200", "--concurrency", "4", "--num-requests", "12"]
    argv += ["--prompt-len", "3:8", "--output-len", "5", "--ttft-slo", "5"]

    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        args = parse_args(["--target", server.address, *argv])
        summary = summarize(await run_load(args), args)
        assert summary["num_completed"] == 12 and summary["not_completed"] == {}
        assert summary["outcomes"] == {"length": 12}
        # The fake streams num_chunks tokens whatever max_tokens says.
        assert summary["total_output_tokens"] == 12 * core.num_chunks
        assert summary["goodput"] == pytest.approx(summary["request_throughput"])
        assert len(core.calls) == 12
        assert all(
            c.prompt_token_ids is not None and 3 <= len(c.prompt_token_ids) <= 8 for c in core.calls
        )
        assert all(c.sampling.ignore_eos and c.sampling.max_tokens == 5 for c in core.calls)

    run_with_server(FakeCore(num_chunks=5, delay_s=0.001), body)


def test_only_stop_and_length_count_as_completed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ABORT and ERROR finals and refused calls are failures, shown by reason; their
    partial outputs enter no throughput, TPOT or goodput figure."""
    script: list[FinishReason | Exception] = [
        FinishReason.LENGTH,
        FinishReason.ABORT,
        FinishReason.STOP,
        QueueFullError("queue full"),
        FinishReason.ERROR,
        FinishReason.LENGTH,
        FinishReason.ABORT,
        FinishReason.LENGTH,
    ]
    out = tmp_path / "run.json"
    argv = ["--concurrency", "1", "--num-requests", "8", "--prompt-len", "4"]
    argv += ["--output-len", "3", "--ttft-slo", "60", "--out", str(out)]

    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        assert await run_main(["--target", server.address, *argv]) == 1

    run_with_server(FakeCore(num_chunks=3, script=script), body)
    table = capsys.readouterr().out
    assert (
        "requests          4/8 completed; not completed: ABORT 2, ERROR 1, RESOURCE_EXHAUSTED 1"
    ) in table
    summary = json.loads(out.read_text())["summary"]
    assert summary["outcomes"] == {
        "ABORT": 2,
        "ERROR": 1,
        "RESOURCE_EXHAUSTED": 1,
        "length": 3,
        "stop": 1,
    }
    # The aborted and errored calls streamed their 3 chunks too: none of them count.
    assert summary["total_output_tokens"] == 4 * 3
    assert summary["request_throughput"] == pytest.approx(4 / summary["duration_s"])
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])


def test_server_stopped_mid_run_is_not_reported_as_success(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    argv = ["--concurrency", "4", "--num-requests", "20", "--prompt-len", "4"]
    argv += ["--output-len", "20", "--out", str(out)]
    core = FakeCore(num_chunks=20, delay_s=0.01)

    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        run = asyncio.ensure_future(run_main(["--target", server.address, *argv]))
        # Stop once some requests completed and others are streaming: those get ABORT.
        await wait_until_async(
            lambda: core.num_completed >= 1 and len(core.calls) - core.num_closed >= 2, 10
        )
        await server.stop(grace=0)
        assert await run == 1

    run_with_server(core, body)
    summary = json.loads(out.read_text())["summary"]
    completed, failed = summary["num_completed"], summary["not_completed"]
    assert 1 <= completed < 20
    assert failed.get("ABORT", 0) >= 2
    assert completed + sum(failed.values()) == 20
    assert summary["total_output_tokens"] == completed * 20  # no partial output counted


def test_prompts_are_fresh_per_run_unless_seeded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--concurrency", "2", "--num-requests", "4", "--prompt-len", "8"]
    argv += ["--output-len", "2"]
    core = FakeCore(num_chunks=2, cached_prompt_tokens=2)
    runs: list[set[tuple[int, ...]]] = []
    out = tmp_path / "run.json"

    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        for extra in ([], [], ["--seed", "7"], ["--seed", "7", "--out", str(out)]):
            before = len(core.calls)
            assert await run_main(["--target", server.address, *argv, *extra]) == 0
            runs.append({tuple(c.prompt_token_ids or ()) for c in core.calls[before:]})

    run_with_server(core, body)
    assert runs[0].isdisjoint(runs[1])  # two unseeded runs: no prompt in common
    assert runs[2] == runs[3] and len(runs[2]) == 4  # the same seed: the same prompts
    record = json.loads(out.read_text())
    assert record["config"]["seed"] == 7 and record["summary"]["seed"] == 7
    # 2 of every 8 prompt tokens were cached, as the final messages' usage said.
    assert record["summary"]["cached_prompt_share"] == pytest.approx(0.25)
    assert record["provenance"]["command"].startswith("python -m bench.load --target ")
    table = capsys.readouterr().out
    assert "prompts           seed 7 (--seed 7 sends them again); 25.0% of prompt tokens" in table


def test_the_suite_splits_time_to_first_token_at_the_call_being_taken_in() -> None:
    """accept_ms: the client's send to the response headers (the router's handler began);
    the rest of TTFT is the service working on the request."""
    from bench.suite_common import ReqTiming, summarize

    timings = []
    for i in range(5):
        t = ReqTiming(sent_s=10.0 + i, accepted_s=10.0 + i + 0.1 * (i + 1))
        t.add_tokens(10.0 + i + 0.5, 1)
        t.add_tokens(10.0 + i + 0.6, 1)
        timings.append(t)
    run = summarize("c", 5, timings, wall_s=5.0)
    assert abs(run["accept_ms"]["p50"] - 300.0) < 1e-6
    assert abs(run["ttft_ms"]["p50"] - 500.0) < 1e-6


def test_the_suite_reads_a_closed_loop_between_its_ramps() -> None:
    """output_tok_s_mid leaves out the first wave (every slot's prompt queued at once, here
    slow) and the drain after the last send: the rate in between is the loop's own."""
    from bench.suite_common import ReqTiming, summarize

    concurrency, tokens = 2, 10
    timings = []
    # First wave: two requests sent at 0, done at 3 and 5 (a slow, synchronized start).
    for end in (3.0, 5.0):
        t = ReqTiming(sent_s=0.0)
        t.add_tokens(end - 1.0, 1)
        t.add_tokens(end, tokens - 1)
        timings.append(t)
    # Then each slot finishes a request every second: sent at 5..7, done at 6..8.
    for k in range(3):
        for _ in range(concurrency):
            t = ReqTiming(sent_s=5.0 + k)
            t.add_tokens(5.5 + k, 1)
            t.add_tokens(6.0 + k, tokens - 1)
            timings.append(t)
    # The last two, sent at 8, drain slowly: done at 10 and 11.
    for end in (10.0, 11.0):
        t = ReqTiming(sent_s=8.0)
        t.add_tokens(end - 1.0, 1)
        t.add_tokens(end, tokens - 1)
        timings.append(t)
    run = summarize("c", concurrency, timings, wall_s=11.0)
    assert run["output_tok_s"] == pytest.approx(100 / 11.0, abs=0.01)
    # Between the first wave's end (its last request, 5) and the last send (8): 3 rounds
    # of 2 × 10 tokens.
    assert run["output_tok_s_mid"] == pytest.approx(60 / 3.0)
    # One round has no middle.
    first_wave = summarize("c", concurrency, timings[:concurrency], wall_s=5.0)
    assert first_wave["output_tok_s_mid"] is None
