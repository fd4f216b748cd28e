"""The multi-turn benchmark's simulation: prefix-aware routing keeps sessions where
their history is cached; least-loaded scatters them."""

from __future__ import annotations

from bench.multiturn import ClusterShape, Workload, run_simulation


def test_prefix_aware_comes_close_to_the_oracle() -> None:
    wl = Workload(num_sessions=16, num_turns=4, system_tokens=256, user_tokens=32)
    shape = ClusterShape(num_workers=4, num_blocks=320, block_size=16)
    by_policy = {s.policy: s for s in run_simulation(wl, shape)}
    oracle, least, prefix = (by_policy[p] for p in ("oracle", "least-loaded", "prefix-aware"))
    assert oracle.requests == least.requests == prefix.requests == 64
    assert prefix.hit_rate <= oracle.hit_rate
    assert prefix.vs_oracle >= 0.9
    assert least.hit_rate < prefix.hit_rate
    assert prefix.prediction_exact is not None and prefix.prediction_exact >= 0.9
