"""The KV cache's blocks as the transfer path moves them: gathered into one contiguous
buffer (all layers, or a few of them while a pass is still writing the rest) and
scattered into other blocks. Block-major layout: one `index_select` / `index_copy_`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from engine.model.staging import to_device


class LayerStream(Protocol):
    """What a runner's step observer returns (engine.transfer.streaming.StepStream)."""

    def layer_written(self, layer_idx: int) -> None: ...

    def abort(self) -> None: ...


class KVBlocks:
    """Gather and scatter over a runner's cache (mixed into ModelRunner)."""

    kv_cache: torch.Tensor  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
    num_blocks: int
    device: torch.device
    _last_step_done: torch.cuda.Event | None

    @property
    def last_step_done(self) -> torch.cuda.Event | None:
        """The end of the step launched last (CUDA; None on CPU or before any step)."""
        return self._last_step_done

    def block_index(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Block ids as an index on the device, copied without waiting for the device (a
        gather between two layers of a running pass must not stall the host)."""
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad} outside [0, {self.num_blocks})")
        return to_device(list(block_ids), torch.long, self.device)

    def _view(self, layers: tuple[int, int] | None, heads: tuple[int, int] | None) -> torch.Tensor:
        cache = self.kv_cache if layers is None else self.kv_cache[:, layers[0] : layers[1]]
        return cache if heads is None else cache[..., heads[0] : heads[1], :]

    def gather_blocks(
        self,
        block_ids: Sequence[int] | torch.Tensor,
        layers: tuple[int, int] | None = None,
        heads: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """A contiguous copy of these blocks' KV, [len(block_ids), *kv_cache.shape[1:]],
        or of layers [start, stop) and KV heads [start, stop) of them (this rank's head
        numbering); `block_ids` may be a `block_index`."""
        # Block-major layout: one index_select, ready to send as one message.
        cache = self._view(layers, heads)
        if not isinstance(block_ids, torch.Tensor):
            block_ids = self.block_index(block_ids)
        return cache.index_select(0, block_ids)

    def scatter_blocks(
        self,
        block_ids: Sequence[int],
        data: torch.Tensor,
        layers: tuple[int, int] | None = None,
        after: Sequence[torch.cuda.Event] | None = None,
        heads: tuple[int, int] | None = None,
    ) -> None:
        """Write `data` (as from `gather_blocks`) into these blocks of the cache (or into
        layers [start, stop) of them), on the caller's stream, once the events `after`
        are done: the steps launched before the blocks were handed out (such a step may
        still be writing blocks the host had freed). None: after every step launched so
        far. `heads`: only KV heads [start, stop) of them (a tensor-parallel part)."""
        cache = self._view(layers, heads)
        expected = (len(block_ids), *cache.shape[1:])
        if tuple(data.shape) != expected:
            raise ValueError(f"KV data of shape {tuple(data.shape)}, expected {expected}")
        if data.dtype != cache.dtype:
            raise ValueError(f"KV data in {data.dtype}, cache in {cache.dtype}")
        if after is None:
            after = [] if self._last_step_done is None else [self._last_step_done]
        stream = torch.cuda.current_stream(self.device) if after else None
        for event in after:
            stream.wait_event(event)  # type: ignore[union-attr]
        cache.index_copy_(0, self.block_index(block_ids), data.to(self.device))
