"""Incremental detokenization: whole UTF-8 only, stop strings cut and never shown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.frontend.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True)


def stream(
    tokenizer: Any, text: str, stop: tuple[str, ...] = ()
) -> tuple[list[str], IncrementalDetokenizer]:
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, stop)
    deltas = [detok.add([t]) for t in ids]
    if not detok.stopped:
        deltas.append(detok.flush())
    return deltas, detok


def test_stream_reassembles_exact_text_with_multibyte_characters(tokenizer: Any) -> None:
    text = " naïve café — 日本語 🙂 emoji, ok"
    deltas, _ = stream(tokenizer, text)
    assert "".join(deltas) == tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_is_cut_and_never_emitted(tokenizer: Any) -> None:
    deltas, detok = stream(tokenizer, " one two STOP three four", stop=("STOP",))
    assert detok.stopped
    assert "".join(deltas) == " one two "
    assert not any("S" in d and "T" in d for d in deltas)


def test_stop_string_spanning_tokens(tokenizer: Any) -> None:
    deltas, detok = stream(tokenizer, " alpha beta gamma", stop=("a gam",))
    assert detok.stopped
    assert "".join(deltas) == " alpha bet"


def test_no_stop_match_flushes_everything(tokenizer: Any) -> None:
    deltas, detok = stream(tokenizer, " hello world", stop=("zzz",))
    assert not detok.stopped
    assert "".join(deltas) == " hello world"


def test_tokens_given_together_past_a_stop_string_are_not_reported(tokenizer: Any) -> None:
    # A router behind on delivery hands the output processor several steps' tokens at
    # once; the chunk must end at the token that completed the stop string, as it does
    # when the tokens come one at a time.
    from engine.core.request import FinishReason
    from engine.frontend.output_processor import OutputProcessor

    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    ids = tokenizer.encode(" one two STOP three four", add_special_tokens=False)
    one_at_a_time = OutputProcessor(tokenizer, prompt, ("STOP",))
    read: list[int] = []
    for token in ids:
        chunk, finish = one_at_a_time.process([token], None)
        read += chunk.token_ids if chunk else []
        if finish is not None:
            break
    together = OutputProcessor(tokenizer, prompt, ("STOP",))
    chunk, finish = together.process(ids, None)
    assert finish is FinishReason.STOP
    assert chunk is not None and chunk.text == " one two "
    assert list(chunk.token_ids) == read
    assert len(read) < len(ids)


def _sentencepiece_style_tokenizer() -> Any:
    """A tiny Llama-2-style tokenizer (metaspace, byte fallback, the first space stripped
    on decode), trained here: the decoder whose output depends most on the prompt before."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens], show_progress=False
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.mark.parametrize("which", ["smollm2", "sentencepiece-style"])
def test_streaming_decoder_gives_the_windowed_decodes_text(tokenizer: Any, which: str) -> None:
    """The tokenizers library's streaming decoder against re-decoding a window with
    tokenizer.decode: the same text for the same tokens, from any prompt, special tokens,
    multi-byte characters split over tokens and random ids included."""
    import random

    from engine.frontend.detokenizer import _StreamDecode, _text_stream, _WindowDecode

    tok = tokenizer if which == "smollm2" else _sentencepiece_style_tokenizer()
    rng = random.Random(3)
    texts = [" naïve café — 日本語 🙂 emoji, ok", "the lazy dog ünïcödé 🙂🙂 end", "x"]
    cases = [tok.encode(t, add_special_tokens=False) for t in texts]
    cases += [[rng.randrange(len(tok)) for _ in range(60)] for _ in range(20)]
    cases.append([tok.eos_token_id, *cases[0], tok.eos_token_id])
    for ids in cases:
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 8))]
        fast = _text_stream(tok, prompt)
        # A prompt ending part-way through a character keeps the windowed decode.
        broken = tok.decode(prompt, skip_special_tokens=True).endswith("\ufffd")
        assert isinstance(fast, _WindowDecode if broken else _StreamDecode)
        slow = _WindowDecode(tok, prompt)
        fast_text = "".join(fast.push(t) for t in ids)
        slow_text = "".join(slow.push(t) for t in ids)
        assert fast_text == slow_text, (ids, prompt)
