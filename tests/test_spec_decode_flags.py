"""--speculative-config: vLLM's JSON, checked before anything starts (one line, exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.spec.spec_config import SpeculativeConfig
from router.cli.engine_flags import engine_args
from router.cli.main import build_parser, main


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_vllm_spellings_are_understood() -> None:
    ngram = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2, "disable_by_batch_size": 8}'
    )
    assert (ngram.method, ngram.prompt_lookup_min, ngram.prompt_lookup_max) == ("ngram", 2, 4)
    assert ngram.speculates_at(8) and not ngram.speculates_at(9)
    # vLLM's older spelling: the method named as the model; one bound sets both.
    old = SpeculativeConfig.from_json(
        '{"model": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    )
    assert (old.method, old.prompt_lookup_min, old.prompt_lookup_max) == ("ngram", 3, 3)
    draft = SpeculativeConfig.from_json('{"model": "/m", "num_speculative_tokens": 4}')
    assert (draft.method, draft.model) == ("draft_model", "/m")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{nope", "not JSON"),
        ('["ngram"]', "expected a JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle' is not supported"),
        ('{"method": "ngram"}', '"num_speculative_tokens"'),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "must be an integer >= 1, got 0"),
        ('{"method": "ngram", "num_speculative_tokens": 99}', "must be <= 16"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "unknown key 'typo'"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            "prompt_lookup_min (4) must be <= prompt_lookup_max (2)",
        ),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', 'needs "model"'),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}',
            "disable_by_batch_size must be an integer >= 1",
        ),
    ],
)
def test_bad_configs_are_one_line_usage_errors(
    config: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (["serve"], ["generate", "hi"]):
        err = _fails([*argv, "--speculative-config", config], capsys)
        assert "argument --speculative-config:" in err and message in err, err


def _model_folder(path: Path, vocab_size: int) -> str:
    path.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_a_draft_model_folder_is_checked_against_the_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = _model_folder(tmp_path / "target", 49152)
    other = _model_folder(tmp_path / "other-vocab", 32000)
    missing = str(tmp_path / "missing")
    for draft, message in (
        (missing, f"draft model {missing}: no config.json in that folder"),
        (other, "has a vocabulary of 32000 tokens, the target 49152"),
    ):
        config = json.dumps({"model": draft, "num_speculative_tokens": 3})
        for argv in (["serve"], ["generate", "hi"]):
            err = _fails([*argv, "--model", target, "--speculative-config", config], capsys)
            assert message in err, err


def test_only_offline_generation_and_the_decode_side_take_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = '{"method": "ngram", "num_speculative_tokens": 2}'
    err = _fails(["generate", "hi", "--server", "h:1", "--speculative-config", config], capsys)
    assert "--speculative-config: only for offline generation" in err
    ns = build_parser().parse_args(["serve", "--speculative-config", config])
    assert engine_args(ns, "decode").speculative == SpeculativeConfig("ngram", 2)
    assert engine_args(ns, "prefill").speculative is None  # it stops at the first token
