"""What every Cannikin Lightning strategy does the same way, whatever wraps the model (DDP, FSDP2): the balancing
engine it drives, the uneven training loader, where each step begins and its loss, and the out-of-memory error that
names the rank.

A mixin placed before the Lightning strategy class (``class X(UnevenBatchesMixin, ModelParallelStrategy)``); the
strategy calls :meth:`UnevenBatchesMixin._init_uneven` in its ``__init__``. Everything about a step (its weights, its
timing, its learning rate) is the :class:`~lightning_cannikin.training.engine.BalancingEngine`'s: the strategy calls
its step API and nothing behind it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NoReturn

import torch
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

from lightning_cannikin._registration import register_launchers
from lightning_cannikin.core.plan import Plan
from lightning_cannikin.training._lightning_compat import uses_distributed_sampler
from lightning_cannikin.training.collective import StrategyCollective, end_process_group_at_exit
from lightning_cannikin.training.data.cost_aware_sampler import SampleCosts
from lightning_cannikin.training.data.loader import loader_batch_size
from lightning_cannikin.training.engine import BalancingEngine
from lightning_cannikin.training.frontends.batch_statistics import smallest_local_batch
from lightning_cannikin.training.frontends.launch_checks import check_before_launch, checked_launcher
from lightning_cannikin.training.frontends.lightning_hooks import BalancingCallback
from lightning_cannikin.training.frontends.strategy_checks import (
    MULTIPLE_LOADERS_ERROR,
    NO_DISTRIBUTED_SAMPLER_ERROR,
    from_ray,
    validate_local_batch_sizes,
    warn_about_fixed_total,
)
from lightning_cannikin.training.measurement.device_memory import LocalBatchOutOfMemoryError, out_of_memory_error
from lightning_cannikin.training.measurement.loss_weights import check_normalisation, every_ranks_units
from lightning_cannikin.training.settings import EngineOptions

__all__ = ["UnevenBatchesMixin"]


class UnevenBatchesMixin:
    """Uneven local batches for a Lightning ``ParallelStrategy`` subclass (see the module's docstring)."""

    # provided by the Lightning strategy this is mixed into
    world_size: int
    global_rank: int
    lightning_module: Any
    root_device: torch.device

    @classmethod
    def _register_names(cls, registry: Any, base: str, kind: str) -> None:
        """``base`` and its launcher variants in Lightning's registry, built by this class
        (:func:`~lightning_cannikin._registration.register_launchers`)."""
        register_launchers(registry, base, cls, kind)

    def _init_uneven(
        self,
        local_batch_sizes: Sequence[int] | None,
        loss_normalisation: str = "sample_mean",
        sample_costs: SampleCosts | None = None,
        batch_units: Callable[[Any], float] | None = None,
    ) -> None:
        self._fixed_sizes = validate_local_batch_sizes(local_batch_sizes)
        check_normalisation(loss_normalisation)
        if loss_normalisation == "count_mean" and sample_costs is None and batch_units is None:
            raise ValueError(
                "`loss_normalisation='count_mean'` needs each sample's count: give `sample_costs` (a sequence, a"
                " function of the index, or 'lengths') or `batch_units` (a function of the local batch)."
            )
        self._sample_costs, self._batch_units = sample_costs, batch_units
        self._normalisation = loss_normalisation
        # this strategy's engine: built once, at setup, from the fit's Cannikin callback's options (or the defaults)
        self._built: BalancingEngine | None = None
        self._plan_before_fit: Plan | None = None  # a plan set before the engine exists: the engine starts from it

    @property
    def engine(self) -> BalancingEngine:
        """The balancing engine this strategy owns and drives (built from the Cannikin callback's options when the fit
        is set up; read earlier, from the defaults)."""
        if self._built is None:
            self._build_engine(EngineOptions())
        assert self._built is not None
        return self._built

    def _build_engine(self, options: EngineOptions) -> None:
        """This strategy's engine, from ``options``, starting from the plan in force (one set before the fit)."""
        plan = self.plan
        self._built, self._plan_before_fit = BalancingEngine(options), None
        if plan is not None:
            self._built.data.set_plan(plan)

    @property
    def plan(self) -> Plan | None:
        """The split in force (``None`` before the training DataLoader is set up)."""
        return self._built.data.plan if self._built is not None else self._plan_before_fit

    @property
    def step_sizes(self) -> tuple[int, ...] | None:
        """Every rank's sample count in the training step in progress (``None`` outside training steps)."""
        return self._built.running.sizes if self._built is not None else None

    @property
    def lr_factor(self) -> float:
        """The multiplier applied to the learning rate in the optimizer step in progress."""
        return self._built.running.lr_factor if self._built is not None else 1.0

    @property
    def fixed_split(self) -> bool:
        """Whether the user fixed the split with ``local_batch_sizes`` (the planner must leave it alone)."""
        return self._fixed_sizes is not None

    def set_plan(self, plan: Plan, from_batch: int | None = None) -> None:
        """Put ``plan`` in force (``from_batch``: in the running epoch from this global batch on; ``None``: from the
        next time the training DataLoader is built)."""
        if plan.world_size != self.world_size:
            raise ValueError(
                f"The plan splits across {plan.world_size} ranks, but the world size is {self.world_size}."
            )
        if self._built is None:
            self._plan_before_fit = plan  # the engine, built at setup, starts from it
        else:
            self._built.data.set_plan(plan, from_batch)

    def _launch_world_size(self) -> int:
        """The world size before the process group exists: nodes x devices, or Ray Train's world under its cluster
        environment (Ray starts one worker per device, so the Trainer's ``devices`` counts only this worker's)."""
        environment = getattr(self, "cluster_environment", None)
        if environment is not None and from_ray(environment):
            return int(environment.world_size())
        return self.num_nodes * self.num_processes  # type: ignore[attr-defined]

    def _checked_launcher(self, start_method: str, sharded: bool = False) -> Any:
        """Lightning's launcher for ``start_method`` (``sharded``: a sharded model's for fork and spawn), checking what
        the fit's arguments already show before it starts any process (under torchrun or SLURM: in every process,
        before the process group exists); one fixed size per rank is checked now."""
        world_size = self._launch_world_size()
        if self._fixed_sizes is not None and len(self._fixed_sizes) != world_size:
            num_nodes, num_processes = self.num_nodes, self.num_processes  # type: ignore[attr-defined]
            layout = f"{num_nodes} node(s) x {num_processes} device(s)"
            if world_size != num_nodes * num_processes:
                layout = "Ray Train's workers"  # the only world `_launch_world_size` takes from elsewhere
            raise ValueError(
                f"`local_batch_sizes` has {len(self._fixed_sizes)} entries but the world size is {world_size}"
                f" ({layout}). Give one size per rank."
            )
        check = partial(check_before_launch, world_size=world_size, fixed_sizes=self._fixed_sizes)
        return checked_launcher(self, start_method, check, sharded)  # type: ignore[arg-type]

    def _take_engine(self) -> None:
        """This fit's engine, built once: from the user's Cannikin callback's options, else from the defaults, which a
        balancing callback drives unless the split is fixed (``strategy="cannikin..."`` alone still balances). A later
        fit keeps it unless its callback brings other options. The strategy owns it; the callback reads it. Raised on
        every rank alike, before the process group exists."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if fitting and not uses_distributed_sampler(trainer):
            raise ValueError(NO_DISTRIBUTED_SAMPLER_ERROR)  # the launcher checked it; here for entry points without one
        if trainer is None:
            return
        callback = next((cb for cb in trainer.callbacks if isinstance(cb, BalancingCallback)), None)
        if callback is None:
            options = self._built.options if self._built is not None else EngineOptions()
            if not self.fixed_split:
                callback = BalancingCallback(options)
                trainer.callbacks.append(callback)
        else:
            options = callback.options  # the user's
        if self._built is None or self._built.options is not options:
            self._build_engine(options)
        if callback is not None:
            callback.use_engine(self.engine)

    def _bind_engine(self, sharded: bool = False) -> None:
        """The engine learns this strategy's facts (after the process group exists, before the callbacks' setup)."""
        collective = StrategyCollective(self)
        smallest = smallest_local_batch(self.lightning_module, self.engine.options.local_batch_bounds)
        self.engine.bind(collective, self.fixed_split, self._normalisation, sharded, smallest)
        self.engine.reductions.use_device(self.root_device)
        end_process_group_at_exit()

    def _out_of_memory(self, error: torch.cuda.OutOfMemoryError) -> NoReturn:
        """Raise an out-of-memory error that names this rank, its local batch and the bounds."""
        if isinstance(error, LocalBatchOutOfMemoryError):
            raise error
        sizes = self.engine.running.sizes
        batch_size = sizes[self.global_rank] if sizes else None
        raise out_of_memory_error(
            self.global_rank, batch_size, sizes, self.engine.controller.bounds, self.root_device
        ) from error

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # every training step passes here, whatever the LightningModule calls inside it
        self.engine.forward_started()
        try:
            return super().training_step(*args, **kwargs)  # type: ignore[misc]
        except torch.cuda.OutOfMemoryError as error:
            self._out_of_memory(error)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The step's learning-rate factor applied for this step only (:meth:`BalancingEngine.optimizer_step`)."""
        try:
            with self.engine.optimizer_step(optimizer):
                return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        except torch.cuda.OutOfMemoryError as error:
            self._out_of_memory(error)  # the optimizer's state, or the closure's forward and backward

    def process_dataloader(self, dataloader: object) -> object:
        """The training loader rebuilt around the uneven sampler; other loaders are left as they are."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        if not isinstance(dataloader, torch.utils.data.DataLoader):
            name = type(self).__name__
            raise ValueError(f"{name} needs a torch DataLoader for training, got {type(dataloader).__name__}.")
        built = self.engine.data.loader  # the engine's training loader of this fit, until its teardown
        if built is not None and not built.iterated:
            # Lightning processes every training loader of a fit before it draws a batch from any: a loader built
            # earlier in this fit and never iterated means that this one is a second loader of the same fit
            raise ValueError(MULTIPLE_LOADERS_ERROR)
        if self._fixed_sizes is not None:
            warn_about_fixed_total(self._fixed_sizes, loader_batch_size(dataloader), self.world_size)
        accumulation = trainer.accumulate_grad_batches
        return self.engine.training_loader(dataloader, accumulation, self._fixed_sizes, self._sample_costs)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The training step begins, with the sizes the loader handed out for ``batch`` (a count mean's units of
        ``batch`` all-gathered where the sampler does not know them)."""
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        trainer = self.lightning_module.trainer
        units = None
        if self._normalisation == "count_mean" and self._sample_costs is None and self._batch_units is not None:
            units = every_ranks_units(float(self._batch_units(batch)), self.root_device)
        # Lightning closes an accumulation window early at the epoch's last batch (or `limit_train_batches`)
        end = trainer.num_training_batches
        end = int(end) if math.isfinite(end) else -1
        self.engine.begin_step(trainer.global_step, trainer.accumulate_grad_batches, end, units)

    def teardown(self) -> None:
        # the fit ends: the loader goes, the plan stays (a later fit starts from it)
        self.engine.data.use_loader(None, None)
        super().teardown()  # type: ignore[misc]
