"""`pdserve serve` as a real subprocess on loopback, for end-to-end tests and benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.harness.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def service_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a service: local Ray without token auth or usage
    reports, unbuffered output (so a log read after a failure is complete)."""
    env = dict(os.environ)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **(extra or {})}


def health_status(address: str, timeout: float = 2.0) -> str | None:
    """The overall health status at `address` ("SERVING", "NOT_SERVING"), None if it
    does not answer. A channel of its own each time: a reused one would wait out its
    reconnect backoff after a refused connection."""
    try:
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    except grpc.RpcError:
        return None


class ServiceProcess:
    """`python -m router.cli.main serve --port <free> ARGS`; stdout and stderr go to `log_path`.

    Unless ARGS name one, the service gets a free metrics port of its own, so services
    (and a `make run` on the default port) can run side by side. `new_session`: in a
    session and process group of its own, as a service manager starts it, so that a
    signal to its group (`os.killpg(proc.pid, ...)`) does not reach the caller.
    """

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        *,
        new_session: bool = False,
    ) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        if "--metrics-port" not in args:
            args = ["--metrics-port", str(free_port()), *args]
        self.args = args
        self.metrics_port = int(args[args.index("--metrics-port") + 1])
        self.log_path = log_path
        self.health_seen: list[str] = []  # each health status seen, once per change
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli.main", "serve", "--port", str(self.port), *args],
            cwd=REPO,
            env=service_env(env),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )

    def log_tail(self, n: int = 4000) -> str:
        """The last `n` bytes of the service's log."""
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def health(self) -> str | None:
        """The overall health status ("SERVING", "NOT_SERVING"), None if not answering."""
        return health_status(self.address)

    def wait_serving(self, timeout: float = 300.0) -> float:
        """Poll health until SERVING; return the seconds since the process started.

        Raises RuntimeError with the log's tail if the process exits first, and
        TimeoutError (after stopping it) if it is not SERVING within `timeout`.
        """
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
                return time.perf_counter() - self.started
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"service not SERVING after {timeout:g} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 90.0) -> int:
        """SIGTERM, wait up to `timeout` for a clean exit (else SIGKILL); the exit code.

        Idempotent: a second call returns the same code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class ServiceExitError(AssertionError):
    """A service did not exit with 0 on SIGTERM (the drain or the shutdown failed)."""


@contextmanager
def service_process(
    args: list[str], log_path: Path, *, env: dict[str, str] | None = None, new_session: bool = False
) -> Iterator[ServiceProcess]:
    """A started service (not yet waited for: call `wait_serving`) for the `with` block,
    stopped after it (unless the block stopped it); ServiceExitError (with the log's tail)
    if it then does not exit 0. An error inside the block wins over that."""
    svc = ServiceProcess(args, log_path, env=env, new_session=new_session)
    try:
        yield svc
    except BaseException:
        svc.stop()
        raise
    code = svc.stop()
    if code != 0:
        raise ServiceExitError(f"service exited with {code} on SIGTERM:\n{svc.log_tail()}")
