"""A one-machine service's Ray instance, in a session of its own.

Ray started by `ray.init` inside the router would be the router's children, in its
process group: a signal to the service's group (`kill -- -PGID`, a terminal) would take
down Ray's GCS, raylet and the workers along with it, mid-drain, in whatever order the
kernel delivers it. So the router starts Ray from a small process of its own session
(`python -m router.fleet.local_ray NUM_CPUS`) and joins it as a driver: a signal to the
service's group reaches the router alone, which drains and then stops Ray itself.

The launcher writes Ray's GCS address on its stdout and keeps Ray up until its stdin
closes: a router that dies in any way (SIGKILL included) closes it, so Ray never
outlives the service. The router itself, once its workers are stopped, ends Ray with
SIGTERM to its whole session. A stop that signals every
process anyway (systemd's control-group stop) still takes Ray down with the router:
`router.fleet.local_watch` notices that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from router.fleet.daemon_calls import call_in_daemon_thread

log = logging.getLogger(__name__)

# Ray's processes exit within a second or so of SIGTERM; past this they are killed
# outright (the service is going away, and nothing of a local Ray is kept).
STOP_RAY_S = 2.0
_PROC = Path("/proc")


class LocalRayError(RuntimeError):
    """The local Ray instance did not start; the message says why."""


class LocalRay:
    """The launcher process of a local Ray instance, seen from the router."""

    def __init__(self, process: subprocess.Popen[bytes], gcs_address: str) -> None:
        self._process = process
        self.gcs_address = gcs_address

    @classmethod
    async def start(cls, num_cpus: int, timeout_s: float = 120.0) -> LocalRay:
        """Start Ray in a new session; returns once its GCS address is known."""
        process = subprocess.Popen(
            [sys.executable, "-m", "router.fleet.local_ray", str(num_cpus)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # out of the service's process group
        )
        assert process.stdout is not None
        try:
            line = await asyncio.wait_for(
                call_in_daemon_thread(process.stdout.readline, "local-ray-start"), timeout_s
            )
        except TimeoutError:
            line = b""
        except BaseException:
            cls(process, "").stop()
            raise
        if not line.strip():
            cls(process, "").stop()
            code = process.returncode
            raise LocalRayError(
                "the local Ray instance did not start "
                + (f"(its launcher exited with {code})" if code is not None else "in time")
            )
        return cls(process, line.decode().strip())

    @property
    def session_id(self) -> int:
        """The session (and process group) of the launcher and every process of Ray's."""
        return self._process.pid

    def processes(self) -> dict[int, str]:
        """pid → command name of the local Ray's processes alive now (Linux; else none)."""
        return session_processes(self.session_id)

    def stop(self, timeout_s: float = STOP_RAY_S) -> None:
        """Stop Ray: SIGTERM to every process of its session (GCS, raylet, agents and
        workers exit within a second or so), then SIGKILL to what is left after
        `timeout_s` (0: at once, for a Ray already going down). Idempotent. The service
        stops its workers first and keeps nothing of a local Ray, so Ray's own orderly
        teardown (seconds) buys nothing here."""
        if self._process.stdin is not None and not self._process.stdin.closed:
            with contextlib.suppress(OSError):
                self._process.stdin.close()
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while session_processes(self.session_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        if session_processes(self.session_id):
            if timeout_s > 0:
                log.warning("the local Ray did not stop within %.0f s; killing it", timeout_s)
            self._signal_all(signal.SIGKILL)
        self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()

    def _signal_all(self, signum: int) -> None:
        # Ray's processes share the launcher's process group unless one made its own.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.session_id, signum)
        for pid in session_processes(self.session_id):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)


def _stat_fields(pid: int) -> list[str] | None:
    """The fields after the command name of /proc/PID/stat (state, ppid, pgrp, session)."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()  # the name may hold spaces and parentheses


def session_processes(session_id: int) -> dict[int, str]:
    """pid → command name of the processes of session `session_id` still running."""
    found: dict[int, str] = {}
    if not _PROC.is_dir():
        return found
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None and fields[0] != "Z" and fields[3] == str(session_id):
            try:
                found[int(entry.name)] = (entry / "comm").read_text().strip()
            except OSError:
                continue
    return found


def _serve_ray(num_cpus: int) -> int:
    """The launcher: start Ray, say where it is, keep it up until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the router's
    import ray

    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        # With router.serving.config.keep_ray_on_loopback() (the CLI calls it) Ray keeps this;
        # otherwise Ray swaps loopback for the host's address.
        _node_ip_address="127.0.0.1",
        log_to_driver=False,  # the workers' lines go to the router, their job's driver
    )
    # SIGTERM ends the launcher at once (set after ray.init, which sets a handler of its
    # own): Ray's processes get it too from whoever sent it, and the kernel kills any
    # left when their parent dies (Ray starts them so).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.stdout.write(ray.get_runtime_context().gcs_address + "\n")
    sys.stdout.flush()
    with contextlib.suppress(OSError):
        while os.read(0, 4096):
            pass
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(_serve_ray(int(sys.argv[1])))
