"""Raw point-to-point bandwidth between two GPUs: `dist.send` / `dist.recv` of one
contiguous tensor, one process per GPU, NCCL (gloo with CPU tensors on a machine without
two GPUs). The hand-off's ceiling: what the same bytes cost with nothing around them."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _worker(
    rank: int, init_method: str, sizes: list[int], iters: int, use_cuda: bool, out: str
) -> None:
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    kwargs: dict[str, Any] = {}
    if use_cuda:
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(
        "nccl" if use_cuda else "gloo", init_method=init_method, rank=rank, world_size=2, **kwargs
    )

    def sync() -> None:
        if use_cuda:
            torch.cuda.synchronize(device)

    def transfer(buf: torch.Tensor) -> None:
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)

    try:
        results = []
        for nbytes in sizes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            for _ in range(2):  # warm-up: connection set-up, buffer registration
                transfer(buf)
            sync()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                transfer(buf)
            sync()
            seconds = (time.perf_counter() - start) / iters
            results.append(
                {"bytes": nbytes, "seconds": seconds, "gib_s": round(nbytes / seconds / 2**30, 2)}
            )
            del buf
        if rank == 1:  # the receiver's clock: the data has arrived
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def send_bandwidth(sizes: list[int], use_cuda: bool, iters: int = 10) -> dict[str, Any]:
    """Spawn two processes (GPU 0 → GPU 1, or gloo on CPU) and time sends of each size."""
    import torch.multiprocessing as mp

    from bench.suite_common import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "nccl.json"
        mp.spawn(
            _worker,
            args=(f"tcp://127.0.0.1:{free_port()}", sizes, iters, use_cuda, str(out)),
            nprocs=2,
            join=True,
        )
        rows = json.loads(out.read_text())
    return {"backend": "nccl" if use_cuda else "gloo", "iters": iters, "sizes": rows}
