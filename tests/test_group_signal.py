"""A SIGTERM sent to the service's whole process group (`kill -- -PGID`, systemd's
default stop) reaches Ray's own processes too; the service must still exit at once and
cleanly, not wait out Ray's GCS reconnect timeout (a minute, then a crash), and streams
in flight, whose workers can no longer be reached, end with their final ABORT at once
rather than after the drain's grace."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.harness import REPO, free_port, service_env, wait_until, wait_until_async
from bench.harness.streams import StreamResult, generate


def _serving(port: int) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


DRAIN_GRACE_S = 30


@pytest.mark.slow  # about 40 s: `make test-slow`
def test_sigterm_to_the_whole_process_group_exits_0_within_seconds(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--port", str(port)]
            + ["--metrics-port", "0", "--drain-grace-s", str(DRAIN_GRACE_S)],
            cwd=REPO,
            env=service_env(None),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as under a service manager
        )
    try:
        wait_until(lambda: _serving(port) or proc.poll() is not None, timeout=240)
        assert proc.poll() is None, log.read_text()[-3000:]
        streams, start = asyncio.run(_signal_while_streaming(port, proc.pid))
        code = proc.wait(60)
        # From the streams' end (which waits for Ray's own processes to go, a second or
        # more on a loaded machine) the exit is what an idle service's is.
        after_streams = time.monotonic() - start - max(ended for _, ended in streams)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert after_streams < 10, f"exited {after_streams:.1f} s after the streams ended"
    assert "stopped" in text
    for result, ended_after in streams:
        assert result.outcome == "final:FINISH_REASON_ABORT", (result.outcome, text[-3000:])
        assert result.num_finals == 1 and result.num_after_final == 0
        assert result.final is not None and "process group" in result.final.error
        assert ended_after < DRAIN_GRACE_S / 2, f"a stream ended {ended_after:.1f} s after"


async def _signal_while_streaming(
    port: int, pgid: int
) -> tuple[list[tuple[StreamResult, float]], float]:
    """Long streams under way, then SIGTERM to the group: each stream's result and how
    long after the signal it ended; the time of the signal."""
    seen = [0, 0]
    streams = [
        asyncio.ensure_future(
            generate(
                f"127.0.0.1:{port}",
                prompt=f"Count slowly, number {i}:",
                max_tokens=2000,
                ignore_eos=True,
                on_tokens=lambda n, i=i: seen.__setitem__(i, n),
            )
        )
        for i in range(len(seen))
    ]
    await wait_until_async(lambda: min(seen) >= 2, 120, what="both streams under way")
    start = time.monotonic()
    os.killpg(pgid, signal.SIGTERM)
    results = await asyncio.gather(*streams)
    return [(r, r.done_at - start) for r in results], start
