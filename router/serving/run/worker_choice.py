"""Which workers an attempt goes to: the routing rules (router/routing/placement.py) over
the pools' routable workers, waiting (not failing) while a whole pool is down and being
replaced, and where a disaggregated request's prompt runs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from engine.wire import GenerationInput, PoolName
from router.routing.kv_index import PrefixIndex
from router.routing.placement import Route, place_prompt, route_by_cache
from router.routing.prefill_policy import PathDecision, PrefillPolicyConfig
from router.serving.config import RouterConfig
from router.serving.run.attempts import WorkerLost
from router.serving.workers import Pools, WorkerRef

WORKER_WAIT_POLL_S = 0.05


class WorkerChoice:
    """Picks workers by cache overlap and load, the prompt's path by the prefill policy
    (read at each choice: the admin API may change it while serving)."""

    def __init__(
        self,
        pools: Pools,
        indexes: dict[PoolName, PrefixIndex],
        config: RouterConfig,
        block_size: int,
        policy: Callable[[], PrefillPolicyConfig],
    ) -> None:
        self.pools = pools
        self.indexes = indexes
        self.config = config
        self.block_size = block_size
        self.policy = policy

    @property
    def routing_policy(self) -> str:
        return self.config.routing.policy

    def hash_prompt(self, pool: PoolName, token_ids: Sequence[int]) -> list[int]:
        """The prompt's block hashes, as `pool`'s prefix index knows blocks."""
        return self.indexes[pool].hash_prompt(token_ids)

    def num_cached(self, ref: WorkerRef, hashes: list[int]) -> int:
        """Prompt tokens `ref`'s prefix cache holds."""
        return self.indexes[ref.pool].num_cached_tokens(ref.index, hashes)

    async def token_worker(self, pool: PoolName, hashes: list[int]) -> WorkerRef:
        """A decode or colocated worker: cache overlap against requests in flight."""
        route = route_by_cache(self.indexes[pool], hashes, self.config.routing)
        return await self._pick(lambda: self.pools.routable(pool), pool, route)

    def prompt_path(
        self, inp: GenerationInput, hashes: list[int], decode_ref: WorkerRef, run_locally: bool
    ) -> tuple[PathDecision, WorkerRef | None, int]:
        """Where the prompt runs: (decision, the prefill worker if remote, the prompt's
        uncached tokens there). `run_locally`: the prefill pool failed the last attempt."""
        if run_locally:
            return PathDecision("local", "prefill_failed"), None, 0
        return place_prompt(
            num_prompt=len(inp.prompt_token_ids),
            max_tokens=inp.sampling.max_tokens,
            hashes=hashes,
            decode_ref=decode_ref,
            prefill_candidates=[
                w for w in self.pools.routable(PoolName.PREFILL) if decode_ref.worker_id in w.peers
            ],
            indexes=self.indexes,
            routing=self.config.routing,
            policy=self.policy(),
            block_size=self.block_size,
        )

    async def _pick(
        self, candidates: Callable[[], Sequence[WorkerRef]], what: str, route: Route
    ) -> WorkerRef:
        """The worker `route` picks among the candidates, waiting (not failing) while a
        whole pool is down and being replaced."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.worker_wait_s
        while True:
            live = candidates()
            if live:
                return route(live)
            if loop.time() >= deadline:
                raise WorkerLost(f"no {what} worker became available")
            await asyncio.sleep(WORKER_WAIT_POLL_S)
