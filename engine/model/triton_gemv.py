"""Matrix-vector products for decode steps of one sequence, in Triton.

A batch-1 decode step is a chain of GEMVs: every weight byte is read once for one row of
activations, so the step's floor is the weights' size over the memory bandwidth. On an
H100 (about 3 TB/s copy rate) cuBLAS read the weights of these shapes at 0.4-2.4 TB/s,
the small projections slowest (bench/gemv.py). Here each program owns `BLOCK_N` output
features, streams their weight rows once in `BLOCK_K`-wide tiles, multiplies them with
every activation row (all of which fit in registers) and sums in float32. No split-K: each output is
summed by one program in one fixed order, so the result does not depend on timing and
every process computes the same bits (prefill and decode workers must agree with a
colocated engine token for token).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

try:  # Triton ships with CUDA builds of torch; the CPU path never needs it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

# Rows of activations the kernel takes. It beats cuBLAS at one row by 3-47 % per
# projection and at two by a little; from four rows on cuBLAS's GEMM kernels win
# (bench/gemv.py), so the model's linear layers use it for one row only.
MAX_ROWS = 8


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    # Sum each tile's products at once (False) or keep them per lane and reduce once at
    # the end (True: fewer shuffles, more registers).
    reduce_late: bool = False


if triton is not None:

    @triton.jit
    def _gemv_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ym,
        M: tl.constexpr,
        M_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        REDUCE_LATE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        EVEN_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, M_PAD)
        offs_k = tl.arange(0, BLOCK_K)
        mask_n = offs_n < N
        mask_m = offs_m < M
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        if REDUCE_LATE:
            acc3 = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
        else:
            acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
        for step in range(0, tl.cdiv(K, BLOCK_K)):
            k = step * BLOCK_K + offs_k
            if EVEN_K:
                w = tl.load(w_rows + k[None, :], mask=mask_n[:, None], other=0.0)
                x = tl.load(x_rows + k[None, :], mask=mask_m[:, None], other=0.0)
            else:
                mask_k = k < K
                w = tl.load(w_rows + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
                x = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            if REDUCE_LATE:
                acc3 += prod
            else:
                acc += tl.sum(prod, axis=2)
        if REDUCE_LATE:
            acc = tl.sum(acc3, axis=2)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def default_config(m: int, n: int, k: int) -> GemvConfig:
    """The configuration for an [m, k] x [n, k]^T product: fixed, never picked by timing,
    so every process runs the same kernel. On an H100 two weight rows a program, 2048
    columns a tile, was within 0.5 us of the best of 28 configurations for every one-row
    projection of the 1B and 8B Llama shapes (bench/gemv.py --sweep); with more rows
    the per-lane sums would not fit in registers, so those reduce each tile at once."""
    block_k = min(2048, triton.next_power_of_2(k))
    if m == 1:
        return GemvConfig(block_n=2, block_k=block_k, num_warps=4)
    if m == 2:
        return GemvConfig(block_n=2, block_k=min(1024, block_k), num_warps=4, reduce_late=True)
    return GemvConfig(block_n=4, block_k=min(1024, block_k), num_warps=4)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x [m, k] @ weight[n, k]^T (+ bias) for m <= MAX_ROWS; CUDA tensors, weight contiguous."""
    return _launch(_gemv_kernel, x, weight, bias, config)


def _launch(
    kernel: object,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig | None,
) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k or x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"gemv takes [<= {MAX_ROWS}, k] rows and a contiguous [n, k] weight")
    cfg = config or default_config(m, n, k)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n),)
    kernel[grid](  # type: ignore[index]
        x,
        weight,
        bias if bias is not None else weight,
        y,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        M=m,
        M_PAD=triton.next_power_of_2(m),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        REDUCE_LATE=cfg.reduce_late,
        HAS_BIAS=bias is not None,
        EVEN_K=k % cfg.block_k == 0,
        num_warps=cfg.num_warps,
    )
    return y


# For torch.compile: a Triton operator the compiler traces into, so the compiled decoder
# launches the kernel from its own generated code, between its fused kernels and inside
# CUDA graphs, without a dispatcher call per product (an opaque custom operator cost
# about 90 us of host time per call, which doubled an ungraphed one-token step).
# Registered only where Triton imports (torch warns at registration otherwise).
if triton is not None:

    @torch.library.triton_op("pdserve::gemv", mutates_args=())
    def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _launch(torch.library.wrap_triton(_gemv_kernel), x, weight, bias, None)


class GemvLinear(torch.nn.Linear):
    """nn.Linear whose one-row products run the Triton GEMV; every other shape is
    F.linear. Installed by changing the class of the model's own Linear modules, so
    parameters, tied weights and the transformers model code stay as they are.

    Under torch.compile the row count of the symbolic graph is known to be at least two
    (sizes 0 and 1 get graphs of their own), so the branch adds no guard: the one-token
    graph (batch-1 decode steps) calls the GEMV and the symbolic graph calls cuBLAS."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if math.prod(x.shape[:-1]) != 1 or not x.is_cuda:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        row = x.reshape(1, x.shape[-1])
        if torch.compiler.is_compiling():
            out = _gemv_op(row, self.weight, self.bias)
        else:
            out = gemv(row, self.weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


def use_gemv(model: torch.nn.Module) -> int:
    """Make the model's 16-bit CUDA Linear layers GemvLinear; returns how many changed."""
    if triton is None:
        return 0
    changed = 0
    for module in model.modules():
        if (
            type(module) is torch.nn.Linear
            and module.weight.is_cuda
            and module.weight.dtype in (torch.bfloat16, torch.float16)
            and module.weight.is_contiguous()
        ):
            module.__class__ = GemvLinear
            changed += 1
    return changed


def uses_gemv(model: torch.nn.Module) -> bool:
    return any(isinstance(m, GemvLinear) for m in model.modules())
