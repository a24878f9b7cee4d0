"""OptPerf planner: exactness against brute force and the greedy heap, closed form, bounds, errors and speed."""

from __future__ import annotations

import heapq
import itertools
import time
from pathlib import Path

import numpy as np
import pytest

from lightning_cannikin.core.optperf import Split, most_even_split, optimal_split, optperf, step_time
from lightning_cannikin.core.plan import even_split, proportional_sizes


def proportional_split(slopes, total: int) -> tuple[int, ...]:
    """The naive heterogeneity-aware baseline: ``b_i`` proportional to speed ``1 / a_i``, ignoring intercepts."""
    return proportional_sizes(total, [1.0 / float(a) for a in slopes])


def closed_form_step_time(slopes: np.ndarray, offsets: np.ndarray, total: float) -> float:
    """Continuous optimum ``T* = (B + sum a0_i / a_i) / sum(1 / a_i)``: one affine piece per device, no caps."""
    return float((total + np.sum(offsets / slopes)) / np.sum(1.0 / slopes))


REPO = Path(__file__).resolve().parents[1]


def _g(slopes: np.ndarray, offsets: np.ndarray, i: int, b: int) -> float:
    """The reference device time, written independently of the planner (same float operations)."""
    return max(float(s) * b + float(o) for s, o in zip(slopes[i], offsets[i], strict=True))


def _brute_force(slopes, offsets, total, lower, upper) -> float:
    n = len(lower)
    best = np.inf
    ranges = [range(int(lower[i]), int(min(upper[i], total)) + 1) for i in range(n)]
    for combo in itertools.product(*ranges):
        if sum(combo) == total:
            best = min(best, max(_g(slopes, offsets, i, b) for i, b in enumerate(combo)))
    return best


def _greedy_heap(slopes, offsets, total, lower, upper) -> tuple[int, ...]:
    """The textbook water-filling: one sample at a time to the smallest g_i(b_i + 1), lowest index on ties."""
    sizes = [int(v) for v in lower]
    cap = [int(min(u, total)) for u in upper]
    heap = [(_g(slopes, offsets, i, b + 1), i) for i, b in enumerate(sizes) if b < cap[i]]
    heapq.heapify(heap)
    for _ in range(total - sum(sizes)):
        _, i = heapq.heappop(heap)
        sizes[i] += 1
        if sizes[i] < cap[i]:
            heapq.heappush(heap, (_g(slopes, offsets, i, sizes[i] + 1), i))
    return tuple(sizes)


def _random_instance(rng: np.random.Generator):
    n = int(rng.integers(2, 5))
    k = int(rng.integers(1, 3))
    if rng.random() < 0.5:
        # Small rationals make exact ties between devices common, which is where tie-breaking bugs hide.
        slopes = rng.choice([0.0, 0.5, 1.0, 2.0, 3.0], size=(n, k))
        offsets = rng.choice([-1.0, 0.0, 0.5, 1.0, 2.0, 4.0], size=(n, k))
    else:
        slopes = rng.uniform(0.0, 3.0, size=(n, k))
        offsets = rng.uniform(-1.0, 5.0, size=(n, k))
    slopes[:, 0] = np.maximum(slopes[:, 0], 0.25)  # every device has one sloped piece
    lower = rng.integers(0, 4, size=n)
    upper = lower + rng.integers(0, 12, size=n)
    total = int(rng.integers(int(lower.sum()), int(min(upper.sum(), 24)) + 1)) if lower.sum() <= 24 else 24
    return slopes, offsets, total, lower, upper


def test_matches_brute_force_and_greedy_heap():
    rng = np.random.default_rng(20240207)
    checked = 0
    while checked < 250:
        slopes, offsets, total, lower, upper = _random_instance(rng)
        if not lower.sum() <= total <= upper.sum():
            continue
        use_upper = rng.random() < 0.8  # sometimes no caps at all
        caps = upper if use_upper else np.full(len(lower), total)
        split = optimal_split(slopes, offsets, total, lower, upper if use_upper else None)
        expected = _brute_force(slopes, offsets, total, lower, caps)
        assert split.step_time == pytest.approx(expected, rel=1e-12, abs=1e-12)
        sizes = split.local_batch_sizes
        assert sum(sizes) == total
        assert all(lo <= b <= hi for lo, b, hi in zip(lower, sizes, caps, strict=True))
        assert max(_g(slopes, offsets, i, b) for i, b in enumerate(sizes)) == split.step_time
        # Exact tie semantics: the same split the one-unit-at-a-time heap produces.
        assert sizes == _greedy_heap(slopes, offsets, total, lower, caps)
        assert optperf(slopes, offsets, [total], lower, upper if use_upper else None)[0] == split.step_time
        checked += 1


def test_slope_zero_pieces_are_floors():
    # Device 1 costs a constant 5 s up to b = 4 (all-reduce floor), then 1 s per sample.
    slopes = [[1.0, 0.0], [1.0, 0.0]]
    offsets = [[0.0, 0.0], [1.0, 5.0]]
    # Device 1 holds 4 samples for the price of its floor; device 0 takes the rest up to the same 5 s.
    assert optimal_split(slopes, offsets, 9) == Split((5, 4), 5.0)
    # One more sample: both devices' next unit costs 6, and the lower rank gets it.
    assert optimal_split(slopes, offsets, 10) == Split((6, 4), 6.0)
    # A device that is nothing but a floor takes everything the others cannot hold cheaper.
    split = optimal_split([[2.0], [0.0]], [[0.0], [3.0]], 7)
    assert split == Split((1, 6), 3.0)
    with pytest.raises(ValueError, match="`slopes`"):
        optimal_split([-1.0, 1.0], [0.0, 0.0], 4)


@pytest.mark.parametrize("seed", range(5))
def test_closed_form_bounds_the_integer_optimum(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 64))
    slopes = rng.uniform(0.5e-3, 5e-3, n)
    offsets = rng.uniform(0.0, 0.05, n)
    for total in (n * 64, n * 500 + 7, n * 4096 + 1):
        continuous = closed_form_step_time(slopes, offsets, total)
        # The continuous optimum gives every device b >= 1 at these sizes, so no bound binds.
        assert np.all((continuous - offsets) / slopes >= 1)
        split = optimal_split(slopes, offsets, total)
        assert continuous <= split.step_time <= continuous + slopes.max()


def test_monotone_in_total_batch_size():
    rng = np.random.default_rng(7)
    slopes = np.stack([rng.uniform(1, 4, 6), rng.uniform(0.2, 1, 6)], axis=1)
    offsets = np.stack([rng.uniform(0, 3, 6), rng.uniform(2, 20, 6)], axis=1)
    upper = rng.integers(10, 60, 6)
    totals = np.arange(0, int(upper.sum()) + 5)
    times = optperf(slopes, offsets, totals, lower=1, upper=upper)
    feasible = (totals >= 6) & (totals <= upper.sum())
    assert np.all(np.isinf(times[~feasible]))
    assert np.all(np.diff(times[feasible]) >= 0)
    assert np.isfinite(times[feasible]).all()


def test_binding_bounds_are_respected():
    # Device 0 is ten times faster but can only hold 10 samples (a memory cap); device 2 must take 30.
    slopes = [0.1, 1.0, 1.0]
    offsets = [0.0, 0.0, 0.0]
    split = optimal_split(slopes, offsets, 60, lower=[1, 1, 30], upper=[10, 100, 100])
    assert split == Split((10, 20, 30), 30.0)
    assert optperf(slopes, offsets, 60, lower=[1, 1, 30], upper=[10, 100, 100]) == 30.0
    # Caps alone: the fast device is full and the other two share the rest evenly.
    assert optimal_split(slopes, offsets, 60, upper=[10, 100, 100]) == Split((10, 25, 25), 25.0)
    # Unbounded, the fast device would take most of the batch.
    assert optimal_split(slopes, offsets, 60).local_batch_sizes[0] > 40


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"total_batch_size": 2}, "lower"),  # three devices need at least 1 each
        ({"total_batch_size": 31, "upper": 10}, "upper"),
        ({"total_batch_size": 9, "lower": [1, 5, 1], "upper": [9, 4, 9]}, "lower` exceeds `upper"),
        ({"total_batch_size": 9, "lower": [1, 1]}, "lower"),
        ({"total_batch_size": 9, "lower": -1}, "lower"),
        ({"total_batch_size": 9, "upper": [3.5, 9, 9]}, "upper"),
        ({"total_batch_size": 9.5}, "total_batch_size"),
        ({"slopes": [1.0, -0.5, 1.0]}, "slopes"),
        ({"slopes": [1.0, np.nan, 1.0]}, "slopes"),
        ({"offsets": [0.0, np.inf, 0.0]}, "offsets"),
        ({"offsets": [[0.0, 1.0]] * 3}, "same shape"),
        ({"slopes": [], "offsets": []}, "slopes"),
    ],
)
def test_invalid_inputs_raise_naming_the_parameter(kwargs, match):
    args = {"slopes": [1.0, 2.0, 3.0], "offsets": [0.0, 0.0, 0.0], "total_batch_size": 9, **kwargs}
    with pytest.raises(ValueError, match=match):
        optimal_split(**args)


def test_optperf_marks_infeasible_candidates_inf_but_rejects_bad_models():
    times = optperf([1.0, 1.0], [0.0, 0.0], [-3, 0, 1, 2, 3, 20, 21], upper=10)
    assert np.isinf(times[[0, 1, 2, 6]]).all()
    np.testing.assert_array_equal(times[[3, 4, 5]], [1.0, 2.0, 10.0])
    with pytest.raises(ValueError, match="slopes"):
        optperf([1.0, -1.0], [0.0, 0.0], [4])
    assert optperf([1.0, 2.0], [0.0, 0.0], np.array([[4, 6], [8, 10]])).shape == (2, 2)


def test_ties_are_deterministic_and_favour_low_ranks():
    # Identical devices: plain DDP's split, remainder on the lowest ranks.
    for total in (8, 9, 11, 15):
        split = optimal_split([2.0] * 4, [1.0] * 4, total)
        assert split.local_batch_sizes == even_split(total, 4)
    # Two devices that tie on every unit: the lower rank always gets the odd sample, on every call.
    results = {optimal_split([[1.0, 0.0]] * 2, [[0.0, 3.0]] * 2, 9).local_batch_sizes for _ in range(5)}
    assert results == {(5, 4)}


def test_optperf_equals_optimal_split_per_candidate():
    rng = np.random.default_rng(11)
    n = 16
    slopes = np.stack([rng.uniform(1e-3, 8e-3, n), rng.uniform(3e-4, 3e-3, n)], axis=1)
    offsets = np.stack([rng.uniform(0.01, 0.05, n), rng.uniform(0.05, 0.2, n)], axis=1)
    lower = rng.integers(1, 8, n)
    upper = rng.integers(64, 400, n)
    totals = np.unique(np.geomspace(int(lower.sum()), int(upper.sum()) + 50, 40).astype(int))
    times = optperf(slopes, offsets, totals, lower, upper)
    for total, predicted in zip(totals, times, strict=True):
        if total > upper.sum():
            assert predicted == np.inf
            continue
        split = optimal_split(slopes, offsets, int(total), lower, upper)
        assert predicted == split.step_time
        assert step_time(slopes, offsets, split.local_batch_sizes) == split.step_time


def test_optperf_is_fast_for_1024_devices_and_50_candidates():
    rng = np.random.default_rng(3)
    n = 1024
    # Four GPU generations, a fixed cost per step, and the two-regime model's communication piece.
    a = rng.choice([0.4e-3, 1e-3, 2.5e-3, 6e-3], n) * rng.uniform(0.9, 1.1, n)
    a0 = rng.uniform(0.01, 0.05, n)
    slopes = np.stack([a, a * (1 / 3 + 0.5 * 2 / 3)], axis=1)
    offsets = np.stack([a0 + 0.01, a0 * (1 / 3 + 0.5 * 2 / 3) + 0.08], axis=1)
    totals = np.geomspace(n, 512 * n, 50).astype(int)
    upper = rng.integers(256, 2048, n)
    optperf(slopes, offsets, totals, upper=upper)  # warm-up
    elapsed = []
    for _ in range(3):
        start = time.perf_counter()
        times = optperf(slopes, offsets, totals, upper=upper)
        elapsed.append(time.perf_counter() - start)
    print(f"\noptperf 1024 devices x 50 candidates, K=2, capped: {min(elapsed) * 1e3:.1f} ms")
    assert min(elapsed) < 0.5
    assert np.all(np.diff(times) >= 0)
    # Spot-check one candidate against the exact split to make sure speed did not cost exactness.
    assert times[20] == optimal_split(slopes, offsets, int(totals[20]), upper=upper).step_time


def test_even_split():
    assert even_split(10, 4) == (3, 3, 2, 2)
    assert even_split(8, 4) == (2, 2, 2, 2)
    assert even_split(2, 3) == (1, 1, 0)
    with pytest.raises(ValueError, match="`n`"):
        even_split(4, 0)
    with pytest.raises(ValueError, match="total_batch_size"):
        even_split(-1, 2)


def test_proportional_split():
    assert proportional_split([1.0, 2.0, 4.0], 70) == (40, 20, 10)
    # Ideal 3.6, 3.6, 1.8: the largest remainder gets the first spare sample, the lower of two equal ones the second.
    assert proportional_split([1.0, 1.0, 2.0], 9) == (4, 3, 2)
    # A very slow device still gets one sample, taken from the device furthest above its ideal share (the higher rank
    # of two equal ones, so low ranks keep the remainder as in even_split).
    assert proportional_split([1.0, 1.0, 1000.0], 10) == (5, 4, 1)
    rng = np.random.default_rng(0)
    for _ in range(50):
        slopes = rng.uniform(0.1, 5.0, 7)
        total = int(rng.integers(7, 500))
        sizes = np.array(proportional_split(slopes, total))
        ideal = total * (1 / slopes) / np.sum(1 / slopes)
        assert sizes.sum() == total and sizes.min() >= 1
        if ideal.min() >= 1:
            assert np.all(np.abs(sizes - ideal) < 1)
    with pytest.raises(ValueError, match="weights"):
        proportional_sizes(4, [1.0, 0.0])
    with pytest.raises(ValueError, match="Cannot split 1 samples across 2 ranks"):
        proportional_sizes(1, [1.0, 1.0])


def test_most_even_split_respects_caps():
    assert most_even_split(10, 4).local_batch_sizes == even_split(10, 4)
    # rank 0 is capped below the even share: it keeps its cap, the rest share what is left as evenly as possible
    assert most_even_split(30, 3, upper=[4, 100, 100]).local_batch_sizes == (4, 13, 13)
    assert most_even_split(30, 3, lower=[15, 1, 1]).local_batch_sizes == (15, 8, 7)
    with pytest.raises(ValueError, match="upper"):
        most_even_split(10, 2, upper=[4, 4])


def test_optimal_beats_proportional_and_even_with_intercepts():
    # Intercepts change the optimal ratios with B: the speed-proportional split is not optimal.
    slopes = np.array([1e-3, 2.5e-3, 6e-3])
    offsets = np.array([0.2, 0.02, 0.05])
    total = 300
    best = optimal_split(slopes, offsets, total).step_time
    proportional = step_time(slopes, offsets, proportional_split(slopes, total))
    even = step_time(slopes, offsets, even_split(total, 3))
    assert best < proportional < even
    assert proportional / best > 1.04


def test_step_time():
    assert step_time([[1.0, 0.5]], [[0.0, 2.0]], [3]) == 3.5
    assert step_time([1.0, 2.0], [0.5, 0.0], [3, 1]) == 3.5
    with pytest.raises(ValueError, match="local_batch_sizes"):
        step_time([1.0, 2.0], [0.0, 0.0], [1, 2, 3])
