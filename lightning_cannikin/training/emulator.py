"""``EmulatedCluster``: make one machine behave like a cluster of devices with different speeds.

Each rank sleeps ``fixed_ms[rank] + per_sample_ms[rank] * b`` milliseconds inside every training step, after the
forward pass and before backward, where ``b`` is the rank's local batch size in that step, or, with ``batch_cost``,
the summed cost (e.g. tokens) of what the rank holds: variable-length data. A sleeping process uses
no CPU, so several emulated devices fit on a couple of cores, and the true per-sample cost of every device is known.
It works with any strategy (plain DDP too), which is what makes side-by-side benchmarks fair.

A rank's host can be emulated too: :meth:`EmulatedCluster.collate_fn` wraps a DataLoader's ``collate_fn`` so that
preparing each batch sleeps ``host_fixed_ms[rank] + host_per_sample_ms[rank] * b`` in the input pipeline, outside the
training step: in series with it without loader workers, hidden behind it where workers keep ahead. So can its
optimizer step (``optimizer_ms``), slept after the gradients are reduced.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor
from torch.utils.data import default_collate
from typing_extensions import override

from lightning_cannikin.simulation.emulated_devices import EmulatedDevices
from lightning_cannikin.training._lightning_compat import loop_meets_each_step

__all__ = ["EmulatedCluster", "loop_meets_each_step"]


class EmulatedCluster(Callback):
    """Emulate heterogeneous devices by sleeping in each training step.

    Args:
        per_sample_ms: milliseconds per sample on each rank (one entry per rank, or one value for all). A rank with
            twice the value emulates a device half as fast.
        fixed_ms: milliseconds per step on each rank, independent of the batch (kernel launches, optimizer, ...).
        speed_changes: from a training step (counted from 0 in this fit, every batch) on, new ``per_sample_ms``:
            e.g. ``{200: [1.0, 3.0]}`` makes rank 1 three times slower at step 200 (drift, a shared GPU).
        jitter_ms: standard deviation of per-step noise (real devices are jittery).
        warmup_steps: the first steps are slower, step 0 by ``warmup_factor``, decaying to normal (real devices
            warm up: allocator, caches, autotuning).
        warmup_factor: how much slower step 0 is.
        saturation_batch: below this local batch the step costs as much as at it (a GPU is not busy at small batches).
        seed: seed of the jitter.
        contention: ``{rank: (factor, every)}``: that rank is ``factor`` times slower on every ``every``-th step (a
            GPU shared with another job, an input pipeline that stalls periodically), e.g. ``{2: (2.5, 3)}``.
        batch_cost: a function of the local batch giving its summed cost (``lambda batch: batch["lengths"].sum()``):
            the rank is then charged ``per_sample_ms`` per unit of that cost instead of per sample.
        host_per_sample_ms: milliseconds per sample that each rank's host spends preparing a batch (one entry per
            rank, or one value for all), slept in the DataLoader's ``collate_fn`` that :meth:`collate_fn` returns.
        host_fixed_ms: milliseconds per batch of each rank's host, whatever its size.
        optimizer_ms: milliseconds of each rank's optimizer step (one entry per rank, or one value for all), slept
            before every ``optimizer.step()``: after the gradients are reduced, outside the compute span (a slower
            device's optimizer step takes longer, and the next step waits for it).

    The cost model is :class:`~lightning_cannikin.simulation.emulated_devices.EmulatedDevices`; every option but the
    first is off by default.

    Example::

        trainer = Trainer(strategy="cannikin", devices=3, accelerator="cpu",
                          callbacks=[EmulatedCluster(per_sample_ms=[0.5, 1.0, 2.0], fixed_ms=20)])

        # equal devices on hosts of unequal speed: the hosts' cost is in the input pipeline
        cluster = EmulatedCluster(per_sample_ms=1.0, fixed_ms=20, host_per_sample_ms=[0.25, 0.5, 1.0])
        loader = DataLoader(dataset, batch_size=32, collate_fn=cluster.collate_fn())

    """

    def __init__(
        self,
        per_sample_ms: float | Sequence[float],
        fixed_ms: float | Sequence[float] = 0.0,
        speed_changes: dict[int, float | Sequence[float]] | None = None,
        jitter_ms: float = 0.0,
        warmup_steps: int = 0,
        warmup_factor: float = 1.0,
        saturation_batch: float | Sequence[float] = 0.0,
        seed: int = 0,
        contention: dict[int, tuple[float, int]] | None = None,
        batch_cost: Callable[[Any], float] | None = None,
        host_per_sample_ms: float | Sequence[float] = 0.0,
        host_fixed_ms: float | Sequence[float] = 0.0,
        optimizer_ms: float | Sequence[float] = 0.0,
    ) -> None:
        self.devices = EmulatedDevices(
            per_sample_ms,
            fixed_ms,
            speed_changes or {},
            jitter_ms,
            warmup_steps,
            warmup_factor,
            saturation_batch,
            seed,
            contention or {},
            host_per_sample_ms,
            host_fixed_ms,
            optimizer_ms,
        )
        self.batch_cost = batch_cost
        self._batch_size: float = 0
        self._step = 0

    def delay_ms(self, rank: int, batch_size: float, step: int = 0) -> float:
        """The emulated extra time of ``rank`` for a local batch of ``batch_size`` samples (or units of cost) at
        training step ``step``."""
        return self.devices.delay_ms(rank, batch_size, step)

    def collate_fn(self, collate: Callable[[list[Any]], Any] | None = None) -> Callable[[list[Any]], Any]:
        """``collate`` (default: torch's ``default_collate``) behind each rank's emulated host cost: pass it as the
        training DataLoader's ``collate_fn``. It runs where the loader collates (the training process without
        workers, a worker with them) and reads the rank from the process group."""
        return _HostCollate(self.devices, collate or default_collate)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # raised identically on every rank, so no rank is left waiting in a collective
        self.devices.check_world_size(trainer.world_size)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_size = float(self.batch_cost(batch)) if self.batch_cost is not None else extract_batch_size(batch)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        time.sleep(self.delay_ms(trainer.global_rank, self._batch_size, self._step) / 1000.0)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        time.sleep(self.devices.optimizer_ms_of(trainer.global_rank) / 1000.0)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._step += 1


class _HostCollate:
    """A collate function that first sleeps its rank's emulated host cost for the batch (picklable, for workers)."""

    def __init__(self, devices: EmulatedDevices, collate: Callable[[list[Any]], Any]) -> None:
        self.devices = devices
        self.collate = collate

    def __call__(self, samples: list[Any]) -> Any:
        # a worker forked from a rank keeps its process group's rank; outside a group there is one rank
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        time.sleep(self.devices.host_ms(rank, len(samples)) / 1000.0)
        return self.collate(samples)
