"""Startup fails fast with a message naming the cause, instead of hanging."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.factory import EngineArgs
from router.fleet.cluster import Cluster, ClusterConfig, StartupError
from router.fleet.pools import Pools

pytestmark = pytest.mark.e2e

ARGS = EngineArgs(kv_cache_gib=0.1)


def test_mismatched_pairing_fails_startup_naming_the_field(
    smollm2_path: Path, ray_session: str
) -> None:
    bad = Cluster(
        ClusterConfig(prefill_args=ARGS, decode_args=EngineArgs(kv_cache_gib=0.1, dtype="bfloat16"))
    )
    with pytest.raises(StartupError, match="dtype differs"):
        asyncio.run(Pools(bad).start())


def test_bad_model_path_fails_startup_with_the_workers_error(
    tmp_path: Path, ray_session: str
) -> None:
    bad = Cluster(
        ClusterConfig(prefill_args=EngineArgs(model=str(tmp_path / "nope")), decode_args=ARGS)
    )
    with pytest.raises(StartupError, match="prefill worker 0 failed to start.*config.json"):
        asyncio.run(Pools(bad).start())
