"""bench.tp_decode on CPU: a tiny model split over gloo ranks gives a row per (TP size,
batch size) with positive times, TP 2's ratio to TP 1 and its all-reduce; a size that
cannot split the model is a note, not a row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.tp_decode import main


def test_each_tp_size_and_batch_is_a_row(
    tiny_model_paths: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tp_decode.json"
    argv = ["--device", "cpu", "--models", str(tiny_model_paths["llama"])]
    argv += ["--tp-sizes", "1,2,3", "--batch-sizes", "1,2", "--context", "40"]
    argv += ["--steps", "3", "--warmup", "1", "--all-reduce-reps", "5", "--out", str(out)]

    assert main(argv) == 0

    result = json.loads(out.read_text())
    assert result["provenance"]["command"].startswith("python -m bench.tp_decode")
    assert result["errors"] == []
    rows = {(r["tp"], r["batch"]): r for r in result["rows"]}
    assert sorted(rows) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for row in rows.values():
        assert row["step_ms"]["median"] > 0
        assert row["context"] == 40
    for batch in (1, 2):
        split, whole = rows[(2, batch)], rows[(1, batch)]
        ratio = split["step_ms"]["median"] / whole["step_ms"]["median"]
        assert split["vs_tp1"] == ratio
        assert split["all_reduce_us"]["median"] > 0
        # Two per layer, three layers, each as long as the all-reduce alone.
        assert split["all_reduces_per_step"] == 2 * 3
        share = 6 * split["all_reduce_us"]["median"] / 1e3 / split["step_ms"]["median"]
        assert split["all_reduce_share"] == pytest.approx(share)
        # Each rank holds one of the two KV heads: half the cache reads of one rank.
        assert split["kv_bytes"] * 2 == whole["kv_bytes"]
        assert split["weight_bytes"] < whole["weight_bytes"]
        assert "vs_tp1" not in whole and "all_reduce_us" not in whole
    # No copy bandwidth on CPU: no floor.
    assert result["copy_GBps"] is None and "floor_ms" not in rows[(1, 1)]
    assert result["notes"] == [
        "tiny-llama TP 3: skipped: tensor parallel size 3 does not divide the model's "
        "4 attention heads"
    ]
    table = capsys.readouterr().out
    assert "tiny-llama" in table and "skipped" in table
