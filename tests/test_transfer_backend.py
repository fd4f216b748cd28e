"""The KV transfer backend chosen through the engine's arguments: two workers of one
process with `kv_transfer_backend="fake"` hand KV off on a queue, no process group, and
the request goes on on the decode worker with the tokens the model gives it alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from decode_worker.worker import DecodeWorker
from engine.core.config import SchedulerConfig
from engine.core.request import FinishReason
from engine.factory import EngineArgs
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.transfer.backends import make_channel
from engine.transfer.channel import RECEIVER_RANK, SENDER_RANK, KVChannel
from engine.transfer.fake import FakeChannel
from engine.wire import ChannelSpec, GenerationInput, TokenUpdate
from prefill_worker.worker import PrefillWorker

ARGS = EngineArgs(
    kv_cache_gib=0.05,
    scheduler=SchedulerConfig(long_prefill_token_threshold=16),
    kv_transfer_backend="fake",
)
SPEC = ChannelSpec("in-process", 0, "prefill-0", 1, "decode-0", 2)


def test_the_backend_makes_each_end_of_a_pair() -> None:
    cpu = torch.device("cpu")
    assert isinstance(make_channel("process_group", SPEC, SENDER_RANK, cpu), KVChannel)
    receiver = make_channel("fake", SPEC, RECEIVER_RANK, cpu)
    sender = make_channel("fake", SPEC, SENDER_RANK, cpu)  # joins the receiver's pair
    assert isinstance(sender, FakeChannel) and isinstance(receiver, FakeChannel)
    assert (sender.peer_id, receiver.peer_id) == ("decode-0", "prefill-0")
    sender.send(None, torch.arange(4.0)).wait(5)
    buffer = torch.zeros(4)
    receiver.recv_into(buffer)
    assert buffer.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_the_fake_backend_is_for_one_process_workers() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        EngineArgs(kv_transfer_backend="fake", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="kv_transfer_backend"):
        EngineArgs(kv_transfer_backend="nccl")  # type: ignore[arg-type]


def test_workers_hand_kv_off_on_the_fake_backend(smollm2_path: Path, reference_llm: LLM) -> None:
    prompt = tuple(100 + (i * 37) % 5000 for i in range(70))
    sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, seed=7)
    inp = GenerationInput("a", prompt, sampling)

    async def main() -> list[int]:
        prefill, decode = PrefillWorker(ARGS, 0), DecodeWorker(ARGS, 0)
        p_info = await prefill.start()
        d_info = await decode.start()
        spec = ChannelSpec("in-process", 0, "prefill-0", p_info.epoch, "decode-0", d_info.epoch)
        await asyncio.gather(prefill.connect(spec), decode.connect(spec))
        try:
            reservation = await decode.reserve(inp)
            assert reservation is not None
            result = await prefill.prefill(inp, reservation)
            assert result.finish_reason is None and result.first_token is not None, result
            updates: list[TokenUpdate] = []
            while not updates or updates[-1].finish_reason is None:
                batch = await decode.next_tokens(0.2)
                updates += [u for u in batch.updates if u.req_id == "a"]
            assert updates[-1].finish_reason is FinishReason.LENGTH
            assert updates[0].kv_handoff_s > 0  # the KV arrived over the channel
            tokens = [result.first_token] + [t for u in updates for t in u.new_token_ids]
            for _ in range(100):  # both pools give every block back
                p, d = await asyncio.gather(prefill.load(), decode.load())
                if p.num_blocks_in_use == d.num_blocks_in_use == 0:
                    break
                await asyncio.sleep(0.05)
            assert (p.num_blocks_in_use, d.num_blocks_in_use) == (0, 0)
            return tokens
        finally:
            await prefill.shutdown()
            await decode.shutdown()

    tokens = asyncio.run(main())
    alone = reference_llm.generate([list(prompt)], sampling)[0]
    assert tuple(tokens) == alone.token_ids
