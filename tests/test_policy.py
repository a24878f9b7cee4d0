"""The one decision policy (pure): goodput picks the total batch, OptPerf its split; callback and simulator agree."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lightning_cannikin.core.explain import missed_prediction
from lightning_cannikin.core.optperf import optimal_split
from lightning_cannikin.core.plan import BatchBounds, Plan
from lightning_cannikin.core.policy import PolicySettings, decide
from lightning_cannikin.core.speed_model import SpeedModel, SpeedModelSettings, StepRecord

CLEAN = SpeedModelSettings(warmup_samples=0)  # synthetic timings have no warm-up to leave out
SLOPES = (0.001, 0.003)  # seconds per sample: rank 1 is 3x slower
FIXED = 0.020  # seconds per step on every rank


def next_decision(
    model, current, noise_scale=None, base_batch_size=None, max_batch_size=None, balance=True, margin=0.05
):
    """What ``decide`` decides, with the callback's arguments (no ``max_batch_size``: the total stays)."""
    settings = PolicySettings(max_batch_size=max_batch_size, balance=balance, margin=margin)
    base = current.total_batch_size if base_batch_size is None else base_batch_size
    return decide(model, current, settings, noise_scale, base)


def next_plan(*args, **kwargs):
    """The plan ``decide`` adopts (:func:`next_decision`'s arguments)."""
    return next_decision(*args, **kwargs).plan


def assert_grows_toward(decision, model, current, target, balance=True):
    """The decision's target is ``target``, and its move goes toward it as far as the evidence reaches: no rank past
    twice the largest batch it ran, to within one candidate's step (about 4%) of the largest total that allows."""
    assert decision.best_total == target, decision
    sizes = decision.plan.local_batch_sizes
    reach = [2 * b for b in model.largest_run]
    assert all(b <= r for b, r in zip(sizes, reach, strict=True)), (sizes, reach)
    reachable = sum(reach) if balance else len(reach) * min(reach)
    assert current.total_batch_size < reachable / 1.05 <= decision.plan.global_batch_size <= reachable, decision


def fitted_balancer(sizes_seen=((24, 8), (16, 16), (20, 12)), upper=None) -> SpeedModel:
    balancer = SpeedModel(2, CLEAN, BatchBounds.parse((None, upper), 2))
    step = 0
    for sizes in sizes_seen:
        for _ in range(5):
            records = [
                StepRecord(step, rank, b, FIXED + SLOPES[rank] * b, FIXED + max(SLOPES) * max(sizes) + 0.002)
                for rank, b in enumerate(sizes)
            ]
            balancer.add(records)
            step += 1
    return balancer


def test_without_statistics_the_total_stays_and_the_split_is_optimal():
    balancer = fitted_balancer()
    plan = next_plan(balancer, Plan((16, 16)), noise_scale=None, base_batch_size=32, max_batch_size=1024)
    slopes, offsets = balancer.pieces()
    assert plan.global_batch_size == 32
    assert plan.local_batch_sizes == optimal_split(slopes, offsets, 32).local_batch_sizes == (24, 8)
    assert plan.predicted_step_time == pytest.approx(FIXED + 0.024 + balancer.tail(), rel=1e-6)


def test_goodput_grows_the_batch_only_when_the_noise_scale_pays_for_it():
    balancer = fitted_balancer()
    current = Plan((24, 8))
    # all noise (efficiency ~1 everywhere): the fixed cost per step makes the largest batch the best
    grown = next_decision(balancer, current, noise_scale=1e9, base_batch_size=32, max_batch_size=256)
    assert_grows_toward(grown, balancer, current, 256)
    # no noise (each extra sample is worth nothing): stay at the base batch
    kept = next_plan(balancer, current, noise_scale=0.0, base_batch_size=32, max_batch_size=256)
    assert kept.global_batch_size == 32
    # mid-epoch (no max_batch_size passed) the total never changes
    assert next_plan(balancer, current, noise_scale=1e9, base_batch_size=32).global_batch_size == 32


def test_even_split_baseline_and_bounds():
    balancer = fitted_balancer(upper=[20, 64])
    even = next_plan(balancer, Plan((16, 16)), balance=False)
    assert even.local_batch_sizes == (16, 16)
    capped = next_plan(balancer, Plan((16, 16)))
    assert capped.local_batch_sizes == (20, 12), "rank 0's cap binds"
    # with rank 0 capped, every extra sample lands on the 3x slower rank: no larger batch pays, even with E = 1
    kept = next_plan(balancer, Plan((16, 16)), noise_scale=1e9, base_batch_size=32, max_batch_size=1024)
    assert kept.global_batch_size == 32 and kept.local_batch_sizes == (20, 12)
    # uncapped, the same statistics grow the batch to the maximum
    uncapped = fitted_balancer()
    free = next_decision(uncapped, Plan((16, 16)), noise_scale=1e9, base_batch_size=32, max_batch_size=1024)
    assert_grows_toward(free, uncapped, Plan((16, 16)), 1024)


def test_an_unidentified_rank_is_probed_at_a_new_size():
    balancer = fitted_balancer(sizes_seen=((16, 16),))
    assert not balancer.identified
    plan = next_plan(balancer, Plan((16, 16)))
    assert plan.global_batch_size == 32
    assert all(b != 16 for b in plan.local_batch_sizes), plan


def test_a_long_stable_plan_neither_loses_its_slopes_nor_stops_adapting():
    # An epoch far longer than the timing window, all at one plan: the epoch-end decision must still see measured
    # slopes. (It once saw one batch size per rank, so it probed instead of balancing, and never grew the batch.)
    balancer = fitted_balancer(sizes_seen=((16, 16), (20, 12), *[(24, 8)] * 200))
    assert balancer.identified
    assert balancer.models()[1].slope == pytest.approx(SLOPES[1], rel=1e-6)
    current = Plan((24, 8))
    assert next_plan(balancer, current).local_batch_sizes == (24, 8)
    grown = next_decision(balancer, current, noise_scale=1e9, base_batch_size=32, max_batch_size=256)
    assert_grows_toward(grown, balancer, current, 256)


def test_an_even_split_adapts_from_the_one_size_prior_while_a_balancing_plan_probes_first():
    balancer = fitted_balancer(sizes_seen=((16, 16),))
    assert not balancer.identified
    # AdaptDL's way: the prior (half the step time fixed) already says a bigger batch pays when every sample counts
    even = next_decision(
        balancer, Plan((16, 16)), noise_scale=1e9, base_batch_size=32, max_batch_size=256, balance=False
    )
    assert_grows_toward(even, balancer, Plan((16, 16)), 256, balance=False)
    sizes = even.plan.local_batch_sizes
    assert max(sizes) - min(sizes) <= 1, "an even split"
    # balancing first measures the slopes: same total, probed split
    probed = next_plan(balancer, Plan((16, 16)), noise_scale=1e9, base_batch_size=32, max_batch_size=256)
    assert probed.global_batch_size == 32 and probed.local_batch_sizes != (16, 16)


def test_a_stale_split_does_not_push_the_total_batch_up():
    # The split in force is far from balanced. At this noise scale a bigger batch (49) beats B0 = 32 by 4.5% at the
    # best split, under the 5% margin, but by 40% over the stale split: re-balancing is the gain, not the batch.
    balancer = fitted_balancer()
    stale = Plan((16, 16))
    assert balancer.predict(stale.local_batch_sizes) > 1.2 * balancer.plan_split(32).predicted_step_time
    plan = next_plan(balancer, stale, noise_scale=40.0, base_batch_size=32, max_batch_size=256)
    assert plan.global_batch_size == 32
    assert plan.local_batch_sizes == balancer.plan_split(32).local_batch_sizes
    # and with a clear gain (noise scale 100: +21% at the best split) the batch does grow
    assert next_plan(balancer, stale, noise_scale=100.0, base_batch_size=32, max_batch_size=256).global_batch_size > 32


def _fitted_on(slopes, intercepts, bounds: BatchBounds, sizes_seen, settings=CLEAN) -> SpeedModel:
    """A speed model fed exact linear timings (no tail), as the callback's gather would feed it."""
    model = SpeedModel(len(slopes), settings, bounds)
    step = 0
    for sizes in sizes_seen:
        for _ in range(3):
            compute = [a * b + a0 for a, a0, b in zip(slopes, intercepts, sizes, strict=True)]
            model.add(StepRecord(step, rank, b, compute[rank], max(compute)) for rank, b in enumerate(sizes))
            step += 1
    return model


def test_an_even_split_never_grows_past_the_smallest_cap():
    # Rank 0 holds at most 10 samples. An even split of more than 3 x 10 would overrun it; the old re-planner capped
    # the total at sum(upper) = 90 and split 90 evenly, putting 30 samples on rank 0.
    bounds = BatchBounds.parse((None, [10, 40, 40]), 3)
    model = _fitted_on([0.001, 0.002, 0.004], [0.02] * 3, bounds, [(10, 10, 10), (8, 11, 11)])
    assert model.identified
    plan = next_plan(model, Plan((10, 10, 10)), noise_scale=1e9, base_batch_size=30, max_batch_size=200, balance=False)
    assert all(b <= cap for b, cap in zip(plan.local_batch_sizes, [10, 40, 40], strict=True)), plan
    assert plan.local_batch_sizes == (10, 10, 10)
    # an even split the bounds do not allow is made as even as they do allow
    uneven_cap = BatchBounds.parse((None, [4, 40, 40]), 3)
    model = _fitted_on([0.001, 0.002, 0.004], [0.02] * 3, uneven_cap, [(4, 13, 13), (3, 14, 13)])
    kept = next_plan(model, Plan((4, 13, 13)), balance=False)
    assert kept.local_batch_sizes == (4, 13, 13)


@pytest.mark.parametrize(("phi", "max_batch"), [(30.0, 600), (5e3, 600), (1e6, 900), (1e6, 300)])
def test_the_simulator_and_the_callback_decide_alike(phi: float, max_batch: int) -> None:
    import math

    from lightning_cannikin.core.controller import Controller, NoiseRule
    from lightning_cannikin.core.noise_scale import NoiseScaleEstimator
    from lightning_cannikin.simulation import ClusterModel, load_job, parse_cluster
    from lightning_cannikin.simulation.engine import replan
    from lightning_cannikin.simulation.gpu_profiles import ProfileStore
    from lightning_cannikin.training.settings import EngineOptions

    cluster = parse_cluster("2xV100,2xT4")
    job = load_job("imagenet", cluster.gpu_types, ProfileStore(use_sia=False))
    simulated = ClusterModel(job, cluster, network_time=0.0)  # no network term: the callback's model has none
    base = job.base_batch_size
    current = simulated.plan("cannikin", base)
    seen = [current.local_batch_sizes, simulated.plan("cannikin", base + 40).local_batch_sizes]

    def live_decision(settings: SpeedModelSettings):
        # the callback's controller: the same devices measured at two splits, the same noise scale, rank zero's decision
        # the noise scale is given, as the simulator is given it (no spread to bound it with: sigmas 0)
        controller = Controller(EngineOptions(max_batch_size=max_batch).policy, noise_rule=NoiseRule(sigmas=0))
        bounds = BatchBounds(tuple(int(b) for b in simulated.lower), tuple(int(b) for b in simulated.upper))
        controller.speed_model = _fitted_on(simulated.slopes, simulated.offsets, bounds, [], settings)
        records = []
        for step, sizes in enumerate(seen * 3):
            compute = [a * b + a0 for a, a0, b in zip(simulated.slopes, simulated.offsets, sizes, strict=True)]
            records += [StepRecord(step, rank, b, compute[rank], max(compute)) for rank, b in enumerate(sizes)]
        estimator = NoiseScaleEstimator(base)
        estimator.load_state_dict(
            {
                "base_batch_size": base,
                "decay": 0.999,
                "sqr_biased": 1.0,
                "var_biased": phi,
                "weight": 1.0,
                "num_updates": 99,
                "sqr_sq_biased": 1.0,
                "var_sq_biased": phi**2,
                "weight_sq": 1.0,
                "spread_known": True,
            }
        )
        controller.estimator = estimator
        controller.noise_folded()  # the statistics read once, as after a fold
        return controller.decide(records, current, mid_epoch=False, adapt_total=True)[0]

    # the simulator knows its devices at every batch size (its model is the truth), so the callback's model is compared
    # with the evidence's reach off; with it on, the callback aims at the same total and moves as far as it reaches
    live = live_decision(replace(CLEAN, evidence_reach=None))
    reaching = live_decision(CLEAN)

    projected = replan(simulated, "cannikin", current, phi, max_batch)
    assert live is not None and live.identified and projected.identified
    assert live.plan.local_batch_sizes == projected.plan.local_batch_sizes
    assert live.plan.accumulation_steps == projected.plan.accumulation_steps == 1
    assert live.plan.predicted_step_time == pytest.approx(projected.plan.predicted_step_time, rel=1e-9)
    assert live.lr_factor == pytest.approx(projected.lr_factor, rel=1e-12)
    if phi > 1e5 and max_batch > base:
        assert projected.plan.total_batch_size > base, "all noise: the decision must grow the batch"
    assert math.isfinite(live.lr_factor)
    assert reaching is not None and reaching.best_total == live.best_total
    seen_largest = [max(b) for b in zip(*seen, strict=True)]
    assert all(b <= 2 * r for b, r in zip(reaching.plan.local_batch_sizes, seen_largest, strict=True)), reaching


def test_optperf_sees_the_communication_floor_of_an_allreduce_bound_job():
    # 50 ms all-reduce that starts when the first bucket is ready, half-way through compute; slopes 1 and 3 ms/sample
    slopes, allreduce, share, optimizer = (0.001, 0.003), 0.050, 0.5, 0.001
    model = SpeedModel(2, CLEAN)
    step = 0
    for sizes in [(16, 16), (24, 8)] * 3:
        for _ in range(5):
            compute = [a * b for a, b in zip(slopes, sizes, strict=True)]
            last = max(compute)
            done = share * last + allreduce  # the all-reduce ends here: after backward when it is the bottleneck
            exposed = max(done, last) - last
            step_time = last + exposed + optimizer
            model.add(StepRecord(step, r, b, compute[r], step_time, allreduce, exposed) for r, b in enumerate(sizes))
            step += 1
    truth = share * 0.024 + allreduce + optimizer  # (24, 8): both ranks compute 24 ms, the all-reduce binds
    assert model.predict((24, 8)) == pytest.approx(truth, rel=0.02)
    compute_only = SpeedModel(2, CLEAN)
    compute_only.fitters, compute_only.tails = model.fitters, model.tails
    # a small total is all-reduce bound: OptPerf(8) cannot beat the all-reduce, which compute + tail alone misses
    floor = float(model.optperf([8])[0])
    assert floor >= allreduce + optimizer
    assert float(compute_only.optperf([8])[0]) < 0.85 * floor
    # at a large total the job is compute-bound: the split is the compute-only one
    assert model.plan_split(400).local_batch_sizes == compute_only.plan_split(400).local_batch_sizes


def test_a_split_is_kept_while_the_best_one_gains_less_than_the_split_margin():
    # identical devices whose fitted fixed costs came out 1.5 ms apart (what timing noise makes of them)
    near = _fitted_on([0.001] * 3, [0.020, 0.0215, 0.019], BatchBounds.parse(None, 3), [(32, 32, 32), (40, 16, 40)])
    assert near.identified
    best = optimal_split(*near.pieces(), 96).local_batch_sizes
    assert best != (32, 32, 32), "the check must be able to fail: the model's optimum is not the even split"

    def split(current, margin):
        settings = PolicySettings(split_margin=margin)
        return decide(near, Plan(current), settings, None, 96).plan.local_batch_sizes

    assert split((32, 32, 32), 0.0) == best  # without hysteresis the noise is chased
    assert split((32, 32, 32), 0.02) == (32, 32, 32)  # the even split is within 2% of the best: kept
    # a probe's split, or one the noise produced, gives way to the even one while that is within the margin
    assert split((40, 16, 40), 0.02) == split((33, 31, 32), 0.02) == (32, 32, 32)
    # real differences (1x:2x:4x) are worth far more than the margin: the optimum is taken
    far = _fitted_on([0.001, 0.002, 0.004], [0.02] * 3, BatchBounds.parse(None, 3), [(32, 32, 32), (40, 16, 40)])
    settings = PolicySettings(split_margin=0.02)
    optimum = optimal_split(*far.pieces(), 96).local_batch_sizes
    assert decide(far, Plan((32, 32, 32)), settings, None, 96).plan.local_batch_sizes == optimum
    # and once balanced, a split the model finds a hair slower than its best (within the margin) is kept. Several
    # splits tie for the optimum here, so the near one is chosen by its predicted time, not by its distance to the
    # solver's pick, and well inside the margin (0.5% to 1.5% slower), so no floating-point tie decides the outcome.
    best = far.predict(optimum)
    nearby = [(b0, b1, 96 - b0 - b1) for b0 in range(optimum[0] - 3, optimum[0] + 4) for b1 in range(1, 96 - b0)]
    inside = [s for s in nearby if 1.005 * best < far.predict(s) < 1.015 * best]
    assert inside, "the check must be able to fail: some split must be slower than the best but within the margin"
    near_optimum = inside[0]
    assert decide(far, Plan(near_optimum), settings, None, 96).plan.local_batch_sizes == near_optimum
    exact = PolicySettings(split_margin=0.0)
    taken = decide(far, Plan(near_optimum), exact, None, 96).plan.local_batch_sizes
    assert taken != near_optimum and far.predict(taken) <= best * (1 + 1e-9)


def test_split_margin_must_not_be_negative():
    with pytest.raises(ValueError, match="split_margin"):
        PolicySettings(split_margin=-0.1)


def test_a_decision_says_why_it_kept_or_changed_the_total_and_the_split():
    balancer = fitted_balancer()
    current = Plan((24, 8))
    best_time = balancer.plan_split(32).predicted_step_time

    def explained(noise_scale, margin=0.05, current=current):
        settings = PolicySettings(max_batch_size=256, margin=margin)
        return decide(balancer, current, settings, noise_scale, 32)

    # noise scale 40: the best total gains about 4.5% at the best split, under the 5% margin: kept, and said so
    kept = explained(40.0)
    assert kept.plan.global_batch_size == 32 and kept.best_total is not None and kept.best_total > 32
    assert 0.0 < kept.total_gain < 0.05
    # the same gain clears a 1% margin: adopted, with the gain that made it
    grown = explained(40.0, margin=0.01)
    assert grown.plan.total_batch_size == grown.best_total == kept.best_total
    assert grown.total_gain == pytest.approx(kept.total_gain)
    # the split: the optimum (24, 8) is in force, so it is kept with no gain to find; a stale even split is more than
    # the 2% split margin slower, and its gain is what the decision reports
    assert kept.split_gain == pytest.approx(0.0, abs=1e-12)
    stale = explained(None, current=Plan((16, 16)))
    assert stale.plan.local_batch_sizes == (24, 8)
    assert stale.split_gain == pytest.approx(balancer.predict((16, 16)) / best_time - 1.0) and stale.split_gain > 0.02
    # no statistics: the total was not reconsidered
    assert stale.best_total is None and stale.total_gain is None


def test_the_gain_takes_the_estimate_held_within_the_bounds():
    from lightning_cannikin.core.policy import gain_noise_scale

    assert gain_noise_scale(None) is None and gain_noise_scale(None, 400.0) is None, "no bounds: no gain"
    assert gain_noise_scale((50.0, 800.0), 400.0) == 400.0
    assert gain_noise_scale((50.0, 800.0), 20.0) == 50.0 and gain_noise_scale((50.0, 800.0), 5e3) == 800.0
    assert gain_noise_scale((300.0, float("inf")), 1e4) == 1e4
    # an estimate that is not finite (the squared mean gradient's average not above zero), or none: the lower bound
    assert gain_noise_scale((300.0, float("inf")), float("inf")) == 300.0 and gain_noise_scale((50.0, 800.0)) == 50.0


@pytest.mark.parametrize("balance", [True, False])
def test_no_decision_takes_a_rank_past_twice_the_largest_batch_it_ran(balance):
    # all noise and a cap of 4,096: the bounds allow any total, the fitted lines favour the largest. Whatever the
    # devices and the sizes run, probes included (one size seen), no rank is planned past twice its largest
    rng = np.random.default_rng(3)
    for _ in range(40):
        n = int(rng.integers(2, 5))
        slopes = rng.uniform(0.0005, 0.005, n)
        seen = [tuple(int(b) for b in rng.integers(4, 40, n)) for _ in range(int(rng.integers(1, 4)))]
        model = _fitted_on(slopes, [0.02] * n, BatchBounds.parse(None, n), seen)
        current = Plan(seen[-1])
        decision = next_decision(
            model, current, noise_scale=1e9, base_batch_size=sum(seen[0]), max_batch_size=4096, balance=balance
        )
        largest = [max(sizes[rank] for sizes in seen) for rank in range(n)]
        assert all(b <= 2 * r for b, r in zip(decision.plan.local_batch_sizes, largest, strict=True)), (
            seen,
            decision.plan,
        )
        unreached = replace(model.settings, evidence_reach=None)
        free = SpeedModel(n, unreached, BatchBounds.parse(None, n))
        free.load_state_dict(model.state_dict())
        if model.identified:  # the same evidence with no reach jumps far past it: the test can fail
            jump = next_decision(
                free, current, noise_scale=1e9, base_batch_size=sum(seen[0]), max_batch_size=4096, balance=balance
            )
            assert jump.plan.global_batch_size > 2 * sum(largest), jump.plan


def test_a_move_whose_timings_miss_its_prediction_is_told_and_one_that_matches_is_not():
    # two ranks on lines of 5 ms + 1 and 2 ms a sample, timed at 16-24 samples; the plan (48, 24) is predicted from
    # those lines. Rank 0 then runs 48 samples at 1.5 ms each (past a knee the lines never saw): refit, the model
    # puts the plan well above its prediction. Where the steps match the lines, nothing is said.
    def timed(per_sample_0: float) -> tuple[SpeedModel, Plan]:
        model = SpeedModel(2, SpeedModelSettings(warmup_samples=0), BatchBounds.parse(None, 2))
        slopes, step = [0.001, 0.002], 0
        for sizes in ((16, 16), (24, 12), (20, 14)):
            for _ in range(6):
                times = [0.005 + s * b for s, b in zip(slopes, sizes, strict=True)]
                model.add([StepRecord(step, r, b, times[r], max(times)) for r, b in enumerate(sizes)])
                step += 1
        plan = Plan((48, 24), predicted_step_time=float(model.predict((48, 24))))
        for _ in range(12):  # the steps run at the plan since its adoption
            times = [0.005 + per_sample_0 * 48, 0.005 + 0.002 * 24]
            model.add([StepRecord(step, r, b, times[r], max(times)) for r, b in enumerate((48, 24))])
            step += 1
        return model, plan

    model, plan = timed(0.0015)
    line = missed_prediction(40, plan, model, 0.02)
    assert line is not None and "by step 40 the plan [48, 24] (total 72)" in line and "+" in line, line
    model, plan = timed(0.001)
    assert missed_prediction(40, plan, model, 0.02) is None
    assert missed_prediction(40, Plan((48, 24)), model, 0.02) is None, "no prediction was made: nothing to miss"
