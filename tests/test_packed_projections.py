"""Packed sibling projections (engine.model.kernels.triton_gemv) keep every supported model's
transformers forward intact: the attention and MLP modules of Llama, Mistral, Qwen2 (q/k/v
biases) and Qwen3 (q/k norms) compute q/k/v and gate/up as one product each for one row,
give the same logits as the model left alone, and leave its parameters and state dict as
they were.

The one-row product is the Triton GEMV on CUDA; here it is `F.linear`, counted, so the
test runs on CPU in milliseconds and fails if a transformers release stops feeding the
projections the way the packing relies on. (tests/test_gpu_gemv.py checks the kernel's
bits on CUDA.)
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import transformers

from engine.model.kernels import triton_gemv

LAYERS = 2
ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}


@pytest.fixture
def products(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """One-row products on CPU, by F.linear; yields the output width of each."""
    widths: list[int] = []

    def product(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        widths.append(weight.shape[0])
        return torch.nn.functional.linear(x, weight, bias)

    monkeypatch.setattr(triton_gemv, "triton", object())  # as if Triton imported
    monkeypatch.setattr(triton_gemv, "_fits_gemv", lambda weight: True)
    monkeypatch.setattr(triton_gemv, "_is_one_cuda_row", lambda x: math.prod(x.shape[:-1]) == 1)
    monkeypatch.setattr(triton_gemv, "gemv", product)
    yield widths


def _tiny(arch: str) -> torch.nn.Module:
    config_class, model_class = ARCHITECTURES[arch]
    config = config_class(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=101,
    )
    torch.manual_seed(0)
    return model_class(config).eval()


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_packed_projections_keep_the_model(arch: str, products: list[int]) -> None:
    model = _tiny(arch)
    one, three = torch.tensor([[7]]), torch.tensor([[7, 8, 9]])
    with torch.inference_mode():
        expected_one, expected_three = model(one).logits, model(three).logits
    keys = list(model.state_dict())
    num_params = sum(p.numel() for p in model.parameters())

    changed = triton_gemv.use_gemv(model)
    assert changed == 7 * LAYERS + 1  # q, k, v, o, gate, up, down a layer; the lm_head
    assert triton_gemv.packed_modules(model) == 2 * LAYERS  # attention and MLP
    assert list(model.state_dict()) == keys  # checkpoints load as before
    assert sum(p.numel() for p in model.parameters()) == num_params  # views, no copies

    with torch.inference_mode():
        products.clear()
        got_one = model(one).logits
        # q+k+v, o, gate+up and down a layer, and the lm_head: one product each.
        attention = (4 + 2 * 2) * 16  # q, k and v widths
        mlp = 2 * 96  # gate and up
        assert products == [attention, 64, mlp, 64] * LAYERS + [101]
        products.clear()
        got_three = model(three).logits  # more than one row: F.linear, never packed
        assert products == []
    torch.testing.assert_close(got_one, expected_one, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_three, expected_three, rtol=1e-5, atol=1e-6)

    triton_gemv.remove_gemv(model)
    assert not triton_gemv.uses_gemv(model) and triton_gemv.packed_modules(model) == 0
    with torch.inference_mode():
        torch.testing.assert_close(model(one).logits, expected_one, rtol=1e-5, atol=1e-6)
