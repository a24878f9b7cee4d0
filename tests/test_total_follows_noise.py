"""The total batch follows a confident noise scale step by step: the engine's own protocol replayed in one process.

The balancing engine runs every call a frontend makes (step start, gradients ready, step end, ``replan_due``,
``replan``) over a collective of one rank and an uneven sampler drawn one batch at a time, as a loader does. The
noise statistics are synthetic, of a known noise scale, fed to the engine's estimator as the exchange would; the step
time is a known function (no timing of this machine enters a decision).
"""

from __future__ import annotations

import numpy as np
import pytest

from lightning_cannikin import CannikinSettings
from lightning_cannikin.core.goodput import candidate_batch_sizes, goodput
from lightning_cannikin.core.speed_model import SpeedModel
from lightning_cannikin.training.engine import BalancingEngine
from lightning_cannikin.training.runtime import RuntimeState
from lightning_cannikin.training.sampler import UnevenBatchSampler
from tests.test_engine import OneRank

BASE, CAP = 48, 4096
FIXED_S, PER_SAMPLE_S = 0.02, 1e-4  # the known step time: 20 ms + 0.1 ms per sample


def step_time(total):
    return FIXED_S + PER_SAMPLE_S * np.asarray(total, dtype=float)


def run_engine(true_noise_scale, steps, seed=0, dim=64, **settings):
    """Drive a ``BalancingEngine`` with default settings (but ``settings``) for ``steps`` steps; every step's
    synthetic statistics (two groups, per-sample gradients of ``|G|^2 = 1`` and ``tr(Sigma) = true_noise_scale(step)``)
    reach its estimator. Returns, per step: the total it ran, its learning-rate factor, and the estimate acted on
    after it."""
    rng = np.random.default_rng(seed)
    mean_gradient = np.ones(dim) / np.sqrt(dim)
    tuning = CannikinSettings(**settings)
    engine = BalancingEngine(CAP, lr_scaling="linear", base_batch_size=BASE, balance=False, settings=tuning)
    runtime = RuntimeState()
    engine.attach(runtime, OneRank())
    plan = runtime.first_plan(BASE, 1)
    sampler = UnevenBatchSampler(1500 * steps, rank=0, plan=plan, shuffle=False)
    runtime.use_loader(plan, sampler)
    engine.start()
    timer, batches = runtime.timer, iter(sampler)
    totals, factors, estimates = [], [], []
    for step in range(steps):
        next(batches)  # the loader draws the next batch: a plan decided now starts after it
        position = sampler.yielded - 1
        sizes = sampler.sizes_at(position)
        runtime.begin_step(position, sizes, rank=0)
        engine.step_started()
        timer.forward_start()
        timer.will_reduce(True)
        timer.gradient_ready()
        engine.backward_done(())
        total = sum(sizes)
        groups_b = np.array([total // 2, total - total // 2], dtype=float)
        scale = np.sqrt(true_noise_scale(step) / dim / groups_b)[:, None]
        groups = mean_gradient + rng.standard_normal((2, dim)) * scale
        reduced = (groups_b[:, None] * groups).sum(axis=0) / total
        engine.estimator.update((groups**2).sum(axis=1), groups_b, float((reduced**2).sum()))
        engine.step_finished()
        totals.append(total)
        factors.append(runtime.lr_factor)
        due, adapt = engine.replan_due()
        if due:
            engine.replan(mid_epoch=True, adapt_total=adapt)
        estimates.append(engine.usable_noise_scale())
    return engine, totals, factors, estimates


@pytest.fixture
def known_step_time(monkeypatch):
    def predict(self, local_batch_sizes, accumulation_steps=1):
        return step_time(np.sum(np.asarray(local_batch_sizes), axis=-1)) * np.asarray(accumulation_steps)

    monkeypatch.setattr(SpeedModel, "predict", predict)


@pytest.mark.parametrize("margin, seed", [(0.05, 0), (0.05, 1), (0.001, 0)])
def test_the_total_follows_a_doubling_noise_scale_at_every_step(known_step_time, margin, seed):
    # the true noise scale doubles every 100 steps; the engine's estimate is confident after a few dozen steps. From
    # then on every step runs a total whose goodput, at the estimate held when its batch was drawn, is within the
    # adapt margin of the best (what the hysteresis promises); with a margin below what two candidates off cost, within
    # one candidate of the optimum. On the 200-step clock of before, the total lagged the estimate up to 200 steps.
    def true_noise_scale(step):
        return 200.0 * 2.0 ** (step // 100)

    steps = 600
    engine, totals, factors, estimates = run_engine(true_noise_scale, steps, seed, adapt_margin=margin)
    candidates = candidate_batch_sizes(BASE, CAP, engine.policy.candidates)
    times = step_time(candidates)
    confident = next(step for step, phi in enumerate(estimates) if phi is not None)
    assert confident < 100, f"the estimate should be confident early, at step {confident}"
    moves = 0
    phi = None
    for step in range(confident + 1, steps):
        # the estimate acted on: the latest confident one (while it is not confident, the total and the band wait)
        phi = estimates[step - 1] if estimates[step - 1] is not None else phi
        options = goodput(candidates, times, phi, BASE)
        best = int(np.argmax(options))
        index = int(np.abs(candidates - totals[step]).argmin())
        assert candidates[index] == totals[step], "every total is a candidate"
        assert options[index] * (1 + margin) >= options[best], (step, totals[step], int(candidates[best]), phi)
        if margin < 0.0014:  # any candidate two or more off the optimum costs at least 0.14% here
            assert abs(index - best) <= 1, (step, totals[step], int(candidates[best]), phi)
        moves += totals[step] != totals[step - 1]
    assert moves >= 3, f"the total must have moved with the estimate for this to mean anything: {moves}"
    # every step runs the learning-rate factor of the plan it ran ("linear": total / B0), from the batch it starts at
    assert factors == pytest.approx([total / BASE for total in totals], rel=1e-12)
