"""CUDA tests of the fast decode path (run with `pytest -m gpu`; skipped without CUDA).

* The Triton paged decode kernel against a float64 reference and against the SDPA group
  path, on random caches and shuffled block tables (GQA, splits, block boundaries).
* Decode steps replayed from CUDA graphs give the eager runner's tokens (tiny float32
  Llama, padded and unpadded batch sizes) and, on the Llama-3.2-1B shape with random
  bf16 weights, the eager logits; padding never touches a block no request owns.
* A prompt chunk run alone replays a prompt CUDA graph and gives the eager runner's
  tokens (whole prompts, chunks after a cached prefix, the padded sizes), and on the
  Llama-3.2-1B shape the eager logits; a chunk whose KV streams layer by layer, or one
  too long for any graph, runs eagerly.
* The one-launch K/V cache write against `index_copy_`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypedDict

import pytest
import torch

from engine.core.batch import Batch, ScheduledSeq
from engine.model.attention import paged_attention_forward, paged_step, write_kv
from engine.model.attention_metadata import PagedAttentionMetadata, build_metadata
from engine.model.compiled import is_compiled, uncompile_decoder
from engine.model.kernels.triton_attention import paged_decode_attention, triton_available
from engine.model.model_runner import ModelRunner
from engine.model.prompt_graphs import prompt_graph_sizes
from engine.sampling_params import GREEDY
from tests.fakes import assert_engine_empty, one_token_each
from tests.tiny_models import tiny_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton"
    ),
]

REPO = Path(__file__).resolve().parents[1]
CONFIG_1B = REPO / "deploy" / "model_configs" / "llama-3.2-1b"


@pytest.fixture(scope="module")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random float32 Llama folder (no tokenizer: the runner needs none)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    path = tmp_path_factory.mktemp("gpu_tiny") / "tiny-llama"
    AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32).save_pretrained(
        path
    )
    return path


class _Placement(TypedDict):
    """The ModelRunner arguments the runners a test compares share."""

    device: str
    dtype: str
    num_blocks: int
    block_size: int


def _reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    table: torch.Tensor,
    ctx: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """float64 attention of one query per sequence over its paged context."""
    n, num_heads, _ = q.shape
    block_size, num_kv_heads = cache.shape[3], cache.shape[4]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for i in range(n):
        pos = torch.arange(int(ctx[i]), device=q.device)
        blocks = table[i, pos // block_size].long()
        k = cache[blocks, layer, 0, pos % block_size].double()  # [c, KVH, D]
        v = cache[blocks, layer, 1, pos % block_size].double()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,chd->hc", q[i].double(), k) * scale
        out[i] = torch.einsum("hc,chd->hd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,dtype",
    [
        (32, 8, 128, 16, torch.bfloat16),  # Llama-3.1-8B
        (32, 8, 64, 16, torch.bfloat16),  # Llama-3.2-1B
        (4, 2, 16, 8, torch.float32),  # the tiny test models
        (12, 4, 96, 32, torch.float16),  # head_dim not a power of two
        (8, 8, 64, 16, torch.bfloat16),  # no GQA
    ],
)
@pytest.mark.parametrize("num_splits", [1, 4, 32])
@pytest.mark.parametrize("write_new", [False, True])
def test_decode_kernel_matches_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_splits: int,
    write_new: bool,
) -> None:
    gen = torch.Generator(device="cuda").manual_seed(num_heads * 1000 + head_dim + num_splits)
    num_blocks, num_layers, max_blocks, n = 600, 3, 80, 7
    cache = torch.randn(
        (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim),
        generator=gen,
        device="cuda",
    ).to(dtype)
    q = torch.randn((n, num_heads, head_dim), generator=gen, device="cuda").to(dtype)
    perm = torch.randperm(num_blocks, generator=gen, device="cuda")
    table = perm[: n * max_blocks].view(n, max_blocks).to(torch.int32)
    # 1 token, a block boundary, mid-block, the whole table, random.
    ctx = torch.tensor(
        [1, block_size, block_size + 3, max_blocks * block_size, 777, 2, 1000],
        dtype=torch.int32,
        device="cuda",
    ).clamp(max=max_blocks * block_size)
    new_kv: dict[str, torch.Tensor] = {}
    if write_new:
        # Each sequence's newest K/V come as inputs; its cache slot (layer 2 only) holds
        # NaN until the kernel writes them there, and no other slot may change.
        new_k, new_v = (
            torch.randn((n, num_kv_heads, head_dim), generator=gen, device="cuda").to(dtype)
            for _ in range(2)
        )
        new_kv = {"new_key": new_k, "new_value": new_v}
        last = (ctx - 1).long()
        blocks = table[torch.arange(n, device="cuda"), last // block_size].long()
        expected = cache.clone()
        expected[blocks, 2, 0, last % block_size] = new_k
        expected[blocks, 2, 1, last % block_size] = new_v
        cache[blocks, 2, :, last % block_size] = float("nan")
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    paged_decode_attention(q, cache, 2, table, ctx, head_dim**-0.5, num_splits, out=out, **new_kv)
    if write_new:
        assert torch.equal(cache, expected)
    ref = _reference(q, cache, 2, table, ctx, head_dim**-0.5)
    assert torch.isfinite(out).all()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


def test_paged_group_matches_sdpa_group_on_a_mixed_step() -> None:
    # The same forward call through the SDPA groups and through the Triton decode group.
    random.seed(3)
    num_heads, num_kv_heads, head_dim, block_size, num_layers = 32, 8, 128, 16, 2
    cache = torch.randn((200, num_layers, 2, block_size, num_kv_heads, head_dim), device="cuda")
    cache = cache.to(torch.bfloat16)
    blocks = list(range(200))
    random.shuffle(blocks)
    num_q = [1, 1, 37, 1, 5, 1]
    starts = [700, 0, 100, 31, 0, 1500]
    tables = []
    for q_len, start in zip(num_q, starts, strict=True):
        need = -(-(start + q_len) // block_size)
        tables.append([blocks.pop() for _ in range(need)])
    num_tokens = sum(num_q)
    query = torch.randn((1, num_heads, num_tokens, head_dim), device="cuda").to(torch.bfloat16)
    key = torch.randn((1, num_kv_heads, num_tokens, head_dim), device="cuda").to(torch.bfloat16)
    value = torch.randn_like(key)

    class Layer(torch.nn.Module):
        layer_idx = 1
        scaling = head_dim**-0.5

    outs = []
    for paged in (False, True):
        kv = cache.clone()
        meta = build_metadata(
            num_q,
            starts,
            tables,
            block_size,
            num_layers,
            torch.device("cuda"),
            bucket_shapes=True,
            paged_decode=paged,
        )
        assert any(g.paged for g in meta.groups) == paged
        with paged_step(meta, kv):
            out, _ = paged_attention_forward(Layer(), query, key, value, None)
        outs.append(out.float())
    assert torch.isfinite(outs[1]).all()
    err = ((outs[1] - outs[0]).norm() / outs[0].norm()).item()
    assert err < 1e-2, err


def _decode_run(
    runner: ModelRunner, prompts: list[list[int]], tables: Sequence[tuple[int, ...]], steps: int
) -> list[list[int]]:
    """Prefill every prompt in one step, then `steps` pure-decode steps; the new tokens."""
    bs = runner.block_size
    seqs = tuple(
        ScheduledSeq(f"r{i}", tuple(p), 0, tables[i], True, GREEDY, 0)
        for i, p in enumerate(prompts)
    )
    first = one_token_each(runner.execute(Batch(seqs, bs)))
    tokens = [list(p) + [first[f"r{i}"]] for i, p in enumerate(prompts)]
    for _ in range(steps):
        batch = Batch(
            tuple(
                ScheduledSeq(f"r{i}", (t[-1],), len(t) - 1, tables[i], True, GREEDY, 0)
                for i, t in enumerate(tokens)
            ),
            bs,
        )
        out = one_token_each(runner.execute(batch))
        for i, t in enumerate(tokens):
            t.append(out[f"r{i}"])
    return [t[len(p) :] for t, p in zip(tokens, prompts, strict=True)]


def test_cuda_graphs_give_eager_tokens_on_tiny_llama(tiny_llama_path: Path) -> None:
    path = tiny_llama_path
    num_blocks, bs = 64, 8
    common = _Placement(device="cuda", dtype="float32", num_blocks=num_blocks, block_size=bs)
    graphed = ModelRunner(path, cuda_graph_batch_sizes=[1, 2, 4, 8], **common)
    compiled = ModelRunner(path, enforce_eager=True, **common)  # as a prefill engine runs
    eager = ModelRunner(path, enforce_eager=True, compile_model=False, **common)
    sdpa = ModelRunner(path, enforce_eager=True, paged_decode=False, compile_model=False, **common)
    assert graphed.cuda_graphs is not None and eager.cuda_graphs is None
    # The graphs replay the compiled decoder, and an engine without graphs compiles too
    # (no silent fall-back to the uncompiled one).
    assert is_compiled(graphed.model) and is_compiled(compiled.model)
    assert not is_compiled(eager.model)
    assert graphed.cuda_graphs.batch_sizes == [1, 2, 4, 8]
    rng = random.Random(5)
    for n in (3, 8, 1):  # 3 pads to the graph of 4
        prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(1, 40))] for _ in range(n)]
        ids = rng.sample(range(num_blocks), k=n * 7)  # 7 blocks: 40 + 12 tokens fit
        tables = [tuple(ids[i * 7 : (i + 1) * 7]) for i in range(n)]
        results = []
        for runner in (graphed, compiled, eager, sdpa):
            runner.kv_cache.fill_(float("nan"))
            results.append(_decode_run(runner, prompts, tables, steps=12))
        assert results[0] == results[1] == results[2] == results[3]
        # Padding rows wrote only the scratch block: unused blocks are still poisoned.
        unused = sorted(set(range(num_blocks)) - set(ids))
        assert torch.isnan(graphed.kv_cache[unused]).all()
    assert graphed.cuda_graphs.num_replays == 3 * 12
    # The graph path validates block tables like the eager one, before any replay.
    with pytest.raises(ValueError, match="outside"):
        graphed.execute(Batch((ScheduledSeq("a", (5,), 0, (num_blocks,), True, GREEDY, 0),), bs))
    with pytest.raises(ValueError, match="cannot hold"):
        graphed.execute(Batch((ScheduledSeq("a", (5,), bs, (0,), True, GREEDY, 0),), bs))
    assert graphed.cuda_graphs.num_replays == 3 * 12


def test_decoder_layers_share_one_compiled_graph(tiny_llama_path: Path) -> None:
    """Compiled layer by layer, the three layers reuse one layer's graphs (one for a
    single token, one for any count), and give the whole stack's compiled tokens."""
    from torch._dynamo.utils import counters

    common = _Placement(device="cuda", dtype="float32", num_blocks=32, block_size=8)
    torch._dynamo.reset()  # no graph of an earlier test reused
    before = counters["stats"]["unique_graphs"]
    by_layer = ModelRunner(tiny_llama_path, cuda_graph_batch_sizes=[1, 2], **common)
    assert counters["stats"]["unique_graphs"] - before == 2
    whole = ModelRunner(
        tiny_llama_path, cuda_graph_batch_sizes=[1, 2], compile_scope="decoder", **common
    )
    assert is_compiled(by_layer.model) and is_compiled(whole.model)
    prompts = [[11, 12, 13, 14, 15], [21, 22]]
    tables = [(0, 1, 2), (3, 4, 5)]
    assert _decode_run(by_layer, prompts, tables, steps=6) == _decode_run(
        whole, prompts, tables, steps=6
    )


def test_cuda_graphs_match_eager_logits_on_llama_1b_shape() -> None:
    runner = ModelRunner(
        CONFIG_1B,
        device="cuda",
        load_format="dummy",
        num_blocks=512,
        block_size=16,
        cuda_graph_batch_sizes=[1, 4, 8],
    )
    assert runner.cuda_graphs is not None and is_compiled(runner.model)
    graphs = runner.cuda_graphs
    model: Any = runner.model  # a transformers model, its get_decoder() included
    decoder = model.get_decoder()
    compiled_forwards = [layer.forward for layer in decoder.layers]
    rng = random.Random(9)
    n = 5  # pads to 8
    prompts = [[rng.randrange(0, 128000) for _ in range(rng.randrange(100, 700))] for _ in range(n)]
    ids = rng.sample(range(512), k=n * 48)
    tables = [tuple(ids[i * 48 : (i + 1) * 48]) for i in range(n)]
    seqs = tuple(
        ScheduledSeq(f"r{i}", tuple(p), 0, tables[i], True, GREEDY, 0)
        for i, p in enumerate(prompts)
    )
    first = one_token_each(runner.execute(Batch(seqs, 16)))
    tokens = [list(p) + [first[f"r{i}"]] for i, p in enumerate(prompts)]
    for _ in range(4):
        batch = Batch(
            tuple(
                ScheduledSeq(f"r{i}", (t[-1],), len(t) - 1, tables[i], True, GREEDY, 0)
                for i, t in enumerate(tokens)
            ),
            16,
        )
        assert graphs.can_run(batch)
        with torch.inference_mode():
            uncompile_decoder(runner.model)  # the reference: transformers' own forward
            eager = runner._forward_eager(batch, None).float()
            for layer, forward in zip(decoder.layers, compiled_forwards, strict=True):
                layer.forward = forward
            graph = graphs.run(batch).float()
        assert torch.isfinite(eager).all() and torch.isfinite(graph).all()
        scale = eager.abs().max().item()
        diff = (graph - eager).abs().max().item()
        assert diff < 0.05 * scale, (diff, scale)
        # Greedy picks agree wherever the eager top-2 margin is above the difference.
        top2 = eager.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * diff
        assert torch.equal(eager.argmax(-1)[clear], graph.argmax(-1)[clear])
        out = one_token_each(runner.execute(batch))  # the graph path end to end
        for i, t in enumerate(tokens):
            t.append(out[f"r{i}"])
    assert graphs.num_replays == 4 * 2


def _chunked_run(
    runner: ModelRunner, prompt: list[int], chunks: list[int], table: tuple[int, ...], steps: int
) -> list[int]:
    """One request's prompt in `chunks`, each a step alone, then `steps` decode steps."""
    bs, start, out = runner.block_size, 0, None
    for i, n in enumerate(chunks):
        chunk = tuple(prompt[start : start + n])
        sample = i == len(chunks) - 1
        seq = ScheduledSeq("r", chunk, start, table, sample, GREEDY, 0)
        out = one_token_each(runner.execute(Batch((seq,), bs)))
        start += n
    assert out is not None
    tokens = [*prompt, out["r"]]
    for _ in range(steps):
        seq = ScheduledSeq("r", (tokens[-1],), len(tokens) - 1, table, True, GREEDY, 0)
        tokens.append(one_token_each(runner.execute(Batch((seq,), bs)))["r"])
    return tokens[len(prompt) :]


def test_prompt_graphs_give_eager_tokens_on_tiny_llama(tiny_llama_path: Path) -> None:
    num_blocks, bs = 64, 8
    common = _Placement(device="cuda", dtype="float32", num_blocks=num_blocks, block_size=bs)
    graphed = ModelRunner(
        tiny_llama_path,
        cuda_graph_batch_sizes=[1, 2],
        prompt_graph_tokens=prompt_graph_sizes(64),
        **common,
    )
    # As a prefill engine runs: prompt graphs, no decode graphs.
    prefill = ModelRunner(
        tiny_llama_path, decode_graphs=False, prompt_graph_tokens=[16, 64], **common
    )
    eager = ModelRunner(tiny_llama_path, enforce_eager=True, prompt_graph_tokens=[64], **common)
    assert graphed.prompt_graphs is not None and prefill.prompt_graphs is not None
    assert prefill.cuda_graphs is None and eager.prompt_graphs is None
    rng = random.Random(7)
    cases = ([1], [16], [17], [63], [40, 20], [64, 64], [70])  # 70: past every graph
    for chunks in cases:
        prompt = [rng.randrange(3, 49152) for _ in range(sum(chunks))]
        table = tuple(rng.sample(range(num_blocks), k=24))  # 192 tokens
        results = []
        for runner in (graphed, prefill, eager):
            runner.kv_cache.fill_(float("nan"))
            results.append(_chunked_run(runner, prompt, chunks, table, steps=8))
        assert results[0] == results[1] == results[2], chunks
        # Padding rows wrote only the scratch block: unused blocks are still poisoned.
        unused = sorted(set(range(num_blocks)) - set(table))
        assert torch.isnan(graphed.kv_cache[unused]).all()
    # Every chunk but the 70-token one, and the one-token prompt: that is a step of one
    # token, which the decode graph of batch 1 runs.
    assert graphed.prompt_graphs.num_replays == 7
    # No decode graphs there: every one-token decode step replays the graph of 16 too.
    assert prefill.prompt_graphs.num_replays == 8 + len(cases) * 8

    class Layers:
        """A step observer's stream: the chunk it streams must run the eager pass."""

        def __init__(self) -> None:
            self.written: list[int] = []

        def layer_written(self, layer_idx: int) -> None:
            self.written.append(layer_idx)

        def abort(self) -> None:
            raise AssertionError("the pass did not fail")

    stream = Layers()
    prefill.step_observer = lambda batch: stream
    before = prefill.prompt_graphs.num_replays
    _chunked_run(prefill, list(range(5, 37)), [32], tuple(range(8)), steps=0)
    assert prefill.prompt_graphs.num_replays == before
    assert stream.written == list(range(prefill.spec.num_layers))
    prefill.step_observer = lambda batch: None  # nothing to stream: the graph again
    _chunked_run(prefill, list(range(5, 37)), [32], tuple(range(8)), steps=0)
    assert prefill.prompt_graphs.num_replays == before + 1


def test_prompt_graphs_match_eager_logits_on_llama_1b_shape() -> None:
    runner = ModelRunner(
        CONFIG_1B,
        device="cuda",
        load_format="dummy",
        num_blocks=256,
        block_size=16,
        decode_graphs=False,
        prompt_graph_tokens=prompt_graph_sizes(512),
    )
    graphs = runner.prompt_graphs
    assert graphs is not None and is_compiled(runner.model)
    rng = random.Random(3)
    table = tuple(rng.sample(range(256), k=64))  # 1024 tokens
    prompt = [rng.randrange(0, 128000) for _ in range(700)]
    # A cached prefix of 300 tokens (run eagerly, two chunks), then a 400-token chunk
    # that pads to the graph of 512.
    for start, n in ((0, 150), (150, 150)):
        seq = ScheduledSeq("r", tuple(prompt[start : start + n]), start, table, False, GREEDY, 0)
        runner.execute(Batch((seq,), 16), use_cuda_graphs=False)
    seq = ScheduledSeq("r", tuple(prompt[300:]), 300, table, True, GREEDY, 0)
    batch = Batch((seq,), 16)
    assert graphs.can_run(batch)
    with torch.inference_mode():
        model: Any = runner.model  # a transformers model, its get_decoder() included
        decoder = model.get_decoder()
        compiled_forwards = [layer.forward for layer in decoder.layers]
        uncompile_decoder(runner.model)  # the reference: transformers' own forward
        eager = runner._forward_eager(batch, None).float()
        for layer, forward in zip(decoder.layers, compiled_forwards, strict=True):
            layer.forward = forward
        graph = graphs.run(batch).float()
    assert eager.shape == graph.shape == (1, runner.spec.vocab_size)
    assert torch.isfinite(graph).all()
    scale = eager.abs().max().item()
    diff = (graph - eager).abs().max().item()
    assert diff < 0.05 * scale, (diff, scale)
    assert graphs.num_replays == 1


def test_async_scheduling_gives_the_plain_loops_tokens(tiny_llama_path: Path) -> None:
    """One step ahead on CUDA: decode inputs come from the device (inside the CUDA graphs
    and on the eager path), with seeded sampling, staggered arrivals and preemption."""
    from engine.core.config import SchedulerConfig
    from engine.factory import EngineArgs, build_engine
    from engine.sampling_params import SamplingParams
    from engine.wire import GenerationInput

    rng = random.Random(11)
    prompts = [
        tuple(rng.randrange(3, 49152) for _ in range(rng.randrange(5, 60))) for _ in range(10)
    ]
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        if i % 2
        else SamplingParams(max_tokens=20, temperature=0.8, top_k=50, seed=i, ignore_eos=True)
        for i in range(10)
    ]
    results = {}
    for async_scheduling in (False, True):
        built = build_engine(
            EngineArgs(
                model=str(tiny_llama_path),
                device="cuda",
                dtype="float32",
                num_blocks=24,  # 192 slots for ~600 tokens: someone is preempted
                block_size=8,
                async_scheduling=async_scheduling,
                scheduler=SchedulerConfig(max_num_seqs=8, long_prefill_token_threshold=16),
            )
        )
        core = built.core
        assert core.async_scheduling is async_scheduling
        assert built.runner.cuda_graphs is not None
        tokens: dict[str, list[int]] = {}
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            core.add_request(GenerationInput(str(i), prompt, sp))
            for _ in range(3):  # arrivals join running batches
                for upd in core.step():
                    tokens.setdefault(upd.req_id, []).extend(upd.new_token_ids)
        while core.has_unfinished:
            for upd in core.step():
                tokens.setdefault(upd.req_id, []).extend(upd.new_token_ids)
        assert_engine_empty(core)
        assert core.scheduler.num_preemptions > 0
        assert built.runner.cuda_graphs.num_replays > 0
        results[async_scheduling] = tokens
    assert results[True] == results[False]
    assert all(len(results[True][str(i)]) == params[i].max_tokens for i in range(10))


def test_launching_a_step_never_waits_for_the_device(tiny_llama_path: Path) -> None:
    """With async scheduling the host prepares step N+1 while the GPU runs step N: no
    launch may read a device value back or copy from pageable memory (each of those
    waits for every queued kernel). torch's sync debug mode reports any such call."""
    import warnings

    from engine.core.request import PLACEHOLDER_TOKEN
    from engine.sampling_params import SamplingParams

    bs = 8
    runner = ModelRunner(
        tiny_llama_path,
        device="cuda",
        dtype="float32",
        num_blocks=64,
        block_size=bs,
        cuda_graph_batch_sizes=[1, 2, 4],
    )
    sampled = SamplingParams(temperature=0.9, top_k=40, top_p=0.8, seed=3)
    params = [GREEDY, sampled, SamplingParams(temperature=1.1, top_p=0.5, seed=4)]
    prompts = [list(range(5 + i, 30 + 3 * i)) for i in range(3)]
    tables = [tuple(range(8 * i, 8 * i + 8)) for i in range(3)]
    prefill = Batch(
        tuple(
            ScheduledSeq(f"r{i}", tuple(p), 0, tables[i], True, params[i], i)
            for i, p in enumerate(prompts)
        ),
        bs,
    )

    def decode(step: int) -> Batch:
        return Batch(
            tuple(
                ScheduledSeq(
                    f"r{i}", (PLACEHOLDER_TOKEN,), len(p) + step, tables[i], True, params[i], i
                )
                for i, p in enumerate(prompts)
            ),
            bs,
        )

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            pending = [runner.launch(prefill)]  # eager: packed prefill, sampled rows
            for step in range(3):  # graphs: inputs fed from the step before, on the device
                pending.append(runner.launch(decode(step)))
            torch.ones(1, device="cuda").item()  # one deliberate sync: the probe works
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    assert len(syncs) == 1, syncs
    assert runner.cuda_graphs is not None and runner.cuda_graphs.num_replays == 3
    # And the same tokens as one step at a time with the inputs given on the host.
    tokens = [p.result() for p in pending]
    runner.kv_cache.zero_()
    known = [one_token_each(runner.execute(prefill))]
    for step in range(3):
        batch = decode(step)
        batch = Batch(tuple(s._replace(token_ids=(known[-1][s.req_id],)) for s in batch.seqs), bs)
        known.append(one_token_each(runner.execute(batch)))
    assert tokens == known


@pytest.mark.parametrize(
    "num_kv_heads,head_dim,dtype",
    [
        (8, 64, torch.bfloat16),
        (8, 128, torch.bfloat16),
        (2, 16, torch.float32),
        (3, 96, torch.float16),
    ],
)
def test_triton_kv_write_matches_index_copy(
    num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """One launch writes each token's K and V where the two `index_copy_` calls did, from
    contiguous and from transposed (as transformers hands them over) inputs."""
    torch.manual_seed(num_kv_heads * head_dim)
    num_blocks, layers, block_size, tokens = 12, 3, 16, 37
    shape = (num_blocks, layers, 2, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, device="cuda").to(dtype)
    expected = cache.clone()
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:tokens]
    slot_rows = (slots // block_size) * (layers * 2 * block_size) + slots % block_size
    meta = PagedAttentionMetadata(
        positions=slots,
        slot_rows=slot_rows,
        rows_per_layer=2 * block_size,
        block_size=block_size,
        groups=(),
    )
    key = torch.randn(1, num_kv_heads, tokens, head_dim, device="cuda").to(dtype)[0].transpose(0, 1)
    value = torch.randn(tokens, num_kv_heads, head_dim, device="cuda").to(dtype)
    for layer in (0, 2):
        write_kv(cache, layer, key, value, meta)
        rows = expected.view(-1, num_kv_heads * head_dim)
        k_rows = slot_rows + layer * 2 * block_size
        rows.index_copy_(0, k_rows, key.reshape(tokens, -1))
        rows.index_copy_(0, k_rows + block_size, value.reshape(tokens, -1))
        assert torch.equal(cache, expected)
