"""Tensor parallelism on GPUs: NCCL all-reduces inside the compiled decoder and the
captured decode graphs, and a tensor-parallel worker behind the router."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

from engine.factory import EngineArgs
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.services import assert_pools_empty, running_service
from tests.test_gpu import CONFIG_1B, _served, needs_gpus
from tests.test_tensor_parallel import _run_group

pytestmark = pytest.mark.gpu

for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (4 heads, 2 KV heads) saved as safetensors, no tokenizer."""
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import tiny_config

    torch.manual_seed(1234)
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32).save_pretrained(
        path
    )
    return path


@needs_gpus(2)
def test_a_split_model_with_graphs_and_the_compiled_decoder_matches_one_gpu(
    tiny_llama: Path, tmp_path: Path
) -> None:
    path = tiny_llama
    whole = _run_group(1, path, "auto", tmp_path, "cuda")
    sizes = (2, 4) if torch.cuda.device_count() >= 4 else (2,)
    for size in sizes:
        split = _run_group(size, path, "auto", tmp_path, "cuda")
        torch.testing.assert_close(split["logits"], whole["logits"], rtol=1e-3, atol=1e-3)
        assert split["tokens"] == whole["tokens"], size


def _peaked_1b(root: Path) -> Path:
    """Llama-3.2-1B's shape with 4 layers, saved as safetensors (both sides load the same
    weights), wide enough that greedy picks are not near ties (float32 sums in another
    order must not flip them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((CONFIG_1B / "config.json").read_text())
    config.update(num_hidden_layers=4, initializer_range=0.2)
    source = root / "config-only"
    source.mkdir(parents=True, exist_ok=True)
    (source / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(source), dtype=torch.float32
    )
    path = root / "llama-1b-4l-peaked"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def peaked_1b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _peaked_1b(tmp_path_factory.mktemp("peaked"))


LAYOUTS = {
    # One worker on two GPUs.
    "colocated_tp2": (2, ["--colocated-workers", "1", "--tensor-parallel-size", "2"]),
    # Prefill on two GPUs hands each rank's heads to the decode rank that holds them.
    "1p1d_tp2_tp2": (4, ["--tensor-parallel-size", "2", "--local-prefill-max-tokens", "0"]),
    # Two prefill ranks hand their heads to one decode GPU.
    "1p1d_tp2_tp1": (
        3,
        ["--prefill-tensor-parallel-size", "2", "--local-prefill-max-tokens", "0"],
    ),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_tensor_parallel_workers_stream_the_tokens_of_one_gpu(
    layout: str, peaked_1b: Path, tmp_path: Path
) -> None:
    from pdserve.v1 import generation_pb2 as pb

    num_gpus, flags = LAYOUTS[layout]
    if torch.cuda.device_count() < num_gpus:
        pytest.skip(f"needs {num_gpus} CUDA devices")
    colocated = layout.startswith("colocated")
    args = [
        *flags, "--model", str(peaked_1b), "--dtype", "float32",
        "--decode-kv-cache-gib", "2", "--drain-grace-s", "10",
        *([] if colocated else ["--prefill-kv-cache-gib", "2"]),
    ]  # fmt: skip
    with running_service(args, tmp_path / "service.log", timeout=300) as service:
        assert "workers on GPUs" in service.log_tail(20000)
        engine = LLM(EngineArgs(model=str(peaked_1b), dtype="float32", kv_cache_gib=2))
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        prompts = [
            [(7 * i + 13 * j) % 128000 + 1 for j in range(n)] for i, n in enumerate((5, 40, 300))
        ]
        for prompt in prompts:
            expected = list(engine.generate([prompt], params)[0].token_ids)
            tokens, final = asyncio.run(_served(service.address, prompt, 16))
            assert tokens == expected, len(prompt)
            assert final.finish_reason == pb.FINISH_REASON_LENGTH
        pools = {pb.POOL_COLOCATED} if colocated else {pb.POOL_PREFILL, pb.POOL_DECODE}
        asyncio.run(assert_pools_empty(service.address, timeout=15, pools=pools))
