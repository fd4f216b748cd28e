"""`pdserve serve`'s planner flags, and the PlannerConfig they become (kept here, beside
the planner, rather than in `router.cli.flags`)."""

from __future__ import annotations

import argparse

from router.cli.flag_types import at_least, number_in
from router.planner.config import DEFAULT_INTERVAL_S, PlannerConfig


def add_planner_args(p: argparse.ArgumentParser) -> None:
    """The SLO planner's flags: what `planner_config` turns into a PlannerConfig."""
    g = p.add_argument_group("planner (sizes the pools by itself from TTFT and TPOT)")
    g.add_argument(
        "--planner",
        action="store_true",
        help="size the prefill and decode pools while serving, from the measured TTFT and "
        "TPOT against --slo-ttft-ms and --slo-tpot-ms, within --max-gpus",
    )
    g.add_argument(
        "--max-gpus",
        type=at_least(2),
        help="with --planner: workers across both pools at most (one GPU each on GPU "
        "machines; on CPU, workers) (default: none; required with --planner)",
    )
    g.add_argument(
        "--min-prefill",
        type=at_least(1),
        default=1,
        help="with --planner: prefill workers at least",
    )
    g.add_argument(
        "--min-decode", type=at_least(1), default=1, help="with --planner: decode workers at least"
    )
    g.add_argument(
        "--planner-interval-s",
        type=number_in(0, open_low=True),
        default=DEFAULT_INTERVAL_S,
        help="with --planner: seconds between decisions",
    )
    g.add_argument(
        "--planner-cooldown-s",
        type=number_in(0),
        help="with --planner: seconds a pool holds after a change, and stays over-provisioned "
        "before it shrinks (default: 3 intervals)",
    )


def planner_config(ns: argparse.Namespace) -> PlannerConfig | None:
    """The planner's settings from `add_planner_args`' flags; None without --planner."""
    if not ns.planner:
        return None
    return PlannerConfig(
        max_workers=ns.max_gpus,
        min_prefill=ns.min_prefill,
        min_decode=ns.min_decode,
        interval_s=ns.planner_interval_s,
        cooldown_s=ns.planner_cooldown_s,
    )
