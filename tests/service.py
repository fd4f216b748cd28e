"""Run `pdserve serve` as a real subprocess on loopback, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def service_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class ServiceProcess:
    """`python -m router.cli serve` with the given flags; logs go to a file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Each service gets its own metrics port, so services (and `make run`) can coexist.
        if "--metrics-port" not in args:
            args = ["--metrics-port", str(free_port()), *args]
        self.metrics_port = int(args[args.index("--metrics-port") + 1])
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--port", str(self.port), *args],
            cwd=REPO,
            env={**service_env(), **(env or {})},
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.health_seen: list[str] = []

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def health(self) -> str | None:
        try:
            with grpc.insecure_channel(self.address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.RpcError:
            return None

    def wait_serving(self, timeout: float = 300.0) -> None:
        """Poll health until SERVING; fail with the log if the process dies first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"service exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            status = self.health()
            if status is not None and (not self.health_seen or self.health_seen[-1] != status):
                self.health_seen.append(status)
            if status == "SERVING":
                return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"service not SERVING after {timeout}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 90.0) -> int:
        """SIGTERM, then wait for a clean exit; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
