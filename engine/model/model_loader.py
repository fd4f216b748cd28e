"""Load a causal LM (real or random weights) and its tokenizer from a local HF folder, offline.

Random ("dummy") weights need only config.json: benchmarks of big shapes run without
downloading anything. Folders without tokenizer files (deploy/model_configs/*) cannot
turn text into tokens, so requests to them must carry `prompt_token_ids`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from engine.model.model_spec import DTYPE_NAMES, ModelSpec, read_generation_eos
from engine.parallel.tensor_parallel import SINGLE, TPRank

# Seed of `load_format="dummy"` weights of a one-process model (fixed: see load_model).
# A tensor-parallel model draws its own (engine.parallel.sharded_loader).
DUMMY_WEIGHTS_SEED = 0

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

LoadFormat = Literal["auto", "dummy"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def resolve_dtype(name: str | None, device: str | torch.device) -> torch.dtype:
    """The torch dtype for `name`; None picks float32 on CPU and bfloat16 on CUDA."""
    if name is None:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """Inverse of `DTYPES`: torch.bfloat16 → 'bfloat16'."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}; use one of {', '.join(DTYPE_NAMES)}")


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' tqdm bars ("Loading weights") off while loading: from a worker they
    reach the service's log as carriage-return redraws behind Ray's line prefix. Restored
    after, for a library user who had them on."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@_no_progress_bars()
def load_model(
    path: str | Path,
    dtype: str | None = None,
    device: str | torch.device = "cpu",
    load_format: LoadFormat = "auto",
    tp: TPRank = SINGLE,
) -> tuple[torch.nn.Module, ModelSpec]:
    """Load the model in `path` for inference on `device`; returns it with its ModelSpec.
    With `tp` of more than one rank, this rank's share only (engine.parallel.sharded_loader)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import is_accelerate_available

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, device)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    # Validate (and reject unsupported architectures) before any heavy work.
    spec = ModelSpec.from_hf_config(
        config,
        name=path.resolve().name,
        dtype=dtype_name(torch_dtype),
        extra_eos_token_ids=read_generation_eos(path),
        tensor_parallel_size=tp.size,
    )
    if tp.size > 1:
        return _load_shard(path, config, tp, torch_dtype, device, load_format), spec
    if load_format == "dummy":
        # Allocating and initialising under the target device keeps big shapes off
        # the CPU (an 8B model's init on 2 cores would take minutes). A fixed seed gives
        # every process the same weights on the same device type: prefill and decode
        # workers must agree, and tests compare a service with a colocated engine.
        # (CPU and CUDA generators differ: a CPU and a CUDA model still differ.)
        rng_devices = (
            [device.index if device.index is not None else torch.cuda.current_device()]
            if device.type == "cuda"
            else []
        )
        with torch.random.fork_rng(devices=rng_devices), torch.device(device):
            torch.manual_seed(DUMMY_WEIGHTS_SEED)
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    elif load_format == "auto":
        kwargs: dict[str, object] = {}
        # transformers 5.24 demands `accelerate` for device_map; without it the
        # weights are read on the CPU and moved once.
        if is_accelerate_available():
            kwargs["device_map"] = str(device)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, local_files_only=True, **kwargs
        )
        model = model.to(device)  # type: ignore[arg-type]  # transformers' stub for .to
    else:
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    model.eval()
    model.requires_grad_(False)
    return model, spec


def _load_shard(
    path: Path,
    config: object,
    tp: TPRank,
    dtype: torch.dtype,
    device: torch.device,
    load_format: LoadFormat,
) -> torch.nn.Module:
    from engine.parallel import sharded_loader

    if load_format == "dummy":
        return sharded_loader.build_sharded_model(
            config, tp, dtype, device, sharded_loader.dummy_reader(config, dtype, device)
        )
    if load_format != "auto":
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    with sharded_loader.safetensors_reader(path) as read:
        return sharded_loader.build_sharded_model(config, tp, dtype, device, read)


def has_tokenizer(path: str | Path) -> bool:
    """True when `path` ships tokenizer files (dummy benchmark configs do not)."""
    return any((Path(path) / name).is_file() for name in _TOKENIZER_FILES)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in `path`, offline."""
    from transformers import AutoTokenizer

    if not has_tokenizer(path):
        raise FileNotFoundError(
            f"no tokenizer files in {path}: this model takes prompt_token_ids, not text"
        )
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
