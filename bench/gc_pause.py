"""How long one full garbage collection stops a serving process, with its start-up heap
left to the collector and frozen out of its sight (`engine.heap.freeze_startup_heap`).

A full collection walks every tracked object, and holds the interpreter's lock while it
does: in a worker, the engine thread's step waits; in the router, every stream's tokens.
The heaps measured are a worker's (an engine built on a model folder, `--model`; default:
a tiny random Llama written to a temporary folder) and the router's (its modules and
Ray's, imported).

    python -m bench.gc_pause --out gc_pause.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.report import write_result
from bench.suite_common import TINY_CONFIG

_MEASURE = """
import gc, json, time
{setup}
gc.collect()
def full():
    t = time.perf_counter(); gc.collect(); return 1000 * (time.perf_counter() - t)
before = min(full() for _ in range({rounds}))
objects = len(gc.get_objects())
from engine.heap import freeze_startup_heap
freeze_startup_heap()
after = min(full() for _ in range({rounds}))
print(json.dumps({{"objects": objects, "full_ms": before, "frozen_full_ms": after}}))
"""

_SETUPS = {
    "worker": "from engine.llm import LLM\nllm = LLM(model={model!r}, load_format='dummy')",
    "router": "import ray, router.service, router.fleet.cluster, router.edge.grpc_server",
}


def measure(process: str, model: str, rounds: int) -> dict[str, float]:
    code = _MEASURE.format(setup=_SETUPS[process].format(model=model), rounds=rounds)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="a model folder for the worker's heap (default: tiny)")
    p.add_argument("--rounds", type=int, default=5, help="collections timed (minimum kept)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    ns = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = ns.model
        if model is None:
            (Path(tmp) / "config.json").write_text(json.dumps(TINY_CONFIG))
            model = tmp
        results = {name: measure(name, model, ns.rounds) for name in _SETUPS}
    print(f"{'process':<8}{'objects':>10}{'full collection ms':>20}{'frozen ms':>11}")
    for name, r in results.items():
        print(f"{name:<8}{r['objects']:>10.0f}{r['full_ms']:>20.1f}{r['frozen_full_ms']:>11.2f}")
    if ns.out is not None:
        write_result(ns.out, "bench.gc_pause", argv, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
