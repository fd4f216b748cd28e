"""Load one rank's share of a model for tensor parallelism.

The model is built from a local config (this rank's heads and MLP width) directly on the
device, its row-parallel and vocabulary-parallel modules swapped in
(engine.parallel.tensor_parallel), and each parameter filled from this rank's slice of the
checkpoint: safetensors reads only the rows or columns asked for, one tensor at a time,
so host memory peaks near one tensor's shard, never at the whole checkpoint.

Random ("dummy") weights are drawn per checkpoint tensor at its full shape from a seed
made of its name, then sliced: every TP size above 1 draws the same full model, so
groups of different sizes compute the same numbers. (A one-process model draws its
weights as transformers initialises them: a different random model.)
"""

from __future__ import annotations

import copy
import json
import zlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from engine.parallel.tensor_parallel import (
    RowParallel,
    ShardPlan,
    TPRank,
    VocabParallelEmbedding,
    VocabParallelHead,
)

# Reads the part `index` of checkpoint tensor `name`, on the host.
PartReader = Callable[[str, tuple[slice, ...]], torch.Tensor]


def local_config(config: Any, plan: ShardPlan) -> Any:
    """The model's config with this rank's share of heads and MLP width."""
    local = copy.deepcopy(config)
    size = plan.tp.size
    local.head_dim = plan.head_dim
    local.num_attention_heads = plan.num_q_heads // size
    local.num_key_value_heads = max(plan.num_kv_heads // size, 1)
    local.intermediate_size = plan.intermediate_size // size
    local.tie_word_embeddings = False  # both vocabulary modules are replaced below
    return local


def shard_plan(config: Any, tp: TPRank) -> ShardPlan:
    """How `config`'s model splits over `tp` (ValueError naming the numbers if it cannot)."""
    num_q = int(config.num_attention_heads)
    return ShardPlan(
        tp=tp,
        num_q_heads=num_q,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_q),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // num_q),
        intermediate_size=int(config.intermediate_size),
        vocab_size=int(config.vocab_size),
    )


def build_sharded_model(
    config: Any,
    tp: TPRank,
    dtype: torch.dtype,
    device: torch.device,
    read_part: PartReader,
) -> torch.nn.Module:
    """This rank's model, its parameters filled by `read_part`."""
    from transformers import AutoModelForCausalLM

    plan = shard_plan(config, tp)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(local_config(config, plan), dtype=dtype)
    decoder = model.get_decoder()
    for layer in decoder.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, tp)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, tp)
    rows, hidden = plan.vocab_rows_per_rank, int(config.hidden_size)
    decoder.embed_tokens = VocabParallelEmbedding(
        torch.empty(rows, hidden, dtype=dtype, device=device), plan.vocab_start, tp
    )
    model.lm_head = VocabParallelHead(
        torch.empty(rows, hidden, dtype=dtype, device=device), plan.vocab_size, tp
    )
    tied = bool(getattr(config, "tie_word_embeddings", False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            source = name.replace(".linear.", ".")
            if source == "lm_head.weight" and tied:
                source = "model.embed_tokens.weight"
            part = plan.finish(source, read_part(source, plan.index_for(source)))
            if part.shape != param.shape:
                raise ValueError(
                    f"{source}: this rank's part has shape {tuple(part.shape)}, the model "
                    f"expects {tuple(param.shape)}"
                )
            param.copy_(part)
    model.eval()
    model.requires_grad_(False)
    return model


@contextmanager
def safetensors_reader(path: Path) -> Iterator[PartReader]:
    """A reader of the folder's safetensors files (one file, or shards with an index)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = ["model.safetensors"]
        if not (path / files[0]).is_file():
            raise FileNotFoundError(
                f"no safetensors weights in {path}: tensor parallelism reads "
                "model.safetensors or model.safetensors.index.json"
            )
        weight_map = {}
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(path / f, framework="pt")) for f in files}
        if not weight_map:
            weight_map = {key: files[0] for key in handles[files[0]].keys()}  # noqa: SIM118

        def read(name: str, index: tuple[slice, ...]) -> torch.Tensor:
            if name not in weight_map:
                raise KeyError(f"{name} is not in the checkpoint at {path}")
            return handles[weight_map[name]].get_slice(name)[index]

        yield read


def dummy_reader(config: Any, dtype: torch.dtype, device: torch.device) -> PartReader:
    """Random weights drawn per tensor at its full shape (seeded by its name), sliced."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        full = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    shapes = {name: tuple(t.shape) for name, t in full.state_dict().items()}
    std = float(getattr(config, "initializer_range", 0.02))

    def read(name: str, index: tuple[slice, ...]) -> torch.Tensor:
        shape = shapes[name]
        if name.endswith(".bias"):
            return torch.zeros(shape, dtype=dtype, device=device)[index]
        if "norm" in name.rsplit(".", 2)[-2]:
            return torch.ones(shape, dtype=dtype, device=device)[index]
        generator = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
        weights = torch.randn(shape, generator=generator, dtype=dtype, device=device)
        return weights.mul_(std)[index]

    return read
