"""`make model` prepares the embedded model: a folder that loads, ready for every server."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

from bench.harness import REPO
from engine.model.embedded import EMBEDDED_MODEL_NAME, default_cache_dir


def test_makefile_model_target_runs_the_entry_point() -> None:
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^model:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert recipe is not None
    assert "-m engine.model.embedded" in recipe.group(1)


def _prepare(cache_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine.model.embedded", "--cache-dir", str(cache_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )


def test_make_model_leaves_a_loadable_folder() -> None:
    """What `make model` runs, on the cache it fills (before `make test` that already ran it,
    so this is the quick path; on an empty cache it converts, printing its stages)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = default_cache_dir()
    proc = _prepare(cache)
    assert proc.returncode == 0, proc.stderr
    folder = cache / EMBEDDED_MODEL_NAME
    assert f"model ready: {folder}" in proc.stdout

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    assert tokenizer.decode(logits[0, -1].argmax()).strip() == "Paris"
