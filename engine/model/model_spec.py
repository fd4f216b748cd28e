"""What the engine needs to know about a model, read once from its HF config.

No torch here: the router and the pairing check use `ModelSpec` without a GPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.parallel.tp_heads import check_tp_size, num_local_kv_heads

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")

# model_type → architecture, for configs (e.g. built in memory) that lack `architectures`.
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def check_architecture(architecture: str) -> None:
    """Raise ValueError naming `architecture` unless pdserve can run it."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def _dtype_name(value: Any) -> str | None:
    """Normalise a config's dtype (torch.dtype, 'torch.bfloat16', 'bfloat16', None) to a name."""
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    return name if name in DTYPE_NAMES else None


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class ModelSpec:
    """Shape facts of a causal LM that the KV cache, sampler and scheduler depend on."""

    name: str  # the model folder's name; part of the pairing key
    architecture: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    dtype: str  # the dtype weights and KV cache run in, e.g. "bfloat16"
    # Ranks the model is split over (engine.parallel.tensor_parallel); each holds
    # `num_local_kv_heads` of the KV heads, and the KV sizes below are one rank's.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        for field_name in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "vocab_size"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"{field_name} must be >= 1, got {getattr(self, field_name)}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        check_tp_size(self.num_q_heads, self.num_kv_heads, self.tensor_parallel_size)
        object.__setattr__(self, "eos_token_ids", _as_id_tuple(self.eos_token_ids))

    @classmethod
    def from_hf_config(
        cls,
        config: Any,
        *,
        name: str = "",
        dtype: str | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
        tensor_parallel_size: int = 1,
    ) -> ModelSpec:
        """Build from a transformers config object (or anything with the same attributes)."""
        architectures = list(getattr(config, "architectures", None) or [])
        if not architectures:
            model_type = getattr(config, "model_type", "")
            architectures = [_ARCH_BY_MODEL_TYPE.get(model_type, f"<model_type {model_type!r}>")]
        architecture = architectures[0]
        check_architecture(architecture)
        num_q_heads = int(config.num_attention_heads)
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_q_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_q_heads
        max_model_len = int(config.max_position_embeddings)
        # The paged attention has no sliding-window mask: capping the context at the
        # window makes every window cover the whole sequence, so results stay exact.
        sliding_window = getattr(config, "sliding_window", None)
        if sliding_window:
            max_model_len = min(max_model_len, int(sliding_window))
        eos = list(_as_id_tuple(getattr(config, "eos_token_id", None)))
        eos += [t for t in extra_eos_token_ids if t not in eos]
        resolved = dtype or _dtype_name(getattr(config, "dtype", None)) or "float32"
        return cls(
            name=name or str(getattr(config, "name_or_path", "") or architecture),
            architecture=architecture,
            num_layers=int(config.num_hidden_layers),
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            hidden_size=int(config.hidden_size),
            vocab_size=int(config.vocab_size),
            max_model_len=max_model_len,
            eos_token_ids=tuple(eos),
            dtype=resolved,
            tensor_parallel_size=tensor_parallel_size,
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | Path, *, dtype: str | None = None) -> ModelSpec:
        """Read config.json (and generation_config.json when present) from a model folder."""
        from transformers import AutoConfig  # heavy import, only when a folder is read

        path = Path(path)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        return cls.from_hf_config(
            config,
            name=path.resolve().name,
            dtype=dtype,
            extra_eos_token_ids=read_generation_eos(path),
        )

    @property
    def num_local_kv_heads(self) -> int:
        """The KV heads one rank's cache holds."""
        return num_local_kv_heads(self.num_kv_heads, self.tensor_parallel_size)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers on one rank, in this spec's dtype."""
        return kv_bytes_per_token(
            self.num_layers, self.num_local_kv_heads, self.head_dim, DTYPE_SIZES[self.dtype]
        )

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes of one KV block (all layers, K and V): the unit a hand-off moves."""
        return block_size * self.kv_bytes_per_token


DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of K and V of one token over all layers: the one formula every size of the
    KV cache (a block, a hand-off, a budget, a benchmark's memory floor) comes from."""
    return 2 * num_layers * num_kv_heads * head_dim * itemsize


def read_generation_eos(path: str | Path) -> tuple[int, ...]:
    """eos ids from a folder's generation_config.json; instruct models often add theirs there."""
    gen_path = Path(path) / "generation_config.json"
    if not gen_path.is_file():
        return ()
    with gen_path.open() as f:
        return _as_id_tuple(json.load(f).get("eos_token_id"))
