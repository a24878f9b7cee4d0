"""The decision controller: a checkpoint at any step resumes every later decision exactly, and the noise reading
travels as one value read once per fold."""

from __future__ import annotations

import numpy as np

from benchmarks.replay import replay
from lightning_cannikin.core.controller import Controller, NoiseReading, NoiseRule
from lightning_cannikin.core.noise_scale import NoiseScaleEstimator
from lightning_cannikin.core.plan import BatchBounds, Plan
from lightning_cannikin.core.policy import PolicySettings
from lightning_cannikin.core.replanner import Replanner
from lightning_cannikin.core.speed_model import StepRecord
from lightning_cannikin.simulation.emulated_devices import EmulatedDevices

FAST = [0.5, 1.0, 2.0]  # ms per sample, 10 ms fixed
# rank 1 slows 3x at step 40 and comes back at 75 (a stall long enough to be taken for a change, then undone); rank 2
# is twice as slow for 8 steps from 130 (a glitch its check suspects)
CHANGES = {40: [0.5, 3.0, 2.0], 75: FAST, 130: [0.5, 1.0, 4.0], 138: FAST}
STEPS = 180


def _noise(step: int) -> tuple[float, float] | None:
    """Bounds every rank holds: none at first, then narrowing around a noise scale that jumps 10x at step 90."""
    if step < 16:
        return None
    truth = 300.0 if step < 90 else 3000.0
    width = 1.0 + 8.0 / (step - 12) ** 0.5
    return truth / width, truth * width


def _run(resume_at: set[int] = frozenset()):  # type: ignore[assignment]
    devices = EmulatedDevices(FAST, 10.0, jitter_ms=0.5, seed=3, speed_changes=CHANGES)
    options = {"epoch_steps": 20, "policy": PolicySettings(max_batch_size=768), "noise": _noise}
    return replay(devices, 3, 96, STEPS, resume_at=resume_at, **options)


def _later(run, step: int) -> dict[str, list]:
    """Everything decided after ``step``: splits, totals, LR factors, when each re-plan came, every "when" state."""
    return {
        "decisions": [
            (at, d.plan.local_batch_sizes, d.plan.accumulation_steps, d.lr_factor, d.identified)
            for at, d in run.decisions
            if at > step
        ],
        "plans": run.plans[step:],
        "states": run.states[step:],
        "votes": [at for at in run.changes if at > step] + [f for i, f in enumerate(run.urgent) if i >= step],
        "drifts": [entry for entry in run.drifts if entry[0] > step],
    }


def test_a_controller_restored_after_any_step_decides_every_later_step_as_the_uninterrupted_one():
    whole = _run()
    states, totals = whole.states, [plan.total_batch_size for plan in whole.plans]
    # the stream passes through every kind of point a resume must carry (else the check proves little)
    assert any(s["settle_at"] is not None for s in states[90:]), "a settling after a move of the total"
    assert any(s["routine_gap"] > 0 for s in states), "a back-off of the routine re-plans"
    assert any(s["unconfirmed_moved"] for s in states), "a rescale not yet confirmed moved the split"
    assert len(whole.drifts) >= 2 and whole.drifts[-1][0] > 75, "a stall taken for a change, and undone once it passed"
    assert any(whole.urgent[130:140]), "a glitch suspected: every rank votes at every step"
    assert any(whole.held), "a suspected change held apart by the speed model"
    assert totals[0] == 96 and max(totals) > 2 * 96, "the total moved"
    for step in range(1, STEPS):
        resumed = _run({step})
        assert _later(resumed, step) == _later(whole, step), f"resumed after step {step}"


def test_a_run_resumed_after_every_step_is_the_uninterrupted_run():
    # nothing that decides may live outside the saved state: a resume at every step would lose it at every step
    whole, resumed = _run(), _run(set(range(1, STEPS)))
    assert _later(resumed, 0) == _later(whole, 0)


def _estimator(updates: int, seed: int = 0) -> NoiseScaleEstimator:
    rng, estimator = np.random.default_rng(seed), NoiseScaleEstimator(32)
    for _ in range(updates):
        groups = 1.0 + rng.standard_normal((2, 16)) * 4.0
        estimator.update((groups**2).sum(axis=1), np.array([16.0, 16.0]), float((groups.mean(axis=0) ** 2).sum()))
    return estimator


def test_the_noise_is_read_once_a_fold_and_every_decision_until_the_next_reads_that_value():
    controller = Controller(PolicySettings(max_batch_size=256), Replanner(adaptive=True), noise_rule=NoiseRule())
    controller.configure(2, None)  # type: ignore[arg-type]
    controller.start(Plan((16, 16)))
    controller.estimator = _estimator(40)
    assert controller.noise == NoiseReading(), "nothing folded yet: no reading"
    assert controller.scale(64) == (1.0, 1.0)
    controller.noise_folded()
    reading = controller.noise
    assert reading.bounds is not None and reading.bounds[0] <= reading.estimate <= reading.bounds[1]
    for _ in range(5):  # more statistics arrive: the reading waits for their fold
        controller.estimator.update(np.array([40.0, 40.0]), np.array([16.0, 16.0]), 1.0)
    assert controller.noise is reading and controller.scale(64) == controller.scale(64)
    controller.noise_folded()
    assert controller.noise != reading and controller.noise == NoiseRule().read(controller.estimator)


def _timed_controller(policy: PolicySettings, bounds: BatchBounds, current: Plan, other: tuple[int, ...]) -> Controller:
    """An adaptive controller running ``current`` whose speed model timed every rank at its size there and at
    ``other`` (rank ``r`` takes ``(r + 1)`` ms a sample and 0.2 s fixed), so its speeds are measured."""
    controller = Controller(policy, Replanner(adaptive=True))
    controller.configure(3, bounds)
    controller.start(current)
    sizes = current.local_batch_sizes
    records = [
        StepRecord(step, rank, size, 0.001 * (rank + 1) * size, 0.2)
        for step in range(12)
        for rank, size in enumerate(sizes if step % 2 else other)
    ]
    controller.speed_model.add(records)
    assert controller.speed_model.identified, "every rank timed at two sizes"
    controller.replanner.identified = True
    return controller


def test_a_mid_epoch_reconsideration_with_no_total_in_reach_waits_for_the_epoch_end():
    # 4 micro-steps under max_batch_size 256 leave 64 samples a micro-step, below the 90 the lower bounds need: no total
    # is in reach until the accumulation may change (an epoch's end), and without remembering that the total would be
    # reconsidered (a gather and rank zero's fit) at every step of the epoch
    current = Plan((40, 30, 30), 4)
    controller = _timed_controller(PolicySettings(max_batch_size=256), BatchBounds((30, 30, 30)), current, (30, 40, 40))
    controller.noise = NoiseReading((500.0, 900.0), 700.0)
    reconsidered = []
    for _ in range(20):
        controller.step_done()
        due, adapt = controller.after_step(False)
        if due:
            decision, _ = controller.decide([], current, mid_epoch=True, adapt_total=adapt)
            assert decision is not None and decision.total_options is None, "no total within reach mid-epoch"
            controller.adopt(current, decision, adapt)
            reconsidered += [controller.step] if adapt else []
    assert reconsidered == [1], reconsidered
    assert controller.epoch_end()[1], "the epoch's end reconsiders: the accumulation may change there"
    state = controller.replanner.state_dict()
    assert state["unreachable"] and Replanner(adaptive=True).state_dict()["unreachable"] is False


def test_an_epoch_end_reconsiders_a_total_chosen_mid_epoch_with_the_accumulation_held():
    # the devices hold 40 samples each: a total past 120 needs accumulation, which changes at epoch ends only. A
    # mid-epoch reconsideration chooses among the totals of one micro-step and finds 120 the best of them; its options
    # lack the accumulated totals, so the epoch's end must not read them as "no move" (yolov3 on 16 T4s in the
    # simulator skipped 256 -> 512 at two epoch ends that way)
    current = Plan((40, 40, 40))
    policy = PolicySettings(max_batch_size=960, accumulate=True)
    controller = _timed_controller(policy, BatchBounds((10, 10, 10), (40, 40, 40)), current, (30, 30, 30))
    controller.noise = NoiseReading((40_000.0, 90_000.0), 60_000.0)  # far above the largest total: larger pays
    controller.replanner.routine_gap = 512  # a long run whose re-plans kept the plan: no routine re-plan is near
    controller.step_done()
    due, adapt = controller.after_step(False)
    assert due and adapt, "no options yet: the total is reconsidered"
    decision, _ = controller.decide([], current, mid_epoch=True, adapt_total=adapt)
    assert decision.plan.total_batch_size == 120 and decision.plan.accumulation_steps == 1
    assert decision.total_options is not None and max(decision.total_options.totals) == 120
    controller.adopt(current, decision, adapt)
    controller.step_done()
    assert controller.after_step(False) == (False, False), "mid-epoch the held options call for no move"
    due, adapt = controller.epoch_end()
    assert due and adapt, "the epoch's end may accumulate: it reconsiders the total"
    decision, _ = controller.decide([], current, mid_epoch=False, adapt_total=adapt)
    assert decision.plan.accumulation_steps > 1 and decision.plan.total_batch_size > 120
    controller.adopt(current, decision, adapt)
    options = controller.replanner.total_options
    restored = Replanner(adaptive=True)
    restored.load_state_dict(controller.replanner.state_dict())
    assert restored.total_options == options and not options.held, "the epoch end's options are the whole set"
