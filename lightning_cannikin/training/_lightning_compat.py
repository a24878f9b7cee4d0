"""Every private Lightning or torch name the package touches, in one place, each with what it relies on.

When Lightning or torch moves one of these, this module is the one to change; the tests that fail name the seam
(``tests/test_mid_epoch_total.py`` for the fit loop's lengths, ``tests/test_grad_ready.py`` and
``tests/test_adaptive.py`` for the gradient capture, ``tests/test_packaging.py`` for the registry). Checked on
Lightning 2.6 and torch 2.13.

Two seams are overrides rather than calls, so they stay where they are: ``CannikinStrategy._configure_launcher`` (the
earliest point where Lightning's DDP knows the world size and has launched nothing) and
``CannikinStrategy._register_ddp_hooks`` (where Lightning's DDP registers its comm hook once the model is wrapped),
together with ``DDPStrategy._ddp_comm_wrapper`` which that override reads.

The fit loop's lengths: Lightning reads the training loader's length once, when it builds the loader, into four
places: the fit loop's ``max_batches`` (``trainer.num_training_batches``: where the epoch ends), the data fetcher's
``length`` (which flags the last batch, so a partial accumulation window still steps and epoch-interval schedulers
run), the combined loader's limits, and the validation cadence ``val_check_batch``. A total batch changed mid-epoch
changes the epoch's length, and so does resuming an epoch whose total changed before the checkpoint. Left stale, a
longer epoch would be cut short (samples dropped) and a shorter one would end without its last-batch bookkeeping.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

# `_PrefetchDataFetcher`: the fetcher Lightning uses unless the training step takes a `dataloader_iter`; only it
# has the `length`/`done`/`fetched` fields `sync_epoch_length` rewrites
from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher

# `_TrainingEpochLoop._broadcast_sigterm_tensor`: from Lightning 2.5.2 the loop broadcasts from rank zero at every
# step's start (its SIGTERM check), where the ranks meet; only emulations ask (`loop_meets_each_step`)
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

# `_register_ddp_comm_hook`: Lightning's helper that registers a comm hook (and wraps it in `ddp_comm_wrapper`);
# DDPStrategy calls it on CUDA only, Cannikin on every device
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook

# `_MultiProcessingLauncher`, `_SubprocessScriptLauncher`: the launchers DDPStrategy builds in `_configure_launcher`
# (start methods fork/spawn, and popen); Cannikin subclasses both to check a fit's arguments before they spawn.
# ModelParallelStrategy knows only the second, and "cannikin_fsdp_fork" needs the first (`checked_launcher`)
# `_WorkerOutput` and `_MultiProcessingLauncher._collect_rank_zero_results`: what rank zero of a forked fit sends back
# (its weights through a temporary file); a sharded model's weights are gathered whole first (`_ShardedLauncher`)
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

# `_StrategyRegistry`: the type of Lightning's `StrategyRegistry`, named in `register_strategies`' signature
from lightning.pytorch.strategies.strategy import _StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

__all__ = [
    "INHERITED_PRIVATE_NAMES",
    "MultiProcessingLauncher",
    "StrategyRegistryType",
    "SubprocessScriptLauncher",
    "epoch_resizable",
    "fit_arguments",
    "foreach_add_",
    "foreach_copy_",
    "foreach_div",
    "foreach_div_",
    "foreach_norm",
    "foreach_sqrt",
    "foreach_sub",
    "fsdp_predivide_factor",
    "fsdp_sharded_parameters",
    "loop_meets_each_step",
    "register_ddp_comm_hook",
    "scaler_scale",
    "sync_epoch_length",
    "uses_distributed_sampler",
]

StrategyRegistryType = _StrategyRegistry

# Private attributes the package's subclasses of Lightning classes reach through ``self`` (read or set), with what they
# rely on; ``tests/test_layering.py`` fails on one that is not listed here.
INHERITED_PRIVATE_NAMES = {
    # DDPStrategy and ModelParallelStrategy: the launcher `_configure_launcher` builds, replaced by one that checks a
    # fit's arguments before any rank starts
    "_launcher": "DDPStrategy, ModelParallelStrategy: the launcher built in `_configure_launcher`",
    # DDPStrategy: the start method ("popen", "spawn", "fork", "forkserver") its registry variants set
    "_start_method": "DDPStrategy: the start method of the registered variant",
    # DDPStrategy: the user's `ddp_comm_wrapper`, which the comm hook must be wrapped in where Cannikin registers it
    "_ddp_comm_wrapper": "DDPStrategy: the comm-hook wrapper passed by the user",
    # ModelParallelStrategy: the data-parallel size argument, which must be the world size under cannikin_fsdp
    "_data_parallel_size": "ModelParallelStrategy: the data_parallel_size argument",
    # _MultiProcessingLauncher: the strategy it launches (rank zero's results of a sharded fit are gathered whole)
    "_strategy": "_MultiProcessingLauncher: the strategy it launches",
}
MultiProcessingLauncher = _MultiProcessingLauncher
SubprocessScriptLauncher = _SubprocessScriptLauncher
register_ddp_comm_hook = _register_ddp_comm_hook

# torch's multi-tensor kernels (`torch._foreach_*`): private, but what torch's own optimizers run on; one launch for a
# list of tensors instead of one per tensor (the fused gradient norms)
foreach_add_ = torch._foreach_add_
foreach_copy_ = torch._foreach_copy_
foreach_div = torch._foreach_div
foreach_div_ = torch._foreach_div_
foreach_norm = torch._foreach_norm
foreach_sqrt = torch._foreach_sqrt
foreach_sub = torch._foreach_sub


def loop_meets_each_step() -> bool:
    """Whether Lightning's training loop makes the ranks meet at each step's start, before it fetches the batch: its
    SIGTERM check broadcasts from rank zero (from Lightning 2.5.2), where rank zero waits for every rank's optimizer
    step and each other rank for rank zero's. Cannikin measures it (``StepRecord.gap``); an emulation's ideal needs to
    know it (:meth:`~lightning_cannikin.simulation.emulated_devices.EmulatedDevices.lead_ms`)."""
    return hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor")


def uses_distributed_sampler(trainer: pl.Trainer) -> bool:
    """The Trainer's ``use_distributed_sampler``, which Lightning keeps on its private ``_accelerator_connector``
    (the Trainer has no public view of it); ``True`` where the attribute is missing, as Lightning's default."""
    return bool(getattr(trainer._accelerator_connector, "use_distributed_sampler", True))


def fit_arguments(trainer: pl.Trainer, args: tuple[Any, ...]) -> tuple[Any, Any] | None:
    """``(train_dataloaders, ckpt_path)`` of the ``trainer.fit`` call a launcher's ``launch(function, *args)`` runs,
    ``None`` for another entry point. Relies on ``Trainer.fit`` passing ``_fit_impl`` its arguments positionally:
    ``(model, train_dataloaders, val_dataloaders, datamodule, ckpt_path, ...)`` (Lightning 2.x)."""
    if trainer.state.fn != TrainerFn.FITTING or len(args) < 5:
        return None
    return args[1], args[4]


def epoch_resizable(trainer: pl.Trainer) -> bool:
    """Whether the running epoch's length may follow the loader: the whole loader is trained on (no
    ``limit_train_batches``) through Lightning's own fetcher (the fit loop's private ``_data_fetcher``, a
    ``_PrefetchDataFetcher`` unless the training step takes a ``dataloader_iter``)."""
    limit = trainer.limit_train_batches
    fetcher = trainer.fit_loop._data_fetcher
    return isinstance(limit, float) and limit == 1.0 and isinstance(fetcher, _PrefetchDataFetcher)


def sync_epoch_length(trainer: pl.Trainer, batches: int) -> bool:
    """Make the fit loop end the running epoch after ``batches`` global batches; whether anything changed.

    Relies on the fit loop's ``max_batches`` and private ``_combined_loader`` (its ``limits`` and ``flattened``), the
    fetcher's ``length``, ``done`` and ``fetched``, and the Trainer's ``val_check_batch`` and private
    ``_val_check_time_interval`` (a time-based validation interval, Lightning 2.6; absent before).
    """
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


class _ShardedLauncher(_MultiProcessingLauncher):
    """Python multiprocessing for a sharded model: rank zero sends back the full weights (gathered from the shards on
    every rank), which the main process's unsharded module can load; Lightning's own would send DTensor shards."""

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        import os
        import tempfile

        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback is not None else None
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state_dict = get_model_state_dict(trainer.lightning_module, options=options)  # a collective: every rank
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == "fit":
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        extra = self.get_extra_results(trainer)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, extra)


def scaler_scale(scaler: Any) -> torch.Tensor | float:
    """A ``GradScaler``'s current scale without a host sync where it can be had: its private ``_get_scale_async``
    (the scale tensor as is); ``get_scale()`` (which syncs) where that is missing."""
    scale = scaler._get_scale_async() if hasattr(scaler, "_get_scale_async") else None
    return float(scaler.get_scale()) if scale is None else scale


def fsdp_predivide_factor(group: Any, dtype: torch.dtype, device_type: str) -> float:
    """What FSDP2 divided a reduce-scatter's input by: fp16 gradients about ``sqrt(n)`` against overflow (the rest
    after the reduction), fp32 and bf16 nothing. Its own rule (``_get_gradient_divide_factors``, torch 2.6 on), read
    from FSDP2; where that is missing, its default for fp32 and bf16."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors
    except ImportError:  # pragma: no cover - another torch
        return 1.0
    factors = _get_gradient_divide_factors(group, None, dtype, device_type)
    return float(factors[0]) if factors[0] is not None else 1.0


def fsdp_sharded_parameters(module: Any) -> list[tuple[torch.nn.Parameter, int]]:
    """The parameters a ``fully_shard``-ed module's reduce-scatter carries, in its order, each with the number of
    elements of its padded shard (FSDP2's ``FSDPParamGroup.fsdp_params``: one group per module with a custom comm)."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    return [(p.sharded_param, p.padded_sharded_param_size.numel()) for g in groups for p in g.fsdp_params]
