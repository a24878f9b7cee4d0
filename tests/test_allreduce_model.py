"""The all-reduce model against a simulated DDP bucket timeline: OptPerf(B) far from the total it was measured at.

DDP reduces gradient buckets in order as backward produces them: bucket ``k`` of ``n`` is ready on rank ``i`` after
its forward and ``(k + 1) / n`` of its backward, and the reduction of one bucket starts once every rank has it and
the previous bucket is reduced. The step ends when the last bucket is reduced. A rank's timer sees its compute, the
span from its first bucket to the end (``allreduce``), the part after its backward (``exposed``) and the time the
reductions themselves ran (``comm_busy``, and ``last_bucket`` for the last one). With noise statistics (the default
adaptive configuration) every step goes through the comm hook, so these are the records the model is fitted on
(``tests/test_adaptive_end_to_end.py`` checks that every step's reductions are timed there).
"""

from __future__ import annotations

import numpy as np
import pytest

from lightning_cannikin.core.goodput import candidate_batch_sizes, goodput
from lightning_cannikin.core.plan import Plan
from lightning_cannikin.core.policy import PolicySettings, decide
from lightning_cannikin.core.speed_model import SpeedModel, SpeedModelSettings, StepRecord

FORWARD = 1.0 / 3.0
BUCKETS = 10
OPTIMIZER = 0.001


class Timeline:
    """Two ranks' compute ``a_i b + a0_i`` (seconds) and a reduction of ``comm`` seconds in equal buckets."""

    def __init__(self, slopes, intercepts, comm):
        self.slopes, self.intercepts, self.comm = np.asarray(slopes), np.asarray(intercepts), float(comm)

    def run(self, sizes):
        """``(compute per rank, end of the reduction)`` of one step."""
        compute = self.slopes * np.asarray(sizes) + self.intercepts
        forward, backward = FORWARD * compute, (1 - FORWARD) * compute
        end = 0.0
        for k in range(BUCKETS):
            ready = float(np.max(forward + backward * (k + 1) / BUCKETS))
            end = max(ready, end) + self.comm / BUCKETS
        return compute, end

    def step_time(self, sizes):
        return self.run(sizes)[1] + OPTIMIZER

    def records(self, step, sizes):
        compute, end = self.run(sizes)
        first = FORWARD * compute + (1 - FORWARD) * compute / BUCKETS
        pieces = (self.comm, self.comm / BUCKETS)  # what the reductions themselves took: all, and the last bucket
        return [
            StepRecord(step, i, int(b), float(t), end + OPTIMIZER, end - f, end - t, None, None, *pieces)
            for i, (b, t, f) in enumerate(zip(sizes, compute, first, strict=True))
        ]

    def optimum(self, total):
        return min(self.step_time((b, total - b)) for b in range(1, total))


COMPUTE_BOUND = Timeline([1e-4, 2e-4], [0.005, 0.005], 0.010)  # at B = 256 backward hides the reduction
ALLREDUCE_BOUND = Timeline([1e-4, 2e-4], [0.005, 0.005], 0.040)  # at B = 256 the reduction is the bottleneck


def fitted(timeline, total=256):
    model = SpeedModel(2, SpeedModelSettings(warmup_samples=0))
    step = 0
    for sizes in [(total // 2, total - total // 2), (total * 5 // 8, total - total * 5 // 8)] * 2:
        model.add([r for s in range(8) for r in timeline.records(step + s, sizes)])
        step += 8
    return model


@pytest.mark.parametrize("timeline", [COMPUTE_BOUND, ALLREDUCE_BOUND], ids=["compute-bound", "allreduce-bound"])
def test_optperf_follows_the_timeline_from_a_quarter_to_four_times_the_total(timeline):
    model = fitted(timeline)
    for total in (64, 96, 128, 192, 256, 384, 512, 768, 1024):
        predicted = float(model.optperf([total])[0])
        truth = timeline.optimum(total)
        assert predicted == pytest.approx(truth, rel=0.05), (total, predicted, truth)


@pytest.mark.parametrize("timeline", [COMPUTE_BOUND, ALLREDUCE_BOUND], ids=["compute-bound", "allreduce-bound"])
@pytest.mark.parametrize("noise_scale", [500, 2_000, 8_000])
def test_the_goodput_choice_is_within_three_percent_of_the_best(timeline, noise_scale):
    model = fitted(timeline)
    policy = PolicySettings(max_batch_size=2048, lr_scaling="none")
    decision = decide(model, Plan((128, 128)), policy, noise_scale, 256)
    chosen = decision.best_total  # the target: the move goes as far as the timings (at most 160 a rank) reach
    candidates = candidate_batch_sizes(256, 2048, 50)
    truths = {int(b): timeline.optimum(int(b)) for b in candidates}
    best = max(goodput(b, t, noise_scale, 256) for b, t in truths.items())
    mine = goodput(chosen, timeline.optimum(chosen), noise_scale, 256)
    assert mine >= 0.97 * best, (chosen, mine / best)
    moved = decision.plan
    assert all(b <= 2 * r for b, r in zip(moved.local_batch_sizes, model.largest_run, strict=True)), moved
    assert moved.global_batch_size == chosen or 256 < moved.global_batch_size < chosen, (moved, chosen)


def test_stalls_a_knee_and_the_all_reduce_plan_together():
    # rank 0 flat below 48 samples, rank 1 2.5x slower every third step, a measured all-reduce: the expected split
    # is planned on pieces of one shape (a knee doubles them for the compute and for the part no speed scales alike)
    model = SpeedModel(2, SpeedModelSettings(warmup_samples=0))
    step = 0
    for sizes in [(32, 96), (48, 80), (64, 64), (80, 48)] * 4:
        for _ in range(6):
            compute = [0.005 + 1e-4 * max(sizes[0], 48), (0.005 + 2e-4 * sizes[1]) * (2.5 if step % 3 == 0 else 1)]
            end = max(compute) + 0.004
            model.add(
                [
                    StepRecord(step, i, b, t, end + OPTIMIZER, end - 0.6 * t, end - t, None, None, 0.004, 0.0004)
                    for i, (b, t) in enumerate(zip(sizes, compute, strict=True))
                ]
            )
            step += 1
    assert model.models()[0].knee == 48 and model.scenarios() is not None
    plan = model.plan_split(128)
    assert sum(plan.local_batch_sizes) == 128 and plan.predicted_step_time > 0


def test_a_first_steps_single_bucket_never_reaches_the_allreduce_model():
    # DDP reduces its first iteration in one bucket and rebuilds the layout after it (torch's "initial bucketing"): a
    # fresh model, and a resumed one (a new DDP model), take only steps after their warm-up into the all-reduce model
    steady = ALLREDUCE_BOUND

    def first_step(step, sizes):
        # one bucket: no overlap with backward, the whole reduction after it, at three times the steady cost
        compute, _ = steady.run(sizes)
        end = float(compute.max()) + 3 * steady.comm
        return [
            StepRecord(
                step,
                i,
                int(b),
                float(t),
                end + OPTIMIZER,
                end - t,
                end - t,
                None,
                None,
                3 * steady.comm,
                3 * steady.comm,
            )
            for i, (b, t) in enumerate(zip(sizes, compute, strict=True))
        ]

    model = SpeedModel(2)  # the engine's settings: the warm-up left out of every fit
    for start in (0, 100):  # the fit's first steps, then a resume's
        if start:
            model.load_state_dict(model.state_dict())  # as the engine resumes a fit: the devices warm up again
            model.restarted()
        model.add(first_step(start, (128, 128)))
        model.add([r for s in range(1, 12) for r in steady.records(start + s, (128, 128))])
        comm, samples = model.comm(), model.comm_fitter.state_dict()["allreduce"]
        assert comm is not None and max(samples) == pytest.approx(steady.comm), "no sample of the single bucket"
        assert comm.allreduce == pytest.approx(steady.comm) and comm.exposed == pytest.approx(steady.comm / BUCKETS)


@pytest.mark.parametrize("timeline", [COMPUTE_BOUND, ALLREDUCE_BOUND], ids=["compute-bound", "allreduce-bound"])
def test_accumulation_pays_the_all_reduce_once_per_optimizer_step(timeline):
    # s micro-steps of a global batch: s - 1 without a reduction (the ranks' compute), the last a whole step. The
    # truth is the timeline's own, the best split found by brute force, independently of the planner
    model = fitted(timeline)
    for micro, steps in ((128, 2), (256, 4), (512, 3)):

        def true_time(split, steps=steps):
            compute, _ = timeline.run(split)
            return (steps - 1) * float(compute.max()) + timeline.step_time(split)

        best = min(true_time((b, micro - b)) for b in range(1, micro))
        predicted = float(model.optperf([micro], steps)[0])
        assert predicted == pytest.approx(best, rel=0.03), (micro, steps)
        split = model.plan_split(micro).local_batch_sizes
        assert float(model.predict(split, steps)) == pytest.approx(true_time(split), rel=0.03)
        # charging every micro-step a whole step, as before, overprices it by the reductions it does not run
        if timeline is ALLREDUCE_BOUND:
            assert steps * float(model.optperf([micro])[0]) > 1.15 * best
