"""The adaptive layer step by step: per-step AdaScale, progress schedules, mid-epoch totals, accumulation.

Every run is real ranks (fork launcher, gloo). Noise dominates (labels of pure noise), and where the total batch
changes the step-time model is replaced by a fixed, known cost (the ranks are forked, so they see the patch): the
decisions then depend only on the noise scale, which a checkpoint restores exactly, so an interrupted run can be
compared with an uninterrupted one. Measured timing would make them depend on this machine's load.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_cannikin import Cannikin, CannikinSettings, CannikinStrategy, EmulatedCluster
from lightning_cannikin.core.goodput import adascale_gain
from lightning_cannikin.core.noise_scale import NoiseScaleEstimator
from lightning_cannikin.core.speed_model import SpeedModel
from lightning_cannikin.training.measurement.grad_stats import FOLD_DELAY
from lightning_cannikin.training.schedules import progress_lr_lambda
from tests.models import IndexedRegression, RecordingRegressor, quiet_trainer, read_records, record_estimator_inputs


def noisy_dataset(num_samples: int) -> IndexedRegression:
    dataset = IndexedRegression(num_samples, seed=3)
    dataset.y = 5.0 * torch.randn(dataset.y.shape, generator=torch.Generator().manual_seed(4))  # no signal at all
    return dataset


class StepRecorder(RecordingRegressor):
    """Also records, per micro-step, the accumulation in force and the LR each optimizer step actually used."""

    def __init__(self, *args, schedule=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.schedule = schedule
        self.accumulation: list[int] = []
        self.stepped_lrs: list[float] = []
        self.validated: list[int] = []

    def training_step(self, batch, batch_idx):
        self.accumulation.append(self.trainer.accumulate_grad_batches)
        return super().training_step(batch, batch_idx)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.dataset, batch_size=64)

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            self.validated.append(self.current_epoch)

    def on_before_optimizer_step(self, optimizer):
        self.stepped_lrs.append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.schedule is None:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, progress_lr_lambda(self.trainer, self.schedule))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_end(self):
        super().on_train_end()
        cannikin = next(cb for cb in self.trainer.callbacks if isinstance(cb, Cannikin))
        extra = {
            "accumulation": self.accumulation,
            "stepped_lrs": self.stepped_lrs,
            "validated": self.validated,
            "progress": cannikin.progress.value,
            "noise_inputs": getattr(self, "noise_inputs", []),
            "epoch_lengths": getattr(self, "epoch_lengths", []),
        }
        Path(self.record_dir, f"extra{self.global_rank}.json").write_text(json.dumps(extra))


class RecordInputsAndLengths(Callback):
    """Every rank: what its noise estimator is fed, and at each epoch end the batches Lightning counted vs ran."""

    def on_train_start(self, trainer, pl_module):
        pl_module.noise_inputs = []
        pl_module.epoch_lengths = []
        record_estimator_inputs(trainer, pl_module.noise_inputs)

    def on_train_epoch_end(self, trainer, pl_module):
        ran = sum(1 for e in pl_module.epochs if e == trainer.current_epoch)
        pl_module.epoch_lengths.append([trainer.num_training_batches, ran])


def extras(record_dir: Path, world_size: int) -> list[dict]:
    return [json.loads((record_dir / f"extra{r}.json").read_text()) for r in range(world_size)]


def fit(
    record_dir,
    cannikin,
    *,
    num_samples=480,
    batch_size=8,
    schedule=None,
    ckpt_path=None,
    callbacks=(),
    model=None,
    **kw,
):
    torch.manual_seed(0)
    model = (model or StepRecorder)(noisy_dataset(num_samples), batch_size, str(record_dir), lr=0.01, schedule=schedule)
    initial = copy.deepcopy(model.layer.state_dict())
    emulated = EmulatedCluster([0.1, 0.1], fixed_ms=20.0)
    trainer = quiet_trainer(
        CannikinStrategy(start_method="fork"), 2, [cannikin, emulated, RecordInputsAndLengths(), *callbacks], **kw
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return initial, read_records(record_dir, 2), extras(record_dir, 2)


def epoch_steps(records, epoch):
    rows = zip(records[0]["steps"], records[1]["steps"], records[0]["epochs"], strict=True)
    return [(a, b) for a, b, e in rows if e == epoch]


def test_per_step_gain_and_progress_schedule_equal_the_formula_on_a_replay(tmp_path):
    # a fixed total of 16 against a base of 8: the AdaScale gain moves with the noise scale at every step
    def schedule(progress):
        return 1.0 / (1.0 + 0.05 * progress)

    settings = CannikinSettings(
        min_noise_updates=3,
        noise_bound_sigmas=0,
        warmup_steps=1000,
        adapt_every_n_steps=None,
        noise_exchange_every=1,
        noise_every_n_steps=1,
    )
    cannikin = Cannikin(
        base_batch_size=8, settings=settings
    )  # one step per exchange: each step's statistics arrive FOLD_DELAY steps later
    _, _, extra = fit(tmp_path, cannikin, schedule=schedule, max_steps=25)
    assert extra[0]["stepped_lrs"] == extra[1]["stepped_lrs"], "the ranks stepped with different learning rates"
    assert extra[0]["noise_inputs"] == extra[1]["noise_inputs"], "the ranks' estimators were fed different numbers"
    fed = extra[0]["noise_inputs"]
    assert len(fed) == 25 - FOLD_DELAY  # each step's statistics are folded in FOLD_DELAY steps later
    # replay: a fresh estimator on the same inputs, the gain formula, progress as the sum of the gains
    estimator, gain, progress, expected, gains = NoiseScaleEstimator(8), 1.0, 0.0, [], []
    for step in range(25):
        expected.append(0.01 * schedule(progress) * gain)
        gains.append(gain)
        progress += gain
        if step >= FOLD_DELAY:
            estimator.update(*fed[step - FOLD_DELAY])
            if estimator.num_updates >= 3:
                gain = float(adascale_gain(estimator.noise_scale, 16, 8))
    assert extra[0]["stepped_lrs"] == pytest.approx(expected, rel=1e-9)
    assert extra[0]["progress"] == pytest.approx(progress, rel=1e-12)
    # no factor before `min_noise_updates` steps of statistics (steps 0-2, folded at the ends of steps 2-4)
    assert gains[: 3 + FOLD_DELAY] == [1.0] * (3 + FOLD_DELAY)
    assert len({round(g, 6) for g in gains[4:]}) > 10, "the gain must move from step to step for this to mean anything"


def known_step_times(monkeypatch, accumulation_is_free: bool = False) -> None:
    """Step time ``20 ms + 0.1 ms x the largest local batch`` per micro-step; optionally, micro-steps beyond the first
    free (a cluster whose reduction and optimizer dominate)."""

    def predict(self, local_batch_sizes, accumulation_steps=1):
        seconds = 0.02 + 1e-4 * np.max(np.asarray(local_batch_sizes, dtype=float), axis=-1)
        return seconds if accumulation_is_free else seconds * np.asarray(accumulation_steps)

    monkeypatch.setattr(SpeedModel, "predict", predict)


def total_changing_cannikin(lr_scaling: str = "adascale", base_batch_size: int | None = None, **kwargs) -> Cannikin:
    settings = CannikinSettings(
        **{
            "min_noise_updates": 3,
            "noise_bound_sigmas": 0,
            "adapt_every_n_steps": 6,
            "noise_every_n_steps": 1,
            **kwargs,
        }
    )
    return Cannikin(48, None, lr_scaling, base_batch_size, balance=False, settings=settings)


def test_mid_epoch_total_change_keeps_every_sample_once_and_lightning_counts_the_epoch(tmp_path, monkeypatch):
    known_step_times(monkeypatch)
    _, records, extra = fit(tmp_path, total_changing_cannikin(), max_epochs=2, limit_val_batches=1)
    for epoch in (0, 1):
        steps = epoch_steps(records, epoch)
        consumed = sorted(i for a, b in steps for i in a + b)
        assert consumed == list(range(480)), f"epoch {epoch} lost or repeated samples"
    totals = [len(a) + len(b) for a, b in epoch_steps(records, 0)]
    assert totals[0] == 16 and totals[-2] == 48, f"the total did not change mid-epoch: {totals}"
    assert len(records[0]["steps"]) == len(records[1]["steps"])
    # Lightning was told the epoch's new length: its count matches the batches run, and epoch-end validation ran
    for lengths in extra[0]["epoch_lengths"]:
        assert lengths[0] == lengths[1], extra[0]["epoch_lengths"]
    assert extra[0]["validated"] == [0, 1]


class PrefetchingRecorder(StepRecorder):
    """A loader worker that draws batches ahead of the training step."""

    def train_dataloader(self):
        return DataLoader(
            self.dataset, batch_size=self.batch_size, shuffle=self.shuffle, num_workers=1, prefetch_factor=3
        )


def test_every_step_runs_at_the_lr_factor_of_the_plan_it_ran(tmp_path, monkeypatch):
    # a loader with workers prefetches, so a total decided mid-epoch starts a few batches after the decision: the
    # steps in between still run the old total, and must run its learning rate ("linear": lr x total / B0)
    known_step_times(monkeypatch)
    cannikin = total_changing_cannikin(lr_scaling="linear", base_batch_size=8)
    _, records, extra = fit(tmp_path, cannikin, max_epochs=1, model=PrefetchingRecorder)
    totals = [len(a) + len(b) for a, b in epoch_steps(records, 0)][:-1]  # the epoch's last batch may be partial
    assert totals[0] == 16 and 48 in totals, f"the total did not change mid-epoch: {totals}"
    assert extra[0]["stepped_lrs"][: len(totals)] == pytest.approx([0.01 * total / 8 for total in totals], rel=1e-12)


@pytest.mark.parametrize(  # mid-epoch after the change, or that epoch's end; the noise of every step or one in two
    "stop, every", [("after_change", 1), ("epoch_end", 1), ("after_change", 2)]
)
def test_mid_epoch_total_change_resumes_exactly(tmp_path, monkeypatch, stop, every):
    known_step_times(monkeypatch)
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    # one step in two measured: exchanged every 2 measured steps, so that what is measured after the resume reaches
    # the estimator (and the learning rate) before the run ends
    exchange = 8 if every == 1 else 2
    cannikin = lambda: total_changing_cannikin(noise_every_n_steps=every, noise_exchange_every=exchange)  # noqa: E731
    _, uninterrupted, _ = fit(tmp_path / "a", cannikin(), max_epochs=2)
    per_epoch = [[len(a) + len(b) for a, b in epoch_steps(uninterrupted, epoch)] for epoch in (0, 1)]
    # the first epoch whose total changes mid-epoch (16 -> 32 -> 48: each move at most doubles what a rank ran)
    moves = [(e, i) for e, totals in enumerate(per_epoch) for i in range(1, len(totals)) if totals[i] != totals[i - 1]]
    assert moves, f"the total must change mid-epoch: {per_epoch}"
    epoch, changed = moves[0]
    totals = per_epoch[epoch]
    assert 0 < changed < len(totals) - 3, f"the total must change mid-epoch: {totals}"
    before = sum(len(t) for t in per_epoch[:epoch])
    stop_step = before + (changed + 2 if stop == "after_change" else len(totals))

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=stop_step, save_top_k=-1)
    _, first, _ = fit(tmp_path / "b", cannikin(), max_steps=stop_step, callbacks=[saver], enable_checkpointing=True)
    (ckpt,) = sorted((tmp_path / "ckpt").glob(f"*step={stop_step}*.ckpt"))
    _, resumed, extra = fit(tmp_path / "c", cannikin(), max_epochs=2, ckpt_path=str(ckpt))

    for epoch in (0, 1):
        seen = sorted(i for records in (first, resumed) for a, b in epoch_steps(records, epoch) for i in a + b)
        assert seen == list(range(480)), f"epoch {epoch}: the resumed run lost or repeated samples"
    for lengths in extra[0]["epoch_lengths"]:
        assert lengths[0] >= lengths[1], extra[0]["epoch_lengths"]  # a resumed epoch ran only its remainder
    for name, value in uninterrupted[0]["params"].items():
        error = (torch.tensor(resumed[0]["params"][name]) - torch.tensor(value)).abs().max().item()
        assert error < 1e-6, f"{name} differs by {error} after resuming at step {stop_step}"


def test_totals_reached_by_accumulation_give_the_exact_mean_gradient(tmp_path, monkeypatch):
    # The speed model prices every micro-step as a full step (the tail of a micro-step without a reduction is not
    # measured apart), so on its own it never finds accumulation worth it. Stand in for a cluster whose reduction and
    # optimizer dominate: micro-steps beyond the first cost nothing.
    known_step_times(monkeypatch, accumulation_is_free=True)
    settings = CannikinSettings(
        min_noise_updates=3, noise_bound_sigmas=0, adapt_every_n_steps=None, noise_every_n_steps=1
    )
    cannikin = Cannikin(max_batch_size=48, balance=False, local_batch_bounds=8, lr_scaling="none", settings=settings)
    initial, records, extra = fit(tmp_path, cannikin, max_epochs=2)
    accumulation = extra[0]["accumulation"]
    epochs = records[0]["epochs"]
    assert {a for a, e in zip(accumulation, epochs, strict=True) if e == 0} == {1}
    assert {a for a, e in zip(accumulation, epochs, strict=True) if e == 1} == {3}, "accumulation was not adopted"
    assert all(len(s) <= 8 for r in records for s in r["steps"]), "a micro-batch exceeded the cap"
    for epoch in (0, 1):
        assert sorted(i for a, b in epoch_steps(records, epoch) for i in a + b) == list(range(480))
    # replay: one SGD step per accumulation window, on the mean loss over every sample of the window
    dataset = noisy_dataset(480)
    layer = nn.Linear(dataset.x.shape[1], 1)
    layer.load_state_dict(initial)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.01)
    start = 0
    while start < len(epochs):
        end = start
        while end < len(epochs) and end - start < accumulation[start] and epochs[end] == epochs[start]:
            end += 1
        index = torch.tensor([i for r in records for s in r["steps"][start:end] for i in s])
        optimizer.zero_grad()
        nn.functional.mse_loss(layer(dataset.x[index]), dataset.y[index]).backward()
        optimizer.step()
        start = end
    for name, value in layer.state_dict().items():
        error = max((torch.tensor(r["params"][name]) - value).abs().max().item() for r in records)
        assert error < 1e-5, f"{name} differs from the exact mean-gradient replay by {error}"


def test_max_batch_size_below_the_initial_total_fails_before_training(tmp_path):
    model = RecordingRegressor(noisy_dataset(64), batch_size=16, record_dir=str(tmp_path))
    trainer = quiet_trainer(CannikinStrategy(start_method="fork"), 2, [Cannikin(max_batch_size=8)], max_steps=2)
    # raised on every rank alike (the fork launcher re-raises rank zero's), before the first step
    with pytest.raises(Exception, match=r"`max_batch_size`=8 is smaller than the initial total batch of 32"):
        trainer.fit(model)
    assert not (tmp_path / "rank0.json").exists(), "no training may happen"


def test_progress_schedule_without_cannikin_runs_on_the_step_count():
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    lr_lambda = progress_lr_lambda(trainer, lambda progress: math.exp(-progress))
    assert [lr_lambda(step) for step in (0, 1, 2)] == pytest.approx([1.0, math.exp(-1), math.exp(-2)])
