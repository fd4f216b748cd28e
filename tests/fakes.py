"""A tiny deterministic stand-in for the model runner, for millisecond scheduler tests."""

from __future__ import annotations

from engine.core.batch import Batch, ScheduledSeq
from engine.core.request import PLACEHOLDER_TOKEN


def next_token(last_token: int, position: int) -> int:
    """A 'model' whose output depends on the context, so recompute errors would show."""
    return (last_token * 31 + position * 7) % 997 + 3


class FakeRunner:
    """Returns next_token(last scheduled token, position) for every sampled sequence."""

    def __init__(self) -> None:
        self.batches: list[Batch] = []
        self._last_sampled: dict[str, int] = {}  # the tokens of the step launched last

    def execute(self, batch: Batch) -> dict[str, int]:
        return self.launch(batch).result()

    def launch(self, batch: Batch) -> Done:
        """Like the real runner: a placeholder input is the token it sampled last step."""
        self.batches.append(batch)
        sampled = {
            s.req_id: next_token(self._last_token(s), s.end_position)
            for s in batch.seqs
            if s.sample
        }
        self._last_sampled = sampled
        return Done(sampled)

    def _last_token(self, seq: ScheduledSeq) -> int:
        token = seq.token_ids[-1]
        if token == PLACEHOLDER_TOKEN:
            return self._last_sampled[seq.req_id]  # KeyError: the engine broke the contract
        return token


class Done:
    """Tokens already known (what launch returns on a runner without a device queue)."""

    def __init__(self, tokens: dict[str, int]) -> None:
        self.tokens = tokens

    def result(self) -> dict[str, int]:
        return self.tokens


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    """What FakeRunner produces for a request run alone."""
    out: list[int] = []
    tokens = list(prompt)
    for _ in range(max_tokens):
        tok = next_token(tokens[-1], len(tokens))
        out.append(tok)
        tokens.append(tok)
    return out
