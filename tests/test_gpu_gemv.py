"""CUDA tests of the small-batch Triton GEMV (run with `pytest -m gpu`; skipped without CUDA).

* The kernel against a float64 reference: one to eight rows, ragged feature counts,
  reduction lengths that are not a multiple of the tile, bias, bf16 and fp16.
* Packed siblings (q/k/v, gate/up stacked into one product) give each projection exactly
  the bits of its own product.
* In the runner (Llama-3.2-1B shape, random bf16 weights): every projection and the
  lm_head of a one-sequence decode step runs on it, q/k/v and gate/up as one launch
  each; steps of more sequences never do; the batch-1 CUDA graph's logits match the
  same step on cuBLAS, and packed logits are bitwise those of one product a projection.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

import pytest
import torch

from engine.core.batch import Batch, ScheduledSeq
from engine.model.compiled import uncompile_decoder
from engine.model.kernels.triton_attention import triton_available
from engine.model.kernels.triton_gemv import (
    GemvConfig,
    gemv,
    packed_modules,
    remove_gemv,
    use_gemv,
    uses_gemv,
)
from engine.model.model_loader import LoadFormat
from engine.model.model_runner import ModelRunner
from engine.sampling_params import GREEDY

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton"
    ),
]

CONFIG_1B = Path(__file__).resolve().parents[1] / "deploy" / "model_configs" / "llama-3.2-1b"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "m,n,k,bias",
    [
        (1, 2048, 2048, False),  # a 1B projection
        (1, 1000, 3000, True),  # ragged n, k not a multiple of the tile
        (2, 37, 130, True),
        (3, 512, 8192, False),  # padded to four rows
        (8, 130, 64, False),
    ],
)
def test_gemv_matches_float64_reference(
    m: int, n: int, k: int, bias: bool, dtype: torch.dtype
) -> None:
    torch.manual_seed(m * 1000 + n)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    configs = [None, GemvConfig(4, 128, 4), GemvConfig(2, 256, 4, reduce_late=m <= 2)]
    for cfg in configs:
        y = gemv(x, w, b, config=cfg)
        assert y.shape == (m, n) and y.dtype == dtype
        # Output rounding only: the sums are float32.
        torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="contiguous"):
        gemv(x, w.t().contiguous().t(), b)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_gives_each_projection_its_own_bits(bias: bool) -> None:
    torch.manual_seed(7)
    k, widths = 2048, (2048, 512, 512)  # a 1B layer's q, k and v
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for n in widths]
    biases = [torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None for n in widths]
    packed = gemv(
        x,
        torch.cat(weights),
        torch.cat([b for b in biases if b is not None]) if bias else None,
    )
    own = torch.cat([gemv(x, w, b) for w, b in zip(weights, biases, strict=True)], dim=1)
    assert torch.equal(packed, own)


def _decode_batch(prompts: list[list[int]], tables: list[tuple[int, ...]]) -> Batch:
    return Batch(
        tuple(
            ScheduledSeq(f"r{i}", (p[-1],), len(p) - 1, tables[i], True, GREEDY, 0)
            for i, p in enumerate(prompts)
        ),
        16,
    )


def _gemv_launches(fn: Callable[[], object]) -> int:
    """How many GEMV kernels fn() runs on the device (from the profiler's trace)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if "_gemv_kernel" in e.name)


def test_one_sequence_decode_runs_every_projection_on_the_gemv() -> None:
    runner = ModelRunner(
        CONFIG_1B,
        device="cuda",
        load_format="dummy",
        num_blocks=256,
        block_size=16,
        cuda_graph_batch_sizes=[1, 4],
    )
    assert uses_gemv(runner.model) and runner.cuda_graphs is not None
    layers = runner.spec.num_layers
    assert packed_modules(runner.model) == 2 * layers  # attention and MLP of every layer
    rng = random.Random(3)
    prompts = [[rng.randrange(0, 128000) for _ in range(rng.randrange(20, 300))] for _ in range(4)]
    ids = rng.sample(range(256), k=4 * 20)
    tables = [tuple(ids[i * 20 : (i + 1) * 20]) for i in range(4)]
    prefill = Batch(
        tuple(
            ScheduledSeq(f"r{i}", tuple(p), 0, tables[i], True, GREEDY, 0)
            for i, p in enumerate(prompts)
        ),
        16,
    )
    runner.execute(prefill)
    four, one = _decode_batch(prompts, tables), _decode_batch(prompts[:1], tables[:1])
    assert _gemv_launches(lambda: runner.execute(four, use_cuda_graphs=False)) == 0  # cuBLAS
    # q+k+v, o, gate+up, down in every layer, and the lm_head: compiled, ungraphed...
    assert _gemv_launches(lambda: runner.execute(one, use_cuda_graphs=False)) == 4 * layers + 1
    # ...and replayed from the batch-1 graph.
    assert _gemv_launches(lambda: runner.execute(one)) == 4 * layers + 1

    with torch.inference_mode():
        graph = runner.cuda_graphs.run(one).float()
        uncompile_decoder(runner.model)  # transformers' own forward from here on
        packed = runner._forward_eager(one, None)
        # One GEMV a projection: the same bits as the packed products.
        remove_gemv(runner.model)
        use_gemv(runner.model, pack=False)
        assert packed_modules(runner.model) == 0
        assert torch.equal(runner._forward_eager(one, None), packed)
        # The batch-1 graph (captured with the GEMV) against the same step on cuBLAS.
        remove_gemv(runner.model)
        assert not uses_gemv(runner.model)
        reference = runner._forward_eager(one, None).float()
    scale = reference.abs().max().item()
    diff = (graph - reference).abs().max().item()
    assert torch.isfinite(graph).all() and diff < 0.05 * scale, (diff, scale)
    top2 = reference.topk(2, dim=-1).values
    if (top2[0, 0] - top2[0, 1]).item() > 2 * diff:
        assert graph.argmax(-1).item() == reference.argmax(-1).item()


class _Placement(TypedDict):
    """The ModelRunner arguments the runners a test compares share."""

    device: str
    load_format: LoadFormat
    num_blocks: int
    block_size: int


def test_gemv_is_off_when_asked_and_for_float32() -> None:
    common = _Placement(device="cuda", load_format="dummy", num_blocks=64, block_size=16)
    off = ModelRunner(CONFIG_1B, small_batch_gemv=False, enforce_eager=True, **common)
    assert not uses_gemv(off.model)
    del off
    fp32 = ModelRunner(
        CONFIG_1B, dtype="float32", enforce_eager=True, compile_model=False, **common
    )
    assert not uses_gemv(fp32.model)
