"""A tiny deterministic stand-in for the model runner, for millisecond scheduler tests."""

from __future__ import annotations

from engine.core.batch import Batch


def next_token(last_token: int, position: int) -> int:
    """A 'model' whose output depends on the context, so recompute errors would show."""
    return (last_token * 31 + position * 7) % 997 + 3


class FakeRunner:
    """Returns next_token(last scheduled token, position) for every sampled sequence."""

    def __init__(self) -> None:
        self.batches: list[Batch] = []

    def execute(self, batch: Batch) -> dict[str, int]:
        self.batches.append(batch)
        return {
            s.req_id: next_token(s.token_ids[-1], s.end_position) for s in batch.seqs if s.sample
        }


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    """What FakeRunner produces for a request run alone."""
    out: list[int] = []
    tokens = list(prompt)
    for _ in range(max_tokens):
        tok = next_token(tokens[-1], len(tokens))
        out.append(tok)
        tokens.append(tok)
    return out
