"""What a tensor-parallel group's and a hand-off pair's NCCL communicators cost in GPU
memory: device memory free (cudaMemGetInfo, which sees NCCL's own buffers, unlike torch's
allocator) before and after each communicator's first collective, per rank.

    python -m bench.nccl_memory --world 4 --out nccl_memory.json

Measured per rank: the CUDA context (for reference), the group of all ranks (what a
worker's tensor-parallel group holds, made at its first all-reduce), and a pair of two
ranks (what one rank pair's hand-off channel holds, made at its first send/recv).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.report import write_result

MIB = 1 << 20


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _rank(rank: int, world: int, port: int, results: Any) -> None:
    torch.cuda.set_device(rank)
    start = torch.cuda.mem_get_info()[0]  # nothing of ours allocated yet
    probe = torch.ones(1 << 20, device="cuda")  # 4 MiB: the context is up
    after_context = _free()
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        device_id=torch.device("cuda", rank),
    )
    before_group = _free()
    dist.all_reduce(probe)
    after_group = _free()
    pair = dist.new_group([0, 1])
    before_pair = _free()
    if rank == 0:
        dist.send(probe, 1, group=pair)
    elif rank == 1:
        dist.recv(probe, 0, group=pair)
    after_pair = _free()
    dist.barrier()
    results[rank] = {
        "context_and_probe_mib": (start - after_context) / MIB,
        "group_mib": (before_group - after_group) / MIB,
        "pair_mib": (before_pair - after_pair) / MIB if rank < 2 else 0.0,
    }
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=torch.cuda.device_count())
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--out", default="nccl_memory.json")
    args = parser.parse_args()
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(args.world, args.port, results), nprocs=args.world)
    rows = [dict(rank=r, **results[r]) for r in sorted(results.keys())]
    print(f"{'rank':>4} {'context MiB':>12} {f'group of {args.world} MiB':>16} {'pair MiB':>9}")
    for row in rows:
        print(
            f"{row['rank']:>4} {row['context_and_probe_mib']:>12.0f} {row['group_mib']:>16.0f}"
            f" {row['pair_mib']:>9.0f}"
        )
    env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    write_result(args.out, "bench.nccl_memory", None, world=args.world, ranks=rows, nccl_env=env)


if __name__ == "__main__":
    main()
