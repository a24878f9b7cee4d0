"""Splitting one global batch of samples of unequal cost across heterogeneous ranks by predicted time.

Sample ``s`` has a cost ``c_s`` (e.g. its token count) and optionally a second cost ``q_s`` (e.g. the square of its
length, for attention). Rank ``r`` holding the set ``S_r`` is predicted to take

    t_r(S_r) = fixed_r + per_cost_r * sum_{s in S_r} c_s + per_square_r * sum_{s in S_r} q_s

and the step lasts ``max_r t_r``. :func:`split_by_cost` assigns every sample to one rank so that this maximum is
minimal or near it: longest processing time first onto the rank whose predicted finish would be earliest (LPT for
uniform machines), then a local search that moves one sample off the slowest rank, or swaps one of its samples with
one of another rank's, while that lowers the slowest rank's time. Every accepted change lowers the sorted vector of
rank times lexicographically, so the search ends; at its end no single move off the slowest rank helps, which bounds
the gap to the fractional optimum :func:`lower_bound` by ``(n - 1) * c_min / sum_r(1 / per_cost_r)`` in the linear
case (``c_min``: the smallest cost on the slowest rank; ``docs/variable-length.md`` derives it).

Deterministic with no collective: samples are ordered by work with ties broken by position, ranks by index, and every
decision rests on elementwise float operations and sums in a fixed order (never a reduction or a BLAS product, whose
rounding may follow the CPU), so bit-equal inputs give equal splits on every rank, whatever its machine. Every rank is
given at least one sample (DDP needs every rank to step), so the batch must have at least as many samples as ranks.

Pure numpy: imports neither torch nor Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["CostSplit", "lower_bound", "predicted_times", "split_by_cost"]

# A change must lower the slowest rank's time by more than this relative amount: float rounding can never make the
# search cycle, and a gain this small is worth nothing.
_RELATIVE_GAIN = 1e-12
# Swaps off the slowest rank are tried with the samples of this many least loaded ranks: a round then costs
# O(|slowest| * (n + a few ranks' samples)) instead of O(|slowest| * m); moves still try every rank.
_SWAP_RANKS = 4
# Two ranks holding at most this many samples together are re-split exhaustively (2**12 subsets).
_PAIR_POOL = 12
# Batches of at most this many samples are solved exactly by branch and bound within this many nodes (a few ms in
# the worst case); there one sample is a large share of a rank's time and the local search's optimum can miss by 10%.
_EXACT_SAMPLES, _EXACT_NODES = 12, 3_000


@dataclass(frozen=True)
class CostSplit:
    """An assignment of a global batch's samples to ranks and its predicted times.

    Args:
        ranks: ``(m,)`` the rank of each sample, indexed like the batch.
        rank_times: ``(n,)`` each rank's predicted time.
        step_time: the slowest rank's predicted time.

    """

    ranks: np.ndarray
    rank_times: np.ndarray
    step_time: float


def _vector(value: ArrayLike, name: str, length: int | None = None) -> np.ndarray:
    array = np.asarray(value, dtype=np.float64)
    if array.ndim != 1 or (length is not None and array.shape[0] != length):
        expected = f"shape ({length},)" if length is not None else "a 1-d sequence"
        raise ValueError(f"`{name}` must be {expected}, got shape {array.shape}.")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError(f"`{name}` must be finite and non-negative, got {array.tolist()[:8]}...")
    return array


def _work(
    costs: ArrayLike,
    fixed: ArrayLike,
    per_cost: ArrayLike,
    squares: ArrayLike | None,
    per_square: ArrayLike | None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(fixed, work)``: validated rank offsets ``(n,)`` and the ``(m, n)`` time of each sample on each rank."""
    c = _vector(costs, "costs")
    a = _vector(per_cost, "per_cost")
    f = _vector(fixed, "fixed", len(a))
    if len(a) == 0:
        raise ValueError("`per_cost` must name at least one rank.")
    work = c[:, None] * a[None, :]
    if per_square is not None:
        q = _vector(c**2 if squares is None else squares, "squares", len(c))
        work = work + q[:, None] * _vector(per_square, "per_square", len(a))[None, :]
    elif squares is not None:
        raise ValueError("`squares` was given without `per_square`; give each rank's time per unit of it.")
    return f, work


def _times(fixed: np.ndarray, work: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Rank times recomputed from scratch, each rank's samples summed in batch order (the same on every rank)."""
    return fixed + np.bincount(ranks, weights=work[np.arange(len(ranks)), ranks], minlength=len(fixed))


def _decreasing_work(work: np.ndarray) -> np.ndarray:
    """Sample positions by total work over the ranks, largest first, ties by position.

    The totals are summed one rank at a time (elementwise adds), not by a reduction whose order may follow the CPU's
    vector width: ranks on different machines must order the samples alike.
    """
    total = work[:, 0].copy()
    for r in range(1, work.shape[1]):
        total += work[:, r]
    return np.lexsort((np.arange(len(total)), -total))


def _subset_sums(values: np.ndarray) -> np.ndarray:
    """The sum of every subset of ``values`` (bit ``i`` of a subset's index: item ``i`` is in it), each added item by
    item in index order, as a loop over the items would (a BLAS product may round differently per machine).

    Built by doubling: the subsets holding item ``i`` are those without it plus ``values[i]``, so ``2**k`` additions in
    all, not ``k * 2**k``.
    """
    sums = np.zeros(1)
    for value in values.tolist():
        sums = np.concatenate((sums, sums + value))
    return sums


def predicted_times(
    ranks: ArrayLike,
    costs: ArrayLike,
    fixed: ArrayLike,
    per_cost: ArrayLike,
    squares: ArrayLike | None = None,
    per_square: ArrayLike | None = None,
) -> np.ndarray:
    """Each rank's predicted time for the assignment ``ranks`` (the rank of each sample); arguments as in
    :func:`split_by_cost`."""
    f, work = _work(costs, fixed, per_cost, squares, per_square)
    r = np.asarray(ranks, dtype=np.int64)
    if r.shape != (work.shape[0],) or np.any(r < 0) or np.any(r >= len(f)):
        raise ValueError(f"`ranks` must give each of the {work.shape[0]} samples a rank in [0, {len(f)}).")
    return _times(f, work, r)


def _greedy(fixed: np.ndarray, work: np.ndarray) -> np.ndarray:
    """Largest work first onto the rank whose finish would be earliest (ties: lowest rank), then empty ranks filled.

    Samples with equal work rows (equal costs) are placed together: handing them out one at a time to the earliest
    finish is water-filling, so the group's placements are its ``g`` smallest candidate finishes
    ``load_r + j * work_r`` (``j = 1..g``), taken in order with ties to the lowest rank, exactly as the one-by-one
    loop would take them, without a Python step per sample.
    """
    m, n = work.shape
    order = _decreasing_work(work)
    ranks = np.empty(m, dtype=np.int64)
    loads = fixed.copy()
    rows = work[order]
    # where the sorted work rows change: each run of equal rows is one group
    breaks = np.flatnonzero(np.any(rows[1:] != rows[:-1], axis=1)) + 1
    steps, rank_ids = np.arange(1, m + 1, dtype=np.float64), np.arange(n)
    for start, stop in zip(np.r_[0, breaks].tolist(), np.r_[breaks, m].tolist(), strict=True):
        g, row = stop - start, rows[start]
        if g == 1:
            r = int(np.argmin(loads + row))
            ranks[order[start]] = r
            loads[r] += row[r]
            continue
        finish = loads[:, None] + row[:, None] * steps[None, :g]  # (n, g): rank r's finish after j more samples
        level = np.partition(finish.reshape(-1), g - 1)[g - 1]  # the g-th smallest finish
        per_rank = np.count_nonzero(finish < level, axis=1)
        short = g - int(per_rank.sum())
        if short:  # ties at the level go to the lowest ranks (rank-major order), as one at a time would
            at = np.flatnonzero(finish.reshape(-1) == level)[:short] // g
            per_rank += np.bincount(at, minlength=n)
        ranks[order[start:stop]] = np.repeat(rank_ids, per_rank)
        loads += row * per_rank  # + 0.0 leaves a rank that took none exactly as it was
    return _fill_empty(work, ranks, n)


def _fill_empty(work: np.ndarray, ranks: np.ndarray, n: int) -> np.ndarray:
    """Give each empty rank (lowest first) the sample that costs it least among ranks holding two or more."""
    counts = np.bincount(ranks, minlength=n)
    for e in np.flatnonzero(counts == 0):
        spare = np.flatnonzero(counts[ranks] > 1)
        s = int(spare[np.argmin(work[spare, e])])
        counts[ranks[s]] -= 1
        counts[e] += 1
        ranks[s] = e
    return ranks


def _improve(fixed: np.ndarray, work: np.ndarray, ranks: np.ndarray, max_rounds: int) -> np.ndarray:
    """Move or swap samples off the slowest rank while that lowers its time below where it was."""
    n = len(fixed)
    times = _times(fixed, work, ranks)
    counts = np.bincount(ranks, minlength=n)
    for _ in range(max_rounds):
        k = int(np.argmax(times))
        top = times[k]
        members = np.flatnonzero(ranks == k)
        others = np.flatnonzero(ranks != k)
        best, change = top * (1.0 - _RELATIVE_GAIN), None
        if counts[k] > 1:  # a move may not empty the slowest rank
            moved = np.maximum((top - work[members, k])[:, None], times[None, :] + work[members])
            moved[:, k] = np.inf
            i, r = np.unravel_index(int(np.argmin(moved)), moved.shape)
            if moved[i, r] < best:
                best, change = moved[i, r], (int(members[i]), None, int(r))
        # swap partners: the samples of the few least loaded ranks (the only ones likely to take more)
        partners = np.zeros(n, dtype=bool)
        partners[np.lexsort((np.arange(n), times))[:_SWAP_RANKS]] = True
        others = others[partners[ranks[others]]]
        if len(others):
            owner = ranks[others]
            into_k = top - work[members, k][:, None] + work[others, k][None, :]
            into_other = (times[owner] - work[others, owner])[None, :] + work[np.ix_(members, owner)]
            swapped = np.maximum(into_k, into_other)
            i, j = np.unravel_index(int(np.argmin(swapped)), swapped.shape)
            if swapped[i, j] < best:
                best, change = swapped[i, j], (int(members[i]), int(others[j]), int(owner[j]))
        if change is None:
            repartition = _repartition(fixed, work, ranks, k, times)
            if repartition is None:
                break
            pool, keep, r = repartition
            ranks[pool] = np.where(keep, k, r)
            counts, times = np.bincount(ranks, minlength=n), _times(fixed, work, ranks)
            continue
        s, u, r = change
        ranks[s] = r
        if u is not None:
            ranks[u] = k
        else:
            counts[k] -= 1
            counts[r] += 1
        times = _times(fixed, work, ranks)
    return ranks


def _repartition(
    fixed: np.ndarray, work: np.ndarray, ranks: np.ndarray, k: int, times: np.ndarray
) -> tuple[np.ndarray, np.ndarray, int] | None:
    """The best split of the slowest rank's samples and one other rank's, exhaustively where the two hold few
    (a neighbourhood that moves and swaps of one sample cannot reach); the first rank, least loaded first, whose pair
    split lowers the slowest time wins."""
    top, counts = times[k], np.bincount(ranks, minlength=len(fixed))
    small = counts + counts[k] <= _PAIR_POOL
    small[k] = False
    for r in np.flatnonzero(small)[np.lexsort((np.flatnonzero(small), times[small]))].tolist():
        pool = np.flatnonzero((ranks == k) | (ranks == r))
        # subset j of the pool stays on k; its complement, subset 2**len(pool) - 1 - j, goes to r
        pair = np.maximum(fixed[k] + _subset_sums(work[pool, k]), fixed[r] + _subset_sums(work[pool, r])[::-1])
        pair[[0, -1]] = np.inf  # neither rank may be left empty
        best = int(np.argmin(pair))
        if pair[best] < top * (1.0 - _RELATIVE_GAIN):
            return pool, (best >> np.arange(len(pool))) & 1 == 1, r
    return None


def _exact(fixed: np.ndarray, work: np.ndarray, incumbent: np.ndarray, node_budget: int) -> np.ndarray:
    """Depth-first branch and bound over the samples in decreasing work, each tried on its ranks in order of finish;
    a branch ends as soon as one rank reaches the best time found. Exact when it ends within ``node_budget`` nodes,
    otherwise the best assignment found (never worse than ``incumbent``)."""
    m, n = work.shape
    order = _decreasing_work(work).tolist()
    rows = work[order].tolist()
    loads, counts = fixed.tolist(), [0] * n
    best = [float(_times(fixed, work, incumbent).max()) * (1.0 - _RELATIVE_GAIN), None]
    chosen, nodes = [0] * m, [0]

    def place(i: int, empties: int) -> None:
        if i == m:
            best[0], best[1] = max(loads), list(chosen)
            return
        for finish, r in sorted((loads[r] + rows[i][r], r) for r in range(n)):
            if finish >= best[0] or nodes[0] >= node_budget:
                return  # later ranks finish no earlier
            if m - i <= empties and counts[r]:
                continue  # as many samples left as empty ranks: they must go there
            nodes[0] += 1
            previous, loads[r], chosen[i] = loads[r], finish, r
            counts[r] += 1
            place(i + 1, empties - (counts[r] == 1))
            counts[r] -= 1
            loads[r] = previous

    place(0, n)
    if best[1] is None:
        return incumbent
    ranks = np.empty(m, dtype=np.int64)
    ranks[order] = best[1]
    return ranks


def split_by_cost(
    costs: ArrayLike,
    fixed: ArrayLike,
    per_cost: ArrayLike,
    squares: ArrayLike | None = None,
    per_square: ArrayLike | None = None,
    max_rounds: int = 1000,
    exact_samples: int = _EXACT_SAMPLES,
) -> CostSplit:
    """Assign a global batch's samples to ranks minimising the predicted step time ``max_r t_r``.

    Args:
        costs: ``(m,)`` each sample's cost, e.g. its token count.
        fixed: ``(n,)`` each rank's time independent of its samples.
        per_cost: ``(n,)`` each rank's time per unit of cost.
        squares: ``(m,)`` each sample's second cost; default ``costs ** 2`` when ``per_square`` is given.
        per_square: ``(n,)`` each rank's time per unit of the second cost (attention's quadratic term), or None.
        max_rounds: at most this many local-search changes (each lowers the step time or a tie at it).
        exact_samples: batches of at most this many samples are then solved exactly by branch and bound (within a
            fixed node budget, so the same on every rank); 0 keeps the greedy and local search alone.

    Returns:
        The assignment; every rank holds at least one sample.

    Raises:
        ValueError: on malformed or negative inputs, or a batch with fewer samples than ranks.

    """
    f, work = _work(costs, fixed, per_cost, squares, per_square)
    m, n = work.shape
    if m < n:
        raise ValueError(
            f"The batch has {m} samples for {n} ranks; every rank needs at least one sample per step."
            " Use a larger global batch (or fold the last one into the previous batch, as the sampler does)."
        )
    ranks = _improve(f, work, _greedy(f, work), max_rounds)
    if m <= exact_samples:
        ranks = _exact(f, work, ranks, _EXACT_NODES)
    times = _times(f, work, ranks)
    return CostSplit(ranks, times, float(times.max()))


def _fractional_level(total: float, fixed: np.ndarray, rate: np.ndarray) -> float:
    """The smallest ``T`` with ``sum_r max(0, T - fixed_r) / rate_r >= total`` (rates > 0)."""
    order = np.argsort(fixed, kind="stable")
    f, inverse = fixed[order], 1.0 / rate[order]
    level = f[0]
    for j in range(len(f)):  # ranks join in order of their fixed time; the level is piecewise linear in between
        level = (total + np.dot(f[: j + 1], inverse[: j + 1])) / inverse[: j + 1].sum()
        if j + 1 == len(f) or level <= f[j + 1]:
            break
    return float(level)


def lower_bound(
    costs: ArrayLike,
    fixed: ArrayLike,
    per_cost: ArrayLike,
    squares: ArrayLike | None = None,
    per_square: ArrayLike | None = None,
) -> float:
    """A step time no assignment can beat: a certificate of how near :func:`split_by_cost` is to the optimum.

    The largest of: the fractional optimum (samples split like a fluid, each rank running at its own rate per unit of
    ``c + lam * q``, taking the best ``lam`` among the ranks' ratios ``per_square / per_cost``), the largest sample on
    its best rank, and every rank's fixed time plus its cheapest sample (no rank stays empty).
    """
    f, work = _work(costs, fixed, per_cost, squares, per_square)
    c = np.asarray(costs, dtype=np.float64)
    a = np.asarray(per_cost, dtype=np.float64)
    bounds = [float((f[None, :] + work).min(axis=1).max()), float((f + work.min(axis=0)).max())]
    if per_square is None:
        lams, q, b = [0.0], np.zeros_like(c), np.zeros_like(a)
    else:
        q = c**2 if squares is None else np.asarray(squares, dtype=np.float64)
        b = np.asarray(per_square, dtype=np.float64)
        lams = sorted({float(br / ar) for ar, br in zip(a, b, strict=True) if ar > 0})
    for lam in lams:
        # a rank's time per unit of c + lam * q is at least min(a_r, b_r / lam)
        rate = a if lam == 0 else np.minimum(a, b / lam)
        if np.all(rate > 0):
            bounds.append(_fractional_level(float(c.sum() + lam * q.sum()), f, rate))
    return max(bounds)
