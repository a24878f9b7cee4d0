"""The adaptive layer in real multi-process runs: noise statistics from the comm hook, LR scaling, total batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_cannikin import Cannikin, CannikinSettings, CannikinStrategy, EmulatedCluster
from lightning_cannikin.training.measurement.grad_stats import FOLD_DELAY
from tests.models import (
    IndexedRegression,
    ManualRegressor,
    RecordingRegressor,
    quiet_trainer,
    read_records,
    record_estimator_inputs,
)


class RecordingSGD(torch.optim.SGD):
    """SGD that records the learning rate it actually steps with."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stepped_lrs: list[float] = []

    def step(self, closure=None):
        self.stepped_lrs.append(self.param_groups[0]["lr"])
        return super().step(closure)


class ScheduledRegressor(RecordingRegressor):
    def __init__(self, *args, schedule: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.schedule = schedule
        self.scheduled_lrs: list[float] = []

    def configure_optimizers(self):
        optimizer = RecordingSGD(self.parameters(), lr=self.lr)
        if self.schedule == "lambda":
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        else:
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_batch_start(self, batch, batch_idx):
        self.scheduled_lrs.append(self.lr_schedulers().get_last_lr()[0])

    def on_train_end(self):
        super().on_train_end()
        optimizer = self.optimizers().optimizer
        path = Path(self.record_dir, f"lrs{self.global_rank}.json")
        path.write_text(
            json.dumps(
                {
                    "stepped": optimizer.stepped_lrs,
                    "scheduled": self.scheduled_lrs,
                    "after": optimizer.param_groups[0]["lr"],
                    "final_schedule": self.lr_schedulers().get_last_lr()[0],
                }
            )
        )


@pytest.mark.parametrize("schedule", ["lambda", "step"])
def test_scaled_lr_is_schedule_times_factor_during_the_step_only(tmp_path, schedule):
    torch.manual_seed(0)
    dataset = IndexedRegression(160)
    model = ScheduledRegressor(dataset, batch_size=8, record_dir=str(tmp_path), lr=0.1, schedule=schedule)
    # the LR was tuned for a total batch of 8; the fixed split runs 16, so the linear rule doubles it
    cannikin = Cannikin(lr_scaling="linear", base_batch_size=8)
    trainer = quiet_trainer(
        CannikinStrategy(local_batch_sizes=[12, 4], start_method="fork"), 2, [cannikin], max_steps=6
    )
    trainer.fit(model)
    for rank in (0, 1):
        lrs = json.loads((tmp_path / f"lrs{rank}.json").read_text())
        assert len(lrs["stepped"]) == 6
        assert lrs["stepped"] == pytest.approx([2.0 * s for s in lrs["scheduled"]], rel=1e-12)
        # the scheduler kept control: outside optimizer.step() the LR is the schedule's own
        assert lrs["after"] == pytest.approx(lrs["final_schedule"], rel=1e-12)
        assert len(set(lrs["scheduled"])) > 1, "the schedule must actually move for this test to mean anything"


class SaveHistory(Callback):
    """Writes rank zero's Cannikin history (the re-plans) to a file at the end of training."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            cannikin = next(cb for cb in trainer.callbacks if isinstance(cb, Cannikin))
            self.path.write_text(json.dumps(cannikin.history))


@pytest.mark.parametrize("balance", [True, False], ids=["cannikin", "even-split"])
def test_total_batch_grows_only_at_epoch_ends_and_keeps_every_sample_once(tmp_path, balance):
    torch.manual_seed(0)
    # a noisy problem (large noise scale) on a cluster where each step has a large fixed cost: bigger is better
    dataset = IndexedRegression(480, seed=3)
    dataset.y += 3.0 * torch.randn_like(dataset.y)
    model = RecordingRegressor(dataset, batch_size=8, record_dir=str(tmp_path), lr=0.01)
    settings = CannikinSettings(
        min_noise_updates=5, noise_bound_sigmas=0, warmup_steps=4, adapt_every_n_steps=None, noise_every_n_steps=1
    )
    cannikin = Cannikin(max_batch_size=128, balance=balance, settings=settings)
    trainer = quiet_trainer(
        CannikinStrategy(start_method="fork"),
        2,
        [cannikin, EmulatedCluster([0.2, 0.6], fixed_ms=15.0), SaveHistory(tmp_path / "history.json")],
        max_epochs=4,
    )
    trainer.fit(model)
    records = read_records(tmp_path, 2)
    history = json.loads((tmp_path / "history.json").read_text())
    # the even-split baseline has nothing to probe: it re-plans at epoch ends only, from the one-size prior at first
    mid_epoch = [h["step"] for h in history if h["step"] % 30 and h["epoch"] == 0]
    assert bool(mid_epoch) == balance, history
    if not balance:
        assert all(len(a) - len(b) in (-1, 0, 1) for a, b in zip(records[0]["steps"], records[1]["steps"], strict=True))
    totals_per_epoch = {}
    for epoch in range(4):
        steps = [
            (a, b)
            for a, b, e in zip(records[0]["steps"], records[1]["steps"], records[0]["epochs"], strict=True)
            if e == epoch
        ]
        consumed = sorted(i for a, b in steps for i in a + b)
        assert consumed == list(range(480)), f"epoch {epoch} lost or repeated samples"
        totals = {len(a) + len(b) for a, b in steps[:-1]}  # the epoch's last batch may be partial
        assert len(totals) == 1, f"the total batch changed within epoch {epoch}: {totals}"
        totals_per_epoch[epoch] = totals.pop()
    assert totals_per_epoch[0] == 16
    assert max(totals_per_epoch.values()) > 16, f"the total batch never grew: {totals_per_epoch}"
    assert max(totals_per_epoch.values()) <= 128


class AdamRegressor(RecordingRegressor):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


class RecordNoiseInputs(Callback):
    """Records what the estimator is fed each step (runs after Cannikin.on_train_start created it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.inputs: list = []

    def on_train_start(self, trainer, pl_module):
        record_estimator_inputs(trainer, self.inputs)

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            self.path.write_text(json.dumps(self.inputs))


@pytest.mark.parametrize("every", [1, 2])
def test_adam_noise_statistics_use_the_preconditioned_gradient(tmp_path, every):
    # a measured step's statistics are folded in FOLD_DELAY measured steps later (rank zero's Y travels with the next
    # exchange, which is read a measured step after it is issued); every=2: steps 0 and 2
    max_steps = every * (1 + FOLD_DELAY) + 1
    dataset, initial, records, fed = fit_recording_noise(tmp_path, [24, 8], AdamRegressor, every, max_steps=max_steps)
    assert len(fed) == 2

    # replay: Adam on the union of each step's samples, and every group's gradient at the same parameters
    layer = nn.Linear(dataset.x.shape[1], 1)
    layer.load_state_dict(initial)
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.05)

    def gradient(index):
        layer.zero_grad()
        index = torch.tensor(index)
        nn.functional.mse_loss(layer(dataset.x[index]), dataset.y[index]).backward()
        return [p.grad.clone() for p in layer.parameters()]

    def squared(grads):
        total = 0.0
        for p, g in zip(layer.parameters(), grads, strict=True):
            state = optimizer.state.get(p, {})
            if "exp_avg_sq" in state:
                v_hat = state["exp_avg_sq"] / (1 - 0.999 ** float(state["step"]))
                g = g / (v_hat.sqrt() + 1e-8)
            total += float(g.pow(2).sum())
        return total

    for step in range(every + 1):
        groups = [r["steps"][step] for r in records]
        union = gradient([i for index in groups for i in index])
        if step % every == 0:
            local = [squared(gradient(index)) for index in groups]
            assert fed[step // every][0] == pytest.approx(local, rel=1e-4), f"step {step}: local norms"
            assert fed[step // every][2] == pytest.approx(squared(union), rel=1e-4), f"step {step}: global norm"
            assert fed[step // every][3] == every
        if step == every:  # Adam has second moments now: the preconditioned norm is measurably not the raw one
            raw = sum(float(g.pow(2).sum()) for g in gradient(groups[0]))
            assert abs(raw - fed[1][0][0]) > 1e-3 * raw
        for p, g in zip(layer.parameters(), union, strict=True):
            p.grad = g
        optimizer.step()


def fit_recording_noise(
    tmp_path, sizes, model_class=RecordingRegressor, noise_every=1, ddp_kwargs=None, **trainer_kwargs
):
    """A fixed-split run that records what the noise-scale estimator is fed; returns what a replay needs.

    With noise statistics every bucket goes through the comm hook (the records say it ran), on measured steps and
    the others alike; the total is fixed, so one step in ``noise_every`` is measured; ``ddp_kwargs`` go to DDP.
    """
    torch.manual_seed(0)
    dataset = IndexedRegression(256)
    model = model_class(dataset, batch_size=8, record_dir=str(tmp_path))
    initial = {k: v.clone() for k, v in model.layer.state_dict().items()}
    out = tmp_path / "inputs.json"
    settings = CannikinSettings(track_noise_scale=True, noise_exchange_every=1, noise_every_n_steps=noise_every)
    cannikin = Cannikin(settings=settings)
    trainer = quiet_trainer(
        CannikinStrategy(local_batch_sizes=sizes, start_method="fork", **(ddp_kwargs or {})),
        len(sizes),
        [cannikin, RecordNoiseInputs(out)],  # one exchange per measured step: FOLD_DELAY holds
        **trainer_kwargs,
    )
    trainer.fit(model)
    records = read_records(tmp_path, len(sizes))
    assert all(r["hook_calls"] > 0 for r in records), "the statistics took the comm hook"
    return dataset, initial, records, json.loads(out.read_text())


def squared_gradient_norm(dataset, parameters, index: list[int]) -> float:
    """``|g|^2`` of the mean-loss gradient over ``index`` at ``parameters`` (a state dict), in one process."""
    layer = nn.Linear(dataset.x.shape[1], 1)
    layer.load_state_dict(parameters)
    index = torch.tensor(index)
    nn.functional.mse_loss(layer(dataset.x[index]), dataset.y[index]).backward()
    return sum(float(p.grad.pow(2).sum()) for p in layer.parameters())


@pytest.mark.parametrize(
    "sizes, every, ddp_kwargs",
    [
        ([24, 8], 1, {}),
        ([20, 8, 4], 1, {}),
        ([20, 8, 4], 3, {}),
        ([20, 8, 4], 3, {"gradient_as_bucket_view": True}),
        ([20, 8, 4], 3, {"find_unused_parameters": True}),
        ([20, 8, 4], 3, {"static_graph": True}),
    ],
    ids=["every-2", "every-3", "one-in-3", "one-in-3-bucket-view", "one-in-3-find-unused", "one-in-3-static-graph"],
)
def test_noise_statistics_match_a_single_process_replay(tmp_path, sizes, every, ddp_kwargs):
    # every bucket through the comm hook, measured on every step or on one in three, with DDP's bucket views, unused
    # parameters and a static graph (whose first step reduces in a callback of DDP's own)
    dataset, initial, records, fed = fit_recording_noise(
        tmp_path, sizes, noise_every=every, ddp_kwargs=ddp_kwargs, max_steps=1 + FOLD_DELAY * every
    )
    ((local, group_sizes, global_sqr, _),) = fed  # step 0's, folded in at step FOLD_DELAY
    groups = [r["steps"][0] for r in records]
    assert group_sizes == sizes
    assert local == pytest.approx([squared_gradient_norm(dataset, initial, g) for g in groups], rel=1e-4)
    union = [i for g in groups for i in g]
    assert global_sqr == pytest.approx(squared_gradient_norm(dataset, initial, union), rel=1e-4)


def test_manual_optimization_measures_one_step_in_k_through_the_hook(tmp_path):
    # the loss cannot carry the weight: the hook applies it, and the statistics see each bucket before it does
    dataset, initial, records, fed = fit_recording_noise(
        tmp_path, [20, 8, 4], ManualRegressor, noise_every=2, max_steps=1 + FOLD_DELAY * 2
    )
    ((local, group_sizes, global_sqr, steps),) = fed  # step 0's, folded in at step 2 * FOLD_DELAY
    groups = [r["steps"][0] for r in records]
    assert group_sizes == [20, 8, 4] and steps == 2
    assert local == pytest.approx([squared_gradient_norm(dataset, initial, g) for g in groups], rel=1e-4)
    union = [i for g in groups for i in g]
    assert global_sqr == pytest.approx(squared_gradient_norm(dataset, initial, union), rel=1e-4)


@pytest.mark.parametrize("every", [1, 2])
def test_accumulation_micro_batches_are_noise_groups_of_their_own(tmp_path, every):
    dataset, initial, records, fed = fit_recording_noise(
        tmp_path, [24, 8], noise_every=every, max_steps=1 + FOLD_DELAY * every, accumulate_grad_batches=2
    )
    ((local, group_sizes, global_sqr, _),) = fed  # step 0's, folded in at step FOLD_DELAY
    micro_batches = [micro for r in records for micro in r["steps"][:2]]  # rank-major: r0m0, r0m1, r1m0, r1m1
    assert group_sizes == [24, 24, 8, 8]
    assert local == pytest.approx([squared_gradient_norm(dataset, initial, m) for m in micro_batches], rel=1e-4)
    union = [i for m in micro_batches for i in m]
    assert global_sqr == pytest.approx(squared_gradient_norm(dataset, initial, union), rel=1e-4)


@pytest.mark.parametrize("ddp_kwargs", [{}, {"static_graph": True}], ids=["dynamic", "static-graph"])
def test_measuring_one_step_in_two_feeds_the_estimator_exactly_those_steps(tmp_path, ddp_kwargs):
    # a measured step's numbers are the every-step run's (which the replay tests check); the step between is skipped.
    # Under a static graph step 2 is past DDP's first, delayed reduction: the steady state is captured right too
    (tmp_path / "every").mkdir()
    (tmp_path / "half").mkdir()
    *_, every_step = fit_recording_noise(tmp_path / "every", [24, 8], ddp_kwargs=ddp_kwargs, max_steps=3 + FOLD_DELAY)
    *_, sampled = fit_recording_noise(
        tmp_path / "half", [24, 8], ddp_kwargs=ddp_kwargs, max_steps=3 + 2 * FOLD_DELAY, noise_every=2
    )
    assert len(every_step) == 3 and len(sampled) == 2
    for got, want in zip(sampled, [every_step[0], every_step[2]], strict=True):
        assert got[1] == want[1] and got[0] == pytest.approx(want[0], rel=1e-6)
        assert got[2] == pytest.approx(want[2], rel=1e-6)
