"""Offline API: `LLM(...).generate(prompts, params)` on one colocated engine, no server."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from engine.core.outputs import TextChunk
from engine.core.request import FinishReason
from engine.factory import EngineArgs, build_engine
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.prompt import encode_prompt
from engine.sampling_params import SamplingParams
from engine.wire import GenerationInput

PromptLike = str | Sequence[int]


@dataclass(frozen=True)
class CompletionOutput:
    """One finished request."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    num_cached_tokens: int


@dataclass(frozen=True)
class StreamEvent:
    """Streamed output of request `index` (position in the prompts list)."""

    index: int
    chunk: TextChunk | None
    finish_reason: FinishReason | None
    num_cached_tokens: int = 0


class LLM:
    """A colocated engine in this process: the reference the disaggregated service must match."""

    def __init__(self, args: EngineArgs | None = None, **kwargs: object) -> None:
        self.args = args or EngineArgs(**kwargs)  # type: ignore[arg-type]
        built = build_engine(self.args)
        self.core = built.core
        self.runner = built.runner
        self.tokenizer = built.tokenizer
        self.spec = built.spec
        self._ids = itertools.count()

    def _input(self, prompt: PromptLike, params: SamplingParams) -> GenerationInput:
        if isinstance(prompt, str):
            ids = encode_prompt(self.tokenizer, prompt=prompt)
        else:
            ids = encode_prompt(self.tokenizer, prompt_token_ids=list(prompt))
        return GenerationInput(f"offline-{next(self._ids)}", tuple(ids), params)

    def stream(
        self,
        prompts: Sequence[PromptLike],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[StreamEvent]:
        """Run all prompts concurrently, yielding text as each step produces it."""
        params_list = _broadcast(params, len(prompts))
        # Validate everything first: a bad prompt fails before anything is scheduled.
        inputs = [self._input(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        requests = [self.core.make_request(inp) for inp in inputs]
        outputs: dict[str, OutputProcessor] = {}
        index_of = {}
        for i, (inp, req) in enumerate(zip(inputs, requests, strict=True)):
            index_of[inp.req_id] = i
            outputs[inp.req_id] = OutputProcessor(
                self.tokenizer, inp.prompt_token_ids, inp.sampling.stop
            )
            self.core.scheduler.add_request(req)
        try:
            while self.core.has_unfinished:
                for upd in self.core.step():
                    chunk, finish = outputs[upd.req_id].process(
                        upd.new_token_ids, upd.finish_reason
                    )
                    if finish is not None and upd.finish_reason is None:
                        self.core.abort(upd.req_id)  # a stop string ended it
                    yield StreamEvent(index_of[upd.req_id], chunk, finish, upd.num_cached_tokens)
        finally:
            for req_id in index_of:  # a caller that stops iterating leaves nothing behind
                self.core.abort(req_id)

    def generate(
        self,
        prompts: Sequence[PromptLike],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Run all prompts to completion; results in prompt order."""
        texts = [""] * len(prompts)
        tokens: list[list[int]] = [[] for _ in prompts]
        reasons: list[FinishReason] = [FinishReason.ERROR] * len(prompts)
        cached = [0] * len(prompts)
        for event in self.stream(prompts, params):
            if event.chunk is not None:
                texts[event.index] += event.chunk.text
                tokens[event.index].extend(event.chunk.token_ids)
            if event.finish_reason is not None:
                reasons[event.index] = event.finish_reason
                cached[event.index] = event.num_cached_tokens
        return [
            CompletionOutput(texts[i], tuple(tokens[i]), reasons[i], cached[i])
            for i in range(len(prompts))
        ]


def _broadcast(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return list(params)
