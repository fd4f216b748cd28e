"""oneDNN linear layers on CPU: which modules change, what they compute, and the runner's
choice."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model.cpu_linear import (
    OneDnnLinear,
    onednn_linear_works,
    remove_onednn_linears,
    use_onednn_linears,
    uses_onednn_linears,
)
from engine.model.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not onednn_linear_works(), reason="no oneDNN linear here")


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.proj = torch.nn.Linear(16, 24)  # with a bias
        self.head = torch.nn.Linear(24, 50, bias=False)
        self.bf16 = torch.nn.Linear(16, 8).to(torch.bfloat16)
        self.tied = torch.nn.Linear(16, 50, bias=False)
        self.tied.weight = self.embed.weight


def test_float32_cpu_linears_change_class_and_keep_their_parameters() -> None:
    block = _Block()
    before = {name: p for name, p in block.named_parameters()}
    assert use_onednn_linears(block) == 3
    assert type(block.proj) is OneDnnLinear and type(block.head) is OneDnnLinear
    assert type(block.tied) is OneDnnLinear
    assert type(block.bf16) is torch.nn.Linear  # bfloat16: torch's own path
    assert dict(block.named_parameters()) == before
    assert block.tied.weight is block.embed.weight
    assert uses_onednn_linears(block)
    remove_onednn_linears(block)
    assert not uses_onednn_linears(block)
    assert type(block.proj) is torch.nn.Linear


@pytest.mark.parametrize("shape", [(1, 16), (7, 16), (1, 5, 16), (0, 16)])
def test_products_equal_f_linear_up_to_rounding(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(16, 24)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(24, 16, generator=gen))
    x = torch.randn(shape, generator=gen)
    expected = torch.nn.functional.linear(x, linear.weight, linear.bias)
    use_onednn_linears(linear)
    with torch.inference_mode():
        got = linear(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_cpu_runner_uses_them_unless_told_not_to(tiny_model_paths: dict[str, Path]) -> None:
    path = tiny_model_paths["llama"]
    on = ModelRunner(path, dtype="float32", num_blocks=4, block_size=8)
    off = ModelRunner(path, dtype="float32", num_blocks=4, block_size=8, onednn_linears=False)
    assert uses_onednn_linears(on.model)
    assert not uses_onednn_linears(off.model)
