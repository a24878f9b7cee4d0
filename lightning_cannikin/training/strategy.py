"""``CannikinStrategy``: DDP with uneven local batches and an exact, sample-weighted gradient all-reduce."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any, NoReturn

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_cannikin.core.plan import Plan
from lightning_cannikin.training._lightning_compat import (
    StrategyRegistryType,
    register_ddp_comm_hook,
    uses_distributed_sampler,
)
from lightning_cannikin.training.comm_hook import WeightedAllReduceState, weighted_allreduce_hook
from lightning_cannikin.training.device_memory import LocalBatchOutOfMemoryError, out_of_memory_error
from lightning_cannikin.training.grad_capture import GradientCapture
from lightning_cannikin.training.grad_ready import GradientReadiness
from lightning_cannikin.training.launch_checks import check_before_launch, checked_launcher
from lightning_cannikin.training.lightning_hooks import BalancingCallback
from lightning_cannikin.training.loader import UnevenDataLoader, loader_batch_size, rebuild_uneven
from lightning_cannikin.training.runtime import RuntimeState
from lightning_cannikin.training.step_timer import step_timer_for
from lightning_cannikin.training.strategy_checks import (
    MULTIPLE_LOADERS_ERROR,
    NO_DISTRIBUTED_SAMPLER_ERROR,
    validate_local_batch_sizes,
    warn_about_fixed_total,
    warn_about_sync_batchnorm,
)


class CannikinStrategy(DDPStrategy):
    """Data-parallel training with a per-rank local batch size and the exact mean gradient over all samples.

    Each rank ``i`` trains on ``b_i`` samples per step, taken from one shared permutation of the dataset, and scales
    its gradient by ``b_i / B`` before a summing all-reduce. The split in force is a :class:`~lightning_cannikin.Plan`;
    the :class:`~lightning_cannikin.Cannikin` callback changes it between epochs as it learns each device's speed.

    Args:
        local_batch_sizes: a fixed split, one entry per rank (global rank order). It turns split planning off, and
            its sum replaces the DataLoader's ``batch_size x world size`` (a warning names both where they differ).
            When ``None``, the first plan gives every rank the training DataLoader's ``batch_size``.
        **kwargs: every :class:`~lightning.pytorch.strategies.DDPStrategy` argument except ``ddp_comm_hook``
            (Cannikin's weighted all-reduce is the hook; ``ddp_comm_wrapper``, e.g. fp16 compression, composes).

    """

    strategy_name = "cannikin"

    def __init__(self, local_batch_sizes: Sequence[int] | None = None, **kwargs: Any) -> None:
        if kwargs.get("ddp_comm_hook") is not None:
            raise ValueError(
                "`ddp_comm_hook` cannot be combined with CannikinStrategy: its weighted all-reduce is the comm hook."
                " Use `ddp_comm_wrapper` to compose compression with it, or `strategy='ddp'` for your own hook."
            )
        if kwargs.get("model_averaging_period") is not None:
            raise ValueError("`model_averaging_period` (post-local SGD) is not supported by CannikinStrategy.")
        super().__init__(**kwargs)
        self._fixed_sizes = validate_local_batch_sizes(local_batch_sizes)
        self._runtime = RuntimeState(fixed_split=self._fixed_sizes is not None)
        self._train_loader: UnevenDataLoader | None = None
        self._forward_hook: Any = None
        self._uses_comm_hook: bool | None = None
        self._readiness: GradientReadiness | None = None
        self._capture: GradientCapture | None = None

    @property
    def runtime(self) -> RuntimeState:
        """The state this strategy shares with the balancing engine (driven by the Cannikin callback)."""
        return self._runtime

    @property
    def hook_state(self) -> WeightedAllReduceState:
        """The weighted all-reduce's state (its observers see every gradient bucket)."""
        return self._runtime.hook

    @property
    def plan(self) -> Plan | None:
        """The split in force (``None`` before the training DataLoader is set up)."""
        return self._runtime.plan

    @property
    def step_sizes(self) -> tuple[int, ...] | None:
        """Every rank's sample count in the training step in progress (``None`` outside training steps)."""
        return self._runtime.step_sizes

    @property
    def lr_factor(self) -> float:
        """The multiplier applied to the learning rate for each optimizer step (set by the Cannikin callback)."""
        return self._runtime.lr_factor

    @property
    def fixed_split(self) -> bool:
        """Whether the user fixed the split with ``local_batch_sizes`` (the planner must leave it alone)."""
        return self._runtime.fixed_split

    @property
    def train_loader(self) -> UnevenDataLoader | None:
        """The uneven training loader built by :meth:`process_dataloader`."""
        return self._train_loader

    def set_plan(self, plan: Plan, from_batch: int | None = None) -> None:
        """Put ``plan`` in force.

        Args:
            plan: the new split; its length must equal the world size.
            from_batch: apply it to the current epoch from this global batch on. ``None`` leaves the running epoch
                alone: the plan takes effect when the training DataLoader is next built.

        """
        if plan.world_size != self.world_size:
            raise ValueError(
                f"The plan splits across {plan.world_size} ranks, but the world size is {self.world_size}."
            )
        self._runtime.adopt(plan, from_batch)

    @override
    def _configure_launcher(self) -> None:
        # the earliest point where the world size is known and no process has been launched yet
        world_size = self.num_nodes * self.num_processes
        if self._fixed_sizes is not None and len(self._fixed_sizes) != world_size:
            raise ValueError(
                f"`local_batch_sizes` has {len(self._fixed_sizes)} entries but the world size is {world_size}"
                f" ({self.num_nodes} node(s) x {self.num_processes} device(s)). Give one size per rank."
            )
        # Lightning's launchers, checking what the fit's arguments already show before they spawn any process
        check = partial(check_before_launch, world_size=world_size, fixed_sizes=self._fixed_sizes)
        self._launcher = checked_launcher(self, self._start_method, check)

    @override
    def setup_environment(self) -> None:
        # `strategy="cannikin"` alone still balances the cluster: a balancing callback with the default engine,
        # unless the user passed one (a `Cannikin`) or fixed the split
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if fitting and not uses_distributed_sampler(trainer):
            raise ValueError(NO_DISTRIBUTED_SAMPLER_ERROR)  # the launcher checked it; here for entry points without one
        wanted = trainer is not None and not self.fixed_split
        if wanted and not any(isinstance(cb, BalancingCallback) for cb in trainer.callbacks):
            trainer.callbacks.append(BalancingCallback())
        super().setup_environment()
        # the device is known now: CUDA events on a GPU, the host clock elsewhere
        self._runtime.use_timer(step_timer_for(self.root_device))

    @property
    def uses_comm_hook(self) -> bool | None:
        """Whether the gradients go through Cannikin's Python comm hook (``False``: DDP's own C++ all-reduce of
        loss-weighted gradients; ``None`` before the model is wrapped)."""
        return self._uses_comm_hook

    def _comm_hook_needed(self) -> bool:
        """The Python hook is needed where something must see each bucket, where the loss cannot carry the weight
        (manual optimization) and where a ``ddp_comm_wrapper`` wraps it. Noise statistics of every step see the
        buckets; measured on one step in k, they capture the local gradient's norm on those steps (``grad_capture``)
        and leave every step's reduction to DDP's own all-reduce."""
        runtime = self._runtime
        noise = runtime.noise
        observers = [o for o in runtime.hook.observers if o is not runtime.timer and o is not noise]
        manual = self.lightning_module is not None and not self.lightning_module.automatic_optimization
        every_step = noise is not None and noise.measure_every == 1
        return bool(observers) or every_step or manual or self._ddp_comm_wrapper is not None

    @override
    def _register_ddp_hooks(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        self._remove_parameter_hooks()
        runtime = self._runtime
        self._uses_comm_hook = self._comm_hook_needed()
        # under automatic optimization the one backward of the step passes `self.backward`, so the weight rides on
        # the loss (one scalar product) instead of on every bucket; under manual optimization the hook applies it.
        # DDP's own all-reduce averages over the ranks: n * b_i / B on the loss makes its mean the weighted mean.
        assert self.lightning_module is not None
        runtime.hook.weight_in_loss = self.lightning_module.automatic_optimization
        runtime.hook.mean_over = 1 if self._uses_comm_hook else self.world_size
        if self._uses_comm_hook:
            # DDPStrategy registers comm hooks on CUDA only; on CPU (gloo) a hook would be silently ignored, and the
            # weighted all-reduce is what makes uneven batches correct, so register it on every device type.
            register_ddp_comm_hook(
                model=self.model,
                ddp_comm_state=runtime.hook,
                ddp_comm_hook=weighted_allreduce_hook,
                ddp_comm_wrapper=self._ddp_comm_wrapper,
            )
        else:
            # DDP's own all-reduce, no Python per bucket: the loss carries n * b_i / B (DDP averages), and two
            # parameter hooks time the gradients
            self._readiness = GradientReadiness(self.model.parameters(), lambda: runtime.timer.gradient_ready())
            if runtime.noise is not None:
                in_place = bool(getattr(self.model, "gradient_as_bucket_view", False))
                self._capture = GradientCapture(self.model.parameters(), runtime.noise.norms, in_place)
        # DDP calls the LightningModule after its pre-forward work (buffer broadcast, a collective that waits for
        # slower ranks): that is where this rank's compute starts
        if self._forward_hook is not None:
            self._forward_hook.remove()
        self._forward_hook = self.model.module.register_forward_pre_hook(
            lambda module, args: runtime.timer.inner_forward_start()
        )
        warn_about_sync_batchnorm(self.model)

    def _remove_parameter_hooks(self) -> None:
        """Remove the timing and noise-capture hooks (a model wrapped again, or the fit's end)."""
        if self._readiness is not None:
            self._readiness.remove()
            self._readiness = None
        if self._capture is not None:
            self._capture.disarm()
            self._capture = None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        # every training step passes here, whatever the LightningModule calls inside it
        self._runtime.timer.forward_start()
        try:
            return super().training_step(*args, **kwargs)
        except torch.cuda.OutOfMemoryError as error:
            self._out_of_memory(error)

    def _out_of_memory(self, error: torch.cuda.OutOfMemoryError) -> NoReturn:
        """Raise an out-of-memory error that names this rank, its local batch and the bounds."""
        if isinstance(error, LocalBatchOutOfMemoryError):
            raise error
        sizes = self._runtime.step_sizes
        batch_size = sizes[self.global_rank] if sizes else None
        raise out_of_memory_error(
            self.global_rank, batch_size, sizes, self._runtime.bounds, self.root_device
        ) from error

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader  # validation, test and predict loaders are left to DDP
        if not isinstance(dataloader, torch.utils.data.DataLoader):
            raise ValueError(
                f"CannikinStrategy needs a torch DataLoader for training, got {type(dataloader).__name__}."
            )
        if self._train_loader is not None and not self._train_loader.iterated:
            # Lightning processes every training loader of a fit before it draws a batch from any: a loader built
            # earlier in this fit and never iterated means that this one is a second loader of the same fit
            raise ValueError(MULTIPLE_LOADERS_ERROR)
        accumulation = trainer.accumulate_grad_batches
        if self._fixed_sizes is not None:
            plan = Plan(self._fixed_sizes, accumulation)
            warn_about_fixed_total(self._fixed_sizes, loader_batch_size(dataloader), self.world_size)
        elif self.plan is not None:
            plan = Plan(self.plan.local_batch_sizes, accumulation, self.plan.predicted_step_time)
        else:
            # the user's batch size on every rank, moved inside the bounds (same total) if it violates them
            plan = self._runtime.first_plan(
                loader_batch_size(dataloader) * self.world_size, self.world_size, accumulation
            )
        loader = rebuild_uneven(dataloader, plan, self.global_rank)
        self._runtime.use_loader(plan, loader.uneven_sampler)
        self._train_loader = loader
        return loader

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._runtime.noise is not None:  # before the step's first backward: is this step measured?
            self._runtime.noise.start_step(self.lightning_module.trainer.global_step)
        loader = self._train_loader
        if loader is None or not loader.pending_steps:
            self._runtime.begin_step(None, None, self.global_rank)
            return
        position, sizes = loader.pending_steps.popleft()
        trainer = self.lightning_module.trainer
        # Lightning closes an accumulation window early at the epoch's last batch (or `limit_train_batches`)
        end = trainer.num_training_batches
        end = int(end) if math.isfinite(end) else -1
        self._runtime.begin_step(position, sizes, self.global_rank, trainer.accumulate_grad_batches, end)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        loss_factor = self._runtime.loss_factor
        if loss_factor != 1.0:
            closure_loss = closure_loss * loss_factor
        # an accumulation micro-step runs under DDP's `no_sync`: no all-reduce, whichever path reduces
        reduces = getattr(self.model, "require_backward_grad_sync", True)
        self._runtime.timer.will_reduce(reduces)
        noise = self._runtime.noise
        capture = self._capture if reduces and noise is not None and noise.measuring else None
        if capture is not None:
            capture.arm(closure_loss)
        try:
            loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        except torch.cuda.OutOfMemoryError as error:
            self._out_of_memory(error)
        finally:
            if self._readiness is not None:
                self._readiness.backward_done()
            if capture is not None:
                capture.disarm()
        if capture is not None and (local := capture.local_squared()) is not None:
            noise.captured(self._runtime.hook, local, capture.parameters)
        return loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        try:
            with self._runtime.learning_rate_scaled(optimizer):
                return super().optimizer_step(optimizer, closure, model, **kwargs)
        except torch.cuda.OutOfMemoryError as error:
            self._out_of_memory(error)  # the optimizer's state, or the closure's forward and backward

    @override
    def teardown(self) -> None:
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        self._remove_parameter_hooks()
        self._train_loader = None
        self._runtime.use_loader(self._runtime.plan, None)
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        entries = (
            ("cannikin", "popen"),
            ("cannikin_spawn", "spawn"),
            ("cannikin_fork", "fork"),
            ("cannikin_notebook", "fork"),
        )
        for name, start_method in entries:
            if name in strategy_registry:
                continue  # a second import (or a reload) must not raise
            strategy_registry.register(
                name,
                cls,
                description=f"Cannikin heterogeneity-aware DDP with `start_method` '{start_method}'",
                start_method=start_method,
            )


__all__ = ["CannikinStrategy"]
