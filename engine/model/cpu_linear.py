"""A float32 CPU model's linear layers through oneDNN instead of torch's default sgemm.

On CPU torch computes a float32 `F.linear` with MKL's sgemm, whose code depends on the
CPU it finds: on AMD x86-64 a decode step's products (a few activation rows against each
weight matrix) run far below the memory's rate. oneDNN, which torch bundles, runs the
same product with kernels generated for the CPU's own vector units (AVX-512 where it has
it) and reads the weights where they are (no repacked copy: the safetensors
file's pages stay the only copy). The results differ from sgemm's in the last bits (the
sums run in another order), as sgemm's own do between row counts; unlike sgemm's, they
were the same on 1, 2 and 4 threads in every shape measured, so engines with different
thread counts (a worker, the engine it is compared with) compute the same bits.

The model's `nn.Linear` modules change class (`OneDnnLinear`), so parameters, tied
embeddings and the transformers model code stay as they are.
"""

from __future__ import annotations

import functools

import torch


def _onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDnnLinear(torch.nn.Linear):
    """nn.Linear whose product runs in oneDNN (float32 CPU weights only: see
    `use_onednn_linears`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _onednn_linear(x, self.weight, self.bias)


@functools.cache
def onednn_linear_works() -> bool:
    """True when this torch has oneDNN's linear operator and it computes a small float32
    product as F.linear does (up to rounding)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    ):
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, generator=gen)
    weight = torch.randn(24, 40, generator=gen)
    bias = torch.randn(24, generator=gen)
    try:
        with torch.inference_mode():
            out = _onednn_linear(x, weight, bias)
    except RuntimeError:
        return False
    return torch.allclose(out, torch.nn.functional.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


def _fits(module: torch.nn.Module) -> bool:
    if type(module) is not torch.nn.Linear:
        return False
    weight = module.weight
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and not weight.is_sparse


def use_onednn_linears(model: torch.nn.Module) -> int:
    """Make the model's float32 CPU Linear layers OneDnnLinear (where oneDNN's operator
    works here); returns how many changed."""
    if not onednn_linear_works():
        return 0
    changed = 0
    for module in model.modules():
        if _fits(module):
            module.__class__ = OneDnnLinear
            changed += 1
    return changed


def remove_onednn_linears(model: torch.nn.Module) -> None:
    """Back to plain Linear layers (torch's default sgemm)."""
    for module in model.modules():
        if isinstance(module, OneDnnLinear):
            module.__class__ = torch.nn.Linear  # type: ignore[assignment]


def uses_onednn_linears(model: torch.nn.Module) -> bool:
    return any(isinstance(m, OneDnnLinear) for m in model.modules())
