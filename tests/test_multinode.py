"""Several Ray nodes on one machine: each pool lands on the node type that offers its
resource, the KV hand-off crosses nodes, and outputs equal the colocated engine's."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.harness import REPO, service_env, service_process
from bench.harness.streams import generate
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from tests.services import assert_pools_empty

# A Ray cluster of several nodes and a service on it, about 30 s: `make test-slow`.
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
MAX_TOKENS = 8

# Which node (named by its custom resources) each live actor runs on, read from the GCS.
_PLACEMENT = """
import json, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
nodes = {
    n["NodeID"]: sorted(k for k in n["Resources"] if k.endswith("_node"))
    for n in ray.nodes() if n["Alive"]
}
actors = [
    (a["ActorClassName"], nodes.get(a["Address"]["NodeID"]))
    for a in ray._private.state.actors().values() if a["State"] == "ALIVE"
]
print(json.dumps(actors))
"""


@pytest.fixture(scope="module")
def ray_nodes() -> Iterator[str]:
    """A head with no CPUs plus one node per pool, all on 127.0.0.1; yields the address.

    Each pool node has room for both workers, so only the resource requirements keep
    the pools apart (Ray would pack both onto one node otherwise).
    """
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1"},
    )
    try:
        for pool in ("prefill", "decode"):
            cluster.add_node(num_cpus=2, resources={f"{pool}_node": 1}, node_ip_address="127.0.0.1")
        yield cluster.address
    finally:
        cluster.shutdown()


def test_pools_on_their_own_nodes_match_the_colocated_engine(
    ray_nodes: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    args = [
        "--ray-address",
        ray_nodes,
        "--prefill-resources",
        '{"prefill_node": 1}',
        "--decode-resources",
        '{"decode_node": 1}',
        "--prefill-kv-cache-gib",
        "0.25",
        "--decode-kv-cache-gib",
        "0.25",
        "--local-prefill-max-tokens",  # every prompt crosses the nodes
        "0",
    ]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)

    def reference() -> list[list[int]]:
        # Asked for here, not as an argument: the engine loads and generates while the
        # service's workers start.
        llm: LLM = request.getfixturevalue("reference_llm")
        return [list(o.token_ids) for o in llm.generate(PROMPTS, [params] * len(PROMPTS))]

    with service_process(args, tmp_path / "service.log") as svc:
        expected = reference()
        svc.wait_serving()
        # A second driver reads where the actors run while the requests are served.
        placement = subprocess.Popen(
            [sys.executable, "-c", _PLACEMENT, ray_nodes],
            cwd=REPO,
            env=service_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

        async def served() -> list[list[int]]:
            outputs = []
            for prompt in PROMPTS:
                result = await generate(
                    svc.address, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, timeout=120
                )
                assert result.final is not None, result
                assert result.final.timings.kv_transfer_seconds > 0  # KV crossed nodes
                outputs.append(result.tokens)
            await assert_pools_empty(svc.address, pools={pb.POOL_PREFILL, pb.POOL_DECODE})
            return outputs

        try:
            got = asyncio.run(served())
            stdout, stderr = placement.communicate(timeout=120)
        finally:
            placement.kill()  # a no-op once it has exited
    assert placement.returncode == 0, stderr
    actors = json.loads(stdout.strip().splitlines()[-1])
    nodes = {cls: node for cls, node in actors if "Prefill" in cls or "Decode" in cls}
    assert nodes == {"PrefillWorker": ["prefill_node"], "DecodeWorker": ["decode_node"]}
    assert got == expected
