"""Small models and data sets shared by the multi-process tests (imported by forked ranks too)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class IndexedRegression(Dataset):
    """``(x, y, index)`` triples from a fixed random linear problem, so consumed indices can be audited."""

    def __init__(self, num_samples: int, dim: int = 4, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, dim, generator=generator)
        self.y = self.x @ torch.randn(dim, 1, generator=generator) + 0.1 * torch.randn(
            num_samples, 1, generator=generator
        )

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


class RecordingRegressor(pl.LightningModule):
    """Linear regression that records which sample indices each rank trained on, step by step.

    On ``on_train_end`` every rank writes ``rank{r}.json`` into ``record_dir``: the index lists per training step, the
    number of comm-hook calls, and the final parameters.
    """

    def __init__(self, dataset: Dataset, batch_size: int, record_dir: str, lr: float = 0.1, shuffle: bool = True):
        super().__init__()
        self.layer = nn.Linear(dataset.x.shape[1], 1)
        self.dataset = dataset
        self.batch_size = batch_size
        self.record_dir = record_dir
        self.lr = lr
        self.shuffle = shuffle
        self.steps: list[list[int]] = []
        self.epochs: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.steps.append(index.tolist())
        self.epochs.append(self.current_epoch)
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=self.shuffle)

    def on_train_end(self) -> None:
        strategy = self.trainer.strategy
        record = {
            "steps": self.steps,
            "epochs": self.epochs,
            "hook_calls": strategy.engine.reductions.comm_hook()[0].calls if hasattr(strategy, "engine") else None,
            "params": {k: v.tolist() for k, v in self.layer.state_dict().items()},
        }
        Path(self.record_dir, f"rank{self.global_rank}.json").write_text(json.dumps(record))


class ManualRegressor(RecordingRegressor):
    """Manual optimization (``manual_backward``; Lightning's DDP reduces nothing after a bare ``loss.backward()``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.steps.append(index.tolist())
        self.epochs.append(self.current_epoch)
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self.layer(x), y))
        optimizer.step()


def read_records(record_dir: Path, world_size: int) -> list[dict]:
    return [json.loads((Path(record_dir) / f"rank{r}.json").read_text()) for r in range(world_size)]


def accumulation_windows(records: list[dict], accumulate: int) -> list[tuple[int, int]]:
    """``(start, end)`` of every optimizer step's window of recorded steps: ``accumulate`` steps, cut short at the end
    of an epoch as Lightning does."""
    steps, epochs = records[0]["steps"], records[0]["epochs"]
    windows, start = [], 0
    while start < len(steps):
        end = start
        while end < len(steps) and end - start < accumulate and epochs[end] == epochs[start]:
            end += 1
        windows.append((start, end))
        start = end
    return windows


def quiet_trainer(strategy, devices: int, callbacks=(), **kwargs) -> pl.Trainer:
    """A CPU Trainer without loggers, checkpoints, progress bars or summaries unless asked for."""
    options = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    options.update(kwargs)
    return pl.Trainer(strategy=strategy, devices=devices, accelerator="cpu", callbacks=list(callbacks), **options)


# every cannikin/* metric the README promises a logger receives (with noise tracking on)
CANNIKIN_METRICS = {
    "cannikin/total_batch_size",
    "cannikin/local_batch_size",
    "cannikin/lr_factor",
    "cannikin/step_time",
    "cannikin/predicted_step_time",
    "cannikin/prediction_error",
    "cannikin/noise_scale",
    "cannikin/efficiency",
}


def record_estimator_inputs(trainer: pl.Trainer, into: list) -> None:
    """Append what the Cannikin callback's noise-scale estimator is fed, ``[local, sizes, global_sqr, steps]`` per
    update, to ``into`` (call it at train start, once the callback has built its estimator)."""
    from lightning_cannikin import Cannikin

    estimator = next(cb for cb in trainer.callbacks if isinstance(cb, Cannikin)).engine.controller.estimator
    update = estimator.update

    def recording(local, sizes, global_sqr, steps=1):
        into.append([list(local), list(sizes), global_sqr, steps])
        return update(local, sizes, global_sqr, steps)

    estimator.update = recording
