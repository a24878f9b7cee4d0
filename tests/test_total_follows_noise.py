"""The adaptive total moves on what the noise statistics prove: the engine's own protocol replayed in one process.

Synthetic gradient statistics of known noise scales at B0 = 64 (:mod:`tests.noise_runs`), a known step time, every
step measured. The guarantees of ``docs/how-it-works.md``: the total grows within a few dozen measured steps where
growth pays, never settles above the true goodput choice by more than the margin, is within 5% of the optimum once
the bounds are narrower than 2x (for several uneven splits), never grows where throughput is flat in the total, moves
on an all-noise estimate by bounded steps only, comes back after a falling noise scale within a stated number of
samples, and a grown total keeps the learning-rate gain its bounds support. The truth is goodput written out and
maximised by brute force here (:func:`tests.noise_runs.true_choice`), not the library's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_cannikin import CannikinSettings
from lightning_cannikin.core.goodput import adascale_gain, candidate_batch_sizes
from lightning_cannikin.core.lr_scaling import lr_factor
from lightning_cannikin.core.noise_scale import NoiseScaleEstimator
from lightning_cannikin.core.policy import gain_noise_scale
from lightning_cannikin.core.speed_model import SpeedModel
from tests.noise_runs import run_engine, true_choice

BASE, CAP, SEEDS = 64, 1024, 20
MARGIN = CannikinSettings().adapt_margin
FIXED_S, PER_SAMPLE_S = 0.02, 1e-4  # the known step time: 20 ms + 0.1 ms per sample (a larger batch is cheap)
# the totals the policy chooses among (its 50 candidates): the truth is the best of them, as no other is on offer
OFFERED = candidate_batch_sizes(BASE, CAP, 50).tolist()
TIE = 1e-9  # the rule's own inequality, on the edge, differs from this one's arithmetic by rounding only


def step_time(total):
    return FIXED_S + PER_SAMPLE_S * np.asarray(total, dtype=float)


def known_time(monkeypatch, time_of_total):
    def predict(self, local_batch_sizes, accumulation_steps=1):
        return time_of_total(np.sum(np.asarray(local_batch_sizes), axis=-1)) * np.asarray(accumulation_steps)

    monkeypatch.setattr(SpeedModel, "predict", predict)


@pytest.fixture
def cheap_batches(monkeypatch):
    known_time(monkeypatch, step_time)


@pytest.mark.parametrize("noise_scale", [64.0, 250.0, 1000.0, 4000.0])
def test_growth_that_pays_comes_within_a_few_dozen_measured_steps_and_never_overshoots(cheap_batches, noise_scale):
    best, best_goodput, goodputs = true_choice(step_time, noise_scale, BASE, CAP, OFFERED)
    assert best_goodput > (1 + MARGIN) * goodputs[BASE], "growth pays beyond the margin at every one of these"
    firsts = []
    for seed in range(SEEDS):
        run = run_engine(lambda step: noise_scale, 200, seed, base=BASE, cap=CAP)
        firsts.append(run.first_growth())
        for step, total in enumerate(run.totals):
            # above the true choice only where that costs no more than the margin: the lower bound rarely overshoots
            assert total <= best or goodputs[total] * (1 + MARGIN) >= best_goodput * (1 - TIE), (seed, step, total)
    within = [first for first in firsts if first is not None and first <= 60]
    assert len(within) >= 0.95 * SEEDS, sorted(f if f is not None else -1 for f in firsts)


@pytest.mark.parametrize("shares", [(5, 3), (1, 2, 4), (1, 1, 1, 5)], ids=["5-3", "1-2-4", "1-1-1-5"])
@pytest.mark.parametrize("noise_scale", [64.0, 250.0, 1000.0, 4000.0])
def test_once_the_bounds_are_narrower_than_2x_the_total_is_within_5_percent_of_the_optimum(
    cheap_batches, noise_scale, shares
):
    # groups (ranks) of uneven shares; the optimum is brute force over every integer total, goodput written out. Up to
    # 1,000 the bounds narrow below 2x within about 110 measured steps; at 4,000 the grown total (about 900 samples a
    # step) leaves the moving average some 70 steps, and the bounds stay about 3x wide: there the total is held to
    # the same 5% from step 200 on, as everywhere
    _, best_goodput, goodputs = true_choice(step_time, noise_scale, BASE, CAP)
    narrow = 0
    for seed in range(4):
        run = run_engine(lambda step: noise_scale, 300, seed, base=BASE, cap=CAP, shares=shares)
        for step in range(1, len(run.totals)):
            bounds = run.bounds[step - 1]  # those the total run at ``step`` was decided with
            if step >= 200 or (bounds is not None and bounds[1] < 2.0 * bounds[0]):
                narrow += step < 200
                assert goodputs[run.totals[step]] >= 0.95 * best_goodput, (seed, step, run.totals[step], bounds)
    assert (narrow > 0) is (noise_scale <= 1000.0), narrow


def test_the_total_never_grows_where_throughput_is_flat_in_it(monkeypatch):
    known_time(monkeypatch, lambda total: PER_SAMPLE_S * np.asarray(total, dtype=float))  # no fixed cost at all
    for seed in range(SEEDS):
        run = run_engine(lambda step: 4000.0, 200, seed, base=BASE, cap=CAP)
        assert set(run.totals) == {BASE}, seed


def test_an_all_noise_estimate_moves_the_total_by_bounded_steps(cheap_batches):
    # |G|^2 = 0: the point estimate is infinite at times, and acting on it sends the total to the cap at once; the
    # lower bound is finite and rises as the spread of |G|^2 shrinks, so the total climbs in steps it proves: never
    # further than the margin of the best total at the lower bound (the infinite upper one sets nothing)
    for seed in range(SEEDS):
        run = run_engine(lambda step: math.inf, 60, seed, base=BASE, cap=CAP)
        first = run.first_growth()
        assert first is not None, seed
        assert run.totals[first] < CAP, (seed, run.totals[first])
        for step in range(first, len(run.totals)):  # beyond the choice under the finite lower bounds held, only as
            low = max(bounds[0] for bounds in run.bounds[:step] if bounds is not None)  # far as costs the margin there
            best, best_goodput, goodputs = true_choice(step_time, low, BASE, CAP, OFFERED)
            total = run.totals[step]
            assert math.isfinite(low), (seed, step)
            assert total <= best or goodputs[total] * (1 + MARGIN) >= best_goodput * (1 - TIE), (seed, step, total)
        for step in range(1, len(run.totals)):  # and no move past twice the largest total run (one rank holds it)
            assert run.totals[step] <= 2 * max(run.totals[:step]), (seed, step, run.totals[: step + 1])
    pointwise = [
        run_engine(lambda step: math.inf, 60, seed, noise_bound_sigmas=0, evidence_reach=None).totals
        for seed in range(3)
    ]
    assert any(CAP in totals[:20] for totals in pointwise), "the check must be able to fail"


def test_a_grown_total_keeps_the_gain_its_bounds_support_as_precision_is_lost_and_regained(cheap_batches):
    # from step 100 |G|^2 falls a hundredfold (the noise scale rises as much, as it does as training goes on): |G|^2 is
    # then the small difference of two large numbers, and the averages lose the precision a rule that waited for it
    # needed (it set the gain back to 1 with the total still grown); every step's factor is the AdaScale gain of its
    # total at the noise scale the bounds and the band held when it started, above 1 while the total is grown
    def noise_scale(step):
        return 500.0 if step < 100 else 50_000.0

    def grad_sqr(step):
        return 1.0 if step < 100 else 0.01

    regained = 0
    for seed in range(8):  # the precision comes back within 400 steps in about one run in six: eight hold one
        run = run_engine(noise_scale, 400, seed, base=BASE, cap=CAP, grad_sqr=grad_sqr)
        lost = next(step for step in range(100, 400) if run.precise[step - 1] and not run.precise[step])
        assert run.totals[lost] > BASE and run.factors[lost + 1] > 1.0, (seed, lost)
        regained += any(run.precise[lost:])
        assert run.totals[-1] > run.totals[99] > BASE, "the total grew, and grew again with the noise scale"
        for step in range(1, len(run.totals)):
            total, bounds, estimate = run.totals[step], run.bounds[step - 1], run.estimates[step - 1]
            expected = lr_factor("adascale", total, BASE, gain_noise_scale(bounds, estimate))
            assert run.factors[step] == pytest.approx(expected, rel=1e-12), (seed, step)
            assert total == BASE or run.factors[step] > 1.0, (seed, step)
    assert regained, "some run regained the precision it lost"


@pytest.mark.parametrize("seed", [0, 1])
def test_the_total_follows_a_doubling_noise_scale_up_and_down(cheap_batches, seed, caplog):
    # the true noise scale doubles every 100 steps to 3,200, then falls 32x to 100 at step 500: the total rises with it
    # and comes down once the upper bound proves a smaller total better; every new total lies between the goodput
    # choices at the two ends of the bounds it was decided with. After the fall the recent window's bounds leave the
    # run's, and the averages restart from it: the lower bound, and with it the gain, is back at or below the new truth
    # within 500 base batches of samples (403-418 measured; the old statistics alone, weighing decay ** (samples / B0),
    # held it above for ln(32) / (1 - decay), about 3,470), and the total is within 5% of the new optimum from 700
    # base batches on (533-537 measured), once the upper bound has proven the smaller totals
    def noise_scale(step):
        return 200.0 * 2.0 ** min(step // 100, 4) if step < 500 else 100.0

    with caplog.at_level("INFO"):
        run = run_engine(noise_scale, 1500, seed, base=BASE, cap=4096)
    offered = candidate_batch_sizes(BASE, 4096, 50).tolist()

    def reachable(step):  # the largest total on offer within twice the largest run before ``step`` (one rank holds it)
        return max(t for t in offered if t <= 2 * max(run.totals[:step]))

    assert run.totals[499] > run.totals[99] > BASE, "the total follows the noise scale up"
    assert run.totals[-1] < run.totals[499], "and down once the upper bound proves it too large"
    for step in range(1, len(run.totals)):
        bounds, total = run.bounds[step - 1], run.totals[step]
        if bounds is None or total == run.totals[step - 1]:
            continue
        low, high = bounds
        at_low = true_choice(step_time, low, BASE, 4096, offered)[0]
        at_high = true_choice(step_time, min(high, 1e9), BASE, 4096, offered)[0]
        # up to the choice at the upper end, and at least the choice at the lower one or as far as the evidence reaches
        assert min(at_low, reachable(step)) <= total <= at_high, (step, total, bounds)
    assert run.engine.controller.estimator.restarts >= 1, "the fall was seen as a change of the statistics"
    assert "the noise statistics changed" in caplog.text, "and the user is told"
    samples = np.cumsum(run.totals[500:])  # samples after the fall
    back = next(i for i, bounds in enumerate(run.bounds[500:]) if bounds is not None and bounds[0] <= 100.0)
    assert samples[back] <= 500 * BASE, samples[back] / BASE
    _, best_goodput, goodputs = true_choice(step_time, 100.0, BASE, 4096, offered)
    settled = int(np.searchsorted(samples, 700 * BASE))
    after = run.totals[500 + settled :]
    assert all(goodputs[total] >= 0.95 * best_goodput for total in after), sorted(set(after))


def test_the_total_follows_a_drifting_noise_scale_sooner_with_the_bound_on_its_present(cheap_batches, monkeypatch):
    # the true noise scale rises evenly from 64 to 192 over 1,000 steps: no step the recent window sees, so the
    # run's average holds a past value all along. With the bounds of the fit that reads the present
    # (NoiseScaleEstimator.run_bounds) the total keeps a larger share of the best goodput at the current truth than
    # with the window's bounds alone (0.9964 against 0.9883 over these 4 seeds measured, a mean total of 160 against
    # 147 over the ramp's second half, where the best rises from 150 to 193), and never beyond the margin above it.
    # Where the statistics are less precise the gain is smaller (200 to 600: 0.9923 against 0.9902)
    def phi(step):
        return 64.0 + 128.0 * step / 999.0

    offered = candidate_batch_sizes(BASE, 4096, 50).tolist()
    truth = [true_choice(step_time, phi(step), BASE, 4096, offered) for step in range(1000)]

    def followed():
        shares, late = [], []
        for seed in range(4):
            run = run_engine(phi, 1000, seed, base=BASE, cap=4096)
            for step in range(100, 1000):
                best, best_goodput, goodputs = truth[step]
                total = run.totals[step]
                assert total <= best or goodputs[total] * (1 + MARGIN) >= best_goodput * (1 - TIE), (seed, step)
                shares.append(goodputs[total] / best_goodput)
            late.append(np.mean(run.totals[500:]))
        return float(np.mean(shares)), float(np.mean(late))

    share, late = followed()
    monkeypatch.setattr(NoiseScaleEstimator, "run_bounds", NoiseScaleEstimator.window_bounds)
    window_share, window_late = followed()
    assert share > window_share + 0.004, (share, window_share)
    assert late > 1.05 * window_late, (late, window_late)


def test_the_gains_progress_is_within_5_percent_of_adascales_at_the_true_noise_scale(cheap_batches):
    # a total of 384 kept against B0 = 64, a noise scale of 700, the statistics measured one step in eight (the
    # default where the total is kept): the progress credited (the sum of the gains) against AdaScale's at the truth
    # (within 0.8% measured). The lower bound alone sits at about 0.86 of the truth there and credits 4-5% too little
    # (0.947-0.954 measured): the gain at the estimate must do clearly better, or the test fails
    truth = float(adascale_gain(700.0, 384, BASE))
    for seed in range(5):
        run = run_engine(lambda step: 700.0, 600, seed, base=BASE, cap=None, total=384)
        assert set(run.totals) == {384}
        start = next(step for step, bounds in enumerate(run.bounds) if bounds is not None) + 1
        credited = sum(run.factors[start:]) / (truth * (len(run.factors) - start))
        at_low = [float(adascale_gain(bounds[0], 384, BASE)) for bounds in run.bounds[start - 1 : -1]]
        low_credited = sum(at_low) / (truth * len(at_low))
        assert abs(credited - 1.0) <= 0.05, (seed, credited)
        assert low_credited < 0.97 and 1.0 - low_credited > 2 * abs(credited - 1.0), (seed, credited, low_credited)
