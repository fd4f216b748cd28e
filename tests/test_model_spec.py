"""ModelSpec from HF configs, the KV pairing check, and the loader's dtype/dummy paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.model.model_loader import has_tokenizer, load_model, load_tokenizer, resolve_dtype
from engine.model.model_spec import SUPPORTED_ARCHITECTURES, ModelSpec

REPO = Path(__file__).resolve().parent.parent


def _write_config(folder: Path, **overrides: object) -> Path:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "max_position_embeddings": 256,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    config.update(overrides)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_spec_reads_shapes_dtype_and_eos_from_both_configs(tmp_path: Path) -> None:
    folder = _write_config(tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    spec = ModelSpec.from_pretrained_dir(folder)
    shape = (spec.architecture, spec.num_layers, spec.num_q_heads, spec.num_kv_heads)
    assert shape == ("LlamaForCausalLM", 2, 4, 2)
    assert spec.head_dim == 16  # hidden_size / heads when head_dim is absent
    assert spec.eos_token_ids == (2, 7)
    assert spec.dtype == "bfloat16"
    assert spec.max_model_len == 256
    assert spec.name == "m"


def test_sliding_window_caps_max_model_len(tmp_path: Path) -> None:
    mistral = _write_config(
        tmp_path / "mistral",
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        sliding_window=64,
    )
    assert ModelSpec.from_pretrained_dir(mistral).max_model_len == 64
    # Qwen2 ships a sliding_window number that is off unless use_sliding_window is set.
    qwen = _write_config(
        tmp_path / "qwen2",
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        sliding_window=64,
        use_sliding_window=False,
    )
    assert ModelSpec.from_pretrained_dir(qwen).max_model_len == 256


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    folder = _write_config(tmp_path / "g", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        load_model(folder, load_format="dummy")
    assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)


def test_kv_layout_mismatch_names_first_differing_field(tmp_path: Path) -> None:
    from engine.wire import KVLayout

    a = KVLayout("m", "bfloat16", 16, 2, 2, 16)
    assert a.mismatch(a) is None
    assert a.mismatch(KVLayout("m", "bfloat16", 16, 2, 4, 16)) == "num_kv_heads differs: 2 vs 4"
    assert a.mismatch(KVLayout("m", "float32", 32, 2, 2, 16)) == (
        "dtype differs: 'bfloat16' vs 'float32'"
    )


def test_deploy_configs_describe_the_real_models() -> None:
    small = ModelSpec.from_pretrained_dir(REPO / "deploy/model_configs/llama-3.2-1b")
    big = ModelSpec.from_pretrained_dir(REPO / "deploy/model_configs/llama-3.1-8b")
    small_shape = (small.num_layers, small.num_kv_heads, small.head_dim, small.vocab_size)
    assert small_shape == (16, 8, 64, 128256)
    assert (big.num_layers, big.num_kv_heads, big.head_dim, big.hidden_size) == (32, 8, 128, 4096)
    assert big.kv_bytes_per_token == 128 * 1024
    huge = ModelSpec.from_pretrained_dir(REPO / "deploy/model_configs/llama-70b")
    huge_shape = (huge.num_layers, huge.num_q_heads, huge.num_kv_heads, huge.head_dim)
    assert huge_shape == (80, 64, 8, 128) and huge.hidden_size == 8192
    assert (huge.vocab_size, huge.max_model_len, huge.dtype) == (128256, 131072, "bfloat16")
    assert huge.kv_bytes_per_token == 320 * 1024
    assert not has_tokenizer(REPO / "deploy/model_configs/llama-3.1-8b")
    with pytest.raises(FileNotFoundError, match="prompt_token_ids"):
        load_tokenizer(REPO / "deploy/model_configs/llama-3.1-8b")


def test_dummy_load_builds_random_weights_from_config_alone(tmp_path: Path) -> None:
    model, spec = load_model(_write_config(tmp_path / "m"), dtype="bfloat16", load_format="dummy")
    assert spec.dtype == "bfloat16"
    weight = model.get_parameter("model.layers.0.self_attn.q_proj.weight")
    assert weight.dtype == torch.bfloat16 and 0.005 < float(weight.float().std()) < 0.1
    assert not any(p.requires_grad for p in model.parameters())


def test_resolve_dtype_defaults_by_device() -> None:
    assert resolve_dtype(None, "cpu") == torch.float32
    assert resolve_dtype(None, "cuda") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        resolve_dtype("int8", "cpu")
