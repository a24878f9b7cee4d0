"""Bounded windows of measurements, newest kept, for the online fits.

:class:`SampleWindow` keeps the newest ``max_samples`` pairs and weighs them by recency. :class:`BatchSizeWindow`
keys its pairs by a batch size and evicts so that a slope, once measured, stays measurable: after a long run at one
plan, a plain window would hold a single batch size, the slope would become unidentifiable, and the fits would fall
back to a guess (and the planner would start probing again) just because the plan was stable.

Pure Python and numpy: imports neither torch nor Lightning.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["BatchSizeWindow", "SampleWindow"]


class SampleWindow:
    """The newest ``max_samples`` pairs, each weighted ``0.5 ** (age / half_life)`` with age 0 for the newest.

    Args:
        max_samples: pairs kept, >= 1 (the oldest are dropped).
        half_life: age in samples at which a pair's weight halves; ``math.inf`` weighs all pairs equally.

    """

    def __init__(self, max_samples: int, half_life: float = float("inf")) -> None:
        half_life = float(half_life)
        if not half_life > 0:  # also rejects NaN; math.inf turns recency weighting off
            raise ValueError(f"`half_life` must be > 0, got {half_life}.")
        if int(max_samples) < 1:
            raise ValueError(f"`max_samples` must be >= 1, got {max_samples}.")
        self.half_life = half_life
        self.max_samples = int(max_samples)
        self._pairs: deque[tuple[Any, Any]] = deque()

    def __len__(self) -> int:
        return len(self._pairs)

    def append(self, first: Any, second: Any) -> None:
        """Add the newest pair, evicting what no longer fits."""
        self._pairs.append((first, second))
        self._on_append(first)
        while len(self._pairs) > self.max_samples:
            self._evict()

    def pairs(self) -> list[tuple[Any, Any]]:
        """The pairs in the window, oldest first."""
        return list(self._pairs)

    def weights(self) -> np.ndarray:
        """Recency weight of each pair, oldest first (age counts positions in the window)."""
        age = np.arange(len(self._pairs) - 1, -1, -1, dtype=np.float64)
        return 0.5 ** (age / self.half_life)

    def columns(self) -> tuple[np.ndarray, np.ndarray]:
        """The two halves of the pairs as float arrays; the window must not be empty."""
        first, second = zip(*self._pairs, strict=True)
        return np.asarray(first, dtype=np.float64), np.asarray(second, dtype=np.float64)

    def clear(self) -> None:
        """Drop every pair."""
        self._pairs.clear()
        self._reset()

    def restore(self, first: Sequence, second: Sequence, convert: tuple[Callable, Callable]) -> None:
        """Replace the pairs, as if ``zip(first, second)`` had arrived one by one (so the same eviction applies)."""
        if len(first) != len(second):
            raise ValueError(f"state holds {len(first)} and {len(second)} values; they must pair up.")
        self.clear()
        for u, v in zip(first, second, strict=True):
            self.append(convert[0](u), convert[1](v))

    def _on_append(self, first: Any) -> None:
        """Bookkeeping for subclasses."""

    def _reset(self) -> None:
        """Bookkeeping for subclasses."""

    def _evict(self) -> None:
        self._pairs.popleft()


class BatchSizeWindow(SampleWindow):
    """A :class:`SampleWindow` of ``(batch_size, value)`` pairs that keeps two batch sizes in view.

    Eviction drops the oldest pair, except the newest ``reserve`` pairs of the second-newest batch size: they stay
    until the plan moves to yet another batch size. The window can then still tell a slope from an intercept after any
    number of steps at one plan.

    Args:
        max_samples: pairs kept, >= 1.
        half_life: as in :class:`SampleWindow`.
        reserve: pairs of the second-newest batch size that eviction keeps (at most half the window).

    """

    def __init__(self, max_samples: int, half_life: float = float("inf"), reserve: int = 16) -> None:
        super().__init__(max_samples, half_life)
        if int(reserve) < 0:
            raise ValueError(f"`reserve` must be >= 0, got {reserve}.")
        self.reserve = min(int(reserve), self.max_samples // 2)
        self._counts: Counter[int] = Counter()
        self._newest: int | None = None
        self._second: int | None = None

    def distinct_batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes present in the window, ascending."""
        return tuple(sorted(self._counts))

    def _on_append(self, first: Any) -> None:
        self._counts[first] += 1
        if first != self._newest:
            self._second, self._newest = self._newest, first

    def _reset(self) -> None:
        self._counts.clear()
        self._newest = self._second = None

    def _evict(self) -> None:
        protected = self._second if self._counts[self._second] <= self.reserve else None
        index = 0
        if protected is not None:
            # the protected pairs are few (<= reserve), so this scan is short
            while self._pairs[index][0] == protected:
                index += 1
        size = self._pairs[index][0]
        del self._pairs[index]
        self._counts[size] -= 1
        if not self._counts[size]:
            del self._counts[size]
