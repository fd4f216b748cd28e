"""A SIGTERM sent to the service's whole process group (`kill -- -PGID`, systemd's
default stop) reaches Ray's own processes too; the service must still exit at once and
cleanly, not wait out Ray's GCS reconnect timeout (a minute, then a crash)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import REPO, free_port, service_env, wait_until


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


def test_sigterm_to_the_whole_process_group_exits_0_within_seconds(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--port", str(port)]
            + ["--metrics-port", "0"],
            cwd=REPO,
            env=service_env(None),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as under a service manager
        )
    try:
        wait_until(lambda: _serving(port) or proc.poll() is not None, timeout=240)
        assert proc.poll() is None, log.read_text()[-3000:]
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(60)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert elapsed < 10, f"exited after {elapsed:.1f} s"
    assert "stopped" in text
