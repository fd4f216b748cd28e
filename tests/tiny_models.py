"""Tiny random transformers configs of each supported architecture, for fast model tests."""

from __future__ import annotations

TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3")

# A wider init than HF's 0.02 makes logits of the random models peaked enough that
# greedy picks are not near-ties (fp32 packed vs unpacked differ in the last bits).
_TINY_COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    tie_word_embeddings=False,
)


def tiny_config(arch: str) -> object:
    """A tiny transformers config of `arch` (GQA 4 q heads / 2 kv heads, head_dim 16)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if arch == "llama":
        return LlamaConfig(**_TINY_COMMON)
    if arch == "mistral":
        return MistralConfig(**_TINY_COMMON, sliding_window=None)
    if arch == "qwen2":
        return Qwen2Config(**_TINY_COMMON)  # Qwen2 has q/k/v biases: covered here
    if arch == "qwen3":
        return Qwen3Config(**_TINY_COMMON)  # Qwen3 has q/k RMSNorm: covered here
    raise ValueError(arch)
