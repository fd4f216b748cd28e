"""How many workers a pool may hold: one rule for `pdserve scale` and AdminService."""

from __future__ import annotations

MAX_POOL_SIZE = 1024


def pool_size_problem(size: int) -> str | None:
    """Why a pool cannot be scaled to `size` workers, or None (a pool that exists keeps at
    least one: a drain, not a scale to 0, takes its last worker away)."""
    if not 1 <= size <= MAX_POOL_SIZE:
        return f"size must be between 1 and {MAX_POOL_SIZE}, got {size}"
    return None
