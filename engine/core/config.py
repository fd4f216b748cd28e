"""Frozen, validated configuration for the scheduler and the KV cache."""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.core.waiting_queue import QUEUE_POLICIES, QueuePolicy

# Tokens per step when none is given, by device type. On a GPU a step of 2048 tokens
# leaves the prompt GEMMs short and pays each step's fixed cost (the running decodes, the
# launch) four times as often: a burst of prompts finishes clearly sooner with 8192
# (docs/benchmarks-history.md); vLLM and SGLang use 8192 on GPUs of this size too.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 8192}
FALLBACK_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class SchedulerConfig:
    """Knobs of the iteration-level scheduler; each is a `pdserve serve` flag per pool."""

    max_num_seqs: int = 128
    # None: the device's default (for_device); 2048 where no device is named.
    max_num_batched_tokens: int | None = None
    # 0 = chunked prefill off: a prompt is split only when it does not fit the
    # step's remaining token budget; > 0 caps every prompt chunk at this many tokens.
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    policy: QueuePolicy = "fcfs"
    prioritize_prefill: bool = False
    # Priority policy: a waiting request gains one priority level per this many seconds
    # it has waited (0 = no aging). See engine/core/waiting_queue.py.
    priority_aging_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0 (0 = chunked prefill off), "
                f"got {self.long_prefill_token_threshold}"
            )
        if self.policy not in QUEUE_POLICIES:
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.priority_aging_s < 0:
            raise ValueError(
                f"priority_aging_s must be >= 0 (0 = no aging), got {self.priority_aging_s}"
            )

    @property
    def step_tokens(self) -> int:
        """The token budget of one step."""
        return self.max_num_batched_tokens or FALLBACK_MAX_NUM_BATCHED_TOKENS

    def for_device(self, device_type: str) -> SchedulerConfig:
        """This config with an unset token budget filled in for the device type."""
        if self.max_num_batched_tokens is not None:
            return self
        budget = DEFAULT_MAX_NUM_BATCHED_TOKENS.get(device_type, FALLBACK_MAX_NUM_BATCHED_TOKENS)
        return replace(self, max_num_batched_tokens=budget)


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
