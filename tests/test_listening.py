"""What a service listens on, and from when: its gRPC port answers (NOT_SERVING) within
the first second, while Ray and the workers start; and no process of a one-machine
service (router, Ray, workers) listens beyond loopback, the KV rendezvous store
included."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from bench.harness import REPO, free_port, service_env
from bench.harness.processes import process_alive, process_tree
from bench.harness.service import health_status
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from tests.listening_sockets import listening_sockets
from tests.services import running_service

ANSWERS_WITHIN_S = 1.0


def test_the_port_answers_not_serving_within_a_second_while_ray_starts(tmp_path: Path) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli.main", "serve", "--port", str(port)]
            + ["--metrics-port", "0"],
            cwd=REPO,
            env=service_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        status = None
        while status is None and time.monotonic() - started < 10 and proc.poll() is None:
            status = health_status(address, timeout=1.0)
        answered_after = time.monotonic() - started
        assert status == "NOT_SERVING", (status, log.read_text()[-3000:])
        assert answered_after < ANSWERS_WITHIN_S, f"first answer after {answered_after:.2f} s"
        with grpc.insecure_channel(address) as channel:
            request = pb.GenerateRequest(prompt="hi")
            with pytest.raises(grpc.RpcError) as refused:
                list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=5))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # Stopped while it warms up: the drain, Ray and the workers starting cut short.
        service = process_tree(proc.pid)
        proc.terminate()
        assert proc.wait(30) == 0, log.read_text()[-3000:]
        deadline = time.monotonic() + 10
        while [p for p in service if process_alive(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in service if process_alive(p)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow  # about 25 s: `make test-slow`
def test_no_process_of_a_local_service_listens_beyond_loopback(tmp_path: Path) -> None:
    with running_service([], tmp_path / "serve.log") as svc:
        sockets = listening_sockets(process_tree(svc.proc.pid))
    open_ones = [str(s) for s in sockets if not s.loopback_only]
    assert open_ones == [], open_ones
    # The router's own: gRPC, metrics and the KV store; the workers' call ports.
    assert len([s for s in sockets if s.pid == svc.proc.pid]) >= 3, [str(s) for s in sockets]
