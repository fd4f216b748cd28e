"""The decoder stack compiled with torch.compile (inductor), for every step on CUDA.

Eagerly, transformers' decoder layers launch dozens of small kernels each per step
(RMSNorm's casts, power, mean and scale; rotary's slices, negation and concatenation;
SiLU and the gate multiply; residual adds). At small batches those launches, not the
weight reads, set the decode step's time. Inductor fuses each run of them into one
Triton kernel (residual add with the next RMSNorm, rotary with the query/key layout,
SiLU·mul) and keeps the matmuls on cuBLAS; paged attention stays one opaque operator
(`pdserve::paged_attention`). The transformers model definition stays the source of
truth: nothing is rewritten by hand.

Compiled at start-up with a symbolic token count (one more graph for a single token),
one decoder layer at a time: the layers share their compiled code, so start-up compiles
one layer, not the stack, a fraction of the time (docs/benchmarks-history.md). The CUDA
graphs of decode steps are captured from it, and steps without a graph (prefill chunks,
mixed steps, every step of a prefill engine) run it directly. Prefill gains from its
fused kernels as much as decode does (docs/benchmarks-history.md).
"""

from __future__ import annotations

import logging
import warnings

import torch

from engine.model.attention import tag_layers

log = logging.getLogger(__name__)

# Every captured batch size and every prefill length share the symbolic graph; a few
# more entries cover an unexpected guard failure without falling back to eager.
_CACHE_SIZE_LIMIT = 16

# What `compile_decoder` compiles as one unit: each decoder layer, or the whole stack.
COMPILE_SCOPES = ("layer", "decoder")


def compile_decoder(model: torch.nn.Module, scope: str = "layer") -> None:
    """Replace the decoder's forward (scope "decoder"), or each decoder layer's forward
    (scope "layer", the default), with its compiled version (compiles on first call).

    Per layer, the compiler traces and generates one layer's kernels once, and every
    layer reuses them (each passes its weights and its layer index as inputs): start-up
    compiles a fraction of what tracing the whole stack does, at the cost of the fusion
    across a layer boundary (the residual add with the next layer's norm) and of the
    embedding, rotary table and final norm staying uncompiled."""
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile scope must be one of {COMPILE_SCOPES}, got {scope!r}")
    decoder = model.get_decoder()  # type: ignore[operator]
    # TF32 stays off on purpose (in a bf16 model the only float32 matmul is rotary's
    # frequency table, which must stay exact; a float32 model is float32 to be exact),
    # so the compiler's advice to enable it is noise in every worker's log.
    warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores", category=UserWarning)
    torch._dynamo.config.cache_size_limit = max(
        torch._dynamo.config.cache_size_limit, _CACHE_SIZE_LIMIT
    )
    tag_layers(model)
    # `deterministic`: no kernel configuration picked by timing it on the device, so
    # every process compiles the same kernels, and a request prefilled in one worker and
    # decoded in another gets the tokens a colocated engine gives (bf16 greedy included).
    # An instance attribute shadows the class's forward; deleting it undoes this.
    for module in _compiled_modules(decoder, scope):
        module.forward = torch.compile(
            module.forward, dynamic=True, options={"deterministic": True}
        )


def _compiled_modules(decoder: torch.nn.Module, scope: str) -> list[torch.nn.Module]:
    if scope == "decoder":
        return [decoder]
    return list(decoder.layers)  # type: ignore[arg-type]


def uncompile_decoder(model: torch.nn.Module) -> None:
    """Back to the eager forward (after a failed compile)."""
    decoder = model.get_decoder()  # type: ignore[operator]
    for module in (decoder, *decoder.layers):
        if "forward" in vars(module):
            del module.forward


def is_compiled(model: torch.nn.Module) -> bool:
    decoder = model.get_decoder()  # type: ignore[operator]
    return any("forward" in vars(module) for module in (decoder, *decoder.layers))
