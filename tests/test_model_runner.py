"""ModelRunner against plain transformers: packed paged steps must give generate()'s tokens."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core.batch import Batch, ScheduledSeq
from engine.model.attention import ATTN_IMPLEMENTATION, _current_step
from engine.model.model_runner import ModelRunner
from engine.model.model_spec import ModelSpec
from engine.sampling_params import GREEDY, SamplingParams
from tests.fakes import one_token_each

MODELS = ("llama", "mistral", "qwen2", "qwen3", "smollm2")  # conftest.TINY_ARCHS + embedded
NUM_NEW = 8
NUM_BLOCKS = 48


@dataclass
class Model:
    """A runner, a reference transformers model and the test prompts of one model folder."""

    runner: ModelRunner
    reference: torch.nn.Module
    prompts: list[list[int]]
    block_size: int
    expected: list[list[int]] = field(default_factory=list)  # generate()'s new tokens


def _prompts(name: str, path: Path) -> list[list[int]]:
    if name != "smollm2":
        rng = random.Random(7)
        # Lengths cross block boundaries (block_size 8) and include a 1-token prompt,
        # which lands in the decode group of the prefill step.
        return [[rng.randrange(3, 49152) for _ in range(n)] for n in (13, 1, 8, 22)]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "hi"]
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
            )
        )
        for q in questions
    ]


_MODELS: dict[str, Model] = {}


@pytest.fixture(params=MODELS)
def model(request: pytest.FixtureRequest, tiny_model_paths: dict[str, Path]) -> Model:
    """One loaded Model per folder, kept for the whole module (loading costs seconds)."""
    name: str = request.param
    if name not in _MODELS:
        from transformers import AutoModelForCausalLM, GenerationConfig

        path = (
            request.getfixturevalue("smollm2_path") if name == "smollm2" else tiny_model_paths[name]
        )
        block_size = 16 if name == "smollm2" else 8
        runner = ModelRunner(path, num_blocks=NUM_BLOCKS, block_size=block_size)
        reference = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch.float32
        )
        prompts = _prompts(name, path)
        m = Model(runner, reference, prompts, block_size)
        config = GenerationConfig(
            max_new_tokens=NUM_NEW, do_sample=False, eos_token_id=2, pad_token_id=2
        )
        for p in prompts:
            out = reference.generate(torch.tensor([p]), generation_config=config)
            m.expected.append(out[0, len(p) :].tolist())
        _MODELS[name] = m
    return _MODELS[name]


@dataclass
class Req:
    req_id: str
    tokens: list[int]  # prompt, then sampled tokens
    block_table: tuple[int, ...]
    arrival_step: int = 0
    chunk: int = 0  # prompt chunk size; 0 = whole prompt at once
    num_computed: int = 0
    num_prompt: int = 0

    def __post_init__(self) -> None:
        self.num_prompt = len(self.tokens)


def drive(runner: ModelRunner, reqs: list[Req], block_size: int, num_new: int = NUM_NEW) -> None:
    """Play the scheduler by hand: chunked prefill, then one decode token per step."""
    step = 0
    while any(len(r.tokens) - r.num_prompt < num_new for r in reqs):
        seqs = []
        for r in reqs:
            if r.arrival_step > step or len(r.tokens) - r.num_prompt >= num_new:
                continue
            remaining = len(r.tokens) - r.num_computed
            n = min(remaining, r.chunk) if r.chunk else remaining
            chunk = tuple(r.tokens[r.num_computed : r.num_computed + n])
            sample = r.num_computed + n == len(r.tokens)
            seqs.append(
                ScheduledSeq(r.req_id, chunk, r.num_computed, r.block_table, sample, GREEDY, 0)
            )
        out = one_token_each(runner.execute(Batch(tuple(seqs), block_size)))
        assert set(out) == {s.req_id for s in seqs if s.sample}
        by_id = {r.req_id: r for r in reqs}
        for s in seqs:
            r = by_id[s.req_id]
            r.num_computed += s.num_tokens
            if s.sample:
                r.tokens.append(out[s.req_id])
        step += 1


def contiguous_tables(m: Model, first_block: int = 0) -> list[tuple[int, ...]]:
    """Simple contiguous block ids, each request getting room for prompt + NUM_NEW tokens."""
    tables, nxt = [], first_block
    for p in m.prompts:
        n = -(-(len(p) + NUM_NEW) // m.block_size)
        tables.append(tuple(range(nxt, nxt + n)))
        nxt += n
    assert nxt <= NUM_BLOCKS
    return tables


def assert_matches_generate(m: Model, reqs: list[Req]) -> None:
    for r, expected in zip(reqs, m.expected, strict=True):
        got = r.tokens[r.num_prompt :]
        # generate() stops at eos; the runner keeps going (stopping is the scheduler's job).
        assert got[: len(expected)] == expected, r.req_id


def test_prefill_then_decode_matches_generate(model: Model) -> None:
    reqs = [
        Req(f"r{i}", list(p), t)
        for i, (p, t) in enumerate(zip(model.prompts, contiguous_tables(model), strict=True))
    ]
    drive(model.runner, reqs, model.block_size)
    assert_matches_generate(model, reqs)


def test_mixed_chunked_prefill_and_decode_matches_generate(model: Model) -> None:
    tables = contiguous_tables(model)
    # Request 0 prefills in chunks of 5 while the others decode; the last one arrives
    # late, so its whole prefill shares a step with decodes.
    reqs = [
        Req(f"r{i}", list(p), t) for i, (p, t) in enumerate(zip(model.prompts, tables, strict=True))
    ]
    reqs[0].chunk = 5
    reqs[-1].arrival_step = 2
    drive(model.runner, reqs, model.block_size)
    assert_matches_generate(model, reqs)


def test_bucketed_shapes_give_the_same_tokens(model: Model) -> None:
    # CUDA pads group shapes to buckets (padding sequences, query rows and kv
    # positions); forcing it on CPU checks the padding never leaks into outputs.
    model.runner.bucket_shapes = True
    try:
        test_mixed_chunked_prefill_and_decode_matches_generate(model)
    finally:
        model.runner.bucket_shapes = None


def test_cache_written_only_through_slot_mapping(model: Model) -> None:
    runner = model.runner
    runner.kv_cache.fill_(float("nan"))
    # Start at block 5 and reverse each table: blocks 0-4 stay unused and logical
    # order differs from physical order.
    tables = [tuple(reversed(t)) for t in contiguous_tables(model, first_block=5)]
    reqs = [
        Req(f"r{i}", list(p), t) for i, (p, t) in enumerate(zip(model.prompts, tables, strict=True))
    ]
    drive(runner, reqs, model.block_size)
    assert_matches_generate(model, reqs)

    written = torch.zeros(runner.num_blocks, runner.block_size, dtype=torch.bool)
    for r in reqs:
        for pos in range(r.num_computed):
            written[r.block_table[pos // runner.block_size], pos % runner.block_size] = True
    finite = torch.isfinite(runner.kv_cache).all(dim=(1, 2, 4, 5))  # [num_blocks, block_size]
    untouched = torch.isnan(runner.kv_cache).all(dim=(1, 2, 4, 5))
    assert torch.equal(finite, written)
    assert torch.equal(untouched, ~written)


def test_attention_gets_no_mask_and_sees_the_step(tiny_model_paths: dict[str, Path]) -> None:
    # The paged fn relies on transformers skipping mask creation for unknown
    # implementations; a transformers upgrade that stops doing so must fail here.
    from transformers import AttentionInterface

    runner = ModelRunner(tiny_model_paths["llama"], num_blocks=4, block_size=8)
    seen: list[tuple[object, int]] = []
    original = AttentionInterface._global_mapping[ATTN_IMPLEMENTATION]

    def spy(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> Any:
        seen.append((attention_mask, _current_step().metadata.num_tokens))
        return original(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(ATTN_IMPLEMENTATION, spy)
    try:
        runner.execute(Batch((ScheduledSeq("a", (5, 6, 7), 0, (1,), True, GREEDY, 0),), 8))
    finally:
        AttentionInterface.register(ATTN_IMPLEMENTATION, original)
    assert seen == [(None, 3)] * runner.spec.num_layers


def test_attention_outside_a_step_says_what_to_use(tiny_model_paths: dict[str, Path]) -> None:
    runner = ModelRunner(tiny_model_paths["llama"], num_blocks=4, block_size=8)
    with pytest.raises(RuntimeError, match="paged_step"):
        runner.model(input_ids=torch.tensor([[5, 6]]), use_cache=False)


def test_seeded_sampling_is_reproducible_across_batches(tiny_model_paths: dict[str, Path]) -> None:
    runner = ModelRunner(tiny_model_paths["qwen3"], num_blocks=8, block_size=8)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4)
    prompt = (11, 12, 13, 14)
    alone = runner.execute(Batch((ScheduledSeq("a", prompt, 0, (0,), True, params, 42),), 8))
    others = tuple(
        ScheduledSeq(f"o{i}", (20 + i, 30), 0, (1 + i,), True, GREEDY, i) for i in range(3)
    )
    together = runner.execute(
        Batch((*others, ScheduledSeq("a", prompt, 0, (4,), True, params, 42)), 8)
    )
    assert together["a"] == alone["a"]


def test_sizes_and_rejections(tiny_model_paths: dict[str, Path]) -> None:
    runner = ModelRunner(tiny_model_paths["llama"], num_blocks=4, block_size=8)
    spec: ModelSpec = runner.spec
    assert runner.block_bytes == spec.kv_block_bytes(8) == runner.kv_cache[0].numel() * 4
    assert runner.execute(Batch((), 8)) == {}
    # A prompt chunk that does not reach the end samples nothing (no lm_head rows).
    assert runner.execute(Batch((ScheduledSeq("a", (5, 6), 0, (0,), False, GREEDY, 0),), 8)) == {}
    with pytest.raises(ValueError, match="block_size"):
        runner.execute(Batch((ScheduledSeq("a", (5,), 0, (0,), True, GREEDY, 0),), 16))
    with pytest.raises(ValueError, match="cannot hold"):
        runner.execute(Batch((ScheduledSeq("a", tuple(range(9)), 0, (0,), True, GREEDY, 0),), 8))
    with pytest.raises(ValueError, match="outside"):
        runner.execute(Batch((ScheduledSeq("a", (5,), 0, (4,), True, GREEDY, 0),), 8))


def test_handed_off_blocks_continue_decoding_identically(tiny_model_paths: dict[str, Path]) -> None:
    # Prefill on one runner, move the blocks into different ids of a second runner
    # (sized by a byte budget), decode there: tokens equal a single-runner run.
    path = tiny_model_paths["mistral"]
    src = ModelRunner(path, num_blocks=8, block_size=8)
    per_block = src.block_bytes
    dst = ModelRunner(path, kv_cache_bytes=12 * per_block + 100, block_size=8)
    assert dst.num_blocks == 12
    prompt = tuple(range(100, 119))  # 19 tokens: 3 blocks
    seq = ScheduledSeq("a", prompt, 0, (5, 1, 6), True, GREEDY, 0)
    first = one_token_each(src.execute(Batch((seq,), 8)))["a"]

    dst.kv_cache.fill_(float("nan"))
    dst.scatter_blocks([9, 2, 4], src.gather_blocks([5, 1, 6]))
    tokens_dst, tokens_src = [first], [first]
    for runner, table, tokens in ((dst, (9, 2, 4), tokens_dst), (src, (5, 1, 6), tokens_src)):
        for _ in range(4):
            pos = len(prompt) + len(tokens) - 1
            seq = ScheduledSeq("a", (tokens[-1],), pos, table, True, GREEDY, 0)
            tokens.append(one_token_each(runner.execute(Batch((seq,), 8)))["a"])
    assert tokens_dst == tokens_src
    with pytest.raises(ValueError, match="shape"):
        dst.scatter_blocks([0], src.gather_blocks([0, 1]))
