"""A tiny deterministic stand-in for the model runner, and engine cores built on it, for
millisecond scheduler tests (with the engine's leak check, `assert_engine_empty`); and a
tokenizer for the router's serving core over bench.fake_workers (`WordTokenizer`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypedDict, Unpack

from engine.core.batch import Batch, ScheduledSeq
from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.engine_core import AsyncRunner, EngineCore, StepTokens
from engine.core.request import PLACEHOLDER_TOKEN
from engine.core.role import EngineRole
from engine.core.waiting_queue import QueuePolicy
from engine.sampling_params import SamplingParams
from engine.spec.spec_config import SpeculativeConfig
from engine.spec.speculation import PROPOSAL_TOKEN, accepted_prefix
from engine.wire import GenerationInput


def next_token(last_token: int, position: int) -> int:
    """A 'model' whose output depends on the context, so recompute errors would show."""
    return (last_token * 31 + position * 7) % 997 + 3


class FakeRunner:
    """Returns model(last scheduled token, position) for every sampled sequence
    (`next_token` unless given another model).

    Proposal slots (PROPOSAL_TOKEN) are filled like a draft model would: with the
    model's own token, except at positions where `draft_misses(position)` is true."""

    def __init__(
        self,
        model: Callable[[int, int], int] = next_token,
        draft_misses: Callable[[int], bool] = lambda position: False,
    ) -> None:
        self.model = model
        self.draft_misses = draft_misses
        self.batches: list[Batch] = []
        self._last_sampled: dict[str, int] = {}  # the tokens of the step launched last

    def execute(self, batch: Batch) -> StepTokens:
        return self.launch(batch).result()

    def launch(self, batch: Batch) -> Done:
        """Like the real runner: a placeholder input is the token it sampled last step;
        a sequence with proposals gets the model's token after each input from the
        newest known one on."""
        batch = Batch(tuple(self._fill_proposals(s) for s in batch.seqs), batch.block_size)
        self.batches.append(batch)
        sampled: dict[str, int | tuple[int, ...]] = {}
        for s in batch.seqs:
            if not s.sample:
                continue
            if s.num_draft_tokens:
                first = len(s.token_ids) - s.num_draft_tokens - 1
                inputs = (self._last_token(s), *s.token_ids[first + 1 :])
                after_each = [
                    self.model(token, s.start_position + first + i + 1)
                    for i, token in enumerate(inputs)
                ]
                proposals = s.token_ids[first + 1 :]
                sampled[s.req_id] = accepted_prefix(proposals, after_each)
            else:
                sampled[s.req_id] = self.model(self._last_token(s), s.end_position)
        self._last_sampled = {k: v for k, v in sampled.items() if isinstance(v, int)}
        return Done(sampled)

    def _fill_proposals(self, seq: ScheduledSeq) -> ScheduledSeq:
        if PROPOSAL_TOKEN not in seq.token_ids:
            return seq
        tokens = list(seq.token_ids)
        for i in range(len(tokens) - seq.num_draft_tokens, len(tokens)):
            position = seq.start_position + i
            token = self.model(tokens[i - 1], position)
            tokens[i] = token + 1 if self.draft_misses(position) else token
        return seq._replace(token_ids=tuple(tokens))

    def _last_token(self, seq: ScheduledSeq) -> int:
        """The sequence's newest token (`newest_token_index`), filled in if a placeholder."""
        token = seq.token_ids[seq.newest_token_index]
        if token == PLACEHOLDER_TOKEN:
            return self._last_sampled[seq.req_id]  # KeyError: the engine broke the contract
        return token


class Done:
    """Tokens already known (what launch returns on a runner without a device queue)."""

    def __init__(self, tokens: StepTokens) -> None:
        self.tokens = tokens

    def result(self) -> StepTokens:
        return self.tokens


# The engine core takes it for its model runner (engine_core.AsyncRunner): checked by mypy.
_A_RUNNER: type[AsyncRunner] = FakeRunner


class RunnerFields(TypedDict, total=False):
    """FakeRunner's arguments, for tests that pass them along."""

    model: Callable[[int, int], int]
    draft_misses: Callable[[int], bool]


class SchedulerFields(TypedDict, total=False):
    """SchedulerConfig's fields, as make_engine takes them."""

    max_num_seqs: int
    max_num_batched_tokens: int | None
    long_prefill_token_threshold: int
    enable_prefix_caching: bool
    policy: QueuePolicy
    prioritize_prefill: bool
    priority_aging_s: float


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    """What FakeRunner produces for a request run alone."""
    out: list[int] = []
    tokens = list(prompt)
    for _ in range(max_tokens):
        tok = next_token(tokens[-1], len(tokens))
        out.append(tok)
        tokens.append(tok)
    return out


def make_engine(
    num_blocks: int = 512,
    block_size: int = 16,
    *,
    eos: frozenset[int] = frozenset(),
    handoff: bool = False,
    async_scheduling: bool = False,
    speculative: SpeculativeConfig | None = None,
    runner: FakeRunner | None = None,
    max_model_len: int = 100_000,
    **sched: Unpack[SchedulerFields],
) -> tuple[EngineCore, FakeRunner]:
    """An engine core on the fake runner: `sched` are SchedulerConfig fields."""
    runner = runner or FakeRunner()
    core = EngineCore(
        runner,
        SchedulerConfig(**sched),
        CacheConfig(num_blocks=num_blocks, block_size=block_size),
        max_model_len=max_model_len,
        vocab_size=1000,
        eos_token_ids=eos,
        role=EngineRole.PREFILL if handoff else EngineRole.COLOCATED,
        async_scheduling=async_scheduling,
        speculative=speculative,
    )
    return core, runner


def add(
    core: EngineCore, req_id: str, prompt_len: int, max_tokens: int, *, priority: int = 0
) -> None:
    """Add a request of `prompt_len` tokens (a function of its id) asking `max_tokens`."""
    prompt = tuple((hash((req_id, i)) % 900) + 10 for i in range(prompt_len))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    core.add_request(GenerationInput(req_id, prompt, params, priority))


def one_token_each(step: StepTokens) -> dict[str, int]:
    """A step's tokens where no sequence had proposals: one token each."""
    tokens = {}
    for req_id, sampled in step.items():
        assert isinstance(sampled, int), (req_id, sampled)
        tokens[req_id] = sampled
    return tokens


def run_to_completion(core: EngineCore, max_steps: int = 10_000) -> dict[str, list[int]]:
    """Step until nothing is left; every request's tokens."""
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished:
            return outputs
        for upd in core.step():
            outputs.setdefault(upd.req_id, []).extend(upd.new_token_ids)
    raise AssertionError("engine did not finish")


def assert_engine_empty(core: EngineCore) -> None:
    """The leak check of one engine (vLLM's `assert_scheduler_empty`): no request left
    running or waiting, and every block back in the pool (cached ones count as free)."""
    stats = core.stats()
    assert not core.has_unfinished, "requests left unfinished"
    assert (stats.num_running, stats.num_waiting) == (0, 0), stats
    assert stats.num_blocks_in_use == 0, stats


class WordTokenizer:
    """Token t is the text '<t>'."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(x) for x in text.replace(">", " ").replace("<", " ").split()]
