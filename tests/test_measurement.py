"""The measurement glue with real ranks (CPU/gloo, fork launcher): where the forward start is taken, the error a
rank gets when it runs out of memory, the SyncBatchNorm warning."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_cannikin import Cannikin, CannikinStrategy
from lightning_cannikin.core.plan import BatchBounds
from lightning_cannikin.training.frontends.strategy_checks import warn_about_sync_batchnorm
from lightning_cannikin.training.measurement.device_memory import LocalBatchOutOfMemoryError, out_of_memory_error
from lightning_cannikin.training.measurement.step_timer import FORWARD
from tests.models import IndexedRegression, RecordingRegressor, quiet_trainer


class SubmoduleRegressor(RecordingRegressor):
    """A training step that calls a submodule, never ``self(...)``, and notes when its body starts."""

    def training_step(self, batch, batch_idx):
        self.body_started = time.perf_counter()
        x, y, _ = batch
        return nn.functional.mse_loss(self.layer(x), y)


class ForwardSpy(Callback):
    """Per step: when DDP's forward was entered, the timer's forward start, and when the step's body started."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: list[tuple[float, float | None, float]] = []
        self.ddp_entered = 0.0

    def on_train_start(self, trainer, pl_module):
        def entered(module, args):
            self.ddp_entered = time.perf_counter()

        trainer.strategy.model.register_forward_pre_hook(entered)  # the DDP wrapper, before its pre-forward work

    def on_before_backward(self, trainer, pl_module, loss):
        forward = trainer.strategy.engine.reductions.timer._marks[FORWARD]
        self.rows.append((self.ddp_entered, forward, pl_module.body_started))

    def on_train_end(self, trainer, pl_module):
        (self.out / f"spy{trainer.global_rank}.json").write_text(json.dumps(self.rows))


def test_forward_start_is_after_ddp_pre_forward_and_before_the_step_body(tmp_path):
    torch.manual_seed(0)
    model = SubmoduleRegressor(IndexedRegression(96), batch_size=8, record_dir=str(tmp_path))
    trainer = quiet_trainer(CannikinStrategy(start_method="fork"), 2, [Cannikin(), ForwardSpy(tmp_path)], max_steps=4)
    trainer.fit(model)
    for rank in range(2):
        rows = json.loads((tmp_path / f"spy{rank}.json").read_text())
        assert len(rows) == 4
        for ddp_entered, forward, body in rows:
            assert forward is not None, "every step has a forward start, whatever training_step calls"
            assert ddp_entered <= forward <= body


class OutOfMemoryRegressor(RecordingRegressor):
    def training_step(self, batch, batch_idx):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


class OutOfMemoryInBackward(Callback):
    def on_before_backward(self, trainer, pl_module, loss):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_out_of_memory_names_the_rank_its_batch_and_the_bounds(tmp_path, where):
    torch.manual_seed(0)
    model_class = OutOfMemoryRegressor if where == "forward" else RecordingRegressor
    model = model_class(IndexedRegression(64), batch_size=8, record_dir=str(tmp_path))
    callbacks = [Cannikin(local_batch_bounds=(2, [30, 30]))]
    if where == "backward":
        callbacks.append(OutOfMemoryInBackward())
    trainer = quiet_trainer(CannikinStrategy(start_method="fork"), 2, callbacks, max_steps=2)
    # every rank fails alike here, so none is left waiting in a collective
    with pytest.raises(Exception, match=r"CUDA out of memory on rank [01] \(cpu\) at a local batch of 8 samples") as e:
        trainer.fit(model)
    assert "`local_batch_bounds` is (lower [2, 2], upper [30, 30])" in str(e.value)
    assert "split in force is [8, 8]" in str(e.value)


def test_out_of_memory_error_is_still_an_out_of_memory_error():
    error = out_of_memory_error(2, 96, (128, 64, 96), BatchBounds((1, 1, 1), None))
    assert isinstance(error, torch.cuda.OutOfMemoryError) and isinstance(error, LocalBatchOutOfMemoryError)
    message = str(error)
    assert message.startswith("CUDA out of memory on rank 2 at a local batch of 96 samples")
    assert "upper None" in message and "entry 2 is below 96" in message


def test_sync_batchnorm_is_warned_about():
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    assert not warn_about_sync_batchnorm(plain)
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(plain)
    with pytest.warns(UserWarning, match="SyncBatchNorm"):
        assert warn_about_sync_batchnorm(synced)
