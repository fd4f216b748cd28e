"""Tensor parallelism on CPU over gloo: a model split over 2 and 4 ranks gives the logits
and the greedy tokens of the whole model on one rank."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from bench.harness.tp_ranks import end_rank
from engine.core.batch import Batch, ScheduledSeq
from engine.model.model_loader import LoadFormat
from engine.model.model_runner import ModelRunner
from engine.parallel.tensor_parallel import SINGLE, TPRank, join_tp_group
from engine.sampling_params import GREEDY
from tests.fakes import one_token_each

BLOCK_SIZE = 8
PROMPTS = ((5, 17, 300, 4000, 9, 12, 77, 1024, 31, 8, 45), (2000, 3, 49000))
NUM_STEPS = 4


def _generate(
    path: str, tp: TPRank, load_format: LoadFormat, device: str = "cpu"
) -> tuple[torch.Tensor, list[list[int]]]:
    """The first step's logits and NUM_STEPS greedy tokens per prompt, on this rank (on
    CUDA: the compiled decoder, decode steps from CUDA graphs)."""
    runner = ModelRunner(
        path,
        num_blocks=16,
        block_size=BLOCK_SIZE,
        tp=tp,
        load_format=load_format,
        device=device,
        dtype="float32",
        max_num_seqs=len(PROMPTS),
    )
    tables = [tuple(range(i * 4, i * 4 + 4)) for i in range(len(PROMPTS))]
    seqs = [ScheduledSeq(f"r{i}", p, 0, tables[i], True, GREEDY, 0) for i, p in enumerate(PROMPTS)]
    batch = Batch(tuple(seqs), BLOCK_SIZE)
    logits = runner._forward_eager(batch, None).float()
    tokens: list[list[int]] = [[] for _ in PROMPTS]
    lengths = [len(p) for p in PROMPTS]
    for step in range(NUM_STEPS):
        out = one_token_each(runner.execute(batch))
        for i in range(len(PROMPTS)):
            tokens[i].append(out[f"r{i}"])
        if step + 1 < NUM_STEPS:
            batch = Batch(
                tuple(
                    ScheduledSeq(
                        f"r{i}", (tokens[i][-1],), lengths[i] + step, tables[i], True, GREEDY, 0
                    )
                    for i in range(len(PROMPTS))
                ),
                BLOCK_SIZE,
            )
    return logits, tokens


def _rank_main(
    rank: int, size: int, rendezvous: str, path: str, load_format: LoadFormat, out: str, device: str
) -> None:
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    tp = join_tp_group(rendezvous, rank, size, torch.device(device))
    logits, tokens = _generate(path, tp, load_format, device)
    if rank == 0:
        torch.save({"logits": logits.cpu(), "tokens": tokens}, out)
    end_rank()


def _run_group(
    size: int, path: Path, load_format: LoadFormat, tmp_path: Path, device: str = "cpu"
) -> dict[str, object]:
    """Rank 0's logits and tokens of a group of `size` processes (one per GPU on CUDA)."""
    out = tmp_path / f"tp{size}.pt"
    rendezvous = str(tmp_path / f"rdv-{uuid.uuid4().hex}")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    mp.spawn(
        _rank_main, args=(size, rendezvous, str(path), load_format, str(out), device), nprocs=size
    )
    return torch.load(out)


# 4 query heads, 2 KV heads: TP 2 splits both, TP 4 replicates each KV head on two
# ranks. Qwen2 has q/k/v biases (one split, one replicated), Qwen3 q/k norms.
@pytest.mark.parametrize(
    ("arch", "sizes"),
    [
        ("llama", (2, 4)),
        pytest.param("qwen2", (4,), marks=pytest.mark.slow),
        pytest.param("qwen3", (2,), marks=pytest.mark.slow),
    ],
)
def test_a_model_split_over_ranks_matches_one_rank(
    arch: str, sizes: tuple[int, ...], tiny_model_paths: dict[str, Path], tmp_path: Path
) -> None:
    path = tiny_model_paths[arch]
    torch.set_num_threads(1)
    whole_logits, whole_tokens = _generate(str(path), SINGLE, "auto")
    for size in sizes:
        split = _run_group(size, path, "auto", tmp_path)
        torch.testing.assert_close(split["logits"], whole_logits, rtol=1e-4, atol=1e-4)
        assert split["tokens"] == whole_tokens, size


def test_random_weights_are_the_same_model_at_every_size(
    tiny_model_paths: dict[str, Path], tmp_path: Path
) -> None:
    # Dummy weights are drawn per tensor at full shape: TP 2 and TP 4 are one model.
    path = tiny_model_paths["llama"]
    two = _run_group(2, path, "dummy", tmp_path)
    four = _run_group(4, path, "dummy", tmp_path)
    torch.testing.assert_close(two["logits"], four["logits"], rtol=1e-4, atol=1e-4)
    assert two["tokens"] == four["tokens"]
