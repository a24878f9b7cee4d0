"""Balancing as real devices need it: jitter, slower first steps, changes of total batch, a real change of speed.

Replayed without Lightning (``benchmarks/replay.py``: the callback's re-plan protocol on emulated devices), so each
scenario runs in milliseconds and over several seeds. ``test_balancing.py`` runs the same code end to end.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.replay import replay
from lightning_cannikin.core.plan import BatchBounds
from lightning_cannikin.core.speed_model import SpeedModel, SpeedModelSettings, StepRecord
from lightning_cannikin.simulation.emulated_devices import EmulatedDevices

# slower first steps as a GPU has them (allocator, autotuning): step 0 three times slower, normal from step 4
WARMUP = {"warmup_steps": 4, "warmup_factor": 3.0}
SEEDS = range(4)


def balanced_decisions(run):
    return [(step, d) for step, d in run.decisions if d.identified]


@pytest.mark.parametrize("seed", SEEDS)
def test_unequal_fixed_costs_with_jitter_and_warmup(seed):
    # per-sample 0.5/1/2 ms and fixed 10/20/30 ms: the optimum of 96 is about [66, 23, 7]; speed-proportional is 1.34x
    devices = EmulatedDevices([0.5, 1.0, 2.0], [10.0, 20.0, 30.0], jitter_ms=3.0, seed=seed, **WARMUP)
    run = replay(devices, 3, 96, 150, epoch_steps=30)
    balanced = balanced_decisions(run)
    second_step, second = balanced[1]
    assert run.clean_step_time(second.plan) <= 1.08 * run.optimum(96), (second.plan, run.decisions)
    regrets = [run.regret(step) for step in range(second_step, len(run.plans))]
    assert np.median(regrets) <= 0.05, (np.median(regrets), run.decisions)
    assert run.drifts == [], "constant devices never change speed"


@pytest.mark.parametrize("seed", SEEDS)
def test_the_readme_demo_is_balanced_in_its_first_epoch(seed):
    # examples/emulated_cluster.py: 1x:2x:4x (1, 2, 4 ms per sample), 10 ms per step, 32 per device, 15 steps an
    # epoch (digits)
    devices = EmulatedDevices([1.0, 2.0, 4.0], 10.0, jitter_ms=2.0, seed=seed, **WARMUP)
    run = replay(devices, 3, 96, 60, epoch_steps=15)
    first_epoch_end = next(d for step, d in run.decisions if step == 15)
    assert run.clean_step_time(first_epoch_end.plan) <= 1.05 * run.optimum(96), run.decisions
    assert run.drifts == []


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_a_growing_total_batch_is_never_a_speed_change(seed):
    devices = EmulatedDevices([0.5, 1.0, 2.0], 20.0, jitter_ms=3.0, seed=seed, **WARMUP)
    changes = {40: 192, 80: 384, 120: 768, 160: 1536}  # 2x to 16x the starting total
    run = replay(devices, 3, 96, 200, epoch_steps=20, totals=changes)
    assert run.drifts == [], run.drifts
    # the model stays identified through every change, so the total batch can keep adapting
    assert all(d.identified for step, d in run.decisions if step >= 40)
    for change, total in changes.items():
        settled = change + 8 + 1  # the re-split, once the new sizes were timed for warmup_steps steps
        assert run.plans[settled].global_batch_size == total
        assert run.regret(settled) <= 0.06, (total, run.plans[settled], run.decisions)


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_a_real_slowdown_is_rebalanced_within_two_replans(seed):
    # rank 1 becomes three times slower at step 60 (another job on its GPU); re-plans every 10 steps
    devices = EmulatedDevices([0.5, 1.0, 2.0], 5.0, {60: [0.5, 3.0, 2.0]}, jitter_ms=2.0, seed=seed, **WARMUP)
    run = replay(devices, 3, 96, 120, epoch_steps=20, replan_every_n_steps=10)
    assert [ranks for _, ranks in run.drifts] == [[1]], run.drifts
    assert run.drifts[0][0] <= 80, "confirmed within two re-plans of the change"
    after = [run.regret(step) for step in range(81, 120)]
    assert np.median(after) <= 0.03 and max(after) <= 0.10, run.decisions  # it was 2.2x slower before


def _records(step, sizes, seconds):
    return [StepRecord(step, rank, b, t, max(seconds)) for rank, (b, t) in enumerate(zip(sizes, seconds, strict=True))]


def test_a_one_window_glitch_is_not_a_speed_change():
    model = SpeedModel(2, SpeedModelSettings(warmup_samples=0))
    step = 0
    for sizes in [(16, 16), (24, 8)] * 2:
        for _ in range(8):
            model.add(_records(step, sizes, [0.01 + 0.001 * sizes[0], 0.01 + 0.003 * sizes[1]]))
            step += 1
    before = model.models()
    # rank 1 twice as slow for one window at a size it has run: held apart, not yet a change of speed
    model.add([r for s in range(8) for r in _records(step + s, (24, 8), [0.034, 2 * 0.034])])
    assert model.drifts == [] and model.models()[1] == before[1]
    # back to normal at the next window: the glitch was one, and the model never moved far
    model.add([r for s in range(8) for r in _records(step + 8 + s, (24, 8), [0.034, 0.034])])
    assert model.drifts == []
    assert model.models()[1].slope == pytest.approx(0.003, rel=0.2)


def test_probe_gives_every_rank_a_real_lever_within_its_bounds():
    model = SpeedModel(3, SpeedModelSettings(warmup_samples=0), BatchBounds.parse(((1, 1, 30), (64, 64, 34)), 3))
    for step in range(4):  # equal speeds at the even split: the speed-proportional split is the split itself
        model.add(_records(step, (32, 32, 32), [0.04, 0.04, 0.04]))
    probe = model.probe((32, 32, 32))
    assert sum(probe) == 96
    assert abs(probe[0] - 32) >= 8 and abs(probe[1] - 32) >= 8, probe  # 25% of 32
    assert 30 <= probe[2] <= 34, "rank 2's bounds leave it no lever: it stays within them"


def test_the_probe_finds_a_levered_split_whenever_one_exists():
    # brute force over every split of small totals: if some split moves every rank by its lever within the bounds,
    # the probe returns one such split
    import itertools

    from lightning_cannikin.core.probe import probe_split

    rng = np.random.default_rng(0)
    for _ in range(300):
        sizes = [int(b) for b in rng.integers(4, 12, size=3)]
        total = sum(sizes)
        upper = [int(max(b, u)) for b, u in zip(sizes, rng.integers(4, 20, size=3), strict=True)]
        lower = [1, 1, 1]
        speeds = [float(v) for v in rng.uniform(0.5, 4.0, size=3)]
        levers = [max(1, round(0.25 * b)) for b in sizes]

        def levered(split, sizes=sizes, lower=lower, upper=upper, levers=levers):
            return all(
                lo <= b <= hi and abs(b - s) >= lever
                for b, s, lo, hi, lever in zip(split, sizes, lower, upper, levers, strict=True)
            )

        exists = any(
            levered((a, b, total - a - b)) for a, b in itertools.product(range(1, total), repeat=2) if a + b < total
        )
        probe = probe_split(sizes, speeds, [0, 1, 2], lower, upper)
        assert sum(probe) == total
        assert levered(probe) == exists, (sizes, upper, speeds, probe)


@pytest.mark.parametrize("seed", SEEDS)
def test_identical_devices_whose_jitter_swamps_their_slopes_stay_even(seed):
    # millisecond steps on a shared host: 3.6 ms a step, 1 ms of jitter. The fitted slopes are scheduler noise, and
    # a split predicted a few percent faster on them is no evidence: without the jitter margin seed 3 ran
    # [21, 60, 15] (10% slower than even) for 280 steps, the others up to 5% slower for a while
    devices = EmulatedDevices([0.02, 0.02, 0.02], 3.0, jitter_ms=1.0, seed=seed)
    run = replay(devices, 3, 96, 300, epoch_steps=32)
    assert max(run.regret(step) for step in range(24, 300)) <= 0.03, run.decisions
    margins = [d.split_margin for _, d in run.decisions if d.split_margin is not None]
    assert margins and min(margins) > 0.02, "the devices' jitter sets the margin, not the 2% default"
