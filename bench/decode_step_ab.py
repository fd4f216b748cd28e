"""One engine decode step of a checkout of the tree against another, on one GPU.

Each run times `ModelRunner.execute` of one pure-decode batch (random weights of a model
shape, random KV, CUDA graphs and the compiled decoder: the engine's defaults) with the
engine of the checkout named by `--tree`, and the GPU time of the step's graph replayed
alone, then appends one JSON line per batch size to `--out`. It imports nothing from
bench/, so it runs against any checkout whose runner takes these arguments. Alternate
the trees in one call on one machine and compare medians:

    for i in 1 2; do for t in OLD_CHECKOUT .; do
        python -m bench.decode_step_ab --tree $t --out $OUT/decode_step_ab.jsonl
    done; done

Not a test: numbers depend on the card; compare only numbers of one run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", type=Path, required=True, help="the checkout whose engine runs")
    p.add_argument("--model", default="deploy/model_configs/llama-3.1-8b", help="in the tree")
    p.add_argument("--batch-sizes", default="1,128")
    p.add_argument("--context", type=int, default=2048, help="tokens of KV per sequence")
    p.add_argument("--steps", type=int, default=50, help="timed steps (after 5 untimed)")
    p.add_argument("--out", type=Path, required=True, help="JSON lines, appended")
    args = p.parse_args()
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree))  # the tree's engine, not the one beside this file
    import torch

    from engine.core.batch import Batch, ScheduledSeq
    from engine.model.model_runner import ModelRunner
    from engine.sampling_params import GREEDY

    block_size, sizes = 16, [int(s) for s in args.batch_sizes.split(",")]
    per_seq = -(-args.context // block_size)
    runner = ModelRunner(
        tree / args.model,
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        num_blocks=max(sizes) * per_seq + 1,
        block_size=block_size,
        max_num_seqs=max(sizes),
        cuda_graph_batch_sizes=sizes,
    )
    runner._kv_storage.normal_()  # random K/V: never time on zeros
    top = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--show-toplevel", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.split()
    # A folder inside another checkout (an exported tree) has no commit of its own.
    commit = top[1] if len(top) == 2 and Path(top[0]).resolve() == tree else None
    rng = random.Random(0)
    for n in sizes:
        blocks = list(range(runner.num_blocks))
        rng.shuffle(blocks)
        batch = Batch(
            tuple(
                ScheduledSeq(
                    f"r{i}",
                    (rng.randrange(runner.spec.vocab_size),),
                    args.context - 1,
                    tuple(blocks[i * per_seq : (i + 1) * per_seq]),
                    True,
                    GREEDY,
                    0,
                )
                for i in range(n)
            ),
            block_size,
        )
        wall = []
        for step in range(5 + args.steps):
            t0 = time.perf_counter()
            runner.execute(batch)
            if step >= 5:
                wall.append((time.perf_counter() - t0) * 1e3)
        graphs = runner.cuda_graphs
        assert graphs is not None, "CUDA graphs were not captured"
        graphs.run(batch)  # the graph's static inputs now hold this batch
        graph = graphs._graphs[next(s for s in graphs.batch_sizes if s >= n)][0]
        gpu = []
        for _ in range(args.steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            gpu.append(start.elapsed_time(end))
        row: dict[str, Any] = {
            "tree": str(args.tree),
            "commit": commit,
            "model": args.model,
            "batch": n,
            "context": args.context,
            "step_ms": statistics.median(wall),
            "graph_gpu_ms": statistics.median(gpu),
            "gpu": torch.cuda.get_device_name(),
        }
        print(json.dumps(row), flush=True)
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
