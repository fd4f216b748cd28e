"""`pdserve serve` without --ray-address starts its own Ray, whatever a past `ray start` left."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import pytest

from router.client import stream_generate
from tests.service import ServiceProcess

pytestmark = pytest.mark.e2e


def test_stale_ray_address_file_does_not_stop_serve(
    tmp_path: Path, tiny_model_paths: dict[str, Path]
) -> None:
    # Ray looks for the last `ray start` in $RAY_TMPDIR/ray/ray_current_cluster; point it
    # at a head that is gone. A short directory: Ray's socket paths must stay < 108 bytes.
    ray_tmp = Path(tempfile.mkdtemp(prefix="pdray-"))
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:9\n")
    svc = ServiceProcess(
        [
            "--model",
            str(tiny_model_paths["llama"]),
            "--prefill-kv-cache-gib",
            "0.02",
            "--decode-kv-cache-gib",
            "0.02",
        ],
        tmp_path / "serve.log",
        env={"RAY_TMPDIR": str(ray_tmp)},
    )
    try:
        svc.wait_serving(timeout=240)

        async def one() -> list[object]:
            return [r async for r in stream_generate(svc.address, prompt="Hi", max_tokens=3)]

        responses = asyncio.run(one())
        assert responses[-1].finish_reason != 0  # type: ignore[attr-defined]
    finally:
        code = svc.stop()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert code == 0, svc.log_tail()
