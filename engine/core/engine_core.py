"""The engine core: one step loop, `schedule() -> execute(batch) -> update(outputs)`."""

from __future__ import annotations

import random
from typing import Protocol

from engine.core.batch import Batch
from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.kv_events import KVEvents
from engine.core.outputs import GenerationInput
from engine.core.request import FinishReason, Request
from engine.core.scheduler import RequestUpdate, Scheduler
from engine.core.validation import validate_prompt
from engine.sampling_params import MAX_SEED


class Runner(Protocol):
    """What the engine needs from a model runner (the real one or a test double)."""

    def execute(self, batch: Batch) -> dict[str, int]: ...


class EngineCore:
    """Validates and admits requests, then advances all of them one step at a time.

    Not thread-safe: callers serialise add/abort/step (the async loop does).
    """

    def __init__(
        self,
        runner: Runner,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: frozenset[int] = frozenset(),
        handoff_after_first_token: bool = False,
    ) -> None:
        self.runner = runner
        self.scheduler = Scheduler(
            scheduler_config, cache_config, handoff_after_first_token=handoff_after_first_token
        )
        self.cache_config = cache_config
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._rng = random.Random()

    def make_request(self, inp: GenerationInput) -> Request:
        """Validate an input and turn it into engine state (raises ValueError)."""
        validate_prompt(
            inp.prompt_token_ids,
            inp.sampling,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            max_cache_tokens=self.cache_config.num_token_slots,
        )
        seed = inp.sampling.seed
        if seed is None:
            seed = self._rng.randint(0, MAX_SEED)
        return Request(
            req_id=inp.req_id,
            prompt_token_ids=list(inp.prompt_token_ids),
            sampling=inp.sampling,
            seed=seed,
            eos_token_ids=self.eos_token_ids,
            priority=inp.priority,
            max_model_len=self.max_model_len,
        )

    def add_request(self, inp: GenerationInput) -> Request:
        """Validate and queue a request."""
        req = self.make_request(inp)
        self.scheduler.add_request(req)
        return req

    def abort(self, req_id: str) -> None:
        """End a request in any state and free its blocks; unknown ids are ignored."""
        self.scheduler.finish_request(req_id, FinishReason.ABORT)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def take_kv_events(self) -> KVEvents:
        """Prefix-cache changes since the last call, for a cache-aware router."""
        return self.scheduler.kv.take_kv_events()

    def step(self) -> list[RequestUpdate]:
        """Run one iteration; returns the new tokens and finishes of this step."""
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        sampled = self.runner.execute(batch)
        return self.scheduler.update(batch, sampled)
