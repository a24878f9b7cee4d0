from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from numpy.typing import ArrayLike

from lightning_cannikin.core.goodput import (
    ADAPT_MARGIN,
    adascale_gain,
    candidate_batch_sizes,
    efficiency,
    goodput,
)
from lightning_cannikin.core.interval_choice import TotalOptions


# the point rule of one noise scale (the interval rule's at low == high): only these tests call it
@dataclass(frozen=True)
class GoodputChoice:
    """The outcome of :func:`choose_batch_size`.

    Attributes:
        batch_size: the candidate with the highest predicted goodput (the current batch size when there are no
            statistics yet).
        goodput: its predicted goodput.
        current_goodput: the goodput of the current batch size and step time.
        adopted: whether to switch to ``batch_size``: it differs from the current one and beats the current goodput
            by more than the margin.
        current_batch_size: the batch size in force when the choice was made.

    """

    batch_size: int
    goodput: float
    current_goodput: float
    adopted: bool
    current_batch_size: int | None = None

    @property
    def next_batch_size(self) -> int:
        """The batch size to run next: ``batch_size`` if adopted, else the current one."""
        if self.adopted or self.current_batch_size is None:
            return self.batch_size
        return self.current_batch_size


def choose_batch_size(
    candidates: ArrayLike,
    step_times: ArrayLike,
    noise_scale: float | None,
    base_batch_size: float,
    current_batch_size: int,
    current_step_time: float | None,
    margin: float = ADAPT_MARGIN,
) -> GoodputChoice:
    """Pick the goodput-maximising candidate, switching only when it clearly beats the current batch size.

    The margin is hysteresis: predictions are noisy, and flapping between two near-equal batch sizes costs a
    re-plan (and a data loader rebuild) each time for no gain.

    Args:
        candidates: total batch sizes to consider.
        step_times: predicted seconds per step for each candidate (``inf`` marks an infeasible one).
        noise_scale: ``phi`` in samples; None means no statistics yet, and then nothing is adopted.
        base_batch_size: B0.
        current_batch_size: the total batch in force.
        current_step_time: its step time (measured or predicted); None or ``inf`` if unknown, which makes any
            feasible candidate with positive goodput win.
        margin: relative improvement required to switch, >= 0 (AdaptDL uses 0.05).

    Returns:
        A :class:`GoodputChoice`. Among equal goodputs the smallest batch size wins.

    """
    sizes = np.asarray(candidates, dtype=np.int64).reshape(-1)
    times = np.asarray(step_times, dtype=np.float64).reshape(-1)
    if sizes.size == 0:
        raise ValueError("`candidates` must not be empty.")
    if sizes.shape != times.shape:
        raise ValueError(f"Got {sizes.size} candidates but {times.size} step times.")
    if not margin >= 0.0:
        raise ValueError(f"`margin` must be >= 0, got {margin}.")
    current_time = np.inf if current_step_time is None else current_step_time
    if noise_scale is None:
        # Efficiency is unknown, so goodputs of different batch sizes cannot be compared yet.
        current = float(goodput(current_batch_size, current_time, noise_scale, base_batch_size))
        return GoodputChoice(int(current_batch_size), current, current, False, int(current_batch_size))
    phi = np.array([noise_scale], dtype=np.float64)
    size, best, current, adopted = _choices(
        sizes, times, phi, base_batch_size, current_batch_size, current_time, margin
    )
    return GoodputChoice(int(size[0]), float(best[0]), float(current[0]), bool(adopted[0]), int(current_batch_size))


def _choices(
    sizes: np.ndarray,
    times: np.ndarray,
    phis: np.ndarray,
    base_batch_size: float,
    current_batch_size: int,
    current_time: float,
    margin: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per noise scale in ``phis``: the best candidate (the smallest of equal goodputs), its goodput, the current
    batch's goodput, and whether the best is adopted (it differs and beats the current one by more than ``margin``)."""
    values = np.asarray(goodput(sizes[None, :], times[None, :], phis[:, None], base_batch_size))
    current = np.asarray(goodput(current_batch_size, current_time, phis, base_batch_size)).reshape(-1)
    best = values.max(axis=1)
    best_size = np.where(values == best[:, None], sizes[None, :], np.iinfo(np.int64).max).min(axis=1)
    adopted = (best_size != int(current_batch_size)) & (best > (1.0 + margin) * current)
    return best_size, best, current, adopted


B0 = 128
# AdaptDL's reference: grad_sqr = 1 and grad_var = 10 per B0-batch, i.e. a per-sample noise scale of 10 * 128.
PHI = 10.0 * B0


def _adaptdl_efficiency(grad_sqr: float, grad_var: float, batch_size: float) -> float:
    """AdaptDL's GoodputFunction.efficiency, transcribed: var is per B0-batch."""
    scale = batch_size / B0
    gain = (grad_var + grad_sqr) / (grad_var / scale + grad_sqr)
    return gain / scale


@pytest.mark.parametrize(
    ("batch_size", "expected"), [(256, 0.916667), (512, 0.785714), (1024, 0.611111), (2048, 0.423077)]
)
def test_efficiency_reference_values(batch_size: int, expected: float) -> None:
    assert round(efficiency(PHI, batch_size, B0), 6) == expected
    assert efficiency(PHI, batch_size, B0) == pytest.approx(_adaptdl_efficiency(1.0, 10.0, batch_size), rel=1e-12)


def test_efficiency_broadcasts_and_is_one_at_base() -> None:
    sizes = np.array([128, 256, 512, 1024, 2048])
    values = efficiency(PHI, sizes, B0)
    assert isinstance(values, np.ndarray)
    np.testing.assert_allclose(values, [1.0, 0.916667, 0.785714, 0.611111, 0.423077], atol=5e-7)
    assert np.all(np.diff(values) < 0)
    assert isinstance(efficiency(PHI, 128, B0), float)
    assert efficiency(PHI, 128, B0) == 1.0


def test_noise_scale_broadcasts() -> None:
    phis = np.array([0.0, PHI, math.inf])
    np.testing.assert_allclose(efficiency(phis, 512, B0), [0.25, 0.785714, 1.0], atol=5e-7)
    np.testing.assert_array_equal(adascale_gain(phis, B0, B0), [1.0, 1.0, 1.0])
    grid = adascale_gain(phis[:, None], np.array([128, 512]), B0)
    assert grid.shape == (3, 2)
    np.testing.assert_allclose(grid[:, 1], [1.0, (10 + 1) / (10 / 4 + 1), 4.0], rtol=1e-12)
    rates = goodput(512, np.array([0.5, np.inf]), phis[:, None], B0)
    assert rates.shape == (3, 2) and np.all(rates[:, 1] == 0.0)
    assert rates[2, 0] == pytest.approx(1024.0)


def test_efficiency_limits() -> None:
    # No noise: a bigger batch is pure waste (E = B0 / B); pure noise: every sample counts fully.
    assert efficiency(0.0, 512, B0) == pytest.approx(0.25)
    assert efficiency(math.inf, 512, B0) == 1.0
    # No statistics yet behaves like no noise: exact at B0, pessimistic above it.
    assert efficiency(None, B0, B0) == 1.0
    assert efficiency(None, 512, B0) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="noise_scale"):
        efficiency(-1.0, 256, B0)
    with pytest.raises(ValueError, match="noise_scale"):
        efficiency(float("nan"), 256, B0)
    with pytest.raises(ValueError, match="positive"):
        efficiency(PHI, 0, B0)


def test_adascale_gain() -> None:
    for phi in (None, 0.0, 3.7, PHI, math.inf):
        assert adascale_gain(phi, B0, B0) == 1.0
    # r(B) = E(B) * B / B0, the AdaptDL gain (var + sqr) / (var / scale + sqr).
    assert adascale_gain(PHI, 512, B0) == pytest.approx((10 + 1) / (10 / 4 + 1), rel=1e-12)
    assert adascale_gain(math.inf, 512, B0) == pytest.approx(4.0)
    assert adascale_gain(0.0, 512, B0) == pytest.approx(1.0)
    assert adascale_gain(None, 512, B0) == pytest.approx(1.0)
    gains = adascale_gain(PHI, np.array([128, 256, 512, 1024]), B0)
    assert np.all(np.diff(gains) > 0) and np.all(gains <= np.array([1, 2, 4, 8]))


def test_candidate_batch_sizes() -> None:
    values = candidate_batch_sizes(128, 4096)
    assert values.dtype.kind == "i"
    assert values[0] == 128 and values[-1] == 4096
    assert np.all(np.diff(values) > 0)
    assert 40 <= values.size <= 50
    ratios = values[1:] / values[:-1]
    # Geometric: a near-constant ratio (up to integer rounding) of (4096 / 128) ** (1 / 49).
    np.testing.assert_allclose(ratios, 32 ** (1 / 49), rtol=0.01)
    small = candidate_batch_sizes(3, 12, count=50)  # rounding merges most points
    np.testing.assert_array_equal(small, np.arange(3, 13))
    np.testing.assert_array_equal(candidate_batch_sizes(64, 64), [64])
    assert candidate_batch_sizes(1, 1000, count=5).tolist() == [1, 6, 32, 178, 1000]
    with pytest.raises(ValueError, match="exceed"):
        candidate_batch_sizes(65, 64)
    with pytest.raises(ValueError, match="lower"):
        candidate_batch_sizes(0, 64)


def test_goodput_values_and_infeasible() -> None:
    assert goodput(512, 0.5, PHI, B0) == pytest.approx(512 / 0.5 * 0.785714, rel=1e-6)
    values = goodput(np.array([128, 256, 512]), np.array([0.1, np.inf, 0.3]), PHI, B0)
    assert values[1] == 0.0
    assert values[0] == pytest.approx(1280.0)
    for bad in (math.inf, 0.0, -1.0, float("nan")):
        assert goodput(256, bad, PHI, B0) == 0.0


def _times_for_goodput(sizes: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Step times that make each candidate's goodput equal to ``targets``."""
    return sizes * efficiency(PHI, sizes, B0) / targets


def test_choose_batch_size_hysteresis() -> None:
    current, current_time = 256, 0.25
    current_goodput = goodput(current, current_time, PHI, B0)
    sizes = np.array([128, 256, 512, 1024])
    # 512 is 3% better than the current plan: below the 5% margin, so keep 256.
    times = _times_for_goodput(sizes, current_goodput * np.array([0.5, 1.0, 1.03, 0.9]))
    choice = choose_batch_size(sizes, times, PHI, B0, current, current_time, margin=0.05)
    assert isinstance(choice, GoodputChoice)
    assert choice.batch_size == 512 and not choice.adopted
    assert choice.goodput == pytest.approx(1.03 * current_goodput)
    assert choice.current_goodput == pytest.approx(current_goodput)
    assert choice.next_batch_size == current
    # 10% better clears the margin.
    times = _times_for_goodput(sizes, current_goodput * np.array([0.5, 1.0, 1.10, 0.9]))
    choice = choose_batch_size(sizes, times, PHI, B0, current, current_time, margin=0.05)
    assert choice.batch_size == 512 and choice.adopted and choice.next_batch_size == 512
    # ... but not with a 20% margin.
    assert not choose_batch_size(sizes, times, PHI, B0, current, current_time, margin=0.2).adopted
    # No statistics: never change, however good the prediction looks.
    choice = choose_batch_size(sizes, times, None, B0, current, current_time)
    assert not choice.adopted and choice.batch_size == current and choice.next_batch_size == current


def test_choose_batch_size_edge_cases() -> None:
    sizes = np.array([128, 256, 512])
    # Unknown current step time: the best feasible candidate is adopted.
    choice = choose_batch_size(sizes, [0.1, 0.15, np.inf], PHI, B0, 128, None)
    assert choice.current_goodput == 0.0 and choice.adopted and choice.batch_size == 256
    # Everything infeasible: nothing adopted.
    choice = choose_batch_size(sizes, [np.inf] * 3, PHI, B0, 128, 0.1)
    assert choice.goodput == 0.0 and not choice.adopted
    # The best candidate is the current batch: no change even if it beats the measured time.
    choice = choose_batch_size(sizes, [0.05, 10.0, 10.0], PHI, B0, 128, 0.1)
    assert choice.batch_size == 128 and not choice.adopted
    # Ties go to the smaller batch.
    tie = choose_batch_size([512, 256], [2.0, 1.0], math.inf, B0, 128, 1.0)  # E = 1: both exactly 256 samples/s
    assert tie.goodput == 256.0 and tie.batch_size == 256
    with pytest.raises(ValueError, match="step times"):
        choose_batch_size(sizes, [0.1, 0.2], PHI, B0, 128, 0.1)
    with pytest.raises(ValueError, match="margin"):
        choose_batch_size(sizes, [0.1, 0.2, 0.3], PHI, B0, 128, 0.1, margin=-0.1)


def test_plain_numbers_take_the_scalar_path_and_agree_with_the_arrays_bitwise():
    import math

    import numpy as np

    from lightning_cannikin.core.goodput import adascale_gain, efficiency

    rng = np.random.default_rng(0)
    for _ in range(2000):
        phi = float(rng.choice([0.0, math.inf, rng.uniform(0, 1e4), rng.uniform(0, 10)]))
        base, batch = int(rng.integers(1, 500)), int(rng.integers(1, 5000))
        assert efficiency(phi, batch, base) == float(efficiency(np.array([phi]), np.array([batch]), base)[0])
        assert adascale_gain(phi, batch, base) == float(adascale_gain(np.array([phi]), np.array([batch]), base)[0])
    assert adascale_gain(123.0, 64, 64) == 1.0 and efficiency(None, 128, 64) == 0.5
    with pytest.raises(ValueError, match="noise_scale"):
        efficiency(float("nan"), 64, 32)


def test_the_interval_rule_at_one_noise_scale_is_the_point_rule():
    # TotalOptions.choose at low == high is the point rule at that noise scale (interval_choice's docstring), checked
    # against choose_batch_size and against the rule written out one candidate at a time, at 97 noise scales a case
    rng = np.random.default_rng(0)
    for _ in range(60):
        sizes = np.unique(rng.integers(1, 2048, size=rng.integers(1, 40)))
        times = rng.uniform(0.005, 0.5, size=sizes.size) * (1 + sizes / 256)
        times[rng.random(sizes.size) < 0.1] = np.inf  # infeasible candidates
        if rng.random() < 0.3:
            times[rng.integers(sizes.size)] = times[0]  # equal goodputs happen too: the smallest size wins
        if rng.random() < 0.7:  # the total in force is a candidate, at the candidate's own time
            index = int(rng.integers(sizes.size))
            current, current_time = int(sizes[index]), float(times[index])
        else:  # or one outside the candidates
            current = int(rng.choice(np.setdiff1d(np.arange(1, 2048), sizes)))
            current_time = float(rng.uniform(0.005, 1.0)) if rng.random() < 0.9 else math.inf
        margin = float(rng.choice([0.0, 0.05, 0.2]))
        options = TotalOptions(tuple(map(int, sizes)), tuple(map(float, times)), current, current_time, 64, margin)
        case = (sizes, times, current, current_time, margin)
        for phi in float(rng.uniform(10, 20000)) * 2.0 ** (np.arange(-48, 49) / 8.0):
            chosen = options.choose(float(phi), float(phi))
            point = choose_batch_size(sizes, times, phi, 64, current, current_time, margin)
            assert chosen.adopted == point.adopted == _adopted_by_hand(float(phi), *case)
            if chosen.adopted:
                assert chosen.batch_size == point.batch_size


def _adopted_by_hand(
    phi: float, sizes: np.ndarray, times: np.ndarray, current: int, current_time: float, margin: float
) -> bool:
    """choose_batch_size's rule, one candidate at a time."""
    values = [float(goodput(int(b), float(t), phi, 64)) for b, t in zip(sizes, times, strict=True)]
    best = max(values)
    size = min(int(b) for b, v in zip(sizes, values, strict=True) if v == best)
    return size != current and best > (1 + margin) * float(goodput(current, current_time, phi, 64))
