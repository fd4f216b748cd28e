"""The planner against the router's own parts, without Ray: what the serving core records
for it, its loop growing and draining real `Pools` (over a fake cluster), its metrics,
and the admin API's view of its last decision."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import pytest
from prometheus_client import CollectorRegistry

from bench.fake_workers import FakePools
from bench.harness import wait_until_async
from engine.core.outputs import FinalResult
from engine.sampling_params import SamplingParams
from pdserve.v1 import admin_pb2 as pb
from router.edge.admin import AdminServicer
from router.fleet.pools import Pools
from router.planner.config import PlannerConfig
from router.planner.loop import PlannerLoop
from router.planner.metrics import PlannerMetrics
from router.planner.signals import ServingSignals
from router.routing.prefill_policy import PrefillPolicyConfig
from router.serving.config import RouterConfig
from router.serving.orchestrator import DisaggregatedGenerator
from router.serving.protocol import GenerateCall
from tests.fakes import WordTokenizer
from tests.test_pools import FakeCluster


def test_the_serving_core_records_what_the_planner_reads() -> None:
    async def body() -> None:
        pools = FakePools(1, 1)
        pools.fakes["prefill-0"].prefill_delay_s = 0.01
        core = DisaggregatedGenerator(pools, WordTokenizer(), RouterConfig())
        core.start()
        core.signals.take(1.0)

        async def run(num_prompt: int, max_tokens: int) -> None:
            call = GenerateCall(
                "", None, tuple(range(100, 100 + num_prompt)), None,
                SamplingParams(max_tokens=max_tokens, seed=num_prompt),
            )  # fmt: skip
            async for item in core.generate(call):
                if isinstance(item, FinalResult):
                    assert item.finish_reason.value == "length"

        await asyncio.gather(run(64, 8), run(96, 8), run(20, 4))
        traffic, prefill, decode = core.signals.take(1.0)
        assert traffic.num_arrivals == 3 and traffic.num_finished == 3
        # Two prompts handed off; the short one ran on its decode worker by design, so it
        # is not the prefill pool's work.
        assert (traffic.num_prompts, traffic.prompt_tokens) == (2, 64 + 96)
        assert traffic.sum_sq_prompt_tokens == 64**2 + 96**2
        assert traffic.output_tokens == 20 and len(traffic.ttft_s) == 3
        assert len(traffic.tpot_s) == 3 and all(t > 0 for t in traffic.tpot_s)
        assert traffic.oldest_waiting_s == 0 and traffic.num_waiting_past_ttft == 0
        assert prefill and prefill[0].num_prompts == 1 and prefill[0].seconds >= 0.01
        assert decode and all(s.batch_size >= 1 and s.step_s > 0 for s in decode)
        again, _, _ = core.signals.take(1.0)
        assert again.num_arrivals == 0 and again.ttft_s == ()  # each interval once
        await core.stop()

    asyncio.run(body())


def test_a_request_still_waiting_for_its_first_token_is_seen_as_waiting() -> None:
    now = [0.0]
    signals = ServingSignals(lambda: now[0])
    signals.request_arrived("a")
    signals.request_arrived("b")
    now[0] = 3.0
    signals.first_token("a", 3.0)
    traffic, _, _ = signals.take(slo_ttft_s=1.0)
    assert traffic.ttft_s == (3.0,)
    assert (traffic.oldest_waiting_s, traffic.num_waiting_past_ttft) == (3.0, 1)
    signals.request_ended("b", 0, None, completed=False)  # cancelled: not a completion
    traffic, _, _ = signals.take(slo_ttft_s=1.0)
    assert traffic.num_waiting_past_ttft == 0 and traffic.num_finished == 0


@dataclass
class _Core:
    """The serving core's side the planner reads."""

    signals: ServingSignals
    prefill_policy: PrefillPolicyConfig = field(default_factory=PrefillPolicyConfig)


class _Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RuntimeError(f"{code.name}: {details}")


def test_the_loop_grows_a_short_pool_then_drains_it_when_the_load_stops() -> None:
    async def body() -> None:
        now = [100.0]
        pools = Pools(FakeCluster())
        await pools.start()
        core = _Core(ServingSignals(lambda: now[0]))
        registry = CollectorRegistry()
        config = PlannerConfig(max_workers=3, interval_s=1.0, cooldown_s=2.0)
        loop = PlannerLoop(
            config, pools, core, max_num_seqs=64, metrics=PlannerMetrics(registry),
            clock=lambda: now[0],
        )  # fmt: skip
        loop.start()

        def second(arrivals: int) -> None:
            """One second of traffic: 1000-token prompts, each 0.5 s of a worker alone."""
            for i in range(arrivals):
                core.signals.request_arrived(f"r{now[0]}-{i}")
                core.signals.prompt_placed(1000, prefill_work=True)
                core.signals.prefill_reply("prefill-0", 1000, 0.5, now[0], was_idle=True)
                core.signals.first_token(f"r{now[0]}-{i}", 0.6)
                core.signals.request_ended(f"r{now[0]}-{i}", 2, 0.01, completed=True)
            now[0] += 1.0

        # Two prompts a second: one worker's whole time, more than it may carry.
        for _ in range(3):
            second(2)
            decision = loop.step()
        assert decision.of("prefill").reason == "capacity_short"
        await wait_until_async(lambda: len(pools.routable("prefill")) == 2, 2)
        assert pools.targets == {"prefill": 2, "decode": 1, "colocated": 0}
        assert (
            registry.get_sample_value(
                "pdserve_planner_decisions_total",
                {"pool": "prefill", "action": "scale_up", "reason": "capacity_short"},
            )
            == 1
        )
        assert registry.get_sample_value("pdserve_planner_target_workers", {"pool": "prefill"}) == 2
        load = registry.get_sample_value("pdserve_planner_load_workers", {"pool": "prefill"})
        assert load == pytest.approx(1.0, rel=0.2)  # two prompts a second of half a second

        admin = AdminServicer(lambda: pools, True, planner=lambda: loop)
        listing = await admin.ListWorkers(pb.ListWorkersRequest(), _Context())
        status = listing.planner
        assert status.max_workers == 3 and status.traffic.startswith("2.00 req/s")
        prefill = next(p for p in status.pools if p.pool == "prefill")
        assert (prefill.current, prefill.target, prefill.action) == (1, 2, "scale_up")
        assert prefill.HasField("load_workers") and "prompts/s" in prefill.detail
        with pytest.raises(RuntimeError, match="FAILED_PRECONDITION: the planner sizes"):
            await admin.ScalePool(pb.ScalePoolRequest(pool="decode", size=2), _Context())

        # The load stops: after a cool-down idle, the newest worker is drained.
        reasons = []
        for _ in range(8):
            second(0)
            decision = loop.step()
            reasons.append(decision.of("prefill").reason)
            if decision.changes:
                break
        assert reasons[-1] == "idle" and "cooldown" in reasons
        await wait_until_async(
            lambda: [w.worker_id for w in pools.all()] == ["prefill-0", "decode-0"], 2
        )
        assert pools.targets["prefill"] == 1
        await loop.stop()
        await pools.stop()

    asyncio.run(body())
