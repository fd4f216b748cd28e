"""The sampler: greedy, top-k/top-p, and counter-based randomness a function of (seed, position)."""

from __future__ import annotations

import torch

from engine.model.sampler import SamplingBatch, bits_to_uniform, sample, uniform_noise
from engine.sampling_params import MAX_SEED, SamplingParams

M31 = 0x7FFFFFFF


def _mix31_py(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M31
    x ^= x >> 15
    x = (x * 0x846CA68B) & M31
    return x ^ (x >> 16)


def _bits_py(seed: int, position: int, token: int) -> int:
    """Plain-int reference of the sampler's hash (Python ints cannot overflow)."""
    key = _mix31_py((seed & M31) ^ 0x1B873593)
    key = _mix31_py(key ^ ((seed >> 31) & M31))
    key = _mix31_py(key ^ (seed >> 62) ^ 0x5BD1E995)
    key = _mix31_py(key ^ (position & M31))
    token_key = _mix31_py(_mix31_py(token ^ 0x2545F491))
    return _mix31_py(key ^ token_key)


def _batch(
    params: list[SamplingParams], seeds: list[int], positions: list[int], vocab: int
) -> SamplingBatch:
    return SamplingBatch.build(params, seeds, positions, vocab_size=vocab)


def test_noise_matches_plain_integer_reference() -> None:
    # Exact integer agreement is what makes CPU and CUDA draw the same noise.
    seeds = [0, 1, 12345, 2**32 + 7, MAX_SEED]
    positions = [0, 5, 1000, 3, 2**31 - 1]
    vocab = 300
    u = uniform_noise(torch.tensor(seeds), torch.tensor(positions), vocab)
    expected = torch.tensor(
        [
            [((_bits_py(s, p, v) >> 8) + 0.5) / 2**23 for v in range(vocab)]
            for s, p in zip(seeds, positions, strict=True)
        ],
        dtype=torch.float32,
    )
    assert torch.equal(u, expected)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0


def test_extreme_hashes_give_finite_gumbel_noise() -> None:
    u = bits_to_uniform(torch.tensor([0, 255, 256, 2**31 - 1]))
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert bool(torch.isfinite(-torch.log(-torch.log(u))).all())


def test_noise_rows_are_uncorrelated_and_uniform() -> None:
    # Neighbouring positions and seeds must not share noise patterns.
    seeds = torch.tensor([5, 5, 6, 2**40 + 5])
    u = uniform_noise(seeds, torch.tensor([100, 101, 100, 100]), 49152).double()
    corr = torch.corrcoef(u)
    off_diagonal = corr[~torch.eye(4, dtype=torch.bool)]
    assert float(off_diagonal.abs().max()) < 0.03  # 0.0045 is one standard error
    assert abs(float(u.mean()) - 0.5) < 0.005
    histogram = torch.histc(u.float(), bins=10, min=0, max=1) / u.numel()
    assert float((histogram - 0.1).abs().max()) < 0.005


def test_same_seed_and_position_give_same_token_regardless_of_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(7, 500)
    mixed = [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=20),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.8),
        SamplingParams(temperature=30.0, top_p=0.95),  # flat: its nucleus search goes wider
    ]
    seeds, positions = [3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]
    together = sample(logits, _batch(mixed, seeds, positions, 500))
    assert torch.equal(together, sample(logits, _batch(mixed, seeds, positions, 500)))
    for i in range(7):
        alone = sample(logits[i : i + 1], _batch([mixed[i]], [seeds[i]], [positions[i]], 500))
        assert int(alone) == int(together[i])


def test_different_seeds_and_positions_draw_different_tokens() -> None:
    logits = torch.zeros(200, 1000)  # uniform: every draw is the noise's choice
    params = [SamplingParams(temperature=1.0)] * 200
    by_seed = sample(logits, _batch(params, list(range(200)), [5] * 200, 1000))
    by_position = sample(logits, _batch(params, [5] * 200, list(range(200)), 1000))
    assert len(set(by_seed.tolist())) > 150
    assert len(set(by_position.tolist())) > 150


def test_top_k_1_and_tiny_top_p_equal_greedy() -> None:
    torch.manual_seed(1)
    logits = torch.randn(64, 257) * 3
    greedy = logits.argmax(dim=-1)
    seeds, positions = list(range(64)), list(range(100, 164))
    for p in (
        SamplingParams(temperature=2.0, top_k=1),
        SamplingParams(temperature=2.0, top_p=1e-6),
    ):
        assert torch.equal(sample(logits, _batch([p] * 64, seeds, positions, 257)), greedy)
    tiny_temp = SamplingParams(temperature=1e-30)  # logits / 1e-30 would overflow to inf
    assert torch.equal(sample(logits, _batch([tiny_temp] * 64, seeds, positions, 257)), greedy)
    zero_temp = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=9)
    assert torch.equal(sample(logits, _batch([zero_temp] * 64, seeds, positions, 257)), greedy)


def test_top_k_keeps_only_the_k_best() -> None:
    torch.manual_seed(2)
    logits = torch.randn(1, 50).expand(2000, 50).contiguous()
    allowed = set(logits[0].topk(3).indices.tolist())
    params = [SamplingParams(temperature=5.0, top_k=3)] * 2000
    tokens = sample(logits, _batch(params, [1] * 2000, list(range(2000)), 50))
    assert set(tokens.tolist()) == allowed


def test_ties_at_the_top_k_cut_are_all_kept() -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0]]).expand(3000, 4).contiguous()
    params = [SamplingParams(temperature=1.0, top_k=2)] * 3000
    tokens = sample(logits, _batch(params, [4] * 3000, list(range(3000)), 4))
    assert set(tokens.tolist()) == {0, 1, 2}


def _frequencies(logits_row: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    vocab = logits_row.shape[0]
    tokens = sample(
        logits_row.expand(n, vocab).contiguous(),
        _batch([params] * n, [77] * n, list(range(n)), vocab),
    )
    return torch.bincount(tokens, minlength=vocab).float() / n


def test_temperature_frequencies_follow_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])
    n = 20000  # standard error of each frequency is below 0.004
    for temperature in (0.7, 1.0, 1.5):
        expected = torch.softmax(logits / temperature, dim=-1)
        freq = _frequencies(logits, SamplingParams(temperature=temperature), n)
        assert torch.allclose(freq, expected, atol=0.015), (temperature, freq, expected)


def test_top_p_renormalises_over_the_nucleus() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])
    probs = torch.softmax(logits, dim=-1)  # [0.64, 0.24, 0.09, 0.03, 0.004]
    # top_p 0.8: 0.64 < 0.8, so the second token is needed; mass before the third is 0.88.
    expected = torch.zeros(5)
    expected[:2] = probs[:2] / probs[:2].sum()
    freq = _frequencies(logits, SamplingParams(temperature=1.0, top_p=0.8), 20000)
    assert torch.allclose(freq, expected, atol=0.015), freq
