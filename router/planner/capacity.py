"""Each pool's speed, fitted from what its workers report while serving.

* Prefill: the seconds a worker is busy for a set of prompts ≈ a·prompts + b·tokens +
  c·Σ tokens² (a per-prompt overhead, a per-token cost, attention's square), from spans
  in which a worker was busy throughout (its throughput under load) and from prompts
  that found it idle. The cost of a prompt mix follows at the lengths observed.
* Decode: a step's time ≈ d₀ + d₁·batch + d₂·context tokens in the batch, from every
  token batch; the largest batch whose step stays within the TPOT target then gives a
  worker's output tokens per second at that target.

Both are least squares with non-negative coefficients over decayed sums (old samples
fade with a half-life, so a new prompt mix or a slower node is learnt within minutes),
held in immutable values so that a planning step stays a pure function. A small ridge,
heaviest on the terms data rarely pins down, keeps a fit from a single prompt length
mostly per-token rather than extrapolating a square it never saw.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from router.planner.snapshot import DecodeSample, PrefillSample

MIN_SAMPLES = 3.0  # (decayed) samples before a fit is used
_RIDGE = 1e-2  # relative to each feature's sum of squares


@dataclass(frozen=True)
class LinearFit:
    """y ≈ coefficients · x, coefficients >= 0, over exponentially decayed samples."""

    penalties: tuple[float, ...]  # ridge weight per feature (relative)
    xtx: tuple[float, ...]  # Σ w·x xᵀ, row-major
    xty: tuple[float, ...]  # Σ w·x y
    weight: float = 0.0  # Σ w: how many samples it holds, decayed

    @classmethod
    def empty(cls, penalties: Sequence[float]) -> LinearFit:
        dim = len(penalties)
        return cls(tuple(penalties), (0.0,) * dim * dim, (0.0,) * dim)

    @property
    def dim(self) -> int:
        return len(self.penalties)

    def updated(self, rows: Iterable[tuple[Sequence[float], float]], decay: float) -> LinearFit:
        """The fit with old samples weighted by `decay` (0-1) and `rows` (x, y) added."""
        xtx = [v * decay for v in self.xtx]
        xty = [v * decay for v in self.xty]
        weight = self.weight * decay
        n = self.dim
        for x, y in rows:
            for i in range(n):
                xty[i] += x[i] * y
                for j in range(n):
                    xtx[i * n + j] += x[i] * x[j]
            weight += 1.0
        return LinearFit(self.penalties, tuple(xtx), tuple(xty), weight)

    def coefficients(self) -> tuple[float, ...] | None:
        """The fitted coefficients, None until MIN_SAMPLES samples were seen."""
        if self.weight < MIN_SAMPLES:
            return None
        n = self.dim
        # The ridge is relative to each feature's own size: where the data cannot tell
        # two terms apart, each explains a share of y in inverse proportion to its penalty.
        ridge = [_RIDGE * self.penalties[i] * self.xtx[i * n + i] for i in range(n)]
        active = [i for i in range(n) if self.xtx[i * n + i] > 0]
        # Non-negative least squares by elimination: drop the most negative term and
        # solve again (a handful of features, so at most a handful of solves).
        while active:
            solution = _solve(
                [
                    [self.xtx[i * n + j] + (ridge[i] if i == j else 0.0) for j in active]
                    for i in active
                ],
                [self.xty[i] for i in active],
            )
            if solution is None:
                return None
            worst = min(range(len(active)), key=lambda k: solution[k])
            if solution[worst] >= 0:
                coef = [0.0] * n
                for k, i in enumerate(active):
                    coef[i] = solution[k]
                return tuple(coef)
            del active[worst]
        return None


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """a·x = b by Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


# Features in units that keep them of one order (prompts, thousands of tokens, millions
# of squared tokens), so the ridge treats them alike.
def _prefill_features(prompts: float, tokens: float, sum_sq: float) -> tuple[float, ...]:
    return (prompts, tokens / 1e3, sum_sq / 1e6)


@dataclass(frozen=True)
class PrefillSpeed:
    """A prefill worker's busy seconds for a set of prompts."""

    # The square term is penalised most: a fit from one length stays per-token.
    fit: LinearFit = LinearFit.empty((1.0, 0.1, 10.0))

    def updated(self, samples: Iterable[PrefillSample], decay: float) -> PrefillSpeed:
        rows = (
            (_prefill_features(s.num_prompts, s.num_tokens, s.sum_sq_tokens), s.seconds)
            for s in samples
            if s.num_prompts > 0 and s.seconds > 0
        )
        return PrefillSpeed(self.fit.updated(rows, decay))

    @property
    def known(self) -> bool:
        return self.fit.coefficients() is not None

    def busy_s(self, prompts: float, tokens: float, sum_sq: float) -> float | None:
        """One worker's seconds for these prompts; None before it was measured."""
        coef = self.fit.coefficients()
        if coef is None:
            return None
        x = _prefill_features(prompts, tokens, sum_sq)
        return sum(c * v for c, v in zip(coef, x, strict=True))


def _decode_features(batch: float, context_tokens: float) -> tuple[float, ...]:
    return (1.0, batch, context_tokens / 1e4)


@dataclass(frozen=True)
class DecodeSpeed:
    """A decode worker's step time by batch size and context."""

    # A decode step mostly reads the weights, whatever the batch: where the data cannot
    # tell, the fixed term explains most, the context term least.
    fit: LinearFit = LinearFit.empty((0.1, 1.0, 10.0))

    def updated(self, samples: Iterable[DecodeSample], decay: float) -> DecodeSpeed:
        rows = (
            (_decode_features(s.batch_size, s.context_tokens), s.step_s)
            for s in samples
            if s.batch_size > 0 and s.step_s > 0
        )
        return DecodeSpeed(self.fit.updated(rows, decay))

    @property
    def known(self) -> bool:
        return self.fit.coefficients() is not None

    def step_s(self, batch: float, context_per_request: float) -> float | None:
        coef = self.fit.coefficients()
        if coef is None:
            return None
        x = _decode_features(batch, batch * context_per_request)
        return sum(c * v for c, v in zip(coef, x, strict=True))

    def best_batch(self, tpot_s: float, context_per_request: float, max_batch: int) -> int | None:
        """The largest batch (at least 1, at most max_batch) whose step is within tpot_s."""
        coef = self.fit.coefficients()
        if coef is None:
            return None
        fixed, per_request = coef[0], coef[1] + coef[2] * context_per_request / 1e4
        if per_request <= 0:
            return max(1, max_batch)
        batch = math.floor((tpot_s - fixed) / per_request)
        return max(1, min(max_batch, batch))
