"""CUDA graphs of the pure-decode forward pass, one per padded batch size.

A decode step launches a few kernels per layer; at small batches their launch cost
(host Python + driver) dwarfs the GPU work. Each graph replays the whole forward
(embedding, every layer with the Triton paged attention, the LM head on every row)
from static input buffers; a step only writes its inputs into those buffers with one
host-to-device copy and two small device copies, replays, and hands the logits on.

Padding rows (a batch of n runs the graph of the next captured size N >= n) take
token 0 at position 0, write their K/V into a scratch block that no request owns
and attend to that one slot: finite, and invisible to real sequences.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import numpy as np
import torch

from engine.core.batch import Batch, ScheduledSeq
from engine.model.attention import paged_step
from engine.model.attention_metadata import AttentionGroup, PagedAttentionMetadata

log = logging.getLogger(__name__)

# input_ids, positions, slot_rows, context_lens, and the row of `last_tokens` that holds
# the input token instead (async scheduling), or -1.
_ROWS = 5


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Sizes to capture: 1, 2, 4, 8, then every multiple of 16, up to max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


def capture_graphs(
    sizes: Sequence[int], forward: Callable[[int], torch.Tensor], device: torch.device
) -> dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]:
    """size -> (graph, its output) of `forward(size)` over static buffers, captured largest
    first into one memory pool (a smaller graph reuses the larger one's memory). Each size
    is warmed up twice on a side stream first: Triton compiles, cuBLAS picks its kernels."""
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(device)
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
    for size in sorted(set(sizes), reverse=True):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = forward(size)
        graphs[size] = (graph, out)
    torch.cuda.synchronize(device)
    return graphs


class _Capturable(Protocol):
    def capture(self) -> None: ...


GraphsT = TypeVar("GraphsT", bound=_Capturable)


def captured_or_none(graphs: GraphsT, steps: str) -> GraphsT | None:
    """`graphs` captured now (start-up), or None with a warning when capture fails: the
    `steps` they would have run then run eagerly."""
    try:
        graphs.capture()
    except Exception:
        log.warning("capturing CUDA graphs failed; %s run eagerly", steps, exc_info=True)
        return None
    return graphs


class DecodeGraphs:
    """Captured decode forwards of one model over one KV cache; `run` replays one."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_storage: torch.Tensor,
        last_tokens: torch.Tensor,
        scratch_block: int,
        block_size: int,
        max_blocks_per_seq: int,
        batch_sizes: Sequence[int],
    ) -> None:
        if not kv_storage.is_cuda:
            raise ValueError("CUDA graphs need a CUDA KV cache")
        self.model = model
        self.kv_storage = kv_storage
        # The tokens the previous step sampled; a row whose input is still a placeholder
        # reads its token from here inside the graph.
        self.last_tokens = last_tokens
        self.scratch_block = scratch_block
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_batch_size = self.batch_sizes[-1]
        num_layers = kv_storage.shape[1]
        self._rows_per_block = num_layers * 2 * block_size
        device = kv_storage.device
        max_n, width = self.max_batch_size, max_blocks_per_seq
        # Static inputs the graphs read; rewritten in place before each replay.
        self._ints = torch.zeros((_ROWS, max_n), dtype=torch.long, device=device)
        self._table = torch.zeros((max_n, width), dtype=torch.int32, device=device)
        self._arange = torch.arange(max_n, device=device)
        # Staging: [n, _ROWS + w] packed on the host (pinned), one copy to the device.
        self._host = torch.empty(max_n * (_ROWS + width), dtype=torch.long).pin_memory()
        self._staging = torch.empty(max_n * (_ROWS + width), dtype=torch.long, device=device)
        # The last copy out of `_host` must finish before the host rewrites it (a step
        # that samples nothing never waits on the device).
        self._host_free = torch.cuda.Event()
        self._host_free.record()
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # req_id → (its block table tuple, the same as an array). The scheduler hands the
        # same tuple object until a table grows, so most steps convert no table at all.
        self._tables: dict[str, tuple[tuple[int, ...], np.ndarray]] = {}
        self.num_replays = 0

    def _metadata(self, n: int) -> PagedAttentionMetadata:
        ints = self._ints[:, :n]
        index = self._arange[:n]
        group = AttentionGroup(
            q_index=index[:, None],
            kv_rows=None,
            block_table=self._table[:n],
            context_lens=ints[3],
            mask=None,
            out_rows=index,
            out_tokens=index,
            max_context=self.max_blocks_per_seq * self.block_size,
            identity=True,
        )
        return PagedAttentionMetadata(
            positions=ints[1],
            slot_rows=ints[2],
            rows_per_layer=2 * self.block_size,
            block_size=self.block_size,
            groups=(group,),
        )

    def _forward(self, n: int, meta: PagedAttentionMetadata) -> torch.Tensor:
        source = self._ints[4, :n]
        input_ids = torch.where(
            source >= 0, self.last_tokens[source.clamp(min=0)], self._ints[0, :n]
        )
        with paged_step(meta, self.kv_storage):
            return self.model(
                input_ids=input_ids[None],
                position_ids=self._ints[1, :n][None],
                use_cache=False,
            ).logits[0]

    def _fill_padding(self, start: int, stop: int) -> None:
        """Rows [start, stop) of the static inputs become padding (scratch block)."""
        self._ints[:, start:stop] = 0
        self._ints[2, start:stop] = self.scratch_block * self._rows_per_block
        self._ints[3, start:stop] = 1
        self._ints[4, start:stop] = -1
        self._table[start:stop, 0] = self.scratch_block

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every batch size, largest first (they share one pool)."""
        self._fill_padding(0, self.max_batch_size)
        self._graphs = capture_graphs(
            self.batch_sizes, lambda n: self._forward(n, self._metadata(n)), self.kv_storage.device
        )
        log.info("captured decode CUDA graphs for batch sizes %s", self.batch_sizes)

    def can_run(self, batch: Batch) -> bool:
        """True when every sequence decodes one token and the batch fits a captured size."""
        if not self._graphs or len(batch.seqs) > self.max_batch_size:
            return False
        return all(
            s.num_tokens == 1 and len(s.block_table) <= self.max_blocks_per_seq for s in batch.seqs
        )

    def run(self, batch: Batch, sources: Sequence[int] | None = None) -> torch.Tensor:
        """Replay the graph for this decode batch; logits [len(batch.seqs), V] (a view).

        `sources[i] >= 0`: row i's input token is `last_tokens[sources[i]]`, not the one
        in the batch (a placeholder).

        Raises ValueError (naming the request) for a block id outside the cache or a
        block table too short for the position, before anything reaches the device.
        """
        seqs = batch.seqs
        n = len(seqs)
        size = next(s for s in self.batch_sizes if s >= n)
        lens = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=n)
        pos = np.fromiter((s.start_position for s in seqs), dtype=np.int64, count=n)
        flat = np.concatenate(self._table_arrays(seqs))
        self._validate(seqs, lens, pos, flat)
        width = max(int(lens.max()), 1)
        self._host_free.synchronize()
        host = self._host.numpy()[: size * (_ROWS + width)].reshape(size, _ROWS + width)
        table = host[:, _ROWS:]
        table[:n][np.arange(width)[None, :] < lens[:, None]] = flat
        block = table[np.arange(n), pos // self.block_size]
        offset = pos % self.block_size
        host[:n, 0] = np.fromiter((s.token_ids[0] for s in seqs), dtype=np.int64, count=n)
        host[:n, 1] = pos
        host[:n, 2] = block * self._rows_per_block + offset
        host[:n, 3] = pos + 1
        host[:n, 4] = -1 if sources is None else sources
        if size > n:
            host[n:, :] = 0
            host[n:, 2] = self.scratch_block * self._rows_per_block
            host[n:, 3] = 1
            host[n:, 4] = -1
            host[n:, _ROWS] = self.scratch_block
        count = size * (_ROWS + width)
        staging = self._staging[:count]
        staging.copy_(self._host[:count], non_blocking=True)
        self._host_free.record()
        staged = staging.view(size, _ROWS + width)
        self._ints[:, :size].copy_(staged[:, :_ROWS].T)
        self._table[:size, :width].copy_(staged[:, _ROWS:])
        graph, logits = self._graphs[size]
        graph.replay()
        self.num_replays += 1
        return logits[:n]

    def _table_arrays(self, seqs: Sequence[ScheduledSeq]) -> list[np.ndarray]:
        """Each sequence's block table as an array, converted only when it changed (the
        cache keeps only this step's requests)."""
        cached, fresh = self._tables, {}
        arrays = []
        for s in seqs:
            entry = cached.get(s.req_id)
            if entry is None or entry[0] is not s.block_table:
                entry = (s.block_table, np.array(s.block_table, dtype=np.int64))
            fresh[s.req_id] = entry
            arrays.append(entry[1])
        self._tables = fresh
        return arrays

    def _validate(
        self, seqs: Sequence[ScheduledSeq], lens: np.ndarray, pos: np.ndarray, flat: np.ndarray
    ) -> None:
        """The eager path's checks, vectorised (the scratch block id = num_blocks)."""
        short = np.flatnonzero(lens * self.block_size <= pos)
        if short.size:
            s = seqs[int(short[0])]
            raise ValueError(
                f"request {s.req_id}: {len(s.block_table)} blocks of {self.block_size} "
                f"cannot hold {s.end_position} tokens"
            )
        if flat.size and (flat.min() < 0 or flat.max() >= self.scratch_block):
            for s in seqs:
                bad = [b for b in s.block_table if not 0 <= b < self.scratch_block]
                if bad:
                    raise ValueError(
                        f"request {s.req_id}: block ids {bad} outside [0, {self.scratch_block})"
                    )
