"""What two workers must agree on before they exchange KV blocks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    """What two workers must agree on before they can exchange blocks."""

    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # Ranks the worker's KV heads are split over. Not compared: workers of different
    # sizes hand KV off in parts (engine.transfer.tp_parts).
    tensor_parallel_size: int = 1

    def mismatch(self, other: KVLayout) -> str | None:
        """A message naming the first field that differs, or None if compatible."""
        for name in (
            "model",
            "dtype",
            "block_size",
            "num_layers",
            "num_kv_heads",
            "head_dim",
        ):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} differs: {mine!r} vs {theirs!r}"
        return None
