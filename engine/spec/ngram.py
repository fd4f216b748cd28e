"""Prompt-lookup proposals: the tokens that followed the request's own latest n tokens.

The rule is vLLM's: the longest suffix of n tokens (n from `max_n` down to `min_n`) that
occurred earlier in the request proposes up to k tokens that followed its earliest
occurrence. Found with one dictionary per n, extended by the tokens added since the last
lookup, so a step costs O(new tokens), not a scan of the whole context (pure Python: a
scan per request per step would cost milliseconds at long contexts).
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """Earliest start of every n-gram (min_n <= n <= max_n) of one growing token list."""

    __slots__ = ("min_n", "max_n", "_firsts", "_next")

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._firsts: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        # Per n, the first start not indexed yet. Only n-grams followed by a token are
        # indexed, so the list's own suffix never matches itself.
        self._next = [0] * (max_n - min_n + 1)

    def propose(self, tokens: Sequence[int], k: int, length: int | None = None) -> tuple[int, ...]:
        """Up to k proposals after the first `length` tokens (default: all) of `tokens`
        (a list that only ever grows); () when none. The proposals may run into tokens
        past `length`: the caller cuts them where they are not known yet."""
        if k < 1:
            return ()
        if length is None:
            length = len(tokens)
        self._extend(tokens, length)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            start = self._firsts[n - self.min_n].get(tuple(tokens[length - n : length]))
            if start is not None:
                return tuple(tokens[start + n : start + n + k])
        return ()

    def _extend(self, tokens: Sequence[int], length: int) -> None:
        for i, firsts in enumerate(self._firsts):
            n = self.min_n + i
            stop = length - n  # starts below this have a following token
            for start in range(self._next[i], stop):
                firsts.setdefault(tuple(tokens[start : start + n]), start)
            self._next[i] = max(self._next[i], stop)
