"""Runs one scheduled Batch as one packed forward pass over the paged KV cache.

What a runner does once, as it starts (kernels, the cache's size, compiling and
capturing), is engine.model.startup.runner_setup's.

On CUDA the decoder is compiled by torch.compile (engine.model.compiled), and pure-decode
steps replay captured CUDA graphs of it (engine.model.cuda_graphs) unless `enforce_eager`,
as do speculative decoding's verifying steps (engine.model.verify_graphs) and steps that
run one prompt chunk alone (engine.model.prompt_graphs); every other step (several
prompts, mixed steps) runs the compiled decoder without a graph.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from engine.core.batch import Batch, ScheduledSeq
from engine.core.request import PLACEHOLDER_TOKEN
from engine.model.attention import paged_step
from engine.model.attention_metadata import PagedAttentionMetadata
from engine.model.cuda_graphs import DecodeGraphs
from engine.model.kv_blocks import KVBlocks, LayerStream
from engine.model.kv_gather import BlockGather
from engine.model.model_loader import LoadFormat, load_model, resolve_dtype
from engine.model.model_spec import ModelSpec
from engine.model.prompt_graphs import PromptGraphs
from engine.model.staging import to_device
from engine.model.startup.huge_pages import empty_on_huge_pages
from engine.model.startup.runner_setup import (
    cache_blocks,
    plan_graphs,
    prepare_model,
    warm_up_and_capture,
)
from engine.model.startup.startup_log import startup_phase
from engine.model.step_tokens import PendingTokens, StepTokens, logits_rows, sample_rows
from engine.model.verify_graphs import VerifyGraphs
from engine.model.verify_graphs import logits_rows as verify_logits_rows
from engine.parallel.step_broadcast import StepPublisher
from engine.parallel.tensor_parallel import SINGLE, TPRank
from engine.spec.draft_model import Proposer, fill_proposals

log = logging.getLogger(__name__)


class ModelRunner(KVBlocks):
    """Owns the model and the KV cache of one worker; turns a Batch into sampled tokens.

    Its arguments: `enforce_eager` turns CUDA graphs off; they are captured as it is
    built (CUDA only) for decode batches of `cuda_graph_batch_sizes` (default: up to
    `max_num_seqs`). `paged_decode` False runs attention as padded SDPA even where
    the Triton kernels could (None: Triton on CUDA when it imports). `compile_model`
    runs the decoder compiled by torch.compile (engine.model.compiled; None: on CUDA
    when Triton imports); it compiles here, at start-up, not on the first request,
    each decoder layer (`compile_scope` "layer") or the whole stack ("decoder").
    `small_batch_gemv` runs one-row products of 16-bit weights (batch-1 decode
    steps, a lone sequence's logits) with the Triton GEMV
    (engine.model.kernels.triton_gemv; None: on CUDA when Triton imports).
    `onednn_linears` runs a CPU model's float32 linear layers in oneDNN instead of
    torch's sgemm (engine.model.cpu_linear; None: on CPU unless compiled).
    `preloaded`: the model and its spec, already loaded from `model_path` (a draft
    model whose weights must count before the target sizes its cache).
    `verify_graph_tokens` q >= 2 (speculative decoding: 1 + proposals) also captures
    graphs of steps of up to q tokens per sequence, for up to
    `verify_graph_max_seqs` sequences (engine.model.verify_graphs). `decode_graphs`
    False captures no decode graphs (an engine that never decodes).
    `prompt_graph_tokens` also captures graphs of one prompt chunk alone, padded to
    these token counts (engine.model.prompt_graphs). `tp`: this process's rank in
    its worker's tensor-parallel group; it loads and caches its share of the model
    (every rank builds its runner with the same arguments, at the same time).
    """

    # Told of every eager step before it runs; may return a stream that hears of each
    # layer whose KV the step has written (layer-wise KV streaming).
    step_observer: Callable[[Batch], LayerStream | None] | None = None
    cuda_graphs: DecodeGraphs | None = None
    verify_graphs: VerifyGraphs | None = None
    prompt_graphs: PromptGraphs | None = None
    # Fills proposal slots before a verifying step (speculative decoding's draft model).
    drafter: Proposer | None = None
    # Rank 0 of a tensor-parallel worker: the other ranks, told of every model call
    # before it runs here (engine.parallel.step_broadcast).
    followers: StepPublisher | None = None
    # Recorded after each launched step: KV imports wait for it before writing blocks
    # the host may have freed while that step was still writing them.
    _last_step_done: torch.cuda.Event | None = None

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str | None = None,
        device: str | torch.device = "cpu",
        load_format: LoadFormat = "auto",
        num_blocks: int | None = None,
        kv_cache_bytes: int | Callable[[], int] | None = None,
        block_size: int = 16,
        bucket_shapes: bool | None = None,
        enforce_eager: bool = False,
        max_num_seqs: int = 128,
        cuda_graph_batch_sizes: Sequence[int] | None = None,
        paged_decode: bool | None = None,
        compile_model: bool | None = None,
        compile_scope: str = "layer",
        small_batch_gemv: bool | None = None,
        onednn_linears: bool | None = None,
        preloaded: tuple[torch.nn.Module, ModelSpec] | None = None,
        verify_graph_tokens: int = 0,
        verify_graph_max_seqs: int = 0,
        decode_graphs: bool = True,
        prompt_graph_tokens: Sequence[int] = (),
        tp: TPRank = SINGLE,
    ) -> None:
        if (num_blocks is None) == (kv_cache_bytes is None):
            raise ValueError("give exactly one of num_blocks and kv_cache_bytes")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        # None: pad attention shapes to buckets on CUDA only (see engine.model.attention).
        self.bucket_shapes = bucket_shapes
        self.paged_decode = paged_decode
        self.tp = tp
        with startup_phase("weights", f"{model_path}, {load_format}"):
            self.model, self.spec = preloaded or load_model(
                model_path, dtype, self.device, load_format, tp
            )
        graphs = plan_graphs(
            self.device, enforce_eager, decode_graphs, prompt_graph_tokens, self.spec.max_model_len
        )
        prepare_model(
            self.model, self.device, small_batch_gemv, compile_model, compile_scope, onednn_linears
        )
        num_blocks = cache_blocks(
            self.spec, block_size, num_blocks, kv_cache_bytes, graphs.scratch, tp, self.device
        )
        self.num_blocks = num_blocks
        self.block_size = block_size
        # With graphs, one extra block past `num_blocks` takes the padding rows' K/V;
        # the scheduler never sees it. On CPU attention gathers whole blocks, and the
        # padding ones read one more block that nothing writes (zeros). `kv_cache` is the
        # part requests own.
        self._block_gather = (
            BlockGather(zero_block=num_blocks + graphs.scratch, mask_dtype=self.dtype)
            if self.device.type == "cpu"
            else None
        )
        stored = num_blocks + graphs.scratch + int(self._block_gather is not None)
        with startup_phase("kv_cache", f"{num_blocks} blocks of {block_size} tokens"):
            shape = self.kv_cache_shape(self.spec, stored, block_size)
            if self.device.type == "cpu":
                # Attention reads every attended block each step, a few KiB from each:
                # on huge pages, far fewer TLB misses.
                self._kv_storage = empty_on_huge_pages(shape, self.dtype).zero_()
            else:
                self._kv_storage = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_cache = self._kv_storage[:num_blocks]
        # The tokens the step launched last sampled, by row, and the request of each row:
        # a later step whose input is still a placeholder reads its token here, on the
        # device (async scheduling).
        self._max_sampled = max(max_num_seqs, 1)
        self._last_tokens = torch.zeros(self._max_sampled, dtype=torch.long, device=self.device)
        self._last_rows: dict[str, int] = {}
        warm_up_and_capture(
            self,
            graphs,
            max_num_seqs,
            cuda_graph_batch_sizes,
            verify_graph_tokens,
            verify_graph_max_seqs,
        )

    @staticmethod
    def kv_cache_shape(spec: ModelSpec, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] (this rank's
        KV heads)."""
        return (num_blocks, spec.num_layers, 2, block_size, spec.num_local_kv_heads, spec.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of KV, every layer (the unit a hand-off moves)."""
        return self.spec.kv_block_bytes(self.block_size)

    def execute(
        self, batch: Batch, *, use_cuda_graphs: bool = True, paged_decode: bool | None = None
    ) -> StepTokens:
        """One packed forward pass for every scheduled token; req_id → sampled token (or,
        for a sequence with proposals, the tokens its verification kept).

        The keywords pick a slower path for one call (benchmarks compare them):
        `use_cuda_graphs` False runs a decode step eagerly, `paged_decode` overrides
        the runner's own choice of attention kernels on the eager path.
        """
        return self.launch(
            batch, use_cuda_graphs=use_cuda_graphs, paged_decode=paged_decode
        ).result()

    @torch.inference_mode()
    def launch(
        self, batch: Batch, *, use_cuda_graphs: bool = True, paged_decode: bool | None = None
    ) -> PendingTokens:
        """Queue one step on the device and return without waiting for it (on CUDA).

        A sequence whose input token is PLACEHOLDER_TOKEN gets the token this runner
        sampled for the same request in the step it launched last; that is the one
        thing async scheduling asks of a runner.
        """
        if batch.block_size != self.block_size:
            raise ValueError(f"batch block_size {batch.block_size} != cache's {self.block_size}")
        if batch.num_draft_tokens:
            batch = fill_proposals(batch, self.drafter)
        if self.followers is not None:
            self.followers.publish(
                "launch", batch, use_cuda_graphs=use_cuda_graphs, paged_decode=paged_decode
            )
        sources = self._placeholder_sources(batch)
        sampled_seqs = [s for s in batch.seqs if s.sample]
        graphs = self.cuda_graphs if use_cuda_graphs else None
        if batch.is_empty:
            logits = None
        elif graphs is not None and graphs.can_run(batch):
            logits = graphs.run(batch, sources)  # validates the block tables itself
            if len(sampled_seqs) < len(batch.seqs):
                rows = [i for i, s in enumerate(batch.seqs) if s.sample]
                logits = logits[to_device(rows, torch.long, self.device)]
        elif (
            use_cuda_graphs and (verify := self.verify_graphs) is not None and verify.can_run(batch)
        ):
            self._check_block_ids(batch)
            rows = verify_logits_rows(batch.seqs, verify.q)
            logits = verify.run(batch, sources, self._last_tokens)
            logits = logits[to_device(rows, torch.long, self.device)]
        else:
            self._check_block_ids(batch)
            logits = self._forward_observed(batch, sources, use_cuda_graphs, paged_decode)
        return self._sample(logits, sampled_seqs)

    def _forward_observed(
        self,
        batch: Batch,
        sources: list[int] | None,
        use_cuda_graphs: bool,
        paged_decode: bool | None,
    ) -> torch.Tensor:
        """A step no decode or verify graph runs: the step observer hears of it first; a
        lone prompt chunk replays a prompt graph unless the observer streams its KV (the
        layer hooks run in the eager pass only)."""
        stream = None if self.step_observer is None else self.step_observer(batch)
        prompt = self.prompt_graphs if use_cuda_graphs else None
        try:
            if prompt is not None and stream is None and sources is None and prompt.can_run(batch):
                return prompt.run(batch)
            on_layer = None if stream is None else stream.layer_written
            return self._forward_eager(batch, sources, paged_decode, on_layer)
        except BaseException:
            if stream is not None:
                try:
                    stream.abort()  # the receivers are told there is nothing to continue
                except Exception:  # noqa: BLE001 - the pass's own error is the one to raise
                    log.exception("closing the streamed KV of a failed pass")
            raise

    def _placeholder_sources(self, batch: Batch) -> list[int] | None:
        """Per sequence, the row of `_last_tokens` that holds its input's last token when
        that is still a placeholder (else -1); None when no sequence has one."""
        sources = None
        last_rows = self._last_rows
        for i, s in enumerate(batch.seqs):
            at = s.newest_token_index
            if s.token_ids[at] != PLACEHOLDER_TOKEN:
                continue
            row = last_rows.get(s.req_id)
            if row is None or s.token_ids.count(PLACEHOLDER_TOKEN) > 1:
                raise ValueError(
                    f"request {s.req_id}: its input token is still being sampled, but the "
                    "step launched last did not sample it"
                )
            if sources is None:
                sources = [-1] * len(batch.seqs)
            sources[i] = row
        return sources

    def _check_block_ids(self, batch: Batch) -> None:
        ids = list(itertools.chain.from_iterable(s.block_table for s in batch.seqs))
        if not ids or (min(ids) >= 0 and max(ids) < self.num_blocks):
            return
        for s in batch.seqs:
            bad = [b for b in s.block_table if not 0 <= b < self.num_blocks]
            if bad:
                raise ValueError(
                    f"request {s.req_id}: block ids {bad} outside [0, {self.num_blocks})"
                )

    def _forward_eager(
        self,
        batch: Batch,
        sources: list[int] | None,
        paged_decode: bool | None = None,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Logits [num sampling seqs, V] from one packed forward (no graph); `on_layer`
        hears of each layer the pass has written."""
        meta = PagedAttentionMetadata.build(
            batch,
            self.spec.num_layers,
            self.device,
            self.bucket_shapes,
            paged_decode=self.paged_decode if paged_decode is None else paged_decode,
            block_gather=self._block_gather,
        )
        input_ids = to_device(
            list(itertools.chain.from_iterable(s.token_ids for s in batch.seqs)),
            torch.long,
            self.device,
        )
        # Only the rows a step samples need the (vocab-wide) lm_head.
        last_token_idx = logits_rows(batch.seqs)
        where: list[int] = []  # tokens still being sampled: their index in input_ids ...
        rows: list[int] = []  # ... and their row in _last_tokens
        start = 0
        for i, s in enumerate(batch.seqs):
            if sources is not None and sources[i] >= 0:
                where.append(start + s.newest_token_index)
                rows.append(sources[i])
            start += s.num_tokens
        if where:
            index = to_device(where + rows, torch.long, self.device).view(2, -1)
            input_ids[index[0]] = self._last_tokens[index[1]]
        with paged_step(meta, self._kv_storage, on_layer):
            return self.model(
                input_ids=input_ids[None],
                position_ids=meta.positions[None],
                use_cache=False,
                logits_to_keep=to_device(last_token_idx, torch.long, self.device),
            ).logits[0]

    def _sample(
        self, logits: torch.Tensor | None, sampled_seqs: list[ScheduledSeq]
    ) -> PendingTokens:
        """Sample on the device, keep the tokens for the next step's placeholders and
        start their one copy to the host."""
        if logits is None or not sampled_seqs:
            self._last_rows = {}
            done = None if logits is None else self._record_step_done()
            return PendingTokens([], torch.empty(0, dtype=torch.long), done)
        tokens = sample_rows(logits, sampled_seqs)
        n = tokens.shape[0]
        req_ids = [s.req_id for s in sampled_seqs]
        verifying = n > len(sampled_seqs)
        proposals = (
            [s.token_ids[-s.num_draft_tokens :] if s.num_draft_tokens else () for s in sampled_seqs]
            if verifying
            else None
        )
        if verifying:
            self._last_rows = {}  # the next step waits for this one: no placeholders
        elif n <= self._max_sampled:
            self._last_tokens[:n].copy_(tokens)
            self._last_rows = {req_id: i for i, req_id in enumerate(req_ids)}
        else:  # more rows than the scheduler ever runs (a benchmark's batch): not kept
            self._last_rows = {}
        # A pinned buffer per step (the caching host allocator hands back a free one), so
        # that results may be read in any order and later steps never overwrite them.
        on_cuda = self.device.type == "cuda"
        host = torch.empty(n, dtype=torch.long, pin_memory=on_cuda)
        host.copy_(tokens, non_blocking=on_cuda)
        return PendingTokens(req_ids, host, self._record_step_done(), proposals)

    def _record_step_done(self) -> torch.cuda.Event | None:
        """Mark the end of the step just queued (CUDA; on CPU every step is done here)."""
        if self.device.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record()
        self._last_step_done = done
        return done
