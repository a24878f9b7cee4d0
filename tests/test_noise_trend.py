"""The straight-line fit that reads a drifting average now (``lightning_cannikin/core/noise_trend.py``): its sums
against a weighted least-squares fit written out with numpy from explicit weights and ages."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_cannikin.core.noise_trend import TrendFit


def _feed(values: np.ndarray, steps: np.ndarray, decay: float) -> tuple[TrendFit, list[float], list[list[float]]]:
    """A fit fed as the estimator feeds it (``values``: updates x values; ``steps``: base batches each update
    stands for), with the caller's sums ``sum w x`` and ``sum w x y`` kept beside it."""
    count = values.shape[1]
    fit, sums, products = TrendFit(count), [0.0] * count, [[0.0] * count for _ in range(count)]
    for row, step in zip(values, steps, strict=True):
        factor = decay**step
        fit.update(factor, float(step), sums)
        sums = [factor * total + (1.0 - factor) * x for total, x in zip(sums, row, strict=True)]
        products = [
            [factor * products[i][j] + (1.0 - factor) * row[i] * row[j] for j in range(count)] for i in range(count)
        ]
    return fit, sums, products


def _explicit(values: np.ndarray, steps: np.ndarray, decay: float):
    """Every update's weight and age written out, and the weighted least-squares fit of ``x = level + slope * age``."""
    factors = decay**steps
    weights = (1.0 - factors) * np.r_[np.cumprod(factors[::-1])[::-1][1:], 1.0]  # later updates' decay applies
    ages = np.r_[np.cumsum(steps[::-1])[::-1][1:], 0.0]  # base batches since each update, the newest at 0
    design = np.c_[np.ones_like(ages), ages]
    normal = design.T @ (weights[:, None] * design)
    coefficients = np.linalg.solve(normal, design.T @ (weights[:, None] * values))
    readout = np.linalg.solve(normal, [1.0, 0.0]) @ (design.T * weights)  # the levels' coefficients on the updates
    residuals = values - design @ coefficients
    hat = np.trace(np.linalg.solve(normal, design.T @ (weights[:, None] ** 2 * design)))
    covariance = (residuals.T @ (weights[:, None] * residuals)) / (weights.sum() - hat)
    return coefficients[0], float(readout @ readout), covariance, weights.sum() ** 2 / (weights**2).sum()


def test_a_straight_line_is_read_exactly_now_with_no_residual() -> None:
    # uneven updates (a measurement standing for 1 to 16 base batches), the decay of the run's window: the fit reads
    # a drifting value at its current value from the third update on, where the average lags it
    rng = np.random.default_rng(0)
    steps = rng.integers(1, 17, size=300).astype(float)
    times = np.cumsum(steps)
    values = np.c_[3.0 + 0.01 * times, 40.0 - 0.002 * times]
    fit, sums, products = _feed(values, steps, 0.999)
    present = fit.present(sums, products)
    assert present is not None
    np.testing.assert_allclose(present.values, values[-1], rtol=1e-9)
    np.testing.assert_allclose(present.covariance, 0.0, atol=1e-6 * float(np.abs(values).max()) ** 2)
    average = np.asarray(sums) / (1.0 - np.prod(0.999**steps))
    assert average[0] < 0.9 * values[-1][0], "the average lags the rise, or the test shows nothing"


@pytest.mark.parametrize("decay, updates", [(0.999, 40), (0.999, 3000), (0.99, 500)])
def test_the_fit_matches_weighted_least_squares_written_out(decay: float, updates: int) -> None:
    rng = np.random.default_rng(updates)
    steps = rng.integers(1, 9, size=updates).astype(float)
    values = rng.standard_normal((updates, 2)) @ np.array([[1.0, 0.4], [0.0, 2.0]]) + [5.0, -1.0]
    fit, sums, products = _feed(values, steps, decay)
    present = fit.present(sums, products)
    level, squares, covariance, count = _explicit(values, steps, decay)
    assert present is not None
    np.testing.assert_allclose(present.values, level, rtol=1e-7, atol=1e-9)
    assert math.isclose(present.squares, squares, rel_tol=1e-6)
    np.testing.assert_allclose(present.covariance, covariance, rtol=1e-6)
    assert math.isclose(present.count, count, rel_tol=1e-9)


def test_the_readings_are_the_same_whatever_the_weights_scale() -> None:
    # a restart takes over the recent window's sums scaled: the readings, their coefficients and the spread stay
    rng = np.random.default_rng(3)
    steps, values = np.ones(200), rng.standard_normal((200, 2))
    fit, sums, products = _feed(values, steps, 0.99)
    before = fit.present(sums, products)
    scaled = TrendFit(2)
    scaled.copy_from(fit, 0.25)
    after = scaled.present([0.25 * s for s in sums], [[0.25 * p for p in row] for row in products])
    assert before is not None and after is not None
    np.testing.assert_allclose(after.values, before.values, rtol=1e-12)
    assert math.isclose(after.squares, before.squares, rel_tol=1e-12)
    np.testing.assert_allclose(after.covariance, before.covariance, rtol=1e-9)


def test_one_age_tells_no_slope_and_the_state_round_trips() -> None:
    fit, sums, products = _feed(np.array([[1.0, 2.0]]), np.ones(1), 0.999)
    assert fit.present(sums, products) is None
    with pytest.raises(ValueError, match="old_sums"):
        fit.update(0.9, 1.0, [0.0])
    fit, sums, products = _feed(np.random.default_rng(1).standard_normal((50, 2)), np.ones(50), 0.99)
    restored = TrendFit(2)
    restored.load_state_dict(fit.state_dict())
    assert restored.present(sums, products) == fit.present(sums, products)
