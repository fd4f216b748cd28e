"""Batched token sampling whose randomness is a pure function of (seed, position, token id).

Noise comes from a counter-based hash computed with torch integer ops, not from a
torch.Generator: the token sampled at a position depends only on the request's seed,
that position and the logits. A preempted, recomputed or handed-off request therefore
reproduces its output exactly, and the same seed gives the same text on CPU and CUDA
(up to the logits themselves).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.model.staging import to_device
from engine.sampling_params import SamplingParams

_MASK31 = 0x7FFFFFFF
# Odd multipliers below 2**32: a 31-bit value times one stays below 2**63, so int64
# arithmetic never overflows (signed overflow is undefined in C++, so its result
# could differ between CPU and CUDA kernels). torch has no uint32 shifts on CPU.
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B
_MIN_TEMPERATURE = 1e-5


def _mix31_(x: torch.Tensor) -> torch.Tensor:
    """In place: a bijective xorshift-multiply mixer on int64 values in [0, 2**31)."""
    x.bitwise_xor_(x >> 16)
    x.mul_(_MUL1).bitwise_and_(_MASK31)
    x.bitwise_xor_(x >> 15)
    x.mul_(_MUL2).bitwise_and_(_MASK31)
    x.bitwise_xor_(x >> 16)
    return x


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A 31-bit key per row from a 63-bit seed and a position (int64 tensors, [n])."""
    key = _mix31_((seeds & _MASK31) ^ 0x1B873593)
    key = _mix31_(key ^ ((seeds >> 31) & _MASK31))
    key = _mix31_(key ^ (seeds >> 62) ^ 0x5BD1E995)
    return _mix31_(key ^ (positions & _MASK31))


def token_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    """A 31-bit key per token id, [vocab_size]."""
    vocab = torch.arange(vocab_size, dtype=torch.long, device=device)
    return _mix31_(_mix31_(vocab ^ 0x2545F491))


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u[row, v] in (0, 1), float32, a pure function of (seed[row], position[row], v)."""
    keys = token_keys(vocab_size, seeds.device)
    # One mixing round per element: the [n, V] work dominates the sampler's cost.
    return bits_to_uniform(_mix31_(row_keys(seeds, positions)[:, None] ^ keys[None, :]))


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """Map 31-bit hashes to float32 u in [2**-24, 1 - 2**-24], never 0 or 1."""
    # 23 bits plus the half step need 24 significant bits: exact in float32. With
    # 24 bits, (2**24 - 1) + 0.5 would round up to 2**24, u to 1.0 and the Gumbel
    # noise to +inf (that token would always win).
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters as tensors, plus flags that let `sample` skip work."""

    temperature: torch.Tensor  # [n] float32, 1.0 on greedy rows (unused there)
    top_k: torch.Tensor  # [n] int64, 0 where off
    top_p: torch.Tensor  # [n] float32, 1.0 where off
    greedy: torch.Tensor  # [n] bool
    seed: torch.Tensor  # [n] int64
    position: torch.Tensor  # [n] int64, position of the token being sampled
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    # Known on the host, so that sampling never reads a device value back (which would
    # wait for the step before when scheduling runs one step ahead).
    max_top_k: int = 0

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        positions: Sequence[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        """Tensors for rows with these params, seeds and sampled-token positions."""
        # Temperatures this small would overflow logits / T; they mean greedy anyway.
        greedy = [is_greedy(p) for p in params]
        top_k = [
            p.top_k if 0 < p.top_k < vocab_size and not g else 0
            for p, g in zip(params, greedy, strict=True)
        ]
        device = torch.device(device)
        return cls(
            temperature=to_device(
                [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                torch.float32,
                device,
            ),
            top_k=to_device(top_k, torch.long, device),
            top_p=to_device(
                [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)],
                torch.float32,
                device,
            ),
            greedy=to_device(greedy, torch.bool, device),
            seed=to_device(list(seeds), torch.long, device),
            position=to_device(list(positions), torch.long, device),
            all_greedy=all(greedy),
            any_top_k=any(top_k),
            max_top_k=max(top_k, default=0),
            any_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy, strict=True)),
        )


def is_greedy(params: SamplingParams) -> bool:
    """True when `params` picks the argmax (greedy, or a temperature too small to matter)."""
    return params.greedy or params.temperature < _MIN_TEMPERATURE


def _kth_largest(scores: torch.Tensor, k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Per row, the k-th largest value; -inf where k == 0 (top-k off). max_k = max(k)."""
    values = scores.topk(max_k, dim=-1).values  # sorted, descending
    kth = values.gather(1, (k - 1).clamp(min=0)[:, None]).squeeze(1)
    return torch.where(k > 0, kth, float("-inf"))


def _nucleus_cut(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest value kept by top-p: tokens >= it hold mass >= top_p.

    On CPU no full-vocab sort (slow over a whole vocabulary on one core): a top-k of
    growing k until it holds `top_p` of the mass. The cut depends on the row alone, whatever k
    found it, so a row's sample never depends on the rest of the batch.
    """
    num_rows, vocab = scores.shape
    log_norm = torch.logsumexp(scores, dim=-1)
    if scores.is_cuda:
        # One full-width top-k (a sort) of every row beats narrow ones, and nothing is
        # read back to the host: rows with p == 1 keep everything (cut -inf).
        values = scores.topk(vocab, dim=-1).values
        mass = (values - log_norm[:, None]).exp().cumsum(dim=-1)
        first = (mass < top_p[:, None]).sum(dim=-1).clamp(max=vocab - 1)
        cut_all = values.gather(1, first[:, None]).squeeze(1)
        return torch.where(top_p < 1.0, cut_all, float("-inf"))
    cut = torch.full((num_rows,), float("-inf"), device=scores.device)
    todo = torch.nonzero(top_p < 1.0).squeeze(1)  # p == 1 keeps everything: cut stays -inf
    k = 64
    while todo.numel():
        k = min(k, vocab)
        values = scores[todo].topk(k, dim=-1).values
        mass = (values - log_norm[todo, None]).exp().cumsum(dim=-1)
        p = top_p[todo, None]
        done = (mass[:, -1:] >= p).squeeze(1) | (k == vocab)
        first = (mass < p).sum(dim=-1).clamp(max=k - 1)  # first index reaching p
        cut[todo[done]] = values[done].gather(1, first[done, None]).squeeze(1)
        todo = todo[~done]
        k *= 16
    return cut


def _filter_top_k_top_p(scores: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Set scores outside each row's top-k, then top-p, to -inf (ties at a cut are kept)."""
    if batch.any_top_k:
        scores = scores.masked_fill(
            scores < _kth_largest(scores, batch.top_k, batch.max_top_k)[:, None], float("-inf")
        )
    if batch.any_top_p:
        scores = scores.masked_fill(
            scores < _nucleus_cut(scores, batch.top_p)[:, None], float("-inf")
        )
    return scores


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Pick one token per row of `logits` [n, V]; returns int64 [n]."""
    logits = logits.to(torch.float32)
    greedy_tokens = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_tokens
    scaled = logits / batch.temperature[:, None]
    if batch.any_top_k or batch.any_top_p:
        scaled = _filter_top_k_top_p(scaled, batch)
    # Exponential race argmax(p / E), E = -log(u), taken in log space: the Gumbel-max
    # argmax(log p - log E). Softmax normalisation is a per-row constant, so it is
    # skipped: the result cannot depend on how a reduction was ordered.
    gumbel = -torch.log(-torch.log(uniform_noise(batch.seed, batch.position, logits.shape[-1])))
    sampled = (scaled + gumbel).argmax(dim=-1)
    return torch.where(batch.greedy, greedy_tokens, sampled)
