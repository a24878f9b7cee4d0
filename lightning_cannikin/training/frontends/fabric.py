"""``CannikinFabricStrategy``: the balancing engine's frontend for a Fabric loop.

Fabric users write their own loop, so the strategy offers three pieces instead of hooks: the weighted all-reduce on
the module ``fabric.setup`` wraps, :meth:`~CannikinFabricStrategy.uneven_dataloader` for the training loader, and
:meth:`~CannikinFabricStrategy.step`, a context around forward and backward that weights and times the step and lets
the :class:`~lightning_cannikin.training.engine.BalancingEngine` re-plan when it is due (while some device is
unmeasured, on a cadence, and after each epoch's last step): the same engine, protocol and decisions as the
Lightning callback's. With ``max_batch_size`` the total batch adapts for goodput too, as under Lightning: the noise
statistics ride on the weighted all-reduce, the learning rate is scaled inside ``optimizer.step()``, and a new total
starts at the next global batch no rank has drawn (the loader's length follows). The accumulation stays the loop's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from lightning.fabric.strategies import DDPStrategy
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_cannikin.core.plan import Plan
from lightning_cannikin.training.collective import StrategyCollective, end_process_group_at_exit
from lightning_cannikin.training.data.loader import UnevenDataLoader
from lightning_cannikin.training.engine import BalancingEngine
from lightning_cannikin.training.frontends.batch_statistics import smallest_local_batch
from lightning_cannikin.training.settings import CannikinSettings, EngineOptions

__all__ = ["CannikinFabricStrategy"]


class CannikinFabricStrategy(DDPStrategy):
    """Fabric's DDP with a per-rank local batch, the exact mean gradient over all samples, and online balancing.

    Args:
        local_batch_sizes: a fixed split, one entry per rank; it turns balancing off. ``None``: start from the
            loader's ``batch_size`` on every rank and balance by measured speed.
        local_batch_bounds: bounds on any rank's local batch, as for the :class:`~lightning_cannikin.Cannikin`
            callback: an upper bound, or ``(lower, upper)`` with scalars or per-rank sequences.
        replan_every_n_steps: also re-plan every this many steps (``None``: at warm-up and epoch ends only).
        accumulate_grad_batches: micro-batches per optimizer step in the loop (see :meth:`step`).
        max_batch_size, lr_scaling, base_batch_size: the adaptive total batch and its learning rate, as for the
            :class:`~lightning_cannikin.Cannikin` callback (``None``: the total stays the loader's).
        settings: the engine's tuning settings (:class:`~lightning_cannikin.CannikinSettings`; its ``accumulate``
            does not apply: the loop's accumulation is the user's).
        **kwargs: every argument of Fabric's :class:`~lightning.fabric.strategies.DDPStrategy`.

    Example::

        strategy = CannikinFabricStrategy()
        fabric = L.Fabric(accelerator="gpu", devices=4, strategy=strategy)
        fabric.launch()
        model, optimizer = fabric.setup(model, optimizer)
        loader = fabric.setup_dataloaders(strategy.uneven_dataloader(loader), use_distributed_sampler=False)
        for epoch in range(epochs):
            for x, y in loader:
                with strategy.step():
                    fabric.backward(loss_fn(model(x), y))
                optimizer.step()
                optimizer.zero_grad()

    """

    def __init__(
        self,
        local_batch_sizes: Sequence[int] | None = None,
        local_batch_bounds: Any = None,
        replan_every_n_steps: int | None = None,
        accumulate_grad_batches: int = 1,
        max_batch_size: int | None = None,
        lr_scaling: str = "adascale",
        base_batch_size: int | None = None,
        settings: CannikinSettings | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if isinstance(accumulate_grad_batches, bool) or accumulate_grad_batches < 1:
            raise ValueError(f"`accumulate_grad_batches` must be a positive integer, got {accumulate_grad_batches}.")
        self._accumulation = int(accumulate_grad_batches)
        self._fixed = None if local_batch_sizes is None else Plan(tuple(local_batch_sizes), self._accumulation)
        # the loop's accumulation is the user's: the engine never changes it
        settings = replace(settings or CannikinSettings(), accumulate=False)
        choices = (max_batch_size, local_batch_bounds, lr_scaling, base_batch_size, True, replan_every_n_steps, False)
        self.engine = BalancingEngine(EngineOptions(*choices, settings))
        self._ddp: DistributedDataParallel | None = None
        self._optimizer: Any = None
        self._optimizer_steps = 0
        self._bound = False  # the engine runs over this strategy's collective

    @property
    def plan(self) -> Plan | None:
        """The split in force (``None`` before :meth:`uneven_dataloader`)."""
        return self.engine.data.plan

    @property
    def speed_model(self) -> Any:
        """The engine's per-device timing models."""
        return self.engine.controller.speed_model

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        end_process_group_at_exit()

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        ddp = super().setup_module(module)
        # Fabric's DDP takes no comm hook; the weighted all-reduce is what makes uneven batches exact
        ddp.register_comm_hook(*self.engine.reductions.comm_hook())
        # CUDA events on a GPU, the host clock elsewhere; the compute starts when DDP hands the batch to the module
        engine = self.engine
        engine.reductions.use_device(self.root_device)
        ddp.module.register_forward_pre_hook(lambda module, args: engine.forward_started(inner=True))
        self._ddp = ddp
        return ddp

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self._optimizer = optimizer  # its family decides the AdaScale rule and the noise's preconditioning
        return super().setup_optimizer(optimizer)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self._optimizer_steps += 1
        with self.engine.optimizer_step(optimizer):  # the step counts at its gain, at its learning-rate factor
            return super().optimizer_step(optimizer, **kwargs)

    def uneven_dataloader(self, dataloader: DataLoader) -> UnevenDataLoader:
        """The training loader, rebuilt so that each rank takes its share of every global batch.

        Pass the result to ``fabric.setup_dataloaders(..., use_distributed_sampler=False)``: the uneven sampler
        already shards the data. The dataset, ``collate_fn``, workers and ``shuffle`` are kept.
        """
        if self._fixed is not None and self._fixed.world_size != self.world_size:
            raise ValueError(
                f"`local_batch_sizes` has {self._fixed.world_size} entries but the world size is {self.world_size}."
            )
        if not self._bound:
            self._bound = True
            module = self._ddp.module if self._ddp is not None else None
            smallest = smallest_local_batch(module, self.engine.options.local_batch_bounds)
            self.engine.bind(StrategyCollective(self), fixed_split=self._fixed is not None, smallest=smallest)
        fixed = self._fixed.local_batch_sizes if self._fixed is not None else None
        loader = self.engine.training_loader(dataloader, self._accumulation, fixed)
        if self.engine.controller.estimator is None:
            self.engine.start(self._optimizer, accumulation_allowed=False)
        return loader

    @contextmanager
    def step(self) -> Iterator[tuple[int, ...]]:
        """Around one training step's (or accumulation micro-step's) forward and backward: weights the all-reduce
        and the loss for the batch in hand, times the step, and afterwards re-plans on every rank when due. Yields
        every rank's sample count in this step.

        With ``accumulate_grad_batches`` > 1, divide each micro-batch's loss by it (as Lightning does) and skip the
        gradient sync on all but the window's last micro-batch (``fabric.no_backward_sync``); the strategy weights
        each micro-batch so that the window's gradient is the exact mean over its samples.
        """
        loader = self.engine.data.loader  # the one `uneven_dataloader` returned
        if loader is None or not loader.pending_steps:
            raise RuntimeError("`step()` needs a batch drawn from the loader that `uneven_dataloader` returned.")
        position, sizes = self.engine.begin_step(self._optimizer_steps, self._accumulation)  # type: ignore[misc]
        self.engine.forward_started()
        yield sizes
        epoch_end = position == len(loader.uneven_sampler) - 1
        self.engine.end_step(epoch_ends=epoch_end)
        if epoch_end:  # the loop's loader runs on: the next epoch's plan starts at its next global batch
            self.engine.end_epoch(rebuilds_loader=False)

    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        # an accumulation micro-step runs under `no_backward_sync`: no all-reduce, its compute ends at backward
        reduces = getattr(self._ddp, "require_backward_grad_sync", True) if self._ddp is not None else True
        parameters = self._ddp.parameters if self._ddp is not None else tuple
        with self.engine.backward(tensor, reduces, parameters) as weighted:
            super().backward(weighted, module, *args, **kwargs)
