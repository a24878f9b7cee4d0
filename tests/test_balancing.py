"""The Cannikin callback on emulated heterogeneous clusters: it learns each device's speed and balances the split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_cannikin import Cannikin, CannikinStrategy, EmulatedCluster
from lightning_cannikin.core.optperf import optimal_split
from lightning_cannikin.simulation.emulated_devices import EmulatedDevices
from lightning_cannikin.training.frontends.lightning_hooks import BalancingCallback
from tests.models import IndexedRegression, RecordingRegressor, quiet_trainer


class DumpCannikin(Callback):
    """Rank zero writes the Cannikin callback's history and fitted models when training ends."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module):
        if not trainer.is_global_zero:
            return
        # the Cannikin passed, or the balancing callback `strategy="cannikin"` adds on its own
        cannikin = next(cb for cb in trainer.callbacks if isinstance(cb, BalancingCallback))
        models = cannikin.speed_model.models()
        self.path.write_text(
            json.dumps(
                {
                    "history": cannikin.history,
                    "slopes": [m.slope for m in models],
                    "intercepts": [m.intercept for m in models],
                    "plan": list(cannikin.plan.local_batch_sizes),
                    "logged": sorted(key for key in trainer.callback_metrics if key.startswith("cannikin/")),
                    "uses_comm_hook": trainer.strategy.uses_comm_hook,
                }
            )
        )


def balance(
    tmp_path,
    per_sample_ms,
    batch_size=32,
    num_samples=640,
    epochs=3,
    cannikin=None,
    fixed_ms=5.0,
    trainer=None,
    **emulated,
):
    torch.manual_seed(0)
    dataset = IndexedRegression(num_samples)
    model = RecordingRegressor(dataset, batch_size=batch_size, record_dir=str(tmp_path))
    out = tmp_path / "cannikin.json"
    callbacks = [EmulatedCluster(per_sample_ms, fixed_ms, **emulated), DumpCannikin(out)]
    if cannikin is not None:
        callbacks.append(cannikin)
    # every step a logging step: with no logger and no progress bar, still nothing may be logged
    strategy = CannikinStrategy(start_method="fork")
    options = {"max_epochs": epochs, "log_every_n_steps": 1, **(trainer or {})}
    trainer = quiet_trainer(strategy, len(per_sample_ms), callbacks, **options)
    trainer.fit(model)
    return json.loads(out.read_text())


def test_two_ranks_one_to_three_converge_to_the_optimal_split(tmp_path):
    # the default callback is added by the strategy itself (no Cannikin passed)
    result = balance(tmp_path, per_sample_ms=[1.0, 3.0], epochs=3)
    # equal intercepts, slopes 1:3 -> the optimum gives rank 0 three quarters of the 64 samples
    b0 = result["plan"][0]
    assert abs(b0 - 48) <= 0.1 * 48, result
    assert sum(result["plan"]) == 64, "the total batch must stay fixed"
    # re-plans happened at warm-up and at each epoch end, each with a prediction
    assert len(result["history"]) >= 3
    assert all(h["predicted_step_time"] > 0 for h in result["history"])
    # no logger and no progress bar: nothing is logged (a logged key costs Lightning work at every step after)
    assert result["logged"] == []
    assert result["uses_comm_hook"] is False, "no bucket observer: DDP's own all-reduce, timed by parameter hooks"


def test_with_accumulation_ddps_own_all_reduce_still_times_and_balances(tmp_path):
    # micro-steps run under no_sync (compute ends at backward), the last one reduces (compute ends at the last
    # gradient hooked): both time the same device
    result = balance(tmp_path, per_sample_ms=[1.0, 3.0], epochs=3, trainer={"accumulate_grad_batches": 2})
    assert result["uses_comm_hook"] is False
    for slope, truth in zip(result["slopes"], [1.0, 3.0], strict=True):
        assert slope * 1000 == pytest.approx(truth, rel=0.2), result
    assert abs(result["plan"][0] - 48) <= 0.1 * 48 and sum(result["plan"]) == 64, result


def test_fitted_slopes_recover_the_emulated_costs(tmp_path):
    # per-sample costs well above what a busy machine adds to a sleep (a fraction of a millisecond per step): at
    # 0.5/1/2 ms the probes' few samples of difference left the fitted slopes to the machine's load (0.84x, 1.16x);
    # and 20 steps an epoch, not 10: with ten, one loaded full-suite run read 3.36 ms for the 4 ms device
    per_sample_ms = [2.0, 4.0, 8.0]
    result = balance(tmp_path, per_sample_ms=per_sample_ms, batch_size=24, num_samples=1440, epochs=2)
    for slope, truth in zip(result["slopes"], per_sample_ms, strict=True):
        assert slope * 1000 == pytest.approx(truth, rel=0.15), result


def test_fixed_split_is_never_replanned(tmp_path):
    torch.manual_seed(0)
    dataset = IndexedRegression(128)
    model = RecordingRegressor(dataset, batch_size=8, record_dir=str(tmp_path))
    trainer = quiet_trainer(
        CannikinStrategy(local_batch_sizes=[12, 4], start_method="fork"), 2, [EmulatedCluster([1.0, 3.0])], max_epochs=2
    )
    trainer.fit(model)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert {len(s) for s in records[0]["steps"]} == {12}
    assert {len(s) for s in records[1]["steps"]} == {4}
    assert not any(isinstance(cb, Cannikin) for cb in trainer.callbacks), "a fixed split needs no planner"


def test_jittery_devices_that_warm_up_are_balanced_without_false_speed_changes(tmp_path):
    # unequal fixed costs: per-sample 0.5/1/2 ms, fixed 10/20/30 ms; the optimum of 96 is about [66, 23, 7]
    per_sample, fixed = [0.5, 1.0, 2.0], [10.0, 20.0, 30.0]
    emulated = {"jitter_ms": 2.0, "warmup_steps": 4, "warmup_factor": 3.0}
    # 8 epochs with a re-plan every 10 steps: epoch-end re-plans that keep the plan come further apart (four times
    # further where the kept split is at the model's optimum, which the jitter decides: 4 re-plans in one CI run, 5 in
    # others), so the cadence makes sure at least 5 re-plans judge the speeds
    cannikin = Cannikin(replan_every_n_steps=10)
    result = balance(tmp_path, per_sample, num_samples=960, epochs=8, cannikin=cannikin, fixed_ms=fixed, **emulated)
    devices = EmulatedDevices(per_sample, fixed)

    def cost(sizes):
        return max(devices.clean_ms(rank, b) for rank, b in enumerate(sizes))

    slopes = [[a] for a in per_sample]
    best = optimal_split(slopes, [[f] for f in fixed], 96).step_time
    assert cost(result["plan"]) <= 1.08 * best, result
    assert len(result["history"]) >= 5 and all(h["speed_changes"] == [] for h in result["history"]), result


class WithUnusedLayer(RecordingRegressor):
    """A model with a layer the loss never uses (DDP needs ``find_unused_parameters`` for it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.unused = torch.nn.Linear(3, 3)


def test_parameters_without_gradients_leave_the_timing_and_the_balance_intact(tmp_path):
    # the readiness hooks learn the order from the gradients that do arrive; the unused layer's never come
    torch.manual_seed(0)
    model = WithUnusedLayer(IndexedRegression(320), batch_size=16, record_dir=str(tmp_path))
    out = tmp_path / "cannikin.json"
    strategy = CannikinStrategy(start_method="fork", find_unused_parameters=True)
    callbacks = [EmulatedCluster([1.0, 3.0], 2.0), DumpCannikin(out)]
    quiet_trainer(strategy, 2, callbacks, max_epochs=3).fit(model)
    result = json.loads(out.read_text())
    assert result["uses_comm_hook"] is False
    assert abs(result["plan"][0] - 24) <= 0.1 * 24 and sum(result["plan"]) == 32, result
