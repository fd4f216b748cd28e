"""Shared fixtures: the embedded SmolLM2 folder and tiny random models of each architecture."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Everything under test loads from local folders; fail loudly if anything tries the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tests talk to loopback only: local Ray instances (here and in services started by the
# tests, which inherit this environment) bind 127.0.0.1, not the host's address.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from engine.model.embedded import default_cache_dir, ensure_embedded_model  # noqa: E402

TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3")

# A wider init than HF's 0.02 makes logits of the random models peaked enough that
# greedy picks are not near-ties (fp32 packed vs unpacked differ in the last bits).
_TINY_COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    tie_word_embeddings=False,
)


def tiny_config(arch: str) -> object:
    """A tiny transformers config of `arch` (GQA 4 q heads / 2 kv heads, head_dim 16)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if arch == "llama":
        return LlamaConfig(**_TINY_COMMON)
    if arch == "mistral":
        return MistralConfig(**_TINY_COMMON, sliding_window=None)
    if arch == "qwen2":
        return Qwen2Config(**_TINY_COMMON)  # Qwen2 has q/k/v biases: covered here
    if arch == "qwen3":
        return Qwen3Config(**_TINY_COMMON)  # Qwen3 has q/k RMSNorm: covered here
    raise ValueError(arch)


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
