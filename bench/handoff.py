"""KV hand-off on one pair channel against raw point-to-point, in the same run.

Two processes (one per GPU, NCCL; or two CPU processes over gloo with --device cpu) build
a pair channel exactly as the workers do (engine.transfer.channel.KVChannel over a
TCPStore). For each prompt length, with a block-major cache of the model's shape:

  raw       pg.send of one contiguous tensor of the same bytes (the link's speed)
  handoff   the whole hand-off as the workers run it: gather the request's scattered
            blocks (index_select) → header + payload on the channel → receive into a
            staging buffer → scatter into other blocks (index_copy_), end to end

  wire      header + payload on the channel, receive into staging (no gather/scatter)

Reports GiB/s, the ratios to raw, and the fixed per-hand-off cost (a 1-block hand-off
minus its raw send). Prints a table; writes JSON to --out.

    python -m bench.handoff --shapes 1b,8b                 # 2 GPUs
    python -m bench.handoff --device cpu --shapes tiny     # the benchmark itself, on CPU
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.distributed import TCPStore

from bench.report import provenance
from engine.transfer.base import KVPoll
from engine.transfer.channel import SENDER_RANK, KVChannel
from engine.wire import ChannelSpec, HandoffEntry, HandoffHeader, HeaderKind

# (layers, kv heads, head dim): block = [layers, 2, block_size, kv heads, head dim]
SHAPES = {"tiny": (4, 2, 16), "1b": (16, 8, 64), "8b": (32, 8, 128)}
BLOCK_SIZE = 16
TOKENS = (16, 128, 512, 2048)
NUM_CACHE_BLOCKS = 512


def _time(fn: Any, device: torch.device, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return out


def _handoff_once(
    channel: KVChannel,
    sending: bool,
    cache: torch.Tensor,
    ids: list[int],
    nbytes: int,
    gathered: torch.Tensor | None = None,
) -> None:
    """One hand-off as the workers run it: gather, header + payload, receive, scatter.
    With `gathered` (already contiguous): header + payload only, no gather or scatter."""
    device = cache.device
    if sending:
        payload = (
            gathered
            if gathered is not None
            else cache.index_select(0, torch.tensor(ids, device=device))
        )
        header = HandoffHeader(
            HeaderKind.HANDOFF,
            channel.next_seq(),
            dst_epoch=2,
            entries=(HandoffEntry("bench", len(ids) * 16, len(ids), 0),),
            num_bytes=nbytes,
        )
        handle = channel.send(header, payload)
        if handle.wait() is not KVPoll.SUCCESS:
            raise RuntimeError(handle.failure)
        return
    header = channel.recv_header()
    num_blocks = header.num_blocks
    staging = torch.empty((num_blocks, *cache.shape[1:]), dtype=cache.dtype, device=device)
    if gathered is not None:
        channel.recv_into(staging)
        return
    # The receiver knows its destination blocks from its own reservation.
    index = torch.tensor(ids, device=device)

    def scatter() -> None:
        cache.index_copy_(0, index, staging)

    channel.recv_into(staging, scatter)


def _worker(rank: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    spec = ChannelSpec("127.0.0.1", port, "prefill-0", 1, "decode-0", 2, 120.0)
    channel = KVChannel(spec, rank, device)
    channel.open()
    pg = channel._group()  # the raw baseline runs on the very same process group
    results = []
    gen = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        layers, heads, dim = SHAPES[shape]
        block = (layers, 2, BLOCK_SIZE, heads, dim)
        cache = torch.randn((NUM_CACHE_BLOCKS, *block), generator=gen).to(args.dtype).to(device)
        for tokens in TOKENS:
            n = -(-tokens // BLOCK_SIZE)
            ids = torch.randperm(NUM_CACHE_BLOCKS, generator=gen)[:n].tolist()
            flat = torch.empty((n, *block), dtype=cache.dtype, device=device)
            nbytes = flat.numel() * flat.element_size()

            def raw(flat: torch.Tensor = flat) -> None:
                if rank == SENDER_RANK:
                    pg.send([flat], 1, 0).wait()
                else:
                    pg.recv([flat], 0, 0).wait()

            handoff = functools.partial(
                _handoff_once, channel, rank == SENDER_RANK, cache, ids, nbytes
            )

            wire = functools.partial(
                _handoff_once, channel, rank == SENDER_RANK, cache, ids, nbytes, flat
            )
            for fn in (raw, wire, handoff):  # warm-up: NCCL's first use and the allocator
                _time(fn, device, 3)
            raw_s = statistics.median(_time(raw, device, args.repeats))
            wire_s = statistics.median(_time(wire, device, args.repeats))
            handoff_s = statistics.median(_time(handoff, device, args.repeats))
            results.append(
                {
                    "shape": shape,
                    "tokens": tokens,
                    "blocks": n,
                    "bytes": nbytes,
                    "raw_ms": round(raw_s * 1e3, 4),
                    "handoff_ms": round(handoff_s * 1e3, 4),
                    "wire_ms": round(wire_s * 1e3, 4),
                    "wire_ratio": round(raw_s / wire_s, 3),
                    "raw_gib_s": round(nbytes / raw_s / 2**30, 2),
                    "handoff_gib_s": round(nbytes / handoff_s / 2**30, 2),
                    "ratio": round(raw_s / handoff_s, 3),
                }
            )
    if rank == 1:
        Path(out_path).write_text(json.dumps(results))
    channel.close(notify_peer=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1b,8b")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "handoff.json"))
    args = parser.parse_args(argv)
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    tmp = Path(args.out).with_suffix(".part")
    mp.spawn(_worker, args=(store.port, args, str(tmp)), nprocs=2, join=True)
    results = json.loads(tmp.read_text())
    tmp.unlink()
    fixed: dict[str, float] = {}
    print(
        f"{'shape':6} {'tokens':>6} {'MiB':>8} {'raw ms':>8} {'wire ms':>8} {'hand-off ms':>11} "
        f"{'raw GiB/s':>9} {'hand-off GiB/s':>14} {'wire ratio':>10} {'ratio':>6}"
    )
    for r in results:
        print(
            f"{r['shape']:6} {r['tokens']:>6} {r['bytes'] / 2**20:>8.2f} {r['raw_ms']:>8.3f} "
            f"{r['wire_ms']:>8.3f} {r['handoff_ms']:>11.3f} {r['raw_gib_s']:>9.1f} "
            f"{r['handoff_gib_s']:>14.1f} {r['wire_ratio']:>10.2f} {r['ratio']:>6.2f}"
        )
        if r["blocks"] == 1:
            fixed[r["shape"]] = round(r["handoff_ms"] - r["raw_ms"], 4)
    print("fixed per-hand-off cost (1 block, hand-off minus raw), ms:", fixed)
    Path(args.out).write_text(
        json.dumps(
            {
                "provenance": provenance("bench.handoff", sys.argv[1:] if argv is None else argv),
                "device": args.device,
                "results": results,
                "fixed_cost_ms": fixed,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
