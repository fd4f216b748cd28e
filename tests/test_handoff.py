"""KV hand-off between real Ray actors over gloo: bit-exact blocks, refusals, leases, pairing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch

from engine.core.config import SchedulerConfig
from engine.core.outputs import GenerationInput
from engine.core.request import FinishReason
from engine.factory import EngineArgs
from engine.sampling_params import SamplingParams
from prefill_worker.worker import DecodeTarget
from router.cluster import Cluster, ClusterConfig

pytestmark = pytest.mark.e2e

ARGS = EngineArgs(kv_cache_gib=0.1, scheduler=SchedulerConfig(long_prefill_token_threshold=16))


@pytest.fixture(scope="module")
def cluster(smollm2_path: Path, ray_session: None) -> Iterator[Cluster]:
    c = Cluster(ClusterConfig(prefill_args=ARGS, decode_args=ARGS))
    c.start()
    yield c
    c.stop()


def _blocks_in_use(cluster: Cluster) -> list[int]:
    refs = cluster.prefill + cluster.decode
    return [load.num_blocks_in_use for load in ray.get([w.handle.load.remote() for w in refs])]


def _input(req_id: str, num_tokens: int) -> GenerationInput:
    prompt = tuple(100 + (i * 37) % 5000 for i in range(num_tokens))
    return GenerationInput(
        req_id, prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )


def test_decode_blocks_are_bit_identical_to_prefill_blocks(cluster: Cluster) -> None:
    prefill, decode = cluster.prefill[0].handle, cluster.decode[0].handle
    block_size = cluster.prefill[0].info.layout.block_size
    for req_id, n in (("a", 70), ("b", 16), ("c", 5)):
        res = ray.get(decode.reserve.remote(req_id, n))
        result = ray.get(
            prefill.prefill.remote(
                _input(req_id, n), DecodeTarget(res.rank, res.epoch, res.block_ids)
            )
        )
        assert result.finish_reason is FinishReason.HANDOFF, result.error
        src = ray.get(prefill.read_blocks.remote(list(result.src_block_ids)))
        dst = ray.get(decode.read_blocks.remote(list(res.block_ids)))
        assert src.shape == dst.shape
        # Compare the prompt's slots; decode writes the next token's KV after them.
        src_slots = src.transpose(0, 2).reshape(src.shape[1], 2, -1, *src.shape[4:])[:, :, :n]
        dst_slots = dst.transpose(0, 2).reshape(dst.shape[1], 2, -1, *dst.shape[4:])[:, :, :n]
        assert torch.equal(src_slots, dst_slots), req_id
        assert src_slots.abs().sum() > 0
        assert len(res.block_ids) == -(-n // block_size)
        ray.get(decode.abort.remote(req_id))
    assert _wait_zero(cluster)


def _wait_zero(cluster: Cluster, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _blocks_in_use(cluster) == [0, 0]:
            return True
        time.sleep(0.1)
    raise AssertionError(f"blocks still in use: {_blocks_in_use(cluster)}")


@pytest.mark.parametrize("tamper", ["epoch", "blocks"])
def test_stale_or_mismatched_handoff_is_refused_and_frees_both_sides(
    cluster: Cluster, tamper: str
) -> None:
    prefill, decode = cluster.prefill[0].handle, cluster.decode[0].handle
    res = ray.get(decode.reserve.remote(f"t-{tamper}", 40))
    target = DecodeTarget(res.rank, res.epoch, res.block_ids)
    if tamper == "epoch":
        target = DecodeTarget(res.rank, "previous-life", res.block_ids)
    else:
        target = DecodeTarget(res.rank, res.epoch, tuple(reversed(res.block_ids)))
    result = ray.get(prefill.prefill.remote(_input(f"t-{tamper}", 40), target))
    assert result.finish_reason is FinishReason.ERROR
    assert "refused" in result.error
    ray.get(decode.abort.remote(f"t-{tamper}"))  # the router does this on error
    assert _wait_zero(cluster)
    # The pair's channel is still in step: a good hand-off right after works.
    res = ray.get(decode.reserve.remote(f"after-{tamper}", 20))
    ok = ray.get(
        prefill.prefill.remote(
            _input(f"after-{tamper}", 20), DecodeTarget(res.rank, res.epoch, res.block_ids)
        )
    )
    assert ok.finish_reason is FinishReason.HANDOFF
    ray.get(decode.abort.remote(f"after-{tamper}"))
    assert _wait_zero(cluster)


def test_expired_reservation_frees_its_blocks(cluster: Cluster) -> None:
    decode = cluster.decode[0].handle
    assert ray.get(decode.reserve.remote("lease", 64, 0.3)) is not None
    assert _blocks_in_use(cluster)[1] == 4
    assert _wait_zero(cluster, timeout=5)
