"""A device not worth its place: at its smallest allowed local batch it is still the step's slowest, so every step
waits for it whatever share it gets, and the cluster would step faster without it.

Pure numpy, on the planner's per-device pieces (:mod:`~lightning_cannikin.core.optperf`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from lightning_cannikin.core.optperf import device_times, optimal_split

__all__ = ["DeadWeight", "dead_weight"]


@dataclass(frozen=True)
class DeadWeight:
    """Rank ``rank`` holds ``local_batch_size`` samples, its lower bound, and is the step's slowest at a total of
    ``total_batch_size``: the step takes ``step_time`` with it and ``step_time_without`` with its samples on the other
    ranks (their best split)."""

    rank: int
    local_batch_size: int
    total_batch_size: int
    step_time: float
    step_time_without: float

    def message(self) -> str:
        """What the log says, once per rank."""
        return (
            f"Cannikin: rank {self.rank} is the step's slowest even at its smallest local batch"
            f" ({self.local_batch_size} samples): a step of {self.total_batch_size} samples is predicted at"
            f" {1e3 * self.step_time:.1f} ms with it and {1e3 * self.step_time_without:.1f} ms with its samples on the"
            " other ranks. At this total the device costs the cluster time at any share (a larger total may"
            " still use it)."
        )


def dead_weight(
    slopes: ArrayLike,
    offsets: ArrayLike,
    local_batch_sizes: Sequence[int],
    lower: Sequence[int],
    upper: Sequence[int] | None = None,
) -> DeadWeight | None:
    """The slowest rank at its lower bound, where the others alone step faster with the same total; else ``None``.

    Args:
        slopes: the planner's per-device pieces, ``(n,)`` or ``(n, K)`` (:meth:`SpeedModel.pieces
            <lightning_cannikin.core.speed_model.SpeedModel.pieces>`).
        offsets: same shape.
        local_batch_sizes: the split in force.
        lower: every rank's lower bound.
        upper: every rank's upper bound (``None``: no cap).

    The step without the rank keeps the others' pieces as they are: a collective over one rank fewer costs about the
    same, so the time saved is the rank's own.
    """
    sizes = np.asarray(local_batch_sizes, dtype=np.int64)
    n = len(sizes)
    if n < 2:
        return None
    slopes, offsets = np.asarray(slopes, dtype=np.float64), np.asarray(offsets, dtype=np.float64)
    times = device_times(slopes, offsets, sizes)
    slowest = int(np.argmax(times))
    if sizes[slowest] > int(lower[slowest]):
        return None  # it could give samples away: the planner would have, were that faster
    others = np.arange(n) != slowest
    caps = None if upper is None else np.asarray(upper)[others]
    total = int(sizes.sum())
    if caps is not None and int(caps.sum()) < total:
        return None  # the others cannot hold its samples
    lows = np.asarray(lower)[others]
    without = optimal_split(slopes[others], offsets[others], total, lows, caps).step_time
    with_it = float(times[slowest])
    if without >= with_it:
        return None
    return DeadWeight(slowest, int(sizes[slowest]), total, with_it, float(without))
