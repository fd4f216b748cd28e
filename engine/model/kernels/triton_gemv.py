"""Matrix-vector products for decode steps of one sequence, in Triton.

A batch-1 decode step is a chain of GEMVs: every weight byte is read once for one row of
activations, so the step's floor is the weights' size over the memory bandwidth. cuBLAS
reads the weights of these shapes well below the card's copy rate, the small projections
slowest (docs/benchmarks-history.md, "one-row GEMV"). Here each program owns `BLOCK_N` output
features, streams their weight rows once in `BLOCK_K`-wide tiles, multiplies them with
every activation row (all of which fit in registers) and sums in float32. No split-K: each output is
summed by one program in one fixed order, so the result does not depend on timing and
every process computes the same bits (prefill and decode workers must agree with a
colocated engine token for token).
"""

from __future__ import annotations

import inspect
import math
from typing import NamedTuple

import torch

try:  # Triton ships with CUDA builds of torch; the CPU path never needs it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

# Rows of activations the kernel takes. It beats cuBLAS at one row on every projection
# and at two by a little; from four rows on cuBLAS's GEMM kernels win (the retired
# `bench.gemv`), so the model's linear layers use it for one row only.
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
    columns a tile, was close to the best of the configurations swept for every one-row
    projection of the 1B and 8B Llama shapes (the retired `bench.gemv`); with more rows
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
# CUDA graphs, without a dispatcher call per product (an opaque custom operator's host
# time per call made an ungraphed one-token step far slower).
# Registered only where Triton imports (torch warns at registration otherwise).
if triton is not None:

    @torch.library.triton_op("pdserve::gemv", mutates_args=())
    def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _launch(torch.library.wrap_triton(_gemv_kernel), x, weight, bias, None)


def _one_row_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., k] with one row in all -> [..., n] on the GEMV (compiled or not)."""
    row = x.reshape(1, x.shape[-1])
    product = _gemv_op if torch.compiler.is_compiling() else gemv
    out = product(row, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def _is_one_cuda_row(x: torch.Tensor) -> bool:
    return x.is_cuda and math.prod(x.shape[:-1]) == 1


class GemvLinear(torch.nn.Linear):
    """nn.Linear whose one-row products run the Triton GEMV; every other shape is
    F.linear. Installed by changing the class of the model's own Linear modules, so
    parameters, tied weights and the transformers model code stay as they are.

    Under torch.compile the row count of the symbolic graph is known to be at least two
    (sizes 0 and 1 get graphs of their own), so the branch adds no guard: the one-token
    graph (batch-1 decode steps) calls the GEMV and the symbolic graph calls cuBLAS."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _is_one_cuda_row(x):
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return _one_row_product(x, self.weight, self.bias)


# Sibling projections of one input that a one-row step runs as a single GEMV over their
# stacked weights: attention's q, k and v, and the gated MLP's gate and up. At one row
# the small products cost launch and ramp-up more than bytes (a 1B k or v takes several
# times its reads), so one launch of the stacked weights beats three. Each output is
# still summed by the program that owns its weight rows, in the same order, so the
# packed product gives each projection exactly the bits its own GEMV would.
PACKED_SIBLINGS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
)


class PackedProjection(GemvLinear):
    """One of packed sibling projections. Handed its parent's packed row (an input as
    wide as all siblings' outputs together, which no other input is), it returns its
    own slice of it; anything else it multiplies as GemvLinear does."""

    packed_width: int
    packed_offset: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] == self.packed_width:
            return x.narrow(-1, self.packed_offset, self.out_features)
        return super().forward(x)


class _PacksSiblings:
    """Mixin for a module (attention, MLP) whose forward feeds one input to packed
    sibling projections: for one CUDA row it computes all their outputs in one GEMV and
    runs the module's own forward on that packed row, from which each sibling takes its
    slice. The module's forward (transformers' code) is otherwise untouched."""

    packed_weight: torch.Tensor
    packed_bias: torch.Tensor | None
    _packed_input: str  # the name of forward's first parameter

    def forward(self, *args: object, **kwargs: object) -> object:
        if args:
            x, rest = args[0], args[1:]
        else:
            x, rest = kwargs.pop(self._packed_input), ()
        assert isinstance(x, torch.Tensor)
        if _is_one_cuda_row(x):
            x = _one_row_product(x, self.packed_weight, self.packed_bias)
        return super().forward(x, *rest, **kwargs)  # type: ignore[misc]


_PACKED_CLASSES: dict[type, type] = {}


def _packed_class(cls: type) -> type:
    if cls not in _PACKED_CLASSES:
        _PACKED_CLASSES[cls] = type(f"Packed{cls.__name__}", (_PacksSiblings, cls), {})
    return _PACKED_CLASSES[cls]


def _pack_siblings(module: torch.nn.Module, names: tuple[str, ...]) -> None:
    """Stack the siblings' weights (and biases) into one buffer of `module`, make each
    sibling's parameters views of it (no extra memory), and swap in the packing classes.
    Nothing changes where the siblings do not fit (types, dtypes, inputs) or the packed
    width could be mistaken for the input's."""
    found = [getattr(module, name, None) for name in names]
    projections = [p for p in found if type(p) is GemvLinear]
    if len(projections) != len(names):
        return
    first = projections[0]
    if any(
        p.in_features != first.in_features
        or p.weight.dtype != first.weight.dtype
        or (p.bias is None) != (first.bias is None)
        for p in projections
    ):
        return
    width = sum(p.out_features for p in projections)
    if width == first.in_features or isinstance(module, _PacksSiblings):
        return
    params = list(inspect.signature(type(module).forward).parameters)
    if len(params) < 2:
        return
    with torch.no_grad():
        weight = torch.cat([p.weight for p in projections])
        bias = None if first.bias is None else torch.cat([p.bias for p in projections])
    module.register_buffer("packed_weight", weight, persistent=False)
    module.register_buffer("packed_bias", bias, persistent=False)
    offset = 0
    for p in projections:
        rows = slice(offset, offset + p.out_features)
        p.weight = torch.nn.Parameter(weight[rows], requires_grad=False)
        if bias is not None:
            p.bias = torch.nn.Parameter(bias[rows], requires_grad=False)
        p.__class__ = PackedProjection
        assert isinstance(p, PackedProjection)
        p.packed_width, p.packed_offset = width, offset
        offset += p.out_features
    module._packed_input = params[1]  # type: ignore[assignment]
    module.__class__ = _packed_class(type(module))


def _fits_gemv(weight: torch.Tensor) -> bool:
    return (
        weight.is_cuda
        and weight.dtype in (torch.bfloat16, torch.float16)
        and weight.is_contiguous()
    )


def use_gemv(model: torch.nn.Module, pack: bool = True) -> int:
    """Make the model's 16-bit CUDA Linear layers GemvLinear and, with `pack`, pack
    sibling projections (PACKED_SIBLINGS) into one product each; returns how many
    Linear layers changed."""
    if triton is None:
        return 0
    changed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and _fits_gemv(module.weight):
            module.__class__ = GemvLinear
            changed += 1
    if pack:
        for module in list(model.modules()):
            for names in PACKED_SIBLINGS:
                _pack_siblings(module, names)
    return changed


def remove_gemv(model: torch.nn.Module) -> None:
    """Back to plain Linear layers and the modules' own classes (cuBLAS for every
    product). Packed siblings keep their weights as views of the packed buffer."""
    for module in model.modules():
        if isinstance(module, GemvLinear):
            module.__class__ = torch.nn.Linear  # type: ignore[assignment]
        elif isinstance(module, _PacksSiblings):
            module.__class__ = type(module).__bases__[1]  # (_PacksSiblings, own class)


def uses_gemv(model: torch.nn.Module) -> bool:
    return any(isinstance(m, GemvLinear) for m in model.modules())


def packed_modules(model: torch.nn.Module) -> int:
    """How many modules run their sibling projections as one packed product."""
    return sum(1 for m in model.modules() if isinstance(m, _PacksSiblings))
