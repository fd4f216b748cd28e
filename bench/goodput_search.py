"""Which Poisson rate to probe next when a few probes must bound a service's goodput at
several TPOT objectives at once.

Each objective keeps a bracket: the highest rate sustained with no lower rate missed
(`sustained`, the goodput as measured) and the lowest rate missed (`failed`). A probe
informs every objective: which one it is aimed at only decides its rate and where a
probe may be cut short. The search grows the rate by `growth` until an objective
misses, halves it while even the first rate misses, then bisects (geometric midpoint)
until failed / sustained <= `resolution`. With a `grid` of rates, every probe is one of
them (the one nearest the rate the search would pick), and a bracket is done once no
grid rate lies inside it. The objective whose bracket is widest goes
first; on a tie the loosest, whose probe also says something of the tighter ones.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# A rate's result at each objective: True sustained, False missed, None unknown (the
# probe was cut short at a tighter objective, so what a looser one saw is incomplete).
Results = Mapping[float, Mapping[str, bool | None]]


@dataclass(frozen=True)
class Bracket:
    """What the probes so far say of one objective's goodput (req/s)."""

    sustained: float = 0.0  # highest rate sustained with every lower rate sustained
    failed: float | None = None  # lowest rate missed; None: none missed (a lower bound)

    @property
    def width(self) -> float:
        """failed / sustained: how far apart the bounds are (inf: open above or below)."""
        if self.failed is None or self.sustained <= 0:
            return math.inf
        return self.failed / self.sustained


def bracket(outcomes: Iterable[tuple[float, bool]]) -> Bracket:
    """The bracket of (rate, sustained) outcomes; a rate sustained above a missed one
    is noise and does not count."""
    rows = list(outcomes)
    failed = min((rate for rate, ok in rows if not ok), default=None)
    sustained = max(
        (rate for rate, ok in rows if ok and (failed is None or rate < failed)), default=0.0
    )
    return Bracket(sustained, failed)


def bracket_at(results: Results, key: str) -> Bracket:
    """The bracket of objective `key` from every rate whose result at it is known."""
    return bracket((rate, ok) for rate, by in results.items() if (ok := by.get(key)) is not None)


def nice(rate: float) -> float:
    """A rate to three significant digits (readable tables, stable prompt seeds)."""
    return float(f"{rate:.3g}")


@dataclass(frozen=True)
class Probe:
    rate: float
    aim: str  # the objective the rate was chosen for: the probe may be cut short at it


@dataclass(frozen=True)
class RateProbeSearch:
    """The next probe for objectives `keys` (TPOT in ms, as JSON keys: '25', '50')."""

    keys: tuple[str, ...]
    start: Mapping[str, float]  # per objective, the first rate (a seed, or the start rate)
    growth: float = 2.0
    resolution: float = 1.2
    min_rate: float = 0.25
    max_rate: float = 256.0
    max_probes: int = 6
    grid: tuple[float, ...] = ()  # when given, the only rates probed

    def candidate(self, key: str, b: Bracket) -> float | None:
        """The rate that narrows `key`'s bracket most; None once it is narrow enough."""
        if self.grid:
            return self._on_grid(key, b)
        if b.failed is None:
            if b.sustained <= 0:
                return self.start[key]
            if b.sustained >= self.max_rate:
                return None
            return min(nice(b.sustained * self.growth), self.max_rate)
        if b.sustained <= 0:
            lower = nice(b.failed / self.growth)
            return lower if lower >= self.min_rate else None
        if b.width <= self.resolution:
            return None
        return nice(math.sqrt(b.sustained * b.failed))

    def _on_grid(self, key: str, b: Bracket) -> float | None:
        inside = [
            r for r in sorted(self.grid) if r > b.sustained and (b.failed is None or r < b.failed)
        ]
        if not inside:
            return None
        if b.sustained <= 0 and b.failed is None:  # nothing known: the grid rate nearest the start
            aim = self.start[key]
        elif b.failed is None:  # growing: the next rate up
            return inside[0]
        elif b.sustained <= 0:  # even the lowest rate tried missed: the next rate down
            return inside[-1]
        else:
            aim = math.sqrt(b.sustained * b.failed)
        return min(inside, key=lambda r: abs(math.log(r / aim)))

    def next_probe(self, results: Results) -> Probe | None:
        if len(results) >= self.max_probes:
            return None
        open_keys = []
        for key in self.keys:
            b = bracket_at(results, key)
            rate = self.candidate(key, b)
            if rate is not None:
                open_keys.append((b.width, float(key), key, rate))
        if not open_keys:
            return None
        # Widest bracket first; on a tie the loosest objective.
        _, _, key, rate = max(open_keys)
        # Of the objectives wanting this very rate, aim at the loosest: a probe cut
        # short at it still tells every tighter one.
        same = [k for _, _, k, r in open_keys if r == rate]
        aim = max(same, key=float)
        while rate in results:  # already probed, its result here unknown: fresh prompts
            rate = nice(rate * 1.05)
        return Probe(rate, aim)


def looser_than(aim: str, keys: Iterable[str]) -> list[str]:
    """The objectives looser than `aim`: what a probe cut short at `aim` cannot tell."""
    return [k for k in keys if float(k) > float(aim)]
