"""What a fit's arguments tell before any process is launched: the checks that need only the Trainer's arguments, the
balancing callback's settings and a training DataLoader passed to ``fit``, run in the launching process.

Without them a configuration error arrives after the launcher has started every rank (tens of seconds on a small
machine). The launchers are Lightning's own, subclassed so that ``launch`` checks before it spawns (or, under torchrun
or SLURM, in every process before the process group exists). The rest is checked where it is today, in every rank.

Which loader is checked here: only a DataLoader given to ``trainer.fit(train_dataloaders=...)``. A datamodule's or a
LightningModule's ``train_dataloader()`` may build its dataset (a download, a tokenisation), which the ranks would
do again; it is checked in the ranks, before any collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from lightning_cannikin.core.plan import BatchBounds, Plan
from lightning_cannikin.training._lightning_compat import (
    MultiProcessingLauncher,
    SubprocessScriptLauncher,
    _ShardedLauncher,
    fit_arguments,
    uses_distributed_sampler,
)
from lightning_cannikin.training.data.loader import check_trainable, loader_batch_size
from lightning_cannikin.training.frontends.lightning_hooks import BalancingCallback
from lightning_cannikin.training.frontends.strategy_checks import NO_DISTRIBUTED_SAMPLER_ERROR

__all__ = [
    "CheckedMultiProcessingLauncher",
    "CheckedShardedLauncher",
    "CheckedSubprocessScriptLauncher",
    "check_before_launch",
    "checked_launcher",
]

SINGLE_DEVICE_NOTE = (
    "Cannikin: training on one device, so there is no split to balance (the total batch and the learning rate still"
    " follow `max_batch_size` and `lr_scaling` where set)."
)


def check_before_launch(
    trainer: pl.Trainer, args: tuple[Any, ...], world_size: int, fixed_sizes: tuple[int, ...] | None
) -> None:
    """Raise for what a ``fit`` call's arguments already show cannot train (``args``: what the launcher runs).

    Args:
        trainer: the Trainer (its arguments and callbacks).
        args: the positional arguments the launcher passes to the Trainer's entry point.
        world_size: nodes x devices.
        fixed_sizes: the strategy's ``local_batch_sizes``, if fixed.

    """
    arguments = fit_arguments(trainer, args)
    if arguments is None:
        return  # validate, test, predict: DDP's loaders
    train_dataloaders, ckpt_path = arguments
    if not uses_distributed_sampler(trainer):
        raise ValueError(NO_DISTRIBUTED_SAMPLER_ERROR)
    if world_size == 1:
        rank_zero_info(SINGLE_DEVICE_NOTE)
    loader = train_dataloaders if isinstance(train_dataloaders, DataLoader) else None
    if fixed_sizes is not None:
        global_batch = sum(fixed_sizes)
    elif loader is not None:
        global_batch = loader_batch_size(loader) * world_size
    else:
        return  # the loader comes from a datamodule or the model: the ranks check it
    if loader is not None:
        check_trainable(loader, global_batch)
    options = next((cb.options for cb in trainer.callbacks if isinstance(cb, BalancingCallback)), None)
    if options is None or ckpt_path is not None:
        return  # a resumed fit starts from the checkpoint's plan, which the ranks check
    accumulation = trainer.accumulate_grad_batches
    if fixed_sizes is not None:
        plan = Plan(fixed_sizes, accumulation)
    else:
        bounds = BatchBounds.parse(options.local_batch_bounds, world_size)
        plan = bounds.first_plan(global_batch, accumulation)  # the bounds can hold it
    options.policy.check_initial(plan)  # `max_batch_size` is not below it


Check = Callable[[pl.Trainer, tuple[Any, ...]], None]


class _ChecksBeforeLaunch:
    """A launcher that runs ``check(trainer, args)`` before Lightning's own ``launch`` starts anything."""

    def __init__(self, check: Check, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._check = check

    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is not None:
            self._check(trainer, args)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


class CheckedSubprocessScriptLauncher(_ChecksBeforeLaunch, SubprocessScriptLauncher):
    """Lightning's launcher of ``strategy="cannikin"`` (popen; torchrun and SLURM too), checking before it spawns."""


class CheckedMultiProcessingLauncher(_ChecksBeforeLaunch, MultiProcessingLauncher):
    """Lightning's launcher of the fork and spawn start methods, checking before it starts the processes."""


class CheckedShardedLauncher(_ChecksBeforeLaunch, _ShardedLauncher):
    """The fork and spawn launcher of ``strategy="cannikin_fsdp"`` (rank zero sends back full weights), checking
    before it starts the processes."""


def checked_launcher(
    strategy: ParallelStrategy, start_method: str, check: Check, sharded: bool = False
) -> _ChecksBeforeLaunch:
    """What ``DDPStrategy._configure_launcher`` builds for ``start_method``, checking with ``check`` first
    (``sharded``: a sharded model's fork or spawn launcher)."""
    if start_method == "popen":
        assert strategy.cluster_environment is not None
        return CheckedSubprocessScriptLauncher(
            check, strategy.cluster_environment, strategy.num_processes, strategy.num_nodes
        )
    launcher = CheckedShardedLauncher if sharded else CheckedMultiProcessingLauncher
    return launcher(check, strategy, start_method=start_method)
