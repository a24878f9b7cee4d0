"""OptPerf: the exact integer split of a total batch across heterogeneous devices that minimises the step time.

Device ``i`` adds ``g_i(b) = max_k(slopes[i, k] * b + offsets[i, k])`` to the step time when it holds ``b`` samples,
and a step lasts ``max_i g_i(b_i)``. Every ``g_i`` is non-decreasing because slopes are
non-negative, so the optimum is water-filling. :func:`optimal_split` returns exactly what the greedy "give the next
sample to the device whose time grows least, lowest rank first" produces when started from the lower bounds, but
without walking the ``B`` samples one at a time: the greedy takes the ``k = B - sum(lower)`` smallest "unit costs"
``g_i(b)`` (``lower_i < b <= upper_i``) of all devices, so the split follows from the ``k``-th smallest unit cost,
which a bracketing search over the level ``T`` finds with exact integer counts.

Pure numpy: imports neither torch nor Lightning, so every rank can run it and get bit-identical plans.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["Split", "device_times", "most_even_split", "optimal_split", "optperf", "step_time", "with_micro_steps"]

# Safety net for the level search: at least every third probe halves the bracket, so a few hundred probes take any
# realistic bracket of step times down to adjacent floats; reaching this means a bug rather than a hard input.
_MAX_SEARCH_ITERATIONS = 1000


@dataclass(frozen=True)
class Split:
    """The solver's answer: a split of the total batch and the step time it costs.

    Unlike a :class:`~lightning_cannikin.core.plan.Plan` it may give a device zero samples (a lower bound of 0 is
    valid maths); callers that train turn it into a plan.

    Args:
        local_batch_sizes: samples on each device, indexed like the solver's inputs.
        step_time: ``max_i g_i(b_i)`` for that split, in the units of the offsets (seconds).

    """

    local_batch_sizes: tuple[int, ...]
    step_time: float


class _Pieces:
    """Validated ``(n, K)`` pieces plus what the level search needs precomputed."""

    def __init__(self, slopes: ArrayLike, offsets: ArrayLike) -> None:
        s = np.asarray(slopes, dtype=np.float64)
        o = np.asarray(offsets, dtype=np.float64)
        if s.shape != o.shape:
            raise ValueError(f"`slopes` and `offsets` must have the same shape, got {s.shape} and {o.shape}.")
        if s.ndim == 1:
            s, o = s[:, None], o[:, None]
        if s.ndim != 2 or s.shape[0] == 0 or s.shape[1] == 0:
            raise ValueError(f"`slopes` must have shape (n,) or (n, K) with n, K >= 1, got {np.shape(slopes)}.")
        if not np.all(np.isfinite(s)):
            raise ValueError("`slopes` must be finite.")
        if not np.all(np.isfinite(o)):
            raise ValueError("`offsets` must be finite.")
        if np.any(s < 0):
            raise ValueError(f"`slopes` must be >= 0 (a device cannot get faster with more samples), got {s.min()}.")
        self.slopes = s
        self.offsets = o
        self.n, self.k = s.shape
        positive = s > 0
        # The inverse of a piece with slope 0 is "any b" (T >= offset) or "no b" (T < offset): fold those pieces into a
        # per-device floor, and make them neutral (+inf) in the min over the inverses of the sloped pieces.
        self.inv = np.where(positive, 1.0 / np.where(positive, s, 1.0), 0.0)
        self.pad = np.where(positive, 0.0, np.inf)
        self.floor = np.where(positive, -np.inf, o).max(axis=1)
        self.has_floor = bool(np.isfinite(self.floor).any())

    def evaluate(self, b: np.ndarray) -> np.ndarray:
        """``g_i(b_i)`` for ``b`` of shape ``(..., n)``; the single formula every comparison in this module uses."""
        # One pass per piece: numpy reduces a short trailing axis far slower than it combines whole arrays.
        out = self.slopes[:, 0] * b + self.offsets[:, 0]
        for j in range(1, self.k):
            np.maximum(out, self.slopes[:, j] * b + self.offsets[:, j], out=out)
        return out

    def count(self, level: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Units each device holds at a level: ``x = clip(max{b : g_i(b) <= T}, lo_i, hi_i)``, exactly.

        Args:
            level: levels ``T``, shape ``(C,)``.
            lo: lower bounds, shape ``(n,)``.
            hi: upper bounds, shape ``(C, n)``.

        Returns:
            ``x`` (float64 holding integers), ``g(x)`` and ``g(x + 1)``, each of shape ``(C, n)``.

        """
        t = level[:, None]
        q = (t - self.offsets[:, 0]) * self.inv[:, 0] + self.pad[:, 0]
        for j in range(1, self.k):
            np.minimum(q, (t - self.offsets[:, j]) * self.inv[:, j] + self.pad[:, j], out=q)
        if self.has_floor:
            q = np.where(t >= self.floor, q, -np.inf)
        x = np.clip(np.floor(q), lo, hi)
        # The float inverse can be one off the float forward model at the edges; the forward model is what the step
        # time and the brute force use, so correct x against it (monotone in b, so stepping converges).
        while True:
            g_next = self.evaluate(x + 1.0)
            up = (x < hi) & (g_next <= t)
            if not up.any():
                break
            x += up
        g_x = self.evaluate(x)
        down = (x > lo) & (g_x > t)
        if down.any():
            while down.any():
                x -= down
                g_x = self.evaluate(x)
                down = (x > lo) & (g_x > t)
            g_next = self.evaluate(x + 1.0)
        return x, g_x, g_next


def _integral_bounds(value: ArrayLike | None, n: int, default: float, name: str) -> np.ndarray:
    if value is None:
        return np.full(n, default, dtype=np.float64)
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim == 0:
        arr = np.full(n, float(arr))
    if arr.shape != (n,):
        raise ValueError(f"`{name}` must be a scalar or have one entry per device ({n}), got shape {arr.shape}.")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"`{name}` must be finite integers, got {arr.tolist()}.")
    if not np.all(arr == np.round(arr)):
        raise ValueError(f"`{name}` must be integers, got {arr.tolist()}.")
    if np.any(arr < 0):
        raise ValueError(f"`{name}` must be >= 0, got {arr.tolist()}.")
    return arr


def _bounds(lower: ArrayLike | None, upper: ArrayLike | None, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Lower bounds (default 1) and upper bounds (default unbounded: ``sum b = B`` and ``b >= 0`` cap them at B)."""
    lo = _integral_bounds(lower, n, 1.0, "lower")
    hi = _integral_bounds(upper, n, np.inf, "upper")
    bad = np.flatnonzero(lo > hi)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"`lower` exceeds `upper` for device {i}: {int(lo[i])} > {int(hi[i])}.")
    return lo, hi


def _totals(total_batch_sizes: ArrayLike, name: str) -> np.ndarray:
    arr = np.asarray(total_batch_sizes, dtype=np.float64)
    if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
        raise ValueError(f"`{name}` must be finite integers, got {np.asarray(total_batch_sizes).tolist()}.")
    return arr


def _search(
    pieces: _Pieces, need: np.ndarray, lo: np.ndarray, hi: np.ndarray, forced: float, exact: bool
) -> np.ndarray:
    """The ``need[c]``-th smallest unit cost ``v`` among ``g_i(b)``, ``lo_i < b <= hi[c, i]``, for each candidate ``c``.

    A bracketing search on the level ``T`` keeps ``left`` (fewer than ``need`` units cost ``<= left``), ``right``
    (a unit cost with at least ``need`` units ``<= right``) and ``nxt`` (the smallest unit cost above ``left``); it is
    done when ``nxt == right``. Probes never go below ``nxt``, so each one removes at least one unit cost from the
    bracket.

    It starts at ``forced = max_i g_i(lo_i)``, where every device is filling, so the unit count is concave in ``T``
    from there on (each ``g_i`` is convex) and Newton steps from the left end cannot overshoot the continuous root: a
    doubled Newton step finds a right end, then Newton steps from the left alternate with secant steps after a probe
    that moved the right end. A probe of ``nxt`` settles a candidate one unit short, and a bisection follows any two
    probes that did not halve the bracket, which bounds the worst case.

    Args:
        pieces: the device model.
        need: ``k >= 1`` per candidate, shape ``(C,)``, at most the number of units available.
        lo: lower bounds, shape ``(n,)``.
        hi: finite upper bounds, shape ``(C, n)``.
        forced: ``max_i g_i(lo_i)``, the step time the lower bounds force.
        exact: find ``v`` even where it lies below ``forced``; otherwise ``max(forced, v)`` is returned.

    """
    c = need.shape[0]
    x, g_x, g_next = pieces.count(np.full(c, forced), lo, hi)
    cnt = (x - lo).sum(axis=1)
    covered = cnt >= need
    left = np.full(c, forced)
    cnt_left = cnt.copy()
    nxt = np.where(x < hi, g_next, np.inf).min(axis=1)
    right = np.where(hi > lo, pieces.evaluate(hi), -np.inf).max(axis=1)  # the dearest last unit: count = all units
    cnt_right = (hi - lo).sum(axis=1)
    newton = _newton(left, cnt_left, need, x, g_x, g_next, hi)
    probe = left + 2.0 * (newton - left)  # no right end yet: gallop past the root
    if exact and covered.any():
        # The threshold lies at or below `forced`; nothing is filling below it, so start from the cheapest first unit.
        first = np.where(hi > lo, pieces.evaluate(np.broadcast_to(lo + 1.0, hi.shape)), np.inf).min(axis=1)
        right = np.where(covered, np.where(x > lo, g_x, -np.inf).max(axis=1), right)
        cnt_right = np.where(covered, cnt, cnt_right)
        left = np.where(covered, np.nextafter(first, -np.inf), left)
        cnt_left = np.where(covered, 0.0, cnt_left)
        nxt = np.where(covered, first, nxt)
        probe = np.where(covered, np.nan, probe)
    far = ~covered  # the right end is still the dearest last unit
    # Bracket widths before the last two probes: unless those two probes halved it, the next one bisects.
    width1 = np.full(c, np.inf)
    width2 = np.full(c, np.inf)
    active = np.flatnonzero((~covered | exact) & (nxt < right))
    probes = 0
    while active.size:
        probes += 1
        if probes > _MAX_SEARCH_ITERATIONS:
            raise RuntimeError("optperf level search did not converge; please report the slopes and offsets.")
        a, r, lft = nxt[active], right[active], left[active]
        ca, cr = cnt_left[active], cnt_right[active]
        nd = need[active]
        secant = a + (nd - ca - 0.5) / np.maximum(cr - ca, 1.0) * (r - a)
        # Widths run from `nxt`: (left, nxt) holds no unit cost, and a bisection halves r - nxt, not r - left.
        stalled = (r - a) > 0.5 * width2[active]
        width2[active] = width1[active]
        width1[active] = r - a
        pr = np.where(stalled, 0.5 * (a + r), probe[active])
        pr = np.where(np.isfinite(pr), pr, secant)
        pr = np.clip(pr, a, np.nextafter(r, -np.inf))
        # One unit short, or a bracket of adjacent floats: probing `nxt` decides the candidate.
        pr = np.where((nd - ca <= 1) | (pr >= r), a, pr)
        h = hi[active]
        x, g_x, g_next = pieces.count(pr, lo, h)
        cnt = (x - lo).sum(axis=1)
        enough = cnt >= nd
        # Snap right to the largest unit cost <= probe, so `right` is always an attained value.
        right[active] = np.where(enough, np.where(x > lo, g_x, -np.inf).max(axis=1), r)
        cnt_right[active] = np.where(enough, cnt, cr)
        left[active] = np.where(enough, lft, pr)
        cnt_left[active] = np.where(enough, ca, cnt)
        nxt[active] = np.where(enough, a, np.where(x < h, g_next, np.inf).min(axis=1))
        newton = _newton(pr, cnt, nd, x, g_x, g_next, h)
        was_far = far[active]
        far[active] = was_far & ~enough
        # Next probe: Newton from a new left end (doubled while no right end is known), the secant after a right move.
        probe[active] = np.where(enough, np.nan, np.where(was_far, pr + 2.0 * (newton - pr), newton))
        active = active[nxt[active] < right[active]]
    return right if exact else np.where(covered, forced, right)


def _newton(
    level: np.ndarray,
    cnt: np.ndarray,
    need: np.ndarray,
    x: np.ndarray,
    g_x: np.ndarray,
    g_next: np.ndarray,
    hi: np.ndarray,
) -> np.ndarray:
    """The level where the unit count, extrapolated at its local rate, is half a unit short of ``need``."""
    # Device i gains a unit every g_i(x_i + 1) - g_i(x_i) seconds of level; it is > 0 where g_x <= level < g_next.
    filling = (x < hi) & (g_x <= level[:, None])
    rate = (1.0 / np.where(filling, g_next - g_x, np.inf)).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return level + (need - 0.5 - cnt) / rate


def _solve(
    pieces: _Pieces, totals: np.ndarray, lo: np.ndarray, hi_user: np.ndarray, exact: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Optimal step time per total (``inf`` when infeasible), plus the greedy's threshold and the bounds used.

    Args:
        exact: also find the greedy's threshold unit cost where it lies below the forced ``max_i g_i(lo_i)`` (the
            split needs it; the step time does not).

    Returns:
        ``(step_time, threshold, hi)`` with shapes ``(C,)``, ``(C,)``, ``(C, n)``; ``threshold`` is ``-inf`` where no
        unit beyond the lower bounds is needed.

    """
    c = totals.shape[0]
    # An upper bound above B can never bind (the other devices hold >= 0), and a finite cap keeps the counts finite.
    hi = np.minimum(hi_user[None, :], np.maximum(totals, 0.0)[:, None])
    hi = np.maximum(hi, lo)  # only changes infeasible rows, which are masked out below
    need = totals - lo.sum()
    feasible = (need >= 0) & (hi.sum(axis=1) >= totals)
    forced = float(pieces.evaluate(lo).max())
    out = np.where(feasible, forced, np.inf)
    threshold = np.full(c, -np.inf)
    todo = np.flatnonzero(feasible & (need > 0))
    if todo.size:
        threshold[todo] = _search(pieces, need[todo], lo, hi[todo], forced, exact)
        out[todo] = np.maximum(forced, threshold[todo])
    return out, threshold, hi


def optimal_split(
    slopes: ArrayLike,
    offsets: ArrayLike,
    total_batch_size: int,
    lower: ArrayLike | None = None,
    upper: ArrayLike | None = None,
) -> Split:
    """The exact integer split minimising ``max_i g_i(b_i)`` subject to ``sum b_i = B`` and ``lower <= b <= upper``.

    Ties are broken like the greedy started from the lower bounds that hands out one sample at a time to the device
    with the smallest ``g_i(b_i + 1)``, lowest index first: so every rank computing the plan gets the same split, and
    identical devices get an even split with the remainder on the lowest ranks.

    Args:
        slopes: ``(n,)`` or ``(n, K)`` non-negative seconds per sample of each piece.
        offsets: same shape, seconds of each piece at ``b = 0``.
        total_batch_size: ``B``.
        lower: ``None`` (1 each), a scalar or per-device integers.
        upper: ``None`` (no cap), a scalar or per-device integers, e.g. memory caps.

    Raises:
        ValueError: on malformed inputs or when no split satisfies the bounds.

    """
    pieces = _Pieces(slopes, offsets)
    lo, hi_user = _bounds(lower, upper, pieces.n)
    totals = _totals([total_batch_size], "total_batch_size")
    total = int(totals[0])
    if lo.sum() > total:
        raise ValueError(
            f"`total_batch_size`={total} is smaller than sum(`lower`)={int(lo.sum())}: every device must hold at least"
            " its lower bound (default 1)."
        )
    if hi_user.sum() < total:
        raise ValueError(
            f"`total_batch_size`={total} exceeds sum(`upper`)={int(hi_user.sum())}: the caps cannot hold it."
        )
    best, threshold, hi = _solve(pieces, totals, lo, hi_user, exact=True)
    level = float(threshold[0])
    if level == -np.inf:
        sizes = lo
    else:
        # Every unit cheaper than the threshold is taken; units costing exactly the threshold go to the lowest
        # indices first, as the greedy heap would hand them out.
        below, _, _ = pieces.count(np.array([np.nextafter(level, -np.inf)]), lo, hi)
        at, _, _ = pieces.count(np.array([level]), lo, hi)
        ties = (at - below)[0]
        missing = total - below.sum()
        taken = np.clip(missing - (np.cumsum(ties) - ties), 0.0, ties)
        sizes = below[0] + taken
    split = tuple(int(b) for b in sizes)
    achieved = float(pieces.evaluate(sizes).max())
    if sum(split) != total or achieved != best[0]:
        raise RuntimeError(f"internal planner error: split {split} costs {achieved}, expected {best[0]}.")
    return Split(split, achieved)


def optperf(
    slopes: ArrayLike,
    offsets: ArrayLike,
    total_batch_sizes: ArrayLike,
    lower: ArrayLike | None = None,
    upper: ArrayLike | None = None,
) -> np.ndarray:
    """The optimal step time (OptPerf) for each candidate total batch size, vectorised across candidates.

    Equal to ``optimal_split(slopes, offsets, B, lower, upper).step_time`` for every feasible ``B``.

    Args:
        slopes: ``(n,)`` or ``(n, K)`` non-negative seconds per sample of each piece.
        offsets: same shape, seconds of each piece at ``b = 0``.
        total_batch_sizes: integer candidates, any shape.
        lower: ``None`` (1 each), a scalar or per-device integers.
        upper: ``None`` (no cap), a scalar or per-device integers.

    Returns:
        Float array shaped like ``total_batch_sizes``; ``inf`` where a candidate violates the bounds.

    """
    pieces = _Pieces(slopes, offsets)
    lo, hi_user = _bounds(lower, upper, pieces.n)
    totals = _totals(total_batch_sizes, "total_batch_sizes")
    best, _, _ = _solve(pieces, totals.reshape(-1), lo, hi_user, exact=False)
    return best.reshape(totals.shape)


def with_micro_steps(
    times: np.ndarray, totals: ArrayLike, steps: ArrayLike, micro_step: Callable[[int], float]
) -> np.ndarray:
    """Optimizer-step times of micro-step totals run ``steps`` times: ``times`` (one whole step each, the reduction
    included) plus ``steps - 1`` micro-steps that reduce nothing, ``micro_step(total)`` seconds each (the ranks'
    compute at the total's split). Gradient accumulation pays its all-reduce once, as it runs."""
    flat = np.array(times, dtype=np.float64).reshape(-1)
    sizes = np.asarray(totals).reshape(-1)
    extra = np.broadcast_to(np.asarray(steps), np.shape(times)).reshape(-1) - 1
    for index in np.flatnonzero(np.isfinite(flat) & (extra > 0)):
        flat[index] += extra[index] * micro_step(int(sizes[index]))
    return flat.reshape(np.shape(times))


def device_times(slopes: ArrayLike, offsets: ArrayLike, local_batch_sizes: ArrayLike) -> np.ndarray:
    """Every device's ``g_i(b_i)`` at a split (shape ``(n,)``), or at each row of a ``(C, n)`` array of splits."""
    pieces = _Pieces(slopes, offsets)
    sizes = np.asarray(local_batch_sizes, dtype=np.float64)
    if sizes.ndim not in (1, 2) or sizes.shape[-1] != pieces.n:
        raise ValueError(f"`local_batch_sizes` must have one entry per device ({pieces.n}), got shape {sizes.shape}.")
    return pieces.evaluate(sizes)


def step_time(slopes: ArrayLike, offsets: ArrayLike, local_batch_sizes: ArrayLike) -> float | np.ndarray:
    """``max_i g_i(b_i)``: the step time the model predicts for a split (shape ``(n,)``: a float), or for each row
    of a ``(C, n)`` array of splits (an array of ``C`` times)."""
    times = device_times(slopes, offsets, local_batch_sizes).max(axis=-1)
    return float(times) if np.ndim(local_batch_sizes) == 1 else times


def most_even_split(
    total_batch_size: int, n: int, lower: ArrayLike | None = None, upper: ArrayLike | None = None
) -> Split:
    """The most even split of ``total_batch_size`` within the bounds: OptPerf on identical devices.

    Without binding bounds it is :func:`~lightning_cannikin.core.plan.even_split` (the remainder on the lowest ranks);
    a rank capped below the even share keeps its cap and the others share the rest evenly.
    """
    return optimal_split(np.ones(n), np.zeros(n), total_batch_size, lower, upper)
