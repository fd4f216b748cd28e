"""bench.cpu_step on a tiny model: two alternating rounds give both sides' times, their
ratio, the engine step's phases (which add up to the step) and the JSON record; the
arguments parse as documented."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.cpu_step import (
    PHASES,
    Round,
    build_parser,
    format_summary,
    main,
    parse_context,
    parse_cpus,
    summarise,
)
from engine.model.cpu_linear import onednn_linear_works


def test_two_rounds_of_a_tiny_model(
    tiny_model_paths: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cpu_step.json"
    argv = ["--model", str(tiny_model_paths["llama"]), "--batch-size", "3", "--context", "40"]
    argv += ["--rounds", "2", "--warmup", "1", "--threads", "1", "--out", str(out)]

    assert main(argv) == 0

    result = json.loads(out.read_text())
    assert result["provenance"]["command"].startswith("python -m bench.cpu_step")
    params = result["params"]
    assert params["batch_size"] == 3 and params["context"] == 40
    # The middle timed round (the second of two) attends 40 tokens: the warm-up 38.
    assert params["contexts"] == [39, 40]
    assert result["machine"]["torch_threads"] == 1
    assert len(result["rounds"]) == 2
    for engine_ms, hf_ms, ratio, engine_cpu, hf_cpu in result["rounds"]:
        assert engine_ms > 0 and hf_ms > 0 and engine_cpu >= 0 and hf_cpu >= 0
        assert ratio == pytest.approx(engine_ms / hf_ms, rel=1e-3)
    eng, hf = result["engine_step_ms"]["p50"], result["transformers_forward_ms"]["p50"]
    assert result["ratio"] == pytest.approx(eng / hf)
    phases = result["engine_phases_ms"]
    assert set(phases) == set(PHASES)
    assert phases["forward"]["mean"] > 0 and phases["metadata"]["mean"] > 0
    assert sum(p["mean"] for p in phases.values()) == pytest.approx(
        result["engine_step_ms"]["mean"], rel=1e-6
    )
    assert params["engine_linears"] == ("onednn" if onednn_linear_works() else "sgemm")
    assert result["passed"] is None
    assert 0 <= result["greedy_agreement"] <= 1
    printed = capsys.readouterr().out
    assert "engine step" in printed and "ratio per round" in printed


def test_parsing() -> None:
    args = build_parser().parse_args([])
    assert args.batch_size == 8 and args.context == 163 and args.threads is None
    assert args.cpus is None and args.max_ratio is None and not args.no_breakdown
    assert not args.sgemm and build_parser().parse_args(["--sgemm"]).sgemm
    args = build_parser().parse_args(["--cpus", "2,3", "--context", "300", "--max-ratio", "1"])
    assert args.cpus == {2, 3} and args.context == 300 and args.max_ratio == 1.0
    assert parse_cpus("0-3") == {0, 1, 2, 3} and parse_cpus("0,4-5") == {0, 4, 5}
    for bad in ("", "a", "3-x", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_cpus(bad)
    for bad in ("1", "x", "offline"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_context(bad)


def test_summary_of_rounds_and_without_a_breakdown() -> None:
    phases = dict.fromkeys(PHASES, 0.001)
    rounds = [
        Round(0.010, 0.008, 0.009, 0.008, True, phases),
        Round(0.012, 0.010, 0.011, 0.011, False, phases),
        Round(0.009, 0.010, 0.008, 0.010, True, phases),
    ]
    result = summarise(rounds)
    assert result["ratio"] == pytest.approx(0.010 / 0.010)
    assert result["ratio_per_round"]["p50"] == pytest.approx(1.2)
    assert result["cpu_ratio"] == pytest.approx(0.009 / 0.010)
    assert result["engine_first_ratio"] == pytest.approx((1.25 + 0.9) / 2)
    assert result["transformers_first_ratio"] == pytest.approx(1.2)
    assert result["engine_phases_ms"]["forward"]["median"] == pytest.approx(1.0)
    result["engine_phases_ms"] = None  # --no-breakdown
    text = format_summary(result, 8, 163)
    assert "ratio 1.000" in text and "engine step, median" not in text
