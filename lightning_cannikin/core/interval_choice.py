"""The total batch chosen over the whole interval of noise scales the statistics allow, not at one end of it.

Goodput ``B / step_time(B) * E(B)`` depends on the noise scale ``phi``, which the statistics only bound:
``low <= phi <= high`` (``high`` may be infinite). Deciding at ``low`` alone never grows a total while ``low`` is below
the break-even noise scale, even where ``high`` says staying may waste most of the cluster. Here every candidate is
judged at both ends:

- its *share* at a noise scale is its goodput over the best candidate's there (1 for the best);
- its *sure share* is the smaller of its shares at ``low`` and at ``high``: the fraction of the best goodput it reaches
  wherever the truth lies in the interval (a goodput ratio of two totals is monotone in ``phi``, so the ends are the
  worst cases). Maximising it is minimax regret over the interval.

The rule keeps what made the one-ended rule safe: a move must raise the sure share by more than the margin, and a
larger total is a candidate only if, with the noise scale at ``low``, it is within the margin of the best total there
(a smaller one, at ``high``). So a move costs at most the margin wherever the truth is, and the bound that may be
infinite never sets how far the total goes: with ``high`` infinite, the sure share still ranks candidates by
throughput, and ``low`` caps the growth. Where ``low == high`` this is the one-ended point rule at that noise scale
exactly.

Pure numpy: imports neither torch nor Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from lightning_cannikin.core.goodput import goodput

__all__ = ["IntervalChoice", "TotalOptions", "relative_gain"]


def relative_gain(new: float, old: float) -> float:
    """``new / old - 1`` (``inf`` where ``old`` is not positive and ``new`` is)."""
    return new / old - 1.0 if old > 0 else (float("inf") if new > 0 else 0.0)


@dataclass(frozen=True)
class IntervalChoice:
    """The outcome of :meth:`TotalOptions.choose` at one interval of noise scales.

    Attributes:
        batch_size: the candidate with the largest sure share (the current total when none is allowed to move).
        sure_share: its sure share: the least fraction of the best goodput it reaches anywhere in the interval.
        current_sure_share: the current total's.
        adopted: whether to move to ``batch_size``: it differs from the current total and raises the sure share by
            more than the margin.

    """

    batch_size: int
    sure_share: float
    current_sure_share: float
    adopted: bool

    @property
    def gain(self) -> float:
        """The relative gain of the sure share over keeping the current total (``inf`` from a share of 0)."""
        return relative_gain(self.sure_share, self.current_sure_share)


@dataclass(frozen=True)
class TotalOptions:
    """The candidate totals of one decision with their predicted step times, and the total in force.

    Every rank holds the same options (rank zero broadcasts them with the decision), so each can tell on its own, at
    the same step, when the noise bounds call for a move (:meth:`moves`).

    Args:
        totals: candidate total batches (per optimizer step).
        times: their predicted step times in seconds (``inf``: infeasible).
        current: the total in force.
        current_time: its step time at its best split.
        base_batch_size: B0.
        margin: the relative gain of the sure share a move must exceed (hysteresis), and the most a move may lose
            against the best total at the end of the interval it moves away from.
        held: chosen mid-epoch with the accumulation held: an epoch's end, where it may change, weighs totals (or
            step counts) these options lack, so it reconsiders the total whatever they say.

    """

    totals: tuple[int, ...]
    times: tuple[float, ...]
    current: int
    current_time: float
    base_batch_size: int
    margin: float
    held: bool = False

    def __post_init__(self) -> None:
        if len(self.totals) != len(self.times) or not self.totals:
            raise ValueError(f"Got {len(self.totals)} candidate totals for {len(self.times)} step times.")
        if not self.margin >= 0:
            raise ValueError(f"`margin` must be >= 0, got {self.margin}.")

    def choose(self, low: float, high: float) -> IntervalChoice:
        """The total to run for noise scales in ``[low, high]`` (``high`` may be ``inf``)."""
        if not 0.0 <= low <= high:  # also rejects NaN
            raise ValueError(f"Noise-scale bounds must satisfy 0 <= low <= high, got ({low}, {high}).")
        sizes = np.asarray(self.totals, dtype=np.int64)
        ends = np.array([low, high], dtype=np.float64)[:, None]
        values = np.asarray(goodput(sizes[None, :], np.asarray(self.times)[None, :], ends, self.base_batch_size))
        kept = np.asarray(goodput(self.current, self.current_time, ends, self.base_batch_size)).reshape(2, 1)
        best = np.maximum(values.max(axis=1, keepdims=True), kept)
        if not np.all(best > 0):  # nothing feasible at some end: nothing to compare
            return IntervalChoice(self.current, 0.0, 0.0, False)
        shares, kept_shares = values / best, kept / best
        # a move towards larger totals must be near-best should the truth be at the low end, towards smaller ones at
        # the high end: what the move risks is bounded by the margin whatever the truth in the interval
        near = 1.0 / (1.0 + self.margin)  # no total gains more than the margin over it there
        allowed = np.where(sizes > self.current, shares[0] >= near, shares[1] >= near) & (sizes != self.current)
        sure, current_sure = shares.min(axis=0), float(kept_shares.min())
        if not allowed.any():
            return IntervalChoice(self.current, current_sure, current_sure, False)
        top = float(sure[allowed].max())
        size = int(sizes[allowed & (sure == top)].min())  # among equal sure shares, the smallest total
        if top <= current_sure:
            return IntervalChoice(self.current, current_sure, current_sure, False)
        return IntervalChoice(size, top, current_sure, top > (1.0 + self.margin) * current_sure)

    def moves(self, bounds: tuple[float, float]) -> bool:
        """Whether noise bounds ``(low, high)`` call for a move of the total in force (asked after every step)."""
        return _moves(self, float(bounds[0]), float(bounds[1]))

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values (a checkpoint's)."""
        return {
            "totals": [int(t) for t in self.totals],
            "times": [float(t) for t in self.times],
            "current": int(self.current),
            "current_time": float(self.current_time),
            "base_batch_size": int(self.base_batch_size),
            "margin": float(self.margin),
            "held": self.held,
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> TotalOptions:
        """What :meth:`to_dict` returned."""
        return cls(
            tuple(int(t) for t in state["totals"]),
            tuple(float(t) for t in state["times"]),
            int(state["current"]),
            float(state["current_time"]),
            int(state["base_batch_size"]),
            float(state["margin"]),
            bool(state.get("held", False)),  # checkpoints before it held no such options
        )


@lru_cache(maxsize=32)  # asked after every step (about 85 us a choice); the bounds change only as statistics are folded
def _moves(options: TotalOptions, low: float, high: float) -> bool:
    return options.choose(low, high).adopted
