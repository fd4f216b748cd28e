"""A hand-off between tensor-parallel groups of different sizes, part by part over real
gloo channels (one per rank pair): every decode rank ends up holding exactly the bytes of
its KV heads that the prefill ranks computed, in the blocks rank 0's verdict names."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from engine.model.kv_blocks import KVBlocks
from engine.parallel.tp_heads import kv_heads_of_rank
from engine.transfer.tp_parts import (
    PartsMirror,
    RankParts,
    Verdict,
    heads_at,
    main_part,
    pair_key,
    receiving_parts,
)
from engine.wire import ChannelSpec, HandoffEntry, HandoffHeader, HeaderKind

NUM_BLOCKS, LAYERS, BLOCK_SIZE, HEAD_DIM = 8, 2, 4, 3


class Cache(KVBlocks):
    """One rank's KV cache: [blocks, layers, 2, block_size, its heads, head_dim]."""

    def __init__(self, num_heads: int) -> None:
        self.kv_cache = torch.zeros(NUM_BLOCKS, LAYERS, 2, BLOCK_SIZE, num_heads, HEAD_DIM)
        self.num_blocks = NUM_BLOCKS
        self.device = torch.device("cpu")
        self._last_step_done = None


def _hand_off(
    num_kv: int, src_tp: int, dst_tp: int, src_blocks: list[int], dst_blocks: list[int]
) -> tuple[torch.Tensor, list[Cache]]:
    """The whole model's KV (every head) of the prefill side, and the decode ranks' caches
    after one message moved `src_blocks` into `dst_blocks`."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    spec = ChannelSpec(
        "127.0.0.1", store.port, "prefill-0", 1, "decode-0", 2,
        sender_tp=src_tp, receiver_tp=dst_tp, num_kv_heads=num_kv,
    )  # fmt: skip
    whole = torch.randn(NUM_BLOCKS, LAYERS, 2, BLOCK_SIZE, num_kv, HEAD_DIM)
    senders = []
    for r in range(src_tp):
        cache = Cache(len(kv_heads_of_rank(num_kv, src_tp, r)))
        held = kv_heads_of_rank(num_kv, src_tp, r)
        cache.kv_cache.copy_(whole[..., held.start : held.stop, :])
        senders.append(cache)
    receivers = [Cache(len(kv_heads_of_rank(num_kv, dst_tp, r))) for r in range(dst_tp)]

    mirror: PartsMirror | None = None
    dst_parts: list[RankParts] = []

    def landed(key: str, seq_no: int) -> None:
        assert mirror is not None
        mirror.landed(key, seq_no)

    dst_parts = [RankParts(r, receivers[r], on_landed=landed) for r in range(dst_tp)]
    src_parts = [RankParts(r, senders[r]) for r in range(src_tp)]

    def publish(verdict: Verdict) -> None:
        for parts in dst_parts:
            parts.verdict(verdict)

    pair = pair_key(spec)
    mirror = PartsMirror(publish, lambda key: receiving_parts(spec) if key == pair else 0)
    threads = [threading.Thread(target=p.connect, args=(spec, True)) for p in src_parts]
    threads += [threading.Thread(target=p.connect, args=(spec, False)) for p in dst_parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    entry = HandoffEntry("req", len(src_blocks) * BLOCK_SIZE - 1, len(src_blocks), 7)
    template = HandoffHeader(HeaderKind.HANDOFF, 0, 2, 1, (entry,), 0, 0)
    for parts in src_parts:
        parts.post("decode-0", src_blocks, template)
    # Rank 0 to rank 0: the workers' own channel carries the main part (here: copied).
    main = main_part(spec)
    rows = senders[0].gather_blocks(src_blocks, heads=heads_at(main, True))
    receivers[0].scatter_blocks(dst_blocks, rows, heads=heads_at(main, False))
    mirror.started(pair, 0, dst_blocks, list(range(len(dst_blocks))))
    mirror.settled(pair, 0)
    for parts in (*src_parts, *dst_parts):
        parts.disconnect("decode-0" if parts in src_parts else "prefill-0", notify_peer=False)
    return whole, receivers


@pytest.mark.parametrize(
    ("num_kv", "src_tp", "dst_tp"),
    [(2, 2, 1), (2, 1, 2), (2, 2, 4), (2, 4, 2), (4, 4, 1), (1, 2, 2)],
)
def test_every_decode_rank_holds_the_prefilled_bytes_of_its_heads(
    num_kv: int, src_tp: int, dst_tp: int
) -> None:
    src_blocks, dst_blocks = [1, 4, 6], [5, 0, 2]
    whole, receivers = _hand_off(num_kv, src_tp, dst_tp, src_blocks, dst_blocks)
    for rank, cache in enumerate(receivers):
        held = kv_heads_of_rank(num_kv, dst_tp, rank)
        expected = whole[src_blocks][..., held.start : held.stop, :]
        assert torch.equal(cache.kv_cache[dst_blocks], expected), rank
        # Nothing else was written.
        others = [b for b in range(NUM_BLOCKS) if b not in dst_blocks]
        assert not cache.kv_cache[others].any(), rank


def test_a_late_acknowledgement_of_a_peers_earlier_pairing_settles_nothing_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The peer restarted (new epoch, same worker id): a part of its earlier pairing that
    # lands late must not count for the new pairing's message of the same number.
    import dataclasses

    from engine.transfer import tp_parts

    monkeypatch.setattr(tp_parts, "VERDICT_TIMEOUT_S", 0.2)
    earlier = ChannelSpec("127.0.0.1", 1, "prefill-0", 1, "decode-0", 2, sender_tp=2)
    now = dataclasses.replace(earlier, prefill_epoch=3)
    assert pair_key(earlier) != pair_key(now)
    mirror = PartsMirror(lambda verdict: None, lambda pair: 1)
    mirror.started(pair_key(now), 0, [1], [0])
    mirror.landed(pair_key(earlier), 0)
    with pytest.raises(RuntimeError, match="did not land"):
        mirror.settled(pair_key(now), 0)
    mirror.started(pair_key(now), 1, [1], [0])
    mirror.landed(pair_key(now), 1)
    mirror.settled(pair_key(now), 1)  # its own part: settled at once
