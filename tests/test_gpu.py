"""CUDA tests (`pytest -m gpu` on a machine with GPUs; skipped without them).

* The engine in bfloat16 on CUDA against the float32 CPU engine, same random weights:
  greedy outputs agree under the close-logprobs rule, nothing is NaN, and the paged cache
  is written exactly where the slot mapping says.
* The NCCL KV hand-off on a pair channel (engine.transfer.channel.KVChannel) between two GPUs
  is bit-exact.
* A 1P1D service on two GPUs answers like the colocated engine on one.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import pytest
import torch
from torch.distributed import TCPStore

from bench.harness import ServiceProcess
from engine.factory import EngineArgs
from engine.llm import LLM
from engine.model.model_loader import LoadFormat
from engine.sampling_params import SamplingParams
from engine.transfer.base import KVPoll
from engine.transfer.channel import SENDER_RANK, KVChannel
from engine.wire import ChannelSpec, HandoffEntry, HandoffHeader, HeaderKind
from tests.services import assert_pools_empty, running_service

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[1]
CONFIG_1B = REPO / "deploy" / "model_configs" / "llama-3.2-1b"

# NVLink multicast can take the shared host's GPUs down: keep it off in every process.
for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")

# Close-logprobs rule (bf16 on CUDA vs fp32 on CPU, same weights). Where the greedy
# tokens first differ, each side's token must be in the other's top 2 and, on both sides,
# the top-2 logprob gap must be below GAP_TOL: a near tie that bf16 rounding (8-bit
# mantissa: ~0.4% per rounding, accumulated over the layers) can flip. Before the
# first difference, the chosen token's logprob must agree within LOGPROB_TOL. On CPU, bf16
# vs fp32 for this model deviated by at most 0.032 (logprob) and diverged only at gaps
# below 0.05: the tolerances leave ~3x room for CUDA's different kernels.
GAP_TOL = 0.1
LOGPROB_TOL = 0.1


def needs_gpus(n: int) -> pytest.MarkDecorator:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(have < n, reason=f"needs {n} CUDA device(s), found {have}")


# ---------------------------------------------------------------- engine vs CPU reference


def small_1b_shape(root: Path, num_layers: int = 4) -> Path:
    """Llama-3.2-1B's config with fewer layers: real head/GQA/vocab shapes, CPU-cheap."""
    config = json.loads((CONFIG_1B / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    path = root / f"llama-3.2-1b-{num_layers}l"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


@dataclass(frozen=True)
class Pick:
    """One sampled position: the chosen token and the top-2 of the log-softmax."""

    token: int
    top_ids: tuple[int, int]
    top_logprobs: tuple[float, float]


@dataclass
class Trace:
    """What a recorded run produced: picks per request, and every cache slot written."""

    picks: dict[str, list[Pick]]
    written_slots: set[int]
    outputs: list[tuple[int, ...]]


def traced_generate(llm: LLM, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Trace:
    """`llm.generate`, recording the top-2 logprobs of every sampled row (by wrapping the
    runner's `_sample`, where logits become tokens on the eager and the graph path alike)
    and the cache slots each batch maps new K/V to (by wrapping `launch`, which every step
    goes through, with or without async scheduling)."""
    runner = llm.runner
    orig_launch, orig_sample = runner.launch, runner._sample
    picks: dict[str, list[Pick]] = defaultdict(list)
    written: set[int] = set()
    unsampled: list[str] = []
    bs = runner.block_size

    def launch(batch: Any, **kwargs: Any) -> Any:
        for s in batch.seqs:
            for p in range(s.start_position, s.end_position):
                written.add(s.block_table[p // bs] * bs + p % bs)
        unsampled[:] = [s.req_id for s in batch.seqs if s.sample]
        out = orig_launch(batch, **kwargs)
        assert not unsampled, "the runner sampled without calling ModelRunner._sample"
        return out

    def sample(logits: torch.Tensor, seqs: list[Any]) -> Any:
        pending = orig_sample(logits, seqs)
        tokens = pending.result()
        top = logits.float().log_softmax(-1).topk(2, dim=-1)
        for s, ids, lps in zip(seqs, top.indices.tolist(), top.values.tolist(), strict=True):
            picks[s.req_id].append(Pick(tokens[s.req_id], (ids[0], ids[1]), (lps[0], lps[1])))
        unsampled.clear()
        return pending

    runner.launch, runner._sample = launch, sample
    try:
        results = llm.generate(list(prompts), params)
    finally:
        del runner.launch, runner._sample
    return Trace(dict(picks), written, [r.token_ids for r in results])


def compare_close(ref: Trace, test: Trace) -> list[str]:
    """Violations of the close-logprobs rule (empty = pass); see GAP_TOL."""
    problems = []
    assert sorted(ref.picks) == sorted(test.picks)
    for req_id in sorted(ref.picks):
        for pos, (a, b) in enumerate(zip(ref.picks[req_id], test.picks[req_id], strict=True)):
            if a.token == b.token:  # greedy: the chosen token is each side's top 1
                if abs(a.top_logprobs[0] - b.top_logprobs[0]) > LOGPROB_TOL:
                    problems.append(
                        f"{req_id} pos {pos}: token {a.token} logprob "
                        f"{a.top_logprobs[0]:.3f} vs {b.top_logprobs[0]:.3f}"
                    )
                continue
            ok = (
                a.token in b.top_ids
                and b.token in a.top_ids
                and a.top_logprobs[0] - a.top_logprobs[1] < GAP_TOL
                and b.top_logprobs[0] - b.top_logprobs[1] < GAP_TOL
            )
            if not ok:
                problems.append(f"{req_id} pos {pos}: {a} vs {b}")
            break  # contexts differ from here on
    return problems


def cache_write_problems(cache: torch.Tensor, written_slots: set[int], block_size: int) -> str:
    """Cache poisoned with NaN before the run: written slots must be finite (all layers,
    K and V), every other slot still NaN. Returns '' when that holds."""
    num_blocks = cache.shape[0]
    # [blocks, layers, 2, block_size, heads, dim] -> per slot: all finite / all NaN.
    per_slot = cache.permute(0, 3, 1, 2, 4, 5).reshape(num_blocks * block_size, -1)
    finite = torch.isfinite(per_slot).all(dim=1).cpu()
    nan = torch.isnan(per_slot).all(dim=1).cpu()
    mask = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    mask[list(written_slots)] = True
    bad_written = (mask & ~finite).nonzero().flatten().tolist()
    bad_untouched = (~mask & ~nan).nonzero().flatten().tolist()
    if not bad_written and not bad_untouched:
        return ""
    return (
        f"scheduled slots not (fully) written or not finite: {bad_written[:20]}; "
        f"slots written outside the slot mapping: {bad_untouched[:20]}"
    )


def fixed_prompts(seed: int = 0) -> list[list[int]]:
    """Lengths around block boundaries (block size 16), ids away from special tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 120_000) for _ in range(n)] for n in (1, 7, 16, 17, 40, 100)]


class _SameModel(TypedDict):
    """The EngineArgs two engines of one model share."""

    model: str
    load_format: LoadFormat
    num_blocks: int


@needs_gpus(1)
def test_cuda_bf16_engine_matches_cpu_fp32_reference(tmp_path: Path) -> None:
    path = small_1b_shape(tmp_path)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = fixed_prompts()
    common = _SameModel(model=str(path), load_format="dummy", num_blocks=96)
    cpu = LLM(EngineArgs(device="cpu", dtype="float32", **common))
    ref = traced_generate(cpu, prompts, params)
    gpu = LLM(EngineArgs(device="cuda", dtype="bfloat16", **common))
    # CPU and CUDA generators differ: give the GPU engine the CPU engine's weights.
    gpu.runner.model.load_state_dict(cpu.runner.model.state_dict())
    gpu.runner.kv_cache.fill_(float("nan"))
    test = traced_generate(gpu, prompts, params)

    for trace in (ref, test):
        assert [len(o) for o in trace.outputs] == [16] * len(prompts)
        for req_id, picks in trace.picks.items():
            assert [p.token for p in picks] in [list(o) for o in trace.outputs], req_id
            # Greedy: the chosen token is a top-1 (ties may list it second).
            assert all(
                p.token in p.top_ids
                and p.top_logprobs[p.top_ids.index(p.token)] == p.top_logprobs[0]
                for p in picks
            ), f"{req_id}: greedy != argmax"
            flat = [lp for p in picks for lp in p.top_logprobs]
            assert all(lp == lp and lp > -1e30 for lp in flat), f"{req_id}: NaN/-inf logprob"
    problems = compare_close(ref, test)
    assert not problems, "\n".join(problems)
    assert not (msg := cache_write_problems(gpu.runner.kv_cache, test.written_slots, 16)), msg


# ---------------------------------------------------------------- NCCL hand-off

HANDOFF_BLOCK_SHAPE = (16, 2, 16, 8, 64)  # Llama-3.2-1B block: layers, K/V, tokens, heads, dim
NUM_SRC_BLOCKS, NUM_DST_BLOCKS = 256, 320


def _handoff_trials() -> list[tuple[list[int], list[int]]]:
    rng = random.Random(7)
    sizes = (1, 2, 7, 33, 128, 5, 64, 1)  # 128 blocks of 512 KiB = one 64 MiB message
    return [
        (rng.sample(range(NUM_SRC_BLOCKS), n), rng.sample(range(NUM_DST_BLOCKS), n)) for n in sizes
    ]


def _source_bits() -> torch.Tensor:
    """Random bit patterns (NaNs and infs included) as bf16: any change of a bit shows."""
    g = torch.Generator().manual_seed(1234)
    bits = torch.randint(-(2**15), 2**15, (NUM_SRC_BLOCKS, *HANDOFF_BLOCK_SHAPE), generator=g)
    return bits.to(torch.int16).view(torch.bfloat16)


def _handoff_worker(rank: int, store_port: int, out_path: str, use_cuda: bool = True) -> None:
    """Rank 0 gathers random block sets and sends them on a pair channel (all posted at
    once); rank 1 receives each header and payload and scatters into other block ids.
    (`use_cuda=False`: gloo on CPU, to check the check itself on a machine without GPUs.)"""
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    spec = ChannelSpec("127.0.0.1", store_port, "prefill-0", 1, "decode-0", 2, 120.0)
    channel = KVChannel(spec, rank, device)
    channel.open()
    try:
        trials = _handoff_trials()
        if rank == SENDER_RANK:
            cache = _source_bits().to(device)
            sends = []
            for n, (src, _dst) in enumerate(trials):
                payload = cache.index_select(0, torch.tensor(src, device=device))
                header = HandoffHeader(
                    HeaderKind.HANDOFF,
                    channel.next_seq(),
                    dst_epoch=2,
                    entries=(HandoffEntry(f"r{n}", len(src) * 16, len(src), 0),),
                    num_bytes=payload.numel() * payload.element_size(),
                )
                sends.append(channel.send(header, payload))
            for handle in sends:
                assert handle.wait(120) is KVPoll.SUCCESS, handle.failure
            return
        cache = torch.zeros((NUM_DST_BLOCKS, *HANDOFF_BLOCK_SHAPE), dtype=torch.bfloat16)
        cache = cache.to(device)
        for n, (_, dst) in enumerate(trials):
            header = channel.recv_header()
            assert header.seq_no == n and header.entries[0].req_id == f"r{n}"
            staging = torch.empty(
                (header.num_blocks, *HANDOFF_BLOCK_SHAPE), dtype=torch.bfloat16
            ).to(device)
            channel.recv_into(staging)
            # The receiver's own reservation names the destination blocks.
            cache.index_copy_(0, torch.tensor(dst, device=device), staging)
        source = _source_bits().view(torch.int16)
        expected = torch.zeros((NUM_DST_BLOCKS, *HANDOFF_BLOCK_SHAPE), dtype=torch.int16)
        for src, dst in trials:
            expected[dst] = source[src]
        got = cache.view(torch.int16).cpu()
        differing = (got != expected).flatten(1).any(dim=1).nonzero().flatten().tolist()
        Path(out_path).write_text(json.dumps({"differing_blocks": differing}))
    finally:
        channel.close(notify_peer=False)


@needs_gpus(2)
def test_nccl_handoff_between_two_gpus_is_bit_exact(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    out = tmp_path / "handoff.json"
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.spawn(
        _handoff_worker,
        args=(store.port, str(out)),
        nprocs=2,
        join=True,
    )
    result = json.loads(out.read_text())
    assert result["differing_blocks"] == [], f"blocks differ after hand-off: {result}"


# ---------------------------------------------------------------- 1P1D service on two GPUs


def _gpu_service(tmp_path: Path, *pools: str) -> Iterator[ServiceProcess]:
    args = [
        *pools,
        "--local-prefill-max-tokens",  # every prompt goes through a hand-off
        "0",
        "--model",
        str(CONFIG_1B),
        "--load-format",
        "dummy",
        "--prefill-kv-cache-gib",
        "2",
        "--decode-kv-cache-gib",
        "2",
        "--drain-grace-s",
        "10",
    ]
    with running_service(args, tmp_path / "service.log", timeout=300) as svc:
        yield svc


@pytest.fixture
def service_1p1d(tmp_path: Path) -> Iterator[ServiceProcess]:
    # Prompts of 32 tokens and more stream their KV layer by layer; shorter ones go whole.
    yield from _gpu_service(tmp_path, "--kv-stream-min-tokens", "32")


@pytest.fixture
def service_2p2d(tmp_path: Path) -> Iterator[ServiceProcess]:
    yield from _gpu_service(tmp_path, "--prefill-workers", "2", "--decode-workers", "2")


async def _served(address: str, prompt: list[int], max_tokens: int) -> tuple[list[int], Any]:
    from router.cli.client import stream_generate

    tokens: list[int] = []
    final = None
    async for resp in stream_generate(
        address, prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
    ):
        tokens.extend(resp.token_ids)
        if resp.finish_reason:
            final = resp
    return tokens, final


@needs_gpus(2)
def test_1p1d_service_on_two_gpus_matches_colocated_engine(
    service_1p1d: ServiceProcess,
) -> None:
    log = service_1p1d.log_path.read_text(errors="replace")
    assert "on GPUs" in log, "the workers did not get GPUs"
    check_service_matches_colocated(service_1p1d.address, CONFIG_1B, "cuda")


@needs_gpus(4)
def test_2p2d_service_on_four_gpus_uses_both_pairs_and_matches_colocated_engine(
    service_2p2d: ServiceProcess,
) -> None:
    from pdserve.v1 import generation_pb2 as pb
    from router.cli.client import get_pool_stats

    assert "2 prefill + 2 decode + 0 colocated workers on GPUs" in service_2p2d.log_tail(20000)
    check_service_matches_colocated(service_2p2d.address, CONFIG_1B, "cuda")
    # The burst above spread over both pairs: every worker ran prompts or decodes.
    stats = asyncio.run(get_pool_stats(service_2p2d.address))
    decode = [w for w in stats.workers if w.pool == pb.POOL_DECODE]
    prefill = [w for w in stats.workers if w.pool == pb.POOL_PREFILL]
    assert len(decode) == 2 and len(prefill) == 2
    assert all(w.prefix_query_tokens > 0 for w in prefill), stats


def check_service_matches_colocated(address: str, model: Path, device: str) -> None:
    """Sequential requests: the same tokens as the colocated engine. A burst: every
    request finishes at full length, and the pools return to zero blocks in use."""
    from pdserve.v1 import generation_pb2 as pb

    prompts = fixed_prompts(seed=1) + [fixed_prompts(seed=2)[-1] * 6]  # + a 600-token prompt
    colocated = LLM(
        EngineArgs(model=str(model), load_format="dummy", device=device, kv_cache_gib=2)
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # One request at a time on both sides: the same shapes run the same kernels, so the
    # bf16 results (and the greedy tokens) are identical, not merely close.
    for i, prompt in enumerate(prompts):
        expected = list(colocated.generate([prompt], params)[0].token_ids)
        tokens, final = asyncio.run(_served(address, prompt, 24))
        assert tokens == expected, f"prompt {i} ({len(prompt)} tokens) differs from colocated"
        assert final.finish_reason == pb.FINISH_REASON_LENGTH
        assert final.timings.kv_transfer_seconds > 0
    del colocated

    async def burst() -> list[tuple[list[int], Any]]:
        return await asyncio.gather(*(_served(address, p, 24) for p in prompts * 4))

    for tokens, final in asyncio.run(burst()):  # batched: all finish, full length
        assert len(tokens) == 24 and final.finish_reason == pb.FINISH_REASON_LENGTH
    # Blocks return to both pools shortly after the last final message.
    asyncio.run(assert_pools_empty(address, timeout=15, pools={pb.POOL_PREFILL, pb.POOL_DECODE}))
