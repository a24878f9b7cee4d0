"""The overhead benchmark's statistics: the interval it quotes beside a median ratio, and the pooling of saved runs."""

import numpy as np
import pytest

from benchmarks.overhead import median_interval, pooled


def test_the_median_interval_covers_the_true_median_about_as_often_as_it_says() -> None:
    # repeats drawn from a known distribution (median 0): a 95% interval should hold it in about 95% of runs
    rng = np.random.default_rng(1)
    trials = 300
    covered = sum(
        low <= 0.0 <= high
        for low, high in (median_interval(rng.normal(size=41), resamples=2000, seed=trial) for trial in range(trials))
    )
    assert 0.88 <= covered / trials <= 0.99


def test_the_median_interval_narrows_with_more_repeats_and_is_a_point_without_spread() -> None:
    rng = np.random.default_rng(2)
    few, many = median_interval(rng.normal(1.0, 0.1, size=21)), median_interval(rng.normal(1.0, 0.1, size=400))
    assert many[1] - many[0] < 0.5 * (few[1] - few[0])
    assert median_interval([0.94] * 11) == (pytest.approx(0.94), pytest.approx(0.94))
    assert median_interval([0.9, 1.0, 0.95], seed=3) == median_interval([0.9, 1.0, 0.95], seed=3)  # reads the same
    with pytest.raises(ValueError, match="`values` is empty"):
        median_interval([])


def test_pooled_reports_give_the_median_of_every_repeat() -> None:
    first = {"a_vs_ddp": {"ratios": [0.9, 1.0], "cpu_per_sample_ratios": [1.1, 1.0], "vs_fixed_ratios": [0.97, 0.99]}}
    second = {"a_vs_ddp": {"ratios": [0.8, 0.95, 1.1], "cpu_per_sample_ratios": [1.2, 1.0, 0.9]}, "setup": {}}
    result = pooled([first, second])
    assert result["a"]["ratios"]["repeats"] == 5
    assert result["a"]["ratios"]["median"] == pytest.approx(0.95)
    assert result["a"]["vs_fixed_ratios"]["repeats"] == 2  # only the run that had the fixed split
    low, high = result["a"]["ratios"]["ci95"]
    assert 0.8 <= low <= 0.95 <= high <= 1.1
