"""Shared fixtures: the embedded SmolLM2 folder, tiny random models of each architecture,
one Ray for the session, the reference engine, and services started per module."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

# Everything under test loads from local folders; fail loudly if anything tries the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tests talk to loopback only: local Ray instances (here and in services started by the
# tests, which inherit this environment) bind 127.0.0.1, not the host's address.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from bench.harness import ServiceProcess  # noqa: E402
from engine.model.embedded import default_cache_dir, ensure_embedded_model  # noqa: E402
from tests.services import StartService, running_service  # noqa: E402
from tests.tiny_models import TINY_ARCHS, tiny_config  # noqa: E402

if TYPE_CHECKING:
    from engine.llm import LLM


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded model folder (converted once per cache dir, ~30 s the first time)."""
    return ensure_embedded_model(default_cache_dir())


@pytest.fixture(scope="session")
def tiny_model_paths(
    tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path
) -> dict[str, Path]:
    """arch → folder of a tiny random-weight float32 model with the SmolLM2 tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True)
    root = tmp_path_factory.mktemp("tiny_models")
    paths = {}
    for i, arch in enumerate(TINY_ARCHS):
        torch.manual_seed(1234 + i)
        model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
        path = root / f"tiny-{arch}"
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[arch] = path
    return paths


@pytest.fixture(scope="session")
def ray_session() -> Iterator[str]:
    """One in-process Ray instance for the session; yields its address.

    Tests that start a Cluster here use it, and the services of the end-to-end modules
    join it (`--ray-address`). Starting and stopping Ray per module or service costs
    seconds each and, on a loaded 2-core machine, can time out; the CPU count is a
    scheduling token (clusters place several actors, pools scale and replace workers).
    (tests/test_service_2p2d.py's service starts a Ray of its own, as `make run` does.)
    """
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=16, include_dashboard=False, _node_ip_address="127.0.0.1")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def reference_llm(smollm2_path: Path) -> LLM:
    """The colocated engine in this process on the embedded model (float32, CPU): what
    every end-to-end service must reproduce token for token, greedy or seeded."""
    from engine.factory import EngineArgs
    from engine.llm import LLM

    return LLM(EngineArgs(kv_cache_gib=0.25))


@pytest.fixture(scope="module")
def start_service(
    tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path
) -> Iterator[StartService]:
    """`start_service(args, name=..., env=..., timeout=...)` starts `pdserve serve ARGS` on
    the embedded model and returns it once SERVING. Every service started so is stopped
    after the module's last test, and the module errors unless each exits 0 on SIGTERM.
    """
    with ExitStack() as stack:

        def start(
            args: list[str],
            *,
            name: str = "service",
            env: dict[str, str] | None = None,
            timeout: float = 300.0,
        ) -> ServiceProcess:
            log = tmp_path_factory.mktemp(name) / "service.log"
            return stack.enter_context(running_service(args, log, env=env, timeout=timeout))

        yield start
