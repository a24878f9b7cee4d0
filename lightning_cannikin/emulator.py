"""``EmulatedCluster``: make one machine behave like a cluster of devices with different speeds.

Each rank sleeps ``fixed_ms[rank] + per_sample_ms[rank] * b`` milliseconds inside every training step, after the
forward pass and before backward, where ``b`` is the rank's local batch size in that step. A sleeping process uses
no CPU, so several emulated devices fit on a couple of cores, and the true per-sample cost of every device is known.
It works with any strategy (plain DDP too), which is what makes side-by-side benchmarks fair.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor
from typing_extensions import override


def _as_per_rank(name: str, value: float | Sequence[float]) -> tuple[float, ...] | float:
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"`{name}` must be >= 0, got {value}.")
        return float(value)
    values = tuple(float(v) for v in value)
    if not values or any(v < 0 for v in values):
        raise ValueError(f"`{name}` must be non-negative milliseconds, one per rank, got {list(values)}.")
    return values


class EmulatedCluster(Callback):
    """Emulate heterogeneous devices by sleeping in each training step.

    Args:
        per_sample_ms: milliseconds per sample on each rank (one entry per rank, or one value for all). A rank with
            twice the value emulates a device half as fast.
        fixed_ms: milliseconds per step on each rank, independent of the batch (kernel launches, optimizer, ...).

    Example::

        trainer = Trainer(strategy="cannikin", devices=3, accelerator="cpu",
                          callbacks=[EmulatedCluster(per_sample_ms=[0.5, 1.0, 2.0], fixed_ms=20)])

    """

    def __init__(self, per_sample_ms: float | Sequence[float], fixed_ms: float | Sequence[float] = 0.0) -> None:
        self.per_sample_ms = _as_per_rank("per_sample_ms", per_sample_ms)
        self.fixed_ms = _as_per_rank("fixed_ms", fixed_ms)
        self._batch_size = 0

    def delay_ms(self, rank: int, batch_size: int) -> float:
        """The emulated extra time of ``rank`` for a local batch of ``batch_size`` samples."""
        per_sample = self.per_sample_ms if isinstance(self.per_sample_ms, float) else self.per_sample_ms[rank]
        fixed = self.fixed_ms if isinstance(self.fixed_ms, float) else self.fixed_ms[rank]
        return fixed + per_sample * batch_size

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # raised identically on every rank, so no rank is left waiting in a collective
        for name in ("per_sample_ms", "fixed_ms"):
            value = getattr(self, name)
            if isinstance(value, tuple) and len(value) != trainer.world_size:
                raise ValueError(
                    f"`{name}` has {len(value)} entries but the world size is {trainer.world_size}."
                    " Give one value per rank, or a single number for all ranks."
                )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_size = extract_batch_size(batch)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        time.sleep(self.delay_ms(trainer.global_rank, self._batch_size) / 1000.0)
