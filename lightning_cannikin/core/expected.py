"""The expected step time: what a step costs on average when some devices stall every few steps.

A step lasts as long as its slowest rank, so the time users pay is the expected maximum ``E[max_i t_i]`` over the
ranks, not the maximum of the per-rank medians (which sees only a stalled device's fast mode) nor of the means. The
per-step records say which ranks were slow together: each recorded step gives one *scenario*, a vector of
multipliers ``m_i = measured / model_i(b_i)``, and a split's expected time is the mean over the scenarios of the
step time with every rank's compute scaled by its multiplier.

Only recurring stalls count. A multiplier within ``threshold`` of 1 is timing noise (set to 1); a rank whose slow
steps come in fewer than ``episodes`` separate runs over the window had a glitch (one slow step, or one slow burst),
not a recurring stall, and keeps multipliers of 1; and each rank's multipliers are capped at its ``1 - rare``
quantile over the window, so the odd outlier of a stalling rank does not count either. When no rank stalls, every
scenario is all ones: the expected time *is* the deterministic step time and the planner is OptPerf, exact.

Pure numpy: imports neither torch nor Lightning.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from lightning_cannikin.core.change import MAD_TO_SD

__all__ = ["Scenarios", "expected_split", "relative_jitter", "stall_scenarios"]


class Scenarios:
    """Distinct multiplier vectors ``(U, n)`` and their weights ``(U,)`` (summing to 1)."""

    def __init__(self, multipliers: np.ndarray, weights: np.ndarray) -> None:
        self.multipliers = multipliers
        self.weights = weights

    def expected(self, slopes: np.ndarray, offsets: np.ndarray, fixed: np.ndarray, splits: np.ndarray) -> np.ndarray:
        """Expected step time of each split ``(C, n)``: pieces ``(n, K)`` whose compute part (all but ``fixed``, the
        part no device's speed scales: the all-reduce, the tail) is multiplied by each scenario's multipliers."""
        m = self.multipliers[None, :, :, None]  # (1, U, n, 1)
        b = np.asarray(splits, dtype=np.float64)[:, None, :, None]  # (C, 1, n, 1)
        times = (slopes * b + (offsets - fixed)) * m + fixed  # (C, U, n, K)
        return times.max(axis=(2, 3)) @ self.weights


def stall_scenarios(
    ratios: np.ndarray, threshold: float = 0.1, rare: float = 0.05, episodes: int = 3
) -> Scenarios | None:
    """The recurring stalls in ``ratios`` (measured over modelled compute, one row per recorded step, one column per
    rank), or ``None`` if no rank stalls (the deterministic model is the expected one).

    Args:
        ratios: ``(S, n)``.
        threshold: a ratio up to ``1 + threshold`` is noise.
        rare: stalls in fewer than this fraction of the steps are outliers: each rank's ratios are capped at their
            ``1 - rare`` quantile (the lower order statistic, so the cap is a measured value).
        episodes: the fewest separate runs of slow steps that make a recurring stall.

    """
    ratios = np.asarray(ratios, dtype=np.float64)
    if ratios.ndim != 2 or ratios.shape[0] == 0:
        return None
    slow = np.isfinite(ratios) & (ratios > 1.0 + threshold)
    starts = slow & ~np.vstack([np.zeros((1, slow.shape[1]), dtype=bool), slow[:-1]])  # first step of each run
    recurring = starts.sum(axis=0) >= episodes
    stalls = np.where(slow & recurring, ratios, 1.0)
    index = int(np.floor((1.0 - rare) * (stalls.shape[0] - 1)))
    cap = np.sort(stalls, axis=0)[index]  # (n,)
    stalls = np.minimum(stalls, cap)
    if np.all(stalls == 1.0):
        return None
    rows, counts = np.unique(stalls, axis=0, return_counts=True)
    return Scenarios(rows, counts / counts.sum())


def relative_jitter(ratios: np.ndarray) -> float:
    """The devices' relative step-time jitter in ``ratios`` (measured over modelled compute, ``(S, n)``): each rank's
    robust spread (``MAD_TO_SD`` x the median absolute deviation) around its median ratio, over that median, the
    median over the ranks. Robust to a rank's recurring stalls (a minority of its steps) and to a model's bias alike."""
    ratios = np.asarray(ratios, dtype=np.float64)
    if ratios.ndim != 2 or ratios.shape[0] < 2:
        return 0.0
    centre = np.median(ratios, axis=0)
    spread = MAD_TO_SD * np.median(np.abs(ratios - centre), axis=0) / np.maximum(centre, 1e-12)
    return float(np.median(spread))


def expected_split(
    cost: Callable[[np.ndarray], np.ndarray],
    start: tuple[int, ...],
    lower: np.ndarray,
    upper: np.ndarray,
    max_rounds: int = 10_000,
) -> tuple[int, ...]:
    """Descend from ``start`` (the deterministic optimum) to a split of the same total with a lower ``cost``.

    ``cost`` maps ``(C, n)`` splits to their expected times. The expected maximum of convex pieces is convex, so a
    descent by moves of ``d`` samples (one rank to another, one rank to all others, all others to one rank), with
    ``d`` halved whenever no move improves strictly, ends at or next to the integer optimum.
    """
    n = len(start)
    current = np.asarray(start, dtype=np.int64)
    best = float(cost(current[None])[0])
    step = max(1, int(current.sum()) // (4 * n))
    moves = []
    for j in range(n):
        for i in range(n):
            if i != j:
                move = np.zeros(n, dtype=np.int64)
                move[j], move[i] = -1, 1
                moves.append(move)
        if n > 2:
            moves.append(np.where(np.arange(n) == j, -(n - 1), 1))  # j gives to every other rank
            moves.append(np.where(np.arange(n) == j, n - 1, -1))  # every other rank gives to j
    directions = np.array(moves, dtype=np.int64)
    for _ in range(max_rounds):
        candidates = current + step * directions
        inside = np.all((candidates >= lower) & (candidates <= upper), axis=1)
        if inside.any():
            times = cost(candidates[inside])
            k = int(np.argmin(times))
            if times[k] < best:
                current, best = candidates[inside][k], float(times[k])
                continue
        if step == 1:
            break
        step //= 2
    return tuple(int(b) for b in current)
