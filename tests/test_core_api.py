"""Single-process checks of the core: registry, plan, sampler layout and configuration errors."""

from __future__ import annotations

import importlib
import time

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_cannikin
from lightning_cannikin import CannikinStrategy, EmulatedCluster, Plan
from lightning_cannikin.core.layout import epoch_layout
from lightning_cannikin.core.plan import proportional_sizes
from lightning_cannikin.training.data.sampler import UnevenBatchSampler


@pytest.mark.parametrize(
    ("name", "start_method"),
    [("cannikin", "popen"), ("cannikin_spawn", "spawn"), ("cannikin_fork", "fork"), ("cannikin_notebook", "fork")],
)
def test_registry_names_resolve(name, start_method):
    strategy = StrategyRegistry.get(name)
    assert isinstance(strategy, CannikinStrategy)
    assert strategy._start_method == start_method


def test_second_import_and_reload_do_not_raise():
    importlib.reload(lightning_cannikin)
    CannikinStrategy.register_strategies(StrategyRegistry)
    assert "cannikin" in StrategyRegistry


def test_trainer_accepts_registry_string():
    trainer = pl.Trainer(strategy="cannikin_fork", devices=2, accelerator="cpu", logger=False)
    assert isinstance(trainer.strategy, CannikinStrategy)


@pytest.mark.parametrize("sizes", [[0, 8], [-1, 4], [8, 2.5], "88", []])
def test_non_positive_or_malformed_sizes_raise(sizes):
    with pytest.raises(ValueError, match="local_batch_sizes"):
        CannikinStrategy(local_batch_sizes=sizes)


def test_sizes_of_wrong_length_raise_before_launch():
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"`local_batch_sizes` has 3 entries but the world size is 2"):
        pl.Trainer(strategy=CannikinStrategy(local_batch_sizes=[8, 8, 8]), devices=2, accelerator="cpu")
    assert time.perf_counter() - started < 10


def test_own_comm_hook_is_rejected():
    with pytest.raises(ValueError, match="ddp_comm_hook"):
        CannikinStrategy(ddp_comm_hook=lambda state, bucket: None)


@pytest.mark.parametrize("kwargs", [{"per_sample_ms": [1.0, -2.0]}, {"per_sample_ms": 1.0, "fixed_ms": -1}])
def test_emulator_rejects_negative_delays(kwargs):
    with pytest.raises(ValueError, match="_ms"):
        EmulatedCluster(**kwargs)


def test_plan_totals_and_validation():
    plan = Plan((24, 8), accumulation_steps=2, predicted_step_time=0.1)
    assert plan.global_batch_size == 32
    assert plan.total_batch_size == 64
    assert Plan.from_dict(plan.to_dict()) == plan
    with pytest.raises(ValueError, match="local_batch_sizes"):
        Plan((4, 0))
    with pytest.raises(ValueError, match="accumulation_steps"):
        Plan((4, 4), accumulation_steps=0)


def test_the_tail_split_is_proportional_positive_and_exact():
    plan = Plan((24, 8))
    assert proportional_sizes(7, plan.local_batch_sizes) == (5, 2)
    assert proportional_sizes(2, plan.local_batch_sizes) == (1, 1)
    assert sum(proportional_sizes(33, Plan((40, 20, 4)).local_batch_sizes)) == 33
    with pytest.raises(ValueError):
        proportional_sizes(2, Plan((1, 1, 1)).local_batch_sizes)


@pytest.mark.parametrize("num_samples", [1, 2, 3, 31, 32, 33, 64, 65, 97, 1000])
@pytest.mark.parametrize("sizes", [(24, 8), (40, 20, 4), (1, 1, 1)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_layout_covers_each_sample_once(num_samples, sizes, drop_last):
    plan = Plan(sizes)
    if num_samples < len(sizes) and not drop_last:
        with pytest.raises(ValueError, match="fewer than the"):
            epoch_layout(num_samples, {0: plan}, drop_last)
        return
    layout = epoch_layout(num_samples, {0: plan}, drop_last)
    covered = [i for batch in layout for rank in range(len(sizes)) for i in range(num_samples)[batch.rank_slice(rank)]]
    if drop_last:
        full = num_samples // plan.global_batch_size
        assert len(layout) == full
        assert covered == list(range(full * plan.global_batch_size))
    else:
        assert covered == list(range(num_samples))
        assert all(min(b.local_batch_sizes) >= 1 for b in layout)


def test_sampler_ranks_partition_the_shared_permutation_and_follow_the_epoch():
    plan = Plan((5, 3))
    samplers = [UnevenBatchSampler(50, rank, plan, shuffle=True, seed=7) for rank in range(2)]
    for epoch in (0, 1):
        for sampler in samplers:
            sampler.sampler.set_epoch(epoch)  # what Lightning calls
        batches = [list(s) for s in samplers]
        assert len(batches[0]) == len(batches[1]) == len(samplers[0])
        assert sorted(i for b in batches for batch in b for i in batch) == list(range(50))
        assert [len(b) for b in batches[0][:-1]] == [5] * (len(batches[0]) - 1)
    assert list(samplers[0]) != [list(range(i, i + 5)) for i in range(0, 50, 8)]


def test_mid_epoch_plan_change_keeps_every_sample_once():
    sampler = UnevenBatchSampler(100, 0, Plan((6, 2)), shuffle=False)
    sampler.set_plan(Plan((2, 6)), from_batch=3)
    layout = sampler.layout()
    assert [b.local_batch_sizes for b in layout[:4]] == [(6, 2), (6, 2), (6, 2), (2, 6)]
    covered = [i for b in layout for r in (0, 1) for i in range(100)[b.rank_slice(r)]]
    assert covered == list(range(100))
    with pytest.raises(ValueError, match="ranks"):
        sampler.set_plan(Plan((1, 1, 1)))


def test_a_plan_from_a_batch_on_never_changes_a_batch_before_it():
    # a rank draws batches ahead of training: a plan from batch k (even k = the old epoch's length, where the tail of
    # fewer items than ranks is folded back) must leave batches 0..k-1 as they were drawn
    plan, other = Plan((5, 2, 6, 6)), Plan((2, 1, 6, 4))
    before = epoch_layout(31, {0: plan, 1: Plan((3, 2, 1, 3))})  # 19, then 9 + 3 folded: (4, 3, 1, 4)
    after = epoch_layout(31, {0: plan, 1: Plan((3, 2, 1, 3)), 2: other})
    assert [b.local_batch_sizes for b in after] == [b.local_batch_sizes for b in before] == [(5, 2, 6, 6), (4, 3, 1, 4)]


def test_the_history_keeps_one_entry_per_replan_step():
    from lightning_cannikin.core.history import PlanHistory
    from lightning_cannikin.core.speed_model import StepRecord

    history = PlanHistory()
    history.append(8, 0, Plan((8, 8), predicted_step_time=0.1), 1.0, None)
    history.observe([StepRecord(step, rank, 8, 0.12, 0.12) for step in range(8, 16) for rank in range(2)])
    # the epoch's last batch re-plans on the schedule, then the epoch's end re-plans at the same step: one entry, the
    # last decision's, with the ranks found to have changed speed at either
    history.append(16, 0, Plan((10, 6), predicted_step_time=0.09), 1.0, None, [1])
    history.append(16, 0, Plan((11, 5), predicted_step_time=0.08), 1.5, 40.0, [0])
    assert [e["step"] for e in history.entries] == [8, 16]
    latest = history.entries[-1]
    assert latest["local_batch_sizes"] == [11, 5] and latest["lr_factor"] == 1.5 and latest["speed_changes"] == [0, 1]
    # the plan before it keeps its measurement, and the new one is measured from its own steps
    assert history.entries[0]["measured_step_time"] == pytest.approx(0.12)
    history.observe([StepRecord(step, rank, b, 0.1, 0.1) for step in (16, 17) for rank, b in enumerate((11, 5))])
    assert latest["measured_step_time"] == pytest.approx(0.1) and latest["prediction_error"] == pytest.approx(0.2)
