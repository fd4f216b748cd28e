"""CUDA tests of speculative decoding (run with `pytest -m gpu`; skipped without CUDA).

The verifying step on the GPU path (compiled decoder, varlen Triton kernel for the
multi-token chunks, CUDA graphs for plain decode steps and for the draft model's
one-token passes, scheduling a step ahead between speculating steps) gives the tokens of
the same engine without speculation: a tiny float32 Llama, greedy and seeded, one
request and eight at once, n-gram and a draft model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.factory import EngineArgs
from engine.llm import LLM
from engine.model.kernels.triton_attention import triton_available
from engine.sampling_params import SamplingParams
from engine.spec.spec_config import SpeculativeConfig
from tests.fakes import assert_engine_empty
from tests.tiny_models import tiny_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton"
    ),
]


@pytest.fixture(scope="module")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    path = tmp_path_factory.mktemp("gpu_spec") / "tiny-llama"
    AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32).save_pretrained(
        path
    )
    return path


def _engine(path: Path, speculative: SpeculativeConfig | None) -> LLM:
    return LLM(
        EngineArgs(
            model=str(path),
            device="cuda",
            dtype="float32",
            num_blocks=512,
            block_size=16,
            speculative=speculative,
        )
    )


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    # Repeated runs: n-gram proposals find matches in the prompts.
    return [
        (torch.randint(10, 49000, (6 + i,), generator=generator).tolist() * 3) for i in range(8)
    ]


def _params(num: int) -> list[SamplingParams]:
    return [
        SamplingParams(
            max_tokens=24, temperature=0.0 if i % 2 else 0.9, seed=50 + i, ignore_eos=True
        )
        for i in range(num)
    ]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_outputs_equal_plain_decoding_on_cuda(
    method: str, tiny_llama_path: Path
) -> None:
    spec = (
        SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3)
        if method == "ngram"
        else SpeculativeConfig("draft_model", 4, model=str(tiny_llama_path))
    )
    plain, speculative = _engine(tiny_llama_path, None), _engine(tiny_llama_path, spec)
    assert speculative.core.async_scheduling and speculative.runner.cuda_graphs is not None
    prompts = _prompts()
    for batch in ([prompts[0]], prompts):
        params = _params(len(batch))
        want = [o.token_ids for o in plain.generate(batch, params)]
        assert [o.token_ids for o in speculative.generate(batch, params)] == want
    stats = speculative.core.stats()
    # A random model seldom repeats itself, so n-gram proposals are few and rarely kept;
    # what matters is that some were verified and the output is still exact.
    assert stats.spec_draft_tokens > 0
    if method == "draft_model":  # the target drafting for itself: nearly all accepted
        assert stats.spec_accepted_tokens > 0.9 * stats.spec_draft_tokens
        drafter = speculative.runner.drafter
        assert drafter is not None and drafter.runner.cuda_graphs.num_replays > 0
    assert_engine_empty(speculative.core)


def test_verify_graph_logits_equal_the_eager_step(tiny_llama_path: Path) -> None:
    from engine.core.batch import Batch, ScheduledSeq
    from engine.model.model_runner import ModelRunner
    from engine.model.verify_graphs import logits_rows

    runner = ModelRunner(
        tiny_llama_path,
        device="cuda",
        dtype="float32",
        num_blocks=64,
        block_size=16,
        max_num_seqs=8,
        verify_graph_tokens=5,
    )
    verify = runner.verify_graphs
    assert verify is not None
    greedy = SamplingParams(temperature=0.0)
    # Three requests' prompts in the cache, then one step: 4 proposals, 2, and a decode.
    tables = [(0, 1), (2, 3), (4,)]
    prompts = [list(range(10, 30)), list(range(40, 57)), list(range(60, 69))]
    runner.execute(
        Batch(
            tuple(
                ScheduledSeq(f"r{i}", tuple(p), 0, t, False, greedy, 0)
                for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
            ),
            16,
        )
    )
    seqs = (
        ScheduledSeq("r0", (30, 31, 32, 33, 34), 20, tables[0], True, greedy, 0, 4),
        ScheduledSeq("r1", (57, 58, 59), 17, tables[1], True, greedy, 0, 2),
        ScheduledSeq("r2", (69,), 9, tables[2], True, greedy, 0),
    )
    batch = Batch(seqs, 16, num_draft_tokens=6)
    with torch.inference_mode():
        eager = runner._forward_eager(batch, None)
        graphed = verify.run(batch)[torch.tensor(logits_rows(seqs, 5), device="cuda")]
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
    replays = verify.num_replays
    assert runner.execute(batch) == runner.execute(batch, use_cuda_graphs=False)
    assert verify.num_replays == replays + 1
