"""Shared runner for the benchmarks: one training run on an emulated cluster, measured from rank zero.

Runs use Lightning's fork launcher so that many runs fit in one invocation without re-importing Lightning; rank zero
writes what it measured to a JSON file that the parent reads back.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.data import ImageClassifier, accuracy, load_dataset
from lightning_cannikin import EmulatedCluster
from lightning_cannikin.training.frontends.lightning_hooks import BalancingCallback


class EpochClock(Callback):
    """Rank zero's wall clock at every epoch start and at the end, plus the Cannikin history and test accuracy.

    With ``target_accuracy`` set, rank zero also evaluates the test set every ``eval_every_samples`` training samples
    (or at every epoch end), off the clock (the time spent evaluating is subtracted), records the curve, and stops
    every rank once the target is reached. Counting samples rather than steps keeps runs with different batch sizes
    on the same evaluation grid.
    """

    def __init__(
        self,
        out: Path,
        test_set: Any,
        target_accuracy: float | None = None,
        total_batch: int = 0,
        eval_every_samples: int | None = None,
        num_classes: int = 10,
    ) -> None:
        self.out = out
        self.num_classes = num_classes
        self.eval_every_samples = eval_every_samples
        self.next_eval = eval_every_samples or 0
        self.total_batch = total_batch
        self.test_set = test_set
        self.target_accuracy = target_accuracy
        self.epoch_starts: list[float] = []
        self.epoch_samples: list[int] = []
        self.step_sizes: list[list[int] | None] = []  # every rank's samples in each step (None: the even split)
        self.curve: list[dict[str, float]] = []
        self.eval_time = 0.0
        self.started = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epoch_starts.append(time.perf_counter())
        self.epoch_samples.append(0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        sizes = getattr(trainer.strategy, "step_sizes", None)
        self.step_sizes.append(list(sizes) if sizes else None)
        self.epoch_samples[-1] += sum(sizes) if sizes else len(batch[0]) * trainer.world_size
        # every rank counts the same samples, so every rank takes part in the same evaluations' broadcasts
        if self.target_accuracy is not None and self.eval_every_samples and sum(self.epoch_samples) >= self.next_eval:
            self.next_eval += self.eval_every_samples
            self._evaluate(trainer, pl_module)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.target_accuracy is not None and not self.eval_every_samples:
            self._evaluate(trainer, pl_module)

    def _evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        reached = False
        if trainer.is_global_zero:
            paused = time.perf_counter()
            value = accuracy(pl_module, self.test_set, num_classes=self.num_classes)
            pl_module.train()
            plan = getattr(trainer.strategy, "plan", None)
            cannikin = next((cb for cb in trainer.callbacks if isinstance(cb, BalancingCallback)), None)
            self.curve.append(
                {
                    "time": paused - self.started - self.eval_time,
                    "epoch": trainer.current_epoch,
                    "accuracy": value,
                    "total_batch_size": plan.total_batch_size if plan else self.total_batch,
                    "lr_factor": getattr(trainer.strategy, "lr_factor", 1.0),
                    "scheduled_lr": trainer.optimizers[0].param_groups[0]["lr"],
                    "samples": sum(self.epoch_samples),
                    "noise_scale": cannikin.noise_scale if cannikin is not None else None,
                    "noise_bounds": cannikin.engine.controller.noise.bounds if cannikin is not None else None,
                }
            )
            reached = value >= self.target_accuracy
            self.eval_time += time.perf_counter() - paused
        if trainer.strategy.broadcast(reached, src=0):
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        cannikin = next((cb for cb in trainer.callbacks if isinstance(cb, BalancingCallback)), None)
        result = {
            "epoch_times": [
                b - a for a, b in zip(self.epoch_starts, [*self.epoch_starts[1:], time.perf_counter()], strict=True)
            ],
            "epoch_samples": self.epoch_samples,
            "step_sizes": self.step_sizes,
            "history": cannikin.history if cannikin is not None else [],
            "test_accuracy": accuracy(pl_module, self.test_set, num_classes=self.num_classes),
            "wall_time": time.perf_counter() - self.started - self.eval_time,
            "curve": self.curve,
        }
        self.out.write_text(json.dumps(result))


def quiet_cpu_trainer(strategy: str, devices: int, max_epochs: int, callbacks: list[Callback]) -> pl.Trainer:
    """A benchmark's Trainer: CPU ranks, no logger, checkpoints, progress bar or model summary (nothing but the
    training on the clock)."""
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=max_epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def run(
    strategy: str,
    per_sample_ms: list[float],
    fixed_ms: float | list[float],
    batch_size: int,
    epochs: int,
    data: str = "digits",
    callbacks: list[Callback] | None = None,
    lr: float = 0.05,
    seed: int = 0,
    target_accuracy: float | None = None,
    train_samples: int | None = None,
    eval_every_samples: int | None = None,
    emulated: dict[str, Any] | None = None,
    task: tuple[Any, Any, Callable[[], pl.LightningModule], int] | None = None,
) -> dict[str, Any]:
    """Train once; returns rank zero's measurements. ``emulated``: more ``EmulatedCluster`` options (jitter, ...).
    ``task``: ``(train set, test set, module factory, number of classes)`` instead of ``data`` and the CNN."""
    torch.set_num_threads(1)
    pl.seed_everything(seed, verbose=False)
    if task is None:
        train, test, shape = load_dataset(data, seed=seed)
        task = (train, test, lambda: ImageClassifier(shape, lr=lr), 10)
    train, test, make_module, num_classes = task
    if train_samples is not None and train_samples < len(train):
        train = torch.utils.data.Subset(
            train, torch.randperm(len(train), generator=torch.Generator().manual_seed(0))[:train_samples].tolist()
        )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cluster = EmulatedCluster(per_sample_ms, fixed_ms, seed=seed, **(emulated or {}))
        # the hosts' emulated cost, where a scenario has one, is slept in the loader's collate_fn
        hosted = any(k.startswith("host_") for k in emulated or {})
        collate = cluster.collate_fn() if hosted else None
        clock = EpochClock(out, test, target_accuracy, batch_size * len(per_sample_ms), eval_every_samples, num_classes)
        trainer = quiet_cpu_trainer(strategy, len(per_sample_ms), epochs, [cluster, clock, *(callbacks or [])])
        trainer.fit(make_module(), DataLoader(train, batch_size=batch_size, shuffle=True, collate_fn=collate))
        return json.loads(out.read_text())


def median(values: list[float]) -> float:
    return float(statistics.median(values))
