"""The memory model (pure) and its effect on plans."""

from __future__ import annotations

import pytest

from lightning_cannikin.core.memory import MemoryFitter
from lightning_cannikin.core.speed_model import SpeedModel, StepRecord

GIB = 1024**3


def test_fitted_memory_model_and_cap():
    fitter = MemoryFitter()
    assert fitter.fit() is None
    for batch in (16, 32, 48):
        for jitter in (0.0, 0.01, -0.01):
            fitter.add(batch, (2.0 + 0.1 * batch) * GIB * (1 + jitter))
    m0, m1 = fitter.fit()
    # the largest peak per size is used: the fit sits on the upper envelope, never below the truth
    assert m1 == pytest.approx(0.1 * 1.01 * GIB, rel=0.02)
    cap = fitter.max_batch_size(16 * GIB, headroom=0.9)
    assert (m0 + m1 * cap) <= 0.9 * 16 * GIB < (m0 + m1 * (cap + 1))
    fitter.add(8, float("nan"))  # ignored
    restored = MemoryFitter()
    restored.load_state_dict(fitter.state_dict())
    assert restored.fit() == fitter.fit()


def test_memory_caps_bound_the_plan():
    balancer = SpeedModel(2)
    step = 0
    for sizes in ((32, 32), (48, 16), (40, 24)):
        for _ in range(3):
            balancer.add(
                [
                    # rank 0 is 4x faster but has a small device: 1 GiB + 0.1 GiB per sample of 4 GiB
                    StepRecord(
                        step, 0, sizes[0], 0.001 * sizes[0], 0.2, None, None, (1 + 0.1 * sizes[0]) * GIB, 4 * GIB
                    ),
                    StepRecord(step, 1, sizes[1], 0.004 * sizes[1], 0.2, None, None, 1e9, 80 * GIB),
                ]
            )
            step += 1
    free = SpeedModel(2)
    free.load_state_dict({**balancer.state_dict(), "memory": [], "memory_caps": [None, None]})
    assert free.plan_split(64).local_batch_sizes[0] > 26, "unbounded, the fast rank would take more"
    cap = balancer.caps[0]
    assert cap in (25, 26)  # (0.9 * 4 GiB - 1 GiB) / 0.1 GiB = 26, less a rounding hair
    assert balancer.caps[1] > 64
    assert balancer.upper == [cap, 2 * 32], "the plan's bounds: the memory cap, and the evidence's reach on rank 1"
    assert balancer.plan_split(64).local_batch_sizes == (cap, 64 - cap)


def test_memory_cap_survives_a_long_run_at_one_plan():
    # two sizes once, then many more steps at one size than the window holds: the cap must not lift, or the planner
    # would hand the device a batch that runs it out of memory
    balancer = SpeedModel(2)
    plans = [(32, 32)] * 4 + [(24, 40)] * 4 + [(26, 38)] * 1000
    for step, sizes in enumerate(plans):
        balancer.add(
            [
                StepRecord(step, 0, sizes[0], 0.001 * sizes[0], 0.2, None, None, (1 + 0.1 * sizes[0]) * GIB, 4 * GIB),
                StepRecord(step, 1, sizes[1], 0.004 * sizes[1], 0.2, None, None, 1e9, 80 * GIB),
            ]
        )
    assert balancer.identified
    assert balancer.upper[0] in (25, 26)
    assert balancer.plan_split(64).local_batch_sizes[0] == balancer.upper[0]


def test_one_batch_size_gives_a_proportional_cap_that_the_probe_respects():
    fitter = MemoryFitter()
    assert fitter.max_batch_size(16 * GIB) is None
    fitter.add(32, 4 * GIB)
    # the peak grows at most in proportion to the batch: 32 x 0.9 x 16 / 4 = 115
    assert fitter.fit() is None and fitter.max_batch_size(16 * GIB) == 115
    # rank 0 runs at 88% of its memory at the even split: it must not be probed above the batch it has run
    model = SpeedModel(3)
    for step in range(8):
        model.add(
            [
                StepRecord(step, 0, 32, 0.010, 0.05, None, None, 0.88 * 4 * GIB, 4 * GIB),
                StepRecord(step, 1, 32, 0.030, 0.05, None, None, 1 * GIB, 80 * GIB),
                StepRecord(step, 2, 32, 0.030, 0.05, None, None, 1 * GIB, 80 * GIB),
            ]
        )
    assert model.upper[0] == 32  # 32 x 0.9 / 0.88 = 32.7
    probe = model.probe((32, 32, 32))
    assert sum(probe) == 96 and probe[0] <= 32, probe
    assert probe != (32, 32, 32), "the other ranks still get a lever"
