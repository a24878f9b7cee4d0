"""Cost-aware splitting of a global batch: optimality against brute force, coverage, determinism, non-empty ranks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from lightning_cannikin.core.cost_split import CostSplit, lower_bound, predicted_times, split_by_cost
from lightning_cannikin.core.optperf import optimal_split


def _indices(split: CostSplit, rank: int) -> np.ndarray:
    """Positions (into the batch) of ``rank``'s samples, in batch order."""
    return np.flatnonzero(split.ranks == rank)


def _counts(split: CostSplit) -> tuple[int, ...]:
    """Samples on each rank."""
    return tuple(int(c) for c in np.bincount(split.ranks, minlength=len(split.rank_times)))


def _brute_force(costs, fixed, per_cost, squares=None, per_square=None) -> float:
    """The best step time over every assignment that leaves no rank empty (written independently of the module)."""
    n = len(fixed)
    work = np.outer(costs, per_cost)
    if per_square is not None:
        work = work + np.outer(squares, per_square)
    best = np.inf
    for assignment in itertools.product(range(n), repeat=len(costs)):
        if len(set(assignment)) < n:
            continue
        loads = list(fixed)
        for s, r in enumerate(assignment):
            loads[r] += work[s, r]
        best = min(best, max(loads))
    return best


def _case(rng: np.random.Generator, m: int, n: int = 3, quadratic: bool = False):
    """Lengths varying at least 4x within the batch, heterogeneous random rank models."""
    low = int(rng.integers(2, 20))
    costs = rng.integers(low, 8 * low + 1, size=m).astype(float)
    costs[:2] = [low, 4 * low]  # the spread is at least 4x
    rng.shuffle(costs)
    fixed, per_cost = rng.uniform(0.0, 2.0, n), rng.uniform(0.005, 0.05, n)
    squares, per_square = (costs**2, rng.uniform(0.0, 0.002, n)) if quadratic else (None, None)
    return costs, fixed, per_cost, squares, per_square


def _sample_count_split(costs, fixed, per_cost, squares, per_square) -> np.ndarray:
    """Today's balancing: OptPerf counts from the per-sample model at the batch's mean cost, contiguous slices."""
    per_sample = per_cost * costs.mean() + (0.0 if per_square is None else per_square * squares.mean())
    counts = optimal_split(per_sample, fixed, len(costs)).local_batch_sizes
    return np.repeat(np.arange(len(fixed)), counts)


@pytest.mark.parametrize("quadratic", [False, True])
def test_within_five_percent_of_brute_force_and_better_than_sample_counts(quadratic):
    rng = np.random.default_rng(7 if quadratic else 3)
    ratios, count_ratios = [], []
    for _ in range(60):
        case = _case(rng, int(rng.integers(3, 9)), quadratic=quadratic)
        best = _brute_force(*case)
        split = split_by_cost(*case)
        ratios.append(split.step_time / best)
        count_ratios.append(predicted_times(_sample_count_split(*case), *case).max() / best)
        assert split.step_time >= lower_bound(*case) * (1 - 1e-12)
    assert max(ratios) <= 1.05, max(ratios)
    # sample-count balancing is never better and clearly worse on typical batches
    assert min(c / r for c, r in zip(count_ratios, ratios, strict=True)) >= 1 - 1e-9
    assert np.median(count_ratios) > np.median(ratios) + 0.05


@pytest.mark.parametrize("m, n", [(40, 3), (300, 7), (1024, 64)])
def test_every_sample_once_non_empty_ranks_and_near_the_lower_bound(m, n):
    rng = np.random.default_rng(m)
    costs = rng.integers(3, 60, size=m).astype(float)
    fixed, per_cost = rng.uniform(0.5, 2.0, n), np.resize([0.01, 0.02, 0.04], n)
    split = split_by_cost(costs, fixed, per_cost)
    assert split.ranks.shape == (m,)
    assert sorted(np.concatenate([_indices(split, r) for r in range(n)]).tolist()) == list(range(m))
    assert min(_counts(split)) >= 1 and sum(_counts(split)) == m
    np.testing.assert_allclose(split.rank_times, predicted_times(split.ranks, costs, fixed, per_cost))
    # a posteriori certificate: the fractional optimum cannot be beaten, and the split is within 2% of it
    assert split.step_time <= 1.02 * lower_bound(costs, fixed, per_cost)


def test_a_rank_too_slow_to_be_worth_a_sample_still_gets_one():
    costs = np.array([50.0, 40.0, 30.0, 20.0, 10.0, 5.0])
    fixed, per_cost = np.array([0.0, 0.0, 100.0]), np.array([0.01, 0.01, 0.01])
    split = split_by_cost(costs, fixed, per_cost)
    assert _counts(split)[2] == 1
    assert _indices(split, 2).tolist() == [5]  # the cheapest sample
    assert split.step_time == pytest.approx(_brute_force(costs, fixed, per_cost))


def test_deterministic_and_independent_of_array_types():
    rng = np.random.default_rng(0)
    costs = rng.integers(1, 9, size=200)  # many equal costs: ties everywhere
    fixed, per_cost = [1.0, 1.0, 2.0, 0.5], [0.02, 0.02, 0.01, 0.04]
    first = split_by_cost(costs, fixed, per_cost)
    again = split_by_cost(costs.tolist(), tuple(fixed), np.array(per_cost))
    assert np.array_equal(first.ranks, again.ranks)
    assert first.step_time == again.step_time


def test_equal_costs_on_identical_ranks_split_evenly():
    split = split_by_cost(np.full(10, 7.0), np.zeros(3), np.full(3, 0.1))
    assert sorted(_counts(split)) == [3, 3, 4]


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="at least one sample"):
        split_by_cost([1.0, 2.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="`per_cost`"):
        split_by_cost([1.0, 2.0], [0.0], [-1.0])
    with pytest.raises(ValueError, match="`fixed`"):
        split_by_cost([1.0, 2.0], [0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="`per_square`"):
        split_by_cost([1.0, 2.0], [0.0], [1.0], squares=[1.0, 4.0])
    with pytest.raises(ValueError, match="`costs`"):
        split_by_cost([1.0, np.nan], [0.0], [1.0])


def test_local_search_alone_is_near_the_optimum_on_most_small_cases():
    """Without the exact search (what large batches get), the greedy and local search still find the optimum or come
    within 5% of it on nearly every small case."""
    rng = np.random.default_rng(11)
    ratios = []
    for _ in range(80):
        case = _case(rng, int(rng.integers(4, 9)), quadratic=bool(rng.random() < 0.3))
        ratios.append(split_by_cost(*case, exact_samples=0).step_time / _brute_force(*case))
    ratios = np.array(ratios)
    assert np.median(ratios) <= 1 + 1e-9
    assert np.mean(ratios <= 1.05) >= 0.95


def test_subset_sums_equal_an_item_by_item_loop_bit_for_bit():
    # the pair re-split compares these sums on every rank: each must be the in-order sum of its subset's items exactly
    from lightning_cannikin.core.cost_split import _subset_sums

    values = np.random.default_rng(3).uniform(0.0, 1.0, 9) * 10.0 ** np.arange(-4, 5)  # rounding shows at any order
    sums = _subset_sums(values)
    assert sums.shape == (2**9,)
    for index in range(2**9):
        expected = 0.0
        for i, value in enumerate(values.tolist()):
            if index >> i & 1:
                expected += value
        assert sums[index] == expected
