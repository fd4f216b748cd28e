"""A decode worker dies (SIGKILL): the router routes around it and keeps serving."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.v1 import generation_pb2 as pb
from router.client import get_pool_stats, stream_generate
from tests.service import ServiceProcess

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def service(
    tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path
) -> Iterator[ServiceProcess]:
    svc = ServiceProcess(
        ["--decode-workers", "2", "--prefill-kv-cache-gib", "0.1", "--decode-kv-cache-gib", "0.1"],
        tmp_path_factory.mktemp("svc-death") / "service.log",
    )
    svc.wait_serving()
    yield svc
    assert svc.stop() == 0, svc.log_tail()


async def _generate(address: str, prompt: str) -> pb.GenerateResponse:
    final = None
    async for resp in stream_generate(address, prompt=prompt, max_tokens=8, ignore_eos=True):
        if resp.finish_reason:
            final = resp
    assert final is not None
    return final


def _decode_worker_pids() -> list[int]:
    # Ray titles actor processes "ray::DecodeWorker..."; the tests run one service at a time.
    out = subprocess.run(["pgrep", "-f", "ray::DecodeWorker"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def test_killed_decode_worker_is_routed_around(service: ServiceProcess) -> None:
    first = asyncio.run(_generate(service.address, "warm up"))
    assert first.finish_reason == pb.FINISH_REASON_LENGTH
    pids = _decode_worker_pids()
    assert len(pids) == 2, pids
    os.kill(pids[0], signal.SIGKILL)

    async def burst() -> list[pb.GenerateResponse]:
        return await asyncio.gather(*(_generate(service.address, f"after {i}") for i in range(6)))

    finals = asyncio.run(burst())
    # Every request ended with exactly one final message; after the router learned of the
    # death (at most the requests that raced it), every new request succeeds.
    assert all(f.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_ERROR) for f in finals)
    later = [asyncio.run(_generate(service.address, f"later {i}")) for i in range(4)]
    assert all(f.finish_reason == pb.FINISH_REASON_LENGTH for f in later)
    stats = asyncio.run(get_pool_stats(service.address))
    decode = [w for w in stats.workers if w.pool == pb.POOL_DECODE]
    assert len(decode) == 1  # the dead one is no longer reported
    assert all(w.num_blocks_in_use == 0 for w in stats.workers)
