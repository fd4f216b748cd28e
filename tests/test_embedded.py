"""The embedded SmolLM2 folder: converted once, atomically, and loadable offline."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import pytest

from engine.model import embedded
from engine.model.embedded import EMBEDDED_MODEL_NAME, ensure_embedded_model
from engine.model.model_spec import ModelSpec


def test_second_call_is_instant_and_folder_loads_offline(smollm2_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    assert ensure_embedded_model(smollm2_path.parent) == smollm2_path
    assert time.perf_counter() - started < 0.5

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, local_files_only=True)
    assert model.dtype.is_floating_point and str(model.dtype) == "torch.float32"
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"
    assert ModelSpec.from_pretrained_dir(smollm2_path).eos_token_ids == (
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )


def _fake_convert(calls: list[int]) -> Callable[[Path, Path], None]:
    def convert(source: Path, out_dir: Path) -> None:
        calls.append(1)
        (out_dir / "model.safetensors").write_text("weights")
        (out_dir / "config.json").write_text("{}")

    return convert


def test_concurrent_callers_convert_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The conversion runs only once all three callers found no folder and reached the
    # lock: the two that wait there must find the first one's folder, not convert again.
    at_lock = threading.Condition()
    num_at_lock = [0]
    real_lock = embedded.FileLock

    class CountingLock:
        def __init__(self, path: str) -> None:
            self._lock = real_lock(path)

        def __enter__(self) -> object:
            with at_lock:
                num_at_lock[0] += 1
                at_lock.notify_all()
            return self._lock.__enter__()

        def __exit__(
            self,
            kind: type[BaseException] | None,
            exc: BaseException | None,
            tb: TracebackType | None,
        ) -> None:
            self._lock.__exit__(kind, exc, tb)

    calls: list[int] = []

    def convert(source: Path, out_dir: Path) -> None:
        calls.append(1)
        with at_lock:
            assert at_lock.wait_for(lambda: num_at_lock[0] == 3, 10), "callers never met"
        (out_dir / "model.safetensors").write_text("weights")
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(embedded, "FileLock", CountingLock)
    monkeypatch.setattr(embedded, "_convert", convert)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_embedded_model(tmp_path)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1]
    assert results == [tmp_path / EMBEDDED_MODEL_NAME] * 3
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [
        EMBEDDED_MODEL_NAME
    ]


def test_interrupted_conversion_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(source: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(embedded, "_convert", broken)
    with pytest.raises(KeyboardInterrupt):
        ensure_embedded_model(tmp_path)
    assert not (tmp_path / EMBEDDED_MODEL_NAME).exists()
    # A temp folder left by a killed process is swept by the next conversion.
    (tmp_path / f".tmp-{EMBEDDED_MODEL_NAME}-stale").mkdir()
    calls: list[int] = []
    monkeypatch.setattr(embedded, "_convert", _fake_convert(calls))
    assert ensure_embedded_model(tmp_path) == tmp_path / EMBEDDED_MODEL_NAME
    assert not list(tmp_path.glob(".tmp-*"))
