"""Sampled speculative decoding keeps the model's distribution: a chi-square test on a tiny
model over fixed seeds, of the first and the second token a verifying step keeps, which
each of three plausible mistakes in verification fails; and the seeded tokens themselves
equal plain decoding's."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core.batch import Batch, ScheduledSeq
from engine.model import model_runner, step_tokens
from engine.model.model_runner import ModelRunner
from engine.model.step_tokens import sample_rows
from engine.sampling_params import SamplingParams
from engine.spec.speculation import accepted_prefix

NUM_SEEDS = 2000
TOP_K = 6  # a few categories, each expected often enough for the chi-square rule
PROMPT = (17, 43, 5, 201, 77, 301, 18, 44, 91, 12)
PARAMS = SamplingParams(max_tokens=8, temperature=1.0, top_k=TOP_K)
BLOCK_SIZE = 16
TABLE = (0, 1)


def _correction_from_next_row(proposals: Sequence[int], sampled: Sequence[int]) -> tuple[int, ...]:
    """Off by one: after a rejection, the token sampled after the rejected proposal."""
    kept = accepted_prefix(proposals, sampled)
    n = len(kept) - 1
    return kept if n == len(proposals) else (*kept[:-1], sampled[n + 1])


def _first_always_accepted(proposals: Sequence[int], sampled: Sequence[int]) -> tuple[int, ...]:
    """No check on the first proposal."""
    return (proposals[0], *accepted_prefix(proposals[1:], sampled[1:]))


def _proposal_rows_greedy(logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> torch.Tensor:
    """The rows after proposals picked by argmax, as if verification were greedy."""
    tokens = sample_rows(logits, seqs)
    row = 0
    for s in seqs:
        tokens[row + 1 : row + 1 + s.num_draft_tokens] = logits[
            row + 1 : row + 1 + s.num_draft_tokens
        ].argmax(dim=-1)
        row += s.num_draft_tokens + 1
    return tokens


MISTAKES: dict[str, tuple[Any, str, Callable[..., Any]]] = {
    "correction_from_next_row": (step_tokens, "accepted_prefix", _correction_from_next_row),
    "first_always_accepted": (step_tokens, "accepted_prefix", _first_always_accepted),
    "proposal_rows_greedy": (model_runner, "sample_rows", _proposal_rows_greedy),
}


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    """A tiny random llama with a vocabulary of 512 (the sampler's work is per vocab id)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(5)
    path = tmp_path_factory.mktemp("tiny-512")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    runner = ModelRunner(Path(path), num_blocks=4, block_size=BLOCK_SIZE)
    # The prompt's KV, but its last token: every sequence below starts from it.
    prefill = ScheduledSeq("prompt", PROMPT[:-1], 0, TABLE, False, PARAMS, 0)
    runner.execute(Batch((prefill,), BLOCK_SIZE))
    return runner


def _distribution(runner: ModelRunner, tokens: tuple[int, ...]) -> torch.Tensor:
    """The sampler's distribution after `tokens` (top-k at temperature 1), [vocab]."""
    seq = ScheduledSeq("probe", tokens, len(PROMPT) - 1, TABLE, True, PARAMS, 0)
    with torch.inference_mode():
        logits = runner._forward_eager(Batch((seq,), BLOCK_SIZE), None)[-1].float()
    kth = logits.topk(TOP_K).values[-1]
    return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)


def _chi_square_p_value(tokens: list[int], probs: torch.Tensor) -> float:
    counts = Counter(tokens)
    support = torch.nonzero(probs).squeeze(1).tolist()
    if not set(counts) <= set(support):
        return 0.0  # a token the sampler can never pick here
    observed = torch.tensor([counts.get(t, 0) for t in support], dtype=torch.float64)
    expected = probs[support].double() * len(tokens)
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(support) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic / 2))


def _verify(runner: ModelRunner, proposals: tuple[int, ...]) -> list[tuple[int, ...]]:
    """What each seed's verifying step keeps after the prompt."""
    seqs = tuple(
        ScheduledSeq(
            f"s{seed}",
            (PROMPT[-1], *proposals),
            len(PROMPT) - 1,
            TABLE,  # the same slots for every sequence: they write identical K/V
            True,
            PARAMS,
            seed,
            len(proposals),
        )
        for seed in range(NUM_SEEDS)
    )
    out = runner.execute(Batch(seqs, BLOCK_SIZE, num_draft_tokens=len(proposals) * NUM_SEEDS))
    kept = []
    for s in seqs:
        tokens = out[s.req_id]
        assert isinstance(tokens, tuple), tokens  # with proposals: the tokens it kept
        kept.append(tokens)
    return kept


def _likely_proposals(runner: ModelRunner) -> tuple[int, int]:
    """The second most likely token after the prompt, then the most likely after it: a
    wrong rule then has plenty to get wrong."""
    first = int(_distribution(runner, (PROMPT[-1],)).topk(2).indices[1])
    return first, int(_distribution(runner, (PROMPT[-1], first)).argmax())


@pytest.mark.parametrize("mistake", [None, *MISTAKES])
def test_kept_tokens_follow_the_models_distribution_only_without_mistakes(
    runner: ModelRunner, mistake: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    proposals = _likely_proposals(runner)
    if mistake is not None:
        monkeypatch.setattr(*MISTAKES[mistake])
    kept = _verify(runner, proposals)
    first = _chi_square_p_value([k[0] for k in kept], _distribution(runner, (PROMPT[-1],)))
    # After an accepted first proposal, the next token follows the model given it.
    after = [k[1] for k in kept if k[0] == proposals[0] and len(k) > 1]
    assert len(after) > NUM_SEEDS // 10  # the proposal is accepted often enough to test
    second = _chi_square_p_value(after, _distribution(runner, (PROMPT[-1], proposals[0])))
    print(f"{mistake}: chi-square p-values {first:.3g} (first kept token), {second:.3g} (second)")
    if mistake is None:
        assert min(first, second) > 1e-3, (first, second)
    else:
        assert min(first, second) < 1e-6, (first, second)


def test_seeded_tokens_equal_plain_decodings(runner: ModelRunner) -> None:
    kept = _verify(runner, _likely_proposals(runner))
    plain_seqs = tuple(
        ScheduledSeq(f"s{seed}", (PROMPT[-1],), len(PROMPT) - 1, TABLE, True, PARAMS, seed)
        for seed in range(NUM_SEEDS)
    )
    plain = runner.execute(Batch(plain_seqs, BLOCK_SIZE))
    assert [k[0] for k in kept] == [plain[s.req_id] for s in plain_seqs]
