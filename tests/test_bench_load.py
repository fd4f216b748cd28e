"""bench.load as a user runs it: a clear error for a dead target, lengths in the report."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from bench.load import main
from router.grpc_server import GrpcServer
from tests.test_servicer import FakeCore, run_with_server


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
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, main, ["--target", server.address, *argv]) == 0

    run_with_server(FakeCore(num_chunks=5), body)
    out = capsys.readouterr().out
    assert "lengths           prompt 3-8 tokens (mean " in out
    assert "output 5-5 tokens (mean 5)" in out
