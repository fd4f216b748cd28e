"""Which steps a prompt CUDA graph runs and at what padded size (CPU, milliseconds), and
the flag that sets the longest one; the graphs' tokens against the eager pass are in
tests/test_gpu_runner.py."""

from __future__ import annotations

import pytest
import torch

from engine.core.batch import Batch, ScheduledSeq
from engine.core.config import SchedulerConfig
from engine.factory import DEFAULT_PROMPT_GRAPH_MAX_TOKENS, EngineArgs, longest_graph_chunk
from engine.model.prompt_graphs import fits_prompt_graph, prompt_graph_sizes, within_context
from engine.sampling_params import GREEDY
from router.cli.engine_flags import engine_args
from router.cli.flags import build_parser


def _seq(
    req_id: str, num_tokens: int, start: int = 0, blocks: int = 4, drafts: int = 0
) -> ScheduledSeq:
    tokens = tuple(range(1, num_tokens + 1))
    return ScheduledSeq(req_id, tokens, start, tuple(range(blocks)), True, GREEDY, 0, drafts)


def test_sizes_pad_any_chunk_by_less_than_half() -> None:
    sizes = prompt_graph_sizes(2048)
    assert sizes[0] == 16 and sizes[-1] == 2048
    for n in range(17, 2049):
        padded = next(s for s in sizes if s >= n)
        assert padded < 1.5 * n, (n, padded)
    assert len(sizes) <= 16  # start-up captures each one
    assert prompt_graph_sizes(100)[-1] == 100  # the longest asked for is always captured
    assert prompt_graph_sizes(10) == [10]
    assert prompt_graph_sizes(0) == []


def test_only_one_prompt_chunk_alone_fits_a_graph() -> None:
    assert fits_prompt_graph(Batch((_seq("a", 512, blocks=32),), 16), 512, 32)
    # A chunk after a cached prefix: its table is longer than the chunk.
    assert fits_prompt_graph(Batch((_seq("a", 100, start=300, blocks=25),), 16), 512, 32)
    assert not fits_prompt_graph(Batch((_seq("a", 513, blocks=33),), 16), 512, 64)
    assert not fits_prompt_graph(Batch((_seq("a", 100, blocks=40),), 16), 512, 32)
    # A table too short for the chunk: the eager pass raises the request's error.
    assert not fits_prompt_graph(Batch((_seq("a", 100, start=20, blocks=7),), 16), 512, 32)
    two = Batch((_seq("a", 10), _seq("b", 1, start=30)), 16)
    assert not fits_prompt_graph(two, 512, 32)
    speculating = Batch((_seq("a", 5, start=40, drafts=4),), 16, num_draft_tokens=4)
    assert not fits_prompt_graph(speculating, 512, 32)


def test_flag_sets_the_engines_longest_graph_and_refuses_negatives(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    default = engine_args(parser.parse_args(["serve"]), "decode")
    assert default.prompt_graph_max_tokens == DEFAULT_PROMPT_GRAPH_MAX_TOKENS
    offline = engine_args(parser.parse_args(["generate", "hi", "--prompt-graph-max-tokens", "64"]))
    assert offline.prompt_graph_max_tokens == 64
    ns = parser.parse_args(["serve", "--prompt-graph-max-tokens", "0"])
    assert engine_args(ns, "prefill").prompt_graph_max_tokens == 0
    assert engine_args(ns, "decode").prompt_graph_max_tokens == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--prompt-graph-max-tokens", "-1"])
    assert "--prompt-graph-max-tokens" in capsys.readouterr().err
    with pytest.raises(ValueError, match="prompt_graph_max_tokens"):
        EngineArgs(prompt_graph_max_tokens=-5)


def test_no_graph_is_longer_than_a_chunk_can_be() -> None:
    cuda = torch.device("cuda")  # only named: the bounds are plain arithmetic
    assert longest_graph_chunk(EngineArgs(), cuda) == DEFAULT_PROMPT_GRAPH_MAX_TOKENS
    small_steps = EngineArgs(scheduler=SchedulerConfig(max_num_batched_tokens=512))
    assert longest_graph_chunk(small_steps, cuda) == 512
    chunked = EngineArgs(scheduler=SchedulerConfig(long_prefill_token_threshold=300))
    assert longest_graph_chunk(chunked, cuda) == 300
    assert longest_graph_chunk(EngineArgs(prompt_graph_max_tokens=0), cuda) == 0
    # A model of 1000 tokens: the graphs stop there, the last one at 1000.
    capped = within_context(prompt_graph_sizes(2048), 1000)
    assert capped[-1] == 1000 and capped[-2] == 768
    assert within_context(prompt_graph_sizes(512), 1000) == prompt_graph_sizes(512)
