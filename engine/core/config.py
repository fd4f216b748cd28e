"""Frozen, validated configuration for the scheduler and the KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Policy = Literal["fcfs", "priority"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Knobs of the iteration-level scheduler; each is a `pdserve serve` flag per pool."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    # 0 = chunked prefill off: a prompt is split only when it does not fit the
    # step's remaining token budget; > 0 caps every prompt chunk at this many tokens.
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    policy: Policy = "fcfs"
    prioritize_prefill: bool = False
    # Priority policy: a waiting request gains one priority level per this many seconds
    # it has waited (0 = no aging). See engine/core/priority.py.
    priority_aging_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0 (0 = chunked prefill off), "
                f"got {self.long_prefill_token_threshold}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.priority_aging_s < 0:
            raise ValueError(
                f"priority_aging_s must be >= 0 (0 = no aging), got {self.priority_aging_s}"
            )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry."""

    num_blocks: int
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")

    @property
    def num_token_slots(self) -> int:
        return self.num_blocks * self.block_size
