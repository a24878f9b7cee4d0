"""Performance model: robust, recency-weighted compute-time fits, the comm model, and the planner's pieces."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from lightning_cannikin.core.optperf import optimal_split, step_time
from lightning_cannikin.core.timing import (
    CommModel,
    CommTimeFitter,
    ComputeTimeFitter,
    LinearTimeModel,
    step_time_pieces,
)

REPO = Path(__file__).resolve().parents[1]
SLOPE, INTERCEPT = 2e-3, 0.05  # 2 ms per sample, 50 ms per step
SIZES = (16, 24, 32, 48, 64, 96, 128)


def _feed(fitter, rng, count, slope=SLOPE, intercept=INTERCEPT, noise=0.0, stragglers=0.0):
    """Add ``count`` samples at random batch sizes with multiplicative noise and 10x stragglers."""
    sizes = rng.choice(SIZES, count)
    seconds = (slope * sizes + intercept) * (1 + noise * rng.standard_normal(count))
    seconds[rng.random(count) < stragglers] *= 10
    for b, t in zip(sizes, seconds, strict=True):
        fitter.add(int(b), float(t))
    return sizes, seconds


def test_linear_time_model():
    model = LinearTimeModel(0.5, 2.0)
    assert model(4) == 4.0 and isinstance(model(4), float)
    np.testing.assert_array_equal(model(np.array([0, 2])), [2.0, 3.0])
    assert LinearTimeModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model
    with pytest.raises(ValueError, match="slope"):
        LinearTimeModel(-1.0, 0.0)
    with pytest.raises(ValueError, match="intercept"):
        LinearTimeModel(1.0, math.nan)


def test_compute_fit_is_exact_on_noiseless_data():
    fitter = ComputeTimeFitter()
    _feed(fitter, np.random.default_rng(0), 200)
    model = fitter.fit()
    assert model.slope == pytest.approx(SLOPE, rel=0.02)
    assert model.intercept == pytest.approx(INTERCEPT, rel=0.02)
    assert fitter.distinct_batch_sizes == SIZES


@pytest.mark.parametrize("seed", range(4))
def test_compute_fit_resists_noise_and_stragglers(seed):
    rng = np.random.default_rng(seed)
    fitter = ComputeTimeFitter(half_life=math.inf)
    _feed(fitter, rng, 500, noise=0.1, stragglers=0.05)
    model = fitter.fit()
    assert model.slope == pytest.approx(SLOPE, rel=0.1)
    assert model.intercept == pytest.approx(INTERCEPT, rel=0.1)
    # The stragglers matter: ordinary least squares on the same window is far off.
    kept = np.array(fitter.samples())
    ls_slope, ls_intercept = np.polyfit(kept[:, 0], kept[:, 1], 1)
    assert abs(ls_slope / SLOPE - 1) > 0.3 or abs(ls_intercept / INTERCEPT - 1) > 0.3


def test_compute_fit_follows_a_speed_change():
    rng = np.random.default_rng(1)
    fitter = ComputeTimeFitter()  # default half-life: 50 samples
    frozen = ComputeTimeFitter(half_life=math.inf)
    for f in (fitter, frozen):
        _feed(f, rng, 300, noise=0.05)
        _feed(f, rng, 100, slope=3 * SLOPE, noise=0.05)  # another job landed on this GPU
    assert fitter.fit().slope == pytest.approx(3 * SLOPE, rel=0.15)
    # Without recency weighting the fit is stuck between the two speeds.
    assert frozen.fit().slope < 2.5 * SLOPE


def test_single_batch_size_uses_the_half_intercept_prior():
    fitter = ComputeTimeFitter()
    for t in (0.20, 0.19, 0.21, 0.20, 2.0):  # one 10x straggler must not move the robust mean
        fitter.add(32, t)
    model = fitter.fit()
    assert model.intercept == pytest.approx(0.10)
    assert model.slope == pytest.approx(0.10 / 32)
    assert model(32) == pytest.approx(0.20)


def test_two_samples_at_two_sizes_give_the_line_through_them():
    fitter = ComputeTimeFitter()
    fitter.add(8, 0.1)
    fitter.add(16, 0.15)
    model = fitter.fit()
    assert model.slope == pytest.approx(0.00625, rel=1e-4)
    assert model.intercept == pytest.approx(0.05, rel=1e-4)


def test_fit_clamps_to_nonnegative_parameters():
    # Times that shrink with the batch: the slope is unknown, so fall back to the prior (never a zero slope).
    shrinking = ComputeTimeFitter()
    for b, t in [(8, 0.30), (16, 0.25), (32, 0.20)] * 4:
        shrinking.add(b, t)
    model = shrinking.fit()
    assert model.slope > 0
    assert model.intercept == pytest.approx(0.125)  # half the median time 0.25, at the median size 16
    assert model.slope == pytest.approx(0.125 / 16)
    # Times proportional to the batch with a small negative fitted intercept: the line goes through the origin.
    origin = ComputeTimeFitter()
    for b in (8, 16, 32, 64):
        origin.add(b, 0.01 * b - 0.002)
        origin.add(b, 0.01 * b - 0.002)
    model = origin.fit()
    assert model.intercept == 0.0
    assert 0.0095 < model.slope < 0.0101


def test_invalid_samples_are_ignored_and_bad_sizes_rejected():
    fitter = ComputeTimeFitter()
    assert fitter.fit() is None
    for t in (math.nan, math.inf, -math.inf, 0.0, -1.0):
        fitter.add(8, t)
    assert fitter.num_samples == 0 and fitter.fit() is None
    fitter.add(8, 0.1)
    assert fitter.samples() == [(8, 0.1)]
    for bad in (0, -4, 2.5):
        with pytest.raises(ValueError, match="batch_size"):
            fitter.add(bad, 0.1)
    with pytest.raises(ValueError, match="half_life"):
        ComputeTimeFitter(half_life=0)
    with pytest.raises(ValueError, match="max_samples"):
        ComputeTimeFitter(max_samples=0)


def test_window_keeps_the_newest_samples():
    fitter = ComputeTimeFitter(max_samples=3)
    for i in range(1, 6):
        fitter.add(i, float(i))
    assert fitter.samples() == [(3, 3.0), (4, 4.0), (5, 5.0)]
    assert fitter.num_samples == 3
    assert fitter.distinct_batch_sizes == (3, 4, 5)


def test_compute_state_dict_round_trips_exactly_through_json():
    rng = np.random.default_rng(5)
    fitter = ComputeTimeFitter()
    _feed(fitter, rng, 80, noise=0.1)
    state = json.loads(json.dumps(fitter.state_dict()))
    restored = ComputeTimeFitter()
    restored.load_state_dict(state)
    assert restored.samples() == fitter.samples()
    assert restored.state_dict() == fitter.state_dict()
    assert restored.fit() == fitter.fit()
    # A smaller window keeps what it would have kept had the samples arrived one by one.
    small, replayed = ComputeTimeFitter(max_samples=10), ComputeTimeFitter(max_samples=10)
    small.load_state_dict(state)
    for batch_size, seconds in fitter.samples():
        replayed.add(batch_size, seconds)
    assert small.samples() == replayed.samples()
    assert len(small.samples()) == 10
    with pytest.raises(ValueError, match="pair up"):
        small.load_state_dict({"batch_sizes": [1, 2], "seconds": [0.1]})


def test_comm_fitter_is_robust_and_round_trips():
    fitter = CommTimeFitter()
    assert fitter.fit() is None
    for _ in range(20):
        fitter.add(0.08, 0.02)
    fitter.add(5.0, 5.0)  # a network hiccup
    fitter.add(math.nan, 0.0)  # ignored
    fitter.add(0.08, -0.1)  # ignored
    fitter.add(0.08, 0.5)  # exposed clamped to the all-reduce time
    assert fitter.num_samples == 22
    assert fitter.samples()[-1] == (0.08, 0.08)
    assert fitter.fit() == CommModel(0.08, 0.02)
    restored = CommTimeFitter()
    restored.load_state_dict(json.loads(json.dumps(fitter.state_dict())))
    assert restored.samples() == fitter.samples() and restored.fit() == fitter.fit()


def test_comm_fitter_follows_recent_samples():
    fitter = CommTimeFitter(half_life=10)
    for _ in range(100):
        fitter.add(0.1, 0.03)
    for _ in range(30):
        fitter.add(0.3, 0.1)  # the job moved to a slower network
    assert fitter.fit() == CommModel(0.3, 0.1)


def test_comm_model_validation_and_dict():
    model = CommModel(0.1, 0.04)
    assert CommModel.from_dict(model.to_dict()) == model
    with pytest.raises(ValueError, match="exposed"):
        CommModel(0.1, 0.2)
    with pytest.raises(ValueError, match="allreduce"):
        CommModel(-0.1, 0.0)


def test_step_time_pieces_three_models():
    compute = [LinearTimeModel(1e-3, 0.02), LinearTimeModel(3e-3, 0.01)]
    comm = CommModel(allreduce=0.09, exposed=0.03)
    slopes, offsets = step_time_pieces(compute, None)
    np.testing.assert_array_equal(slopes, [[1e-3], [3e-3]])
    np.testing.assert_array_equal(offsets, [[0.02], [0.01]])
    slopes, offsets = step_time_pieces(compute, comm)
    np.testing.assert_allclose(offsets, [[0.05], [0.04]])
    slopes, offsets = step_time_pieces(compute, comm, backward_fraction=0.25)
    assert slopes.shape == offsets.shape == (2, 2)
    # g_i(b) = max(t_i(b) + c_last, f_i(b) + r k_i(b) + c) with f = t / 3, k = 2 t / 3, r = 1/4.
    for b in (1, 10, 60, 200):
        for i, model in enumerate(compute):
            t = model(b)
            expected = max(t + comm.exposed, t / 3 + 0.25 * 2 * t / 3 + comm.allreduce)
            got = step_time(slopes[i : i + 1], offsets[i : i + 1], [b])
            assert got == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="backward_fraction"):
        step_time_pieces(compute, comm, backward_fraction=1.5)
    with pytest.raises(ValueError, match="compute"):
        step_time_pieces([], comm)


def test_two_regime_model_changes_the_predicted_time_not_the_split():
    # With c, c_last and r shared by all ranks, g_i(b) = h(t_i(b)) for one increasing h, so the best split is the
    # compute-only one; what changes is OptPerf: small batches are communication-bound and cost at least c.
    compute = [LinearTimeModel(1e-3, 0.02), LinearTimeModel(4e-3, 0.0)]
    comm = CommModel(allreduce=0.3, exposed=0.02)
    simple = step_time_pieces(compute, comm)
    regimes = step_time_pieces(compute, comm, backward_fraction=0.5)
    share = 1 / 3 + 0.5 * 2 / 3
    for total in (20, 100, 2000):
        plain = optimal_split(*simple, total)
        split = optimal_split(*regimes, total)
        assert split.local_batch_sizes == plain.local_batch_sizes
        slowest = max(model(b) for model, b in zip(compute, split.local_batch_sizes, strict=True))
        assert split.step_time == pytest.approx(max(slowest + 0.02, share * slowest + 0.3), rel=1e-12)
        assert split.step_time >= 0.3  # the all-reduce cannot end before it has run
    assert optimal_split(*regimes, 20).step_time > 2 * optimal_split(*simple, 20).step_time  # hidden comm was not free
    assert optimal_split(*regimes, 2000).step_time == optimal_split(*simple, 2000).step_time  # compute-bound


def test_slope_stays_measured_however_long_one_plan_runs():
    # a few steps at 16, then far more steps at 32 than the window holds: a plain window would keep only 32s, lose the
    # slope and fall back to the one-size guess (half the time as intercept)
    def seconds(batch_size: int) -> float:
        return 0.002 * batch_size + 0.010

    fitter = ComputeTimeFitter(max_samples=64)
    for batch_size in [16] * 8 + [32] * 500:
        fitter.add(batch_size, seconds(batch_size))
    assert fitter.num_samples == 64
    assert fitter.distinct_batch_sizes == (16, 32)
    model = fitter.fit()
    assert model.slope == pytest.approx(0.002, rel=1e-9)
    assert model.intercept == pytest.approx(0.010, rel=1e-9)
    # when the plan moves on, the reserve follows: the newest other size is kept, the older one goes
    for _ in range(500):
        fitter.add(40, seconds(40))
    assert fitter.distinct_batch_sizes == (32, 40)
    assert fitter.fit().slope == pytest.approx(0.002, rel=1e-9)


def test_a_resumed_speed_model_keeps_what_it_saw_and_leaves_out_only_the_restarted_devices_warm_up():
    from lightning_cannikin.core.speed_model import SpeedModel, StepRecord

    def records(steps, slow=1.0):
        return [StepRecord(s, r, 8, (0.01 + 0.002 * r) * (slow if r else 1.0), 0.05) for s in steps for r in (0, 1)]

    model = SpeedModel(2)
    model.add(records(range(0, 30)))
    model.add(records(range(30, 40), slow=3.0))  # rank 1 three times slower from step 30: a rescale to confirm
    assert model.watch.unconfirmed and model.jitter >= 0
    state = json.loads(json.dumps(model.state_dict()))
    restored = SpeedModel(2)
    restored.load_state_dict(state)
    assert restored.state_dict() == model.state_dict() and restored.watch.unconfirmed
    assert restored.jitter == model.jitter, "the latest steps, and the split's margin from their jitter"
    # a resume at step 40 with two records read before the checkpoint (steps 38, 39) and fed at the next re-plan
    samples = [f.num_samples for f in restored.fitters]
    restored.restarted(first_step=40)
    restored.add(records(range(38, 46), slow=3.0))
    warmup = restored.settings.warmup_samples
    assert [f.num_samples for f in restored.fitters] == [n + 8 - warmup for n in samples], "steps 40-43 warm up"
