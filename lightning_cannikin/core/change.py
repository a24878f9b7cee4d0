"""Is a device's speed changing? One rule, used by each rank on its own times and by the speed model on all of them.

A *clear change* is a run of recent step times of which at least three in four sit beyond a relative band around
what the device used to take, all on the same side. A periodic stall (every second or third step) or a one-window
glitch never fills three quarters of the window, so neither counts; a device that halves its speed fills it within
about ``window`` steps. A smaller change is judged the same way over a longer window; the recency-weighted fits
follow it at the re-plan it asks for.

:class:`LocalChangeCheck` is the cheap, local half: each rank feeds it its own compute time every step (a few
floats, no collective) and asks it on the steps :class:`~lightning_cannikin.core.schedule.ReplanSchedule` says (the
same steps on every rank); only when some rank answers yes do the ranks need to meet and re-plan.

Pure Python and numpy: imports neither torch nor Lightning.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

__all__ = ["DEFAULT_WINDOW", "LocalChangeCheck", "clear_change"]

DEFAULT_WINDOW = 16  # steps of recent times judged at once: a change fills 3/4 of them within 12 steps


def clear_change(ratios: Sequence[float], band: float, window: int = DEFAULT_WINDOW) -> float | None:
    """The measured ratio of a clear change in the last ``window`` ratios (measured / expected), or ``None``.

    Args:
        ratios: measured over expected times, oldest first.
        band: relative change a ratio must exceed to count (0.25: beyond 0.8 or 1.25).
        window: how many of the latest ratios are judged; fewer than this is never a change.

    Returns:
        The median of the ratios beyond the band on the side that holds at least three quarters of the window.

    """
    if len(ratios) < window:
        return None
    recent = np.asarray(ratios[-window:], dtype=np.float64)
    for beyond in (recent > 1.0 + band, recent < 1.0 / (1.0 + band)):
        if 4 * int(beyond.sum()) >= 3 * window:
            return float(np.median(recent[beyond]))
    return None


def trailing_run(ratios: Sequence[float], band: float) -> int:
    """How many of the latest ratios lie beyond the band on the side of the last one (0 if the last is inside)."""
    if not len(ratios):
        return 0
    high = ratios[-1] > 1.0 + band
    if not (high or ratios[-1] < 1.0 / (1.0 + band)):
        return 0
    count = 0
    for ratio in reversed(ratios):
        if (ratio > 1.0 + band) if high else (ratio < 1.0 / (1.0 + band)):
            count += 1
        else:
            break
    return count


class LocalChangeCheck:
    """One rank's watch on its own speed: fed every step, asked on the steps the schedule chooses.

    The reference is the median of the first ``reference`` times at the batch size in force (after ``skip`` steps
    that may still carry the previous plan's warm-up); later times at the same size fill a window. Two changes
    count: a large one (beyond ``band`` in three of the last ``window`` steps in four), within about ``window``
    steps, and a small one (beyond ``small_band``, or twice the reference's own spread if that is larger, over
    ``small_window`` steps), later. A new batch size starts a new reference, and so does :meth:`reset` (call it after
    a re-plan this check asked for: the speed model has then seen the change).

    Args:
        band: relative change that counts at once (the speed model's ``drift_tolerance``).
        window: recent steps judged for a large change.
        reference: steps whose median is the reference.
        skip: steps left out after a change of batch size or a reset.
        small_band: the smallest relative change that counts, over ``small_window`` steps.
        small_window: recent steps judged for a small change.

    """

    def __init__(
        self,
        band: float = 0.25,
        window: int = DEFAULT_WINDOW,
        reference: int = 8,
        skip: int = 2,
        small_band: float = 0.08,
        small_window: int = 48,
    ) -> None:
        if not (band > 0 and small_band > 0) or min(int(window), int(reference), int(small_window)) < 1 or skip < 0:
            raise ValueError(
                "`band`, `small_band` must be > 0, `window`, `small_window`, `reference` >= 1 and `skip` >= 0; got"
                f" {band}, {small_band}, {window}, {small_window}, {reference}, {skip}."
            )
        self.band, self.window, self.reference, self.skip = float(band), int(window), int(reference), int(skip)
        self.small_band, self.small_window = float(small_band), int(small_window)
        self._batch_size: int | None = None
        self._seen = 0
        self._reference: list[float] = []
        self._recent: deque[float] = deque(maxlen=max(self.window, self.small_window))

    def reset(self) -> None:
        """Start over: a re-plan happened (the model now knows what the times showed)."""
        self._batch_size = None

    def observe(self, batch_size: int, seconds: float) -> None:
        """One step's compute time at ``batch_size`` (non-finite or non-positive times are ignored)."""
        if not (np.isfinite(seconds) and seconds > 0):
            return
        if batch_size != self._batch_size:
            self._batch_size, self._seen = int(batch_size), 0
            self._reference = []
            self._recent.clear()
        self._seen += 1
        if self._seen <= self.skip:
            return
        if len(self._reference) < self.reference:
            self._reference.append(float(seconds))
        else:
            self._recent.append(float(seconds))

    def changed(self) -> bool:
        """Whether this rank's recent times show a clear change against its reference."""
        if len(self._reference) < self.reference:
            return False
        expected = float(np.median(self._reference))
        ratios = [t / expected for t in self._recent]
        spread = 1.4826 * float(np.median(np.abs(np.asarray(self._reference) / expected - 1.0)))
        small = max(self.small_band, 2.0 * spread)
        large = clear_change(ratios, self.band, self.window)
        return large is not None or clear_change(ratios, small, self.small_window) is not None
