"""Where a prompt runs: the decision's rules, and changing them while serving."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import grpc
import pytest

from bench.fake_workers import FakePools
from engine.core.outputs import FinalResult
from engine.core.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.wire import EngineSpeed, PoolName, WorkerStats
from pdserve.v1 import admin_pb2 as pb
from router.edge.admin import AdminServicer
from router.routing.prefill_policy import (
    PathInputs,
    PrefillPolicyConfig,
    PrefillRate,
    StepWindow,
    decide,
)
from router.routing.worker_load import WorkerLoad
from router.serving.config import RouterConfig
from router.serving.orchestrator import DisaggregatedGenerator
from router.serving.protocol import GenerateCall
from tests.fakes import WordTokenizer

IDLE = PathInputs(
    has_prefill=True,
    num_uncached_decode=512,
    num_uncached_prefill=512,
    prefill_queued_tokens=0,
    prefill_tokens_per_s=10_000.0,
    handoff_s=0.001,
    decode_running=8,
    decode_step_s=0.010,
    decode_queued_tokens=0,
    decode_free_blocks=1000,
    num_prompt_blocks=32,
    num_output_tokens=10,
)
SATURATED: dict[str, Any] = {"prefill_queued_tokens": 20_000, "num_uncached_decode": 400}
POLICY = PrefillPolicyConfig(local_prefill_max_tokens=32, slo_ttft_ms=1000, slo_tpot_ms=50)


@pytest.mark.parametrize(
    ("changes", "path", "reason"),
    [
        ({}, "remote", "prefill_within_slo"),
        ({"has_prefill": False}, "local", "no_prefill_worker"),
        ({"num_uncached_decode": 20}, "local", "short_prompt"),
        ({"decode_free_blocks": 40}, "remote", "decode_kv_pressure"),
        ({"prefill_tokens_per_s": None}, "remote", "no_estimate"),
        # 20 000 tokens queued at 10 000 tok/s: 2 s to the first token remotely; the
        # decode worker has nothing queued: 400 tokens take it 40 ms, 4 ms over each of
        # a running request's 10 output tokens.
        ({**SATURATED, "decode_step_s": 0.002}, "local", "prefill_saturated"),
        # The same on a decode worker already at 48 ms a step: 52 ms, over the target.
        ({**SATURATED, "decode_step_s": 0.048}, "remote", "decode_at_tpot_slo"),
        # At 38 ms a step: 42 ms, under the 50 ms target but not within 80 % of it
        # (a mean at the target would leave half the requests over it).
        ({**SATURATED, "decode_step_s": 0.038}, "remote", "decode_at_tpot_slo"),
        # Saturated, but the decode worker's own queue is longer still (0.74 s against
        # 0.6 s remotely).
        (
            {
                **SATURATED,
                "prefill_queued_tokens": 6_000,
                "decode_step_s": 0.002,
                "decode_queued_tokens": 7_000,
                "num_output_tokens": 1000,
            },
            "remote",
            "remote_sooner",
        ),
        # Overloaded: 2 s remotely, 1.6 s of prompts queued on the decode worker. Sooner
        # there, but past the 1 s target either way: its running requests keep their pace.
        (
            {
                **SATURATED,
                "decode_step_s": 0.002,
                "decode_queued_tokens": 16_000,
                "num_output_tokens": 1000,
            },
            "remote",
            "decode_past_ttft_slo",
        ),
        # Nothing running on decode: its step budget is the only cost.
        ({"prefill_queued_tokens": 20_000, "decode_running": 0}, "local", "prefill_saturated"),
    ],
)
def test_each_rule_gives_its_path_and_reason(
    changes: dict[str, Any], path: str, reason: str
) -> None:
    decision = decide(replace(IDLE, **changes), POLICY)
    assert (decision.path, decision.reason) == (path, reason)


def test_a_decode_worker_slow_at_its_own_prompts_is_priced_at_its_own_rate() -> None:
    # Saturated: 2 s remotely. At the prefill worker's 10 000 tok/s the 400 tokens take
    # the decode worker 40 ms, 4 ms over each of 10 output tokens on a 2 ms step.
    saturated = replace(IDLE, **SATURATED, decode_step_s=0.002)
    assert decide(saturated, POLICY).reason == "prefill_saturated"
    # Its own prompts took 0.2 ms a token lately: 80 ms, still within the TPOT target.
    twice = replace(saturated, decode_local_s_per_token=0.0002)
    decision = decide(twice, POLICY)
    assert decision.reason == "prefill_saturated"
    assert decision.ttft_local_s == pytest.approx(0.082)
    # At 1 ms a token: 400 ms of stall, 42 ms over each output token: past 80 % of 50 ms.
    assert decide(replace(saturated, decode_local_s_per_token=0.001), POLICY).reason == (
        "decode_at_tpot_slo"
    )
    # Faster than the prefill worker's rate is not believed: the pool's rate is a floor.
    fast = decide(replace(saturated, decode_local_s_per_token=0.00001), POLICY)
    assert fast.ttft_local_s == pytest.approx(0.042)


def test_local_prompts_teach_the_load_their_time_per_token_short_ones_do_not() -> None:
    from router.routing.worker_load import WorkerLoad

    load = WorkerLoad()
    load.lease(400, prices_local_prefill=True).done_with_tokens(0.2)
    assert load.local_prefill_s_per_token.value == pytest.approx(0.0005)
    # A short prompt's time is mostly fixed cost; a lease without a time learns nothing.
    load.lease(20, prices_local_prefill=False).done_with_tokens(0.05)
    load.lease(400, prices_local_prefill=True).done_with_tokens(None)
    assert load.local_prefill_s_per_token.value == pytest.approx(0.0005)
    assert load.queued_tokens == 0


def test_a_zero_short_prompt_threshold_hands_every_prompt_off() -> None:
    off = PrefillPolicyConfig(local_prefill_max_tokens=0)
    saturated = replace(IDLE, prefill_queued_tokens=10**6, decode_running=0)
    assert decide(saturated, off).reason == "local_prefill_off"
    assert decide(replace(IDLE, num_uncached_decode=1), off).path == "remote"
    # With no prefill worker to take it, the prompt still runs (locally).
    assert decide(replace(IDLE, has_prefill=False), off).path == "local"


def test_bad_targets_are_refused_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="slo_ttft_ms"):
        PrefillPolicyConfig(slo_ttft_ms=0)
    with pytest.raises(ValueError, match="local_prefill_max_tokens"):
        PrefillPolicyConfig(local_prefill_max_tokens=-1)


def test_prefill_rate_under_load_counts_tokens_over_busy_time() -> None:
    rate = PrefillRate(window_s=0.1)
    rate.observe(512, 0.05, now=10.05, busy_since=10.0, was_idle=True)
    assert rate.tokens_per_s.value == pytest.approx(512 / 0.05)
    # Busy since 10.0 throughout: 16 replies of one step, then 16 of the next.
    for _ in range(16):
        rate.observe(512, 0.2, now=10.2, busy_since=10.0, was_idle=False)
    for _ in range(16):
        rate.observe(512, 0.2, now=10.3, busy_since=10.0, was_idle=False)
    assert rate.tokens_per_s.value is not None and rate.tokens_per_s.value > 20_000


def test_step_time_is_a_mean_over_time_that_a_long_stall_weighs_by_its_length() -> None:
    window = StepWindow(window_s=2.0)
    assert window.mean(0.0) is None
    for i in range(9):  # nine 10 ms steps, then one stall of 110 ms for a local prompt
        window.add(0.01 * (i + 1), 0.01, 1)
    window.add(0.2, 0.11, 1)
    # 200 ms over 10 steps: 20 ms a step, the pace a running request got.
    assert window.mean(0.2) == pytest.approx(0.02)
    # Two seconds on, the nine short steps have left the window; the stall has not.
    window.add(2.15, 0.01, 1)
    assert window.mean(2.15) == pytest.approx(0.06)
    assert window.mean(10.0) is None


class _Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RuntimeError(f"{code.name}: {details}")


def test_the_policy_changes_while_serving_and_applies_to_the_next_request() -> None:
    async def body() -> None:
        pools = FakePools(1, 1)
        core = DisaggregatedGenerator(pools, WordTokenizer(), RouterConfig())
        core.start()
        admin = AdminServicer(lambda: pools, True, lambda: core)
        call = GenerateCall(
            "", None, tuple(range(100, 164)), None, SamplingParams(max_tokens=3, seed=1)
        )

        async def local_prefill() -> bool:
            async for item in core.generate(call):
                if isinstance(item, FinalResult):
                    return item.timings.local_prefill
            raise AssertionError("no final")

        assert not await local_prefill()  # 64 tokens: handed off by default
        reply = await admin.SetPrefillPolicy(
            pb.SetPrefillPolicyRequest(local_prefill_max_tokens=100), _Context()
        )
        assert reply.policy.local_prefill_max_tokens == 100
        assert reply.policy.slo_ttft_ms == RouterConfig().slo_ttft_ms  # unset: kept
        assert await local_prefill()
        with pytest.raises(RuntimeError, match="INVALID_ARGUMENT: slo_tpot_ms"):
            await admin.SetPrefillPolicy(pb.SetPrefillPolicyRequest(slo_tpot_ms=-1), _Context())
        assert core.prefill_policy.local_prefill_max_tokens == 100
        await core.stop()

    asyncio.run(body())


def test_a_saturated_prefill_pool_sends_prompts_to_an_idle_decode_worker() -> None:
    """Over fake workers: once the prompts queued on the prefill worker would take more
    than half the TTFT target, the next ones run on the decode worker; every request
    completes, and each decision is counted with its reason."""
    from bench.harness.polling import wait_until_async
    from router.observability import metrics
    from tests.test_orchestrator import _collect, _generator

    def counted(path: str, reason: str) -> float:
        value = metrics.get_metrics().registry.get_sample_value(
            "pdserve_prefill_path_total", {"path": path, "reason": reason}
        )
        return value or 0.0

    def call(i: int) -> GenerateCall:
        prompt = tuple(range(100 * i, 100 * i + 64))  # no prefix shared between them
        return GenerateCall("", None, prompt, None, SamplingParams(max_tokens=4, seed=i))

    async def body() -> None:
        pools = FakePools(1, 1)
        prefill = pools.fakes["prefill-0"]
        # 100 ms target: saturated once 50 ms of prompts wait on the prefill worker.
        gen = _generator(pools, slo_ttft_ms=100.0)
        prefill.prefill_delay_s = 0.01  # the worker's rate, measured on an idle worker:
        await _collect(gen.generate(call(0)))  # 64 tokens in 10 ms
        before = {
            r: counted(p, r)
            for p, r in (("remote", "prefill_within_slo"), ("local", "prefill_saturated"))
        }
        prefill.hold_prefill = asyncio.Event()  # the prefill worker stops answering
        tasks = [asyncio.ensure_future(_collect(gen.generate(call(i)))) for i in range(1, 9)]

        def remote() -> float:
            return counted("remote", "prefill_within_slo") - before["prefill_within_slo"]

        def local() -> float:
            return counted("local", "prefill_saturated") - before["prefill_saturated"]

        await wait_until_async(lambda: remote() + local() == 8, 5.0)
        # About five queued (50 ms of work with the next one's own, plus the hand-off's
        # time): the later ones ran locally, and finish while the prefill worker holds.
        assert (remote(), local()) in ((5, 3), (4, 4))
        num_local = int(local())
        await wait_until_async(lambda: sum(t.done() for t in tasks) == num_local, 5.0)
        assert all(t.done() for t in tasks[8 - num_local :])
        assert all(t.result()[1].timings.local_prefill for t in tasks[8 - num_local :])
        # What those prompts took on the decode worker (one fake step each, 64 tokens)
        # prices the next local prompt there.
        decode_load = pools.workers["decode"][0].load
        step_s = pools.fakes["decode-0"].step_s
        assert decode_load.local_prefill_s_per_token.value == pytest.approx(step_s / 64)
        prefill.hold_prefill.set()
        for _, final in await asyncio.gather(*tasks):
            assert final.finish_reason is FinishReason.LENGTH, final.error
        await gen.stop()

    asyncio.run(body())


def test_a_burst_on_a_fresh_service_is_placed_from_the_workers_warm_up_speeds() -> None:
    """Nothing has answered yet: the first prompts are priced at the speeds the workers
    measured as they warmed up, so a burst that queues more than half the TTFT target on
    the prefill worker overflows to the decode worker at once, and no prompt is placed
    without an estimate."""
    from bench.harness.polling import wait_until_async
    from router.observability import metrics
    from tests.test_orchestrator import _collect, _generator

    reasons = ("no_estimate", "prefill_within_slo", "prefill_saturated")

    def counts() -> dict[str, float]:
        registry = metrics.get_metrics().registry
        return {
            r: sum(
                registry.get_sample_value("pdserve_prefill_path_total", {"path": p, "reason": r})
                or 0.0
                for p in ("local", "remote")
            )
            for r in reasons
        }

    def call(i: int) -> GenerateCall:
        prompt = tuple(range(100 * i, 100 * i + 64))  # no prefix shared between them
        return GenerateCall("", None, prompt, None, SamplingParams(max_tokens=4, seed=i))

    async def body() -> None:
        # Each worker ran a prompt of 64 tokens in 10 ms as it warmed up.
        pools = FakePools(1, 1, speed=EngineSpeed(64, 0.01, 0.002))
        prefill = pools.fakes["prefill-0"]
        gen = _generator(pools, slo_ttft_ms=100.0)  # saturated past 50 ms of queued prompts
        before = counts()
        prefill.hold_prefill = asyncio.Event()  # the burst finds the prefill worker busy
        tasks = [asyncio.ensure_future(_collect(gen.generate(call(i)))) for i in range(8)]

        def placed() -> dict[str, float]:
            return {r: n - before[r] for r, n in counts().items()}

        await wait_until_async(lambda: sum(placed().values()) == 8, 5.0)
        assert placed()["no_estimate"] == 0
        # About five prompts fit in 50 ms at 6400 tokens/s; the rest run locally.
        assert (placed()["prefill_within_slo"], placed()["prefill_saturated"]) in ((5, 3), (4, 4))
        prefill.hold_prefill.set()
        for _, final in await asyncio.gather(*tasks):
            assert final.finish_reason is FinishReason.LENGTH, final.error
        await gen.stop()

    asyncio.run(body())


def test_traffic_replaces_the_warm_up_estimates_as_it_measures_them() -> None:
    load = WorkerLoad()
    load.assume(EngineSpeed(num_prompt_tokens=64, prefill_s=0.064, decode_step_s=0.01))
    assert load.prefill_rate.tokens_per_s.value == pytest.approx(1000.0)
    assert load.local_prefill_s_per_token.value == pytest.approx(0.001)
    # A reply from the idle worker: its own rate, not a blend with the warm-up's.
    load.prefill_rate.observe(500, 0.25, now=10.0, busy_since=9.75, was_idle=True)
    assert load.prefill_rate.tokens_per_s.value == pytest.approx(2000.0)
    # Later samples average as before.
    load.prefill_rate.tokens_per_s.add(1000.0)
    assert load.prefill_rate.tokens_per_s.value == pytest.approx(1800.0)


def test_a_running_batch_with_no_step_measured_yet_is_priced_at_the_warm_up_step() -> None:
    load = WorkerLoad()
    load.assume(EngineSpeed(64, 0.064, decode_step_s=0.02))
    assert load.decode_step_s(now=1.0) is None  # idle: no step to wait for
    # The first batch of a burst: requests run, no step in the window yet.
    load.observe_batch(1, _stats(num_running=3), now=1.0)
    assert load.decode_step_s(now=1.0) == pytest.approx(0.02)
    load.observe_batch(2, _stats(num_running=3), now=1.1)
    assert load.decode_step_s(now=1.1) == pytest.approx(0.05)  # measured: 0.1 s, 2 steps


def _stats(num_running: int) -> WorkerStats:
    return WorkerStats(PoolName.DECODE, 0, 100, 10, num_running, 0, 0, 0)
