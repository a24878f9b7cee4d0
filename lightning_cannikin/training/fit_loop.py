"""The Lightning side of a re-plan: gathering every rank's records, then the plan, the epoch's length, the accumulation.

A new total batch decided at an epoch end takes effect when Lightning rebuilds the loader (``reload_dataloaders_every
_n_epochs``), with the accumulation set on the Trainer as Lightning's ``GradientAccumulationScheduler`` sets it. A new
total decided mid-epoch lands on the next global batch not yet handed out, with the accumulation in force, and the
epoch ends when its samples run out: Lightning must be told the epoch's new number of global batches.

Lightning reads the training loader's length once, when it builds the loader, into four places: the fit loop's
``max_batches`` (``trainer.num_training_batches``: where the epoch ends), the data fetcher's ``length`` (which flags
the last batch, so a partial accumulation window still steps and epoch-interval schedulers run), the combined
loader's limits, and the validation cadence ``val_check_batch``. A total batch changed mid-epoch changes the epoch's
length, and so does resuming an epoch whose total changed before the checkpoint. Left stale, a longer epoch would be
cut short (samples dropped) and a shorter one would end without its last-batch bookkeeping (no epoch-end validation).

These are Lightning internals (checked on 2.6): ``tests/test_mid_epoch_total.py`` fails if they move.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher

from lightning_cannikin.core.plan import Plan
from lightning_cannikin.training.runtime import RuntimeState

__all__ = ["adopt_plan", "all_gather", "epoch_resizable", "sync_epoch_length"]


def all_gather(obj: Any) -> list[Any]:
    """One object per rank (a single-process run returns ``[obj]``)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def adopt_plan(
    trainer: pl.Trainer, runtime: RuntimeState, plan: Plan, mid_epoch: bool, from_batch: int, probe_steps: int = 0
) -> None:
    """Put a plan every rank decided alike in force (from global batch ``from_batch`` when ``mid_epoch``); a probe
    (``probe_steps`` > 0) mid-epoch alternates with the split it leaves for that many global batches."""
    current = runtime.plan
    total_changed = current is not None and plan.total_batch_size != current.total_batch_size
    if total_changed:
        # the next epoch's length changes with the total batch: Lightning must rebuild the loader to see it
        trainer.reload_dataloaders_every_n_epochs = max(trainer.reload_dataloaders_every_n_epochs, 1)
    if not mid_epoch:
        trainer.accumulate_grad_batches = plan.accumulation_steps
        runtime.adopt(plan, None if total_changed else 0)  # a new total waits for the rebuilt loader
        return
    interleave = (current, probe_steps) if current is not None and probe_steps > 0 else None
    runtime.adopt(plan, from_batch=from_batch, interleave=interleave)
    if total_changed and runtime.sampler is not None:
        sync_epoch_length(trainer, len(runtime.sampler))


def epoch_resizable(trainer: pl.Trainer) -> bool:
    """Whether the running epoch's length may follow the loader: the whole loader is trained on (no
    ``limit_train_batches``) through Lightning's own fetcher (not a ``dataloader_iter`` training step)."""
    limit = trainer.limit_train_batches
    fetcher = trainer.fit_loop._data_fetcher
    return isinstance(limit, float) and limit == 1.0 and isinstance(fetcher, _PrefetchDataFetcher)


def sync_epoch_length(trainer: pl.Trainer, batches: int) -> bool:
    """Make the fit loop end the running epoch after ``batches`` global batches; whether anything changed."""
    loop = trainer.fit_loop
    if not epoch_resizable(trainer) or loop.max_batches == batches:
        return False
    loop.max_batches = batches
    combined = loop._combined_loader
    if combined is not None:
        combined.limits = [batches] * len(combined.flattened)
    fetcher = loop._data_fetcher
    if fetcher is not None and fetcher.length is not None:
        fetcher.length = batches
        fetcher.done = fetcher.fetched >= batches
    timed = getattr(trainer, "_val_check_time_interval", None) is not None
    if isinstance(trainer.val_check_interval, float) and trainer.val_check_batch is not None and not timed:
        # Lightning's own rule for a fractional interval; an integer interval is the user's batch count and stays
        trainer.val_check_batch = max(1, int(batches * trainer.val_check_interval))
    return True
