"""``CannikinFabricStrategy``: uneven local batches, the weighted all-reduce and step timing for a Fabric loop.

Fabric users write their own loop, so the strategy offers three pieces instead of hooks: the weighted all-reduce on
the module ``fabric.setup`` wraps, :meth:`~CannikinFabricStrategy.uneven_dataloader` for the training loader, and
:meth:`~CannikinFabricStrategy.step`, a context around forward and backward that weights and times the step and
re-plans the split when it is due (while some device is unmeasured, on a cadence, and after each epoch's last step).
The plans come from the same speed model and :func:`~lightning_cannikin.core.policy.decide` as the Lightning callback;
the total batch stays the loader's (no goodput adaptation or learning-rate scaling here).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from lightning.fabric.strategies import DDPStrategy
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_cannikin.core.plan import BatchBounds, Plan, even_split
from lightning_cannikin.core.policy import PolicySettings, decide
from lightning_cannikin.core.schedule import ReplanSchedule
from lightning_cannikin.core.speed_model import SpeedModel, SpeedModelSettings
from lightning_cannikin.training.comm_hook import weighted_allreduce_hook
from lightning_cannikin.training.loader import UnevenDataLoader, loader_batch_size, rebuild_uneven
from lightning_cannikin.training.runtime import RuntimeState
from lightning_cannikin.training.step_timer import step_timer_for

__all__ = ["CannikinFabricStrategy"]


class CannikinFabricStrategy(DDPStrategy):
    """Fabric's DDP with a per-rank local batch, the exact mean gradient over all samples, and online balancing.

    Args:
        local_batch_sizes: a fixed split, one entry per rank; it turns balancing off. ``None``: start from the
            loader's ``batch_size`` on every rank and balance by measured speed.
        local_batch_bounds: bounds on any rank's local batch, as for the :class:`~lightning_cannikin.Cannikin`
            callback: an upper bound, or ``(lower, upper)`` with scalars or per-rank sequences.
        warmup_steps: while some device is timed at one batch size only, re-plan every this many steps.
        replan_every_n_steps: also re-plan every this many steps (``None``: at warm-up and epoch ends only).
        half_life: recency half-life of the timing fits, in steps.
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
        warmup_steps: int = 8,
        replan_every_n_steps: int | None = None,
        half_life: float = 50.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        BatchBounds.check(local_batch_bounds)
        self._fixed = None if local_batch_sizes is None else Plan(tuple(local_batch_sizes))
        self._bounds = local_batch_bounds
        self.schedule = ReplanSchedule(warmup_steps, replan_every_n_steps)
        self._speed_settings = SpeedModelSettings(half_life=half_life)
        self.runtime = RuntimeState(fixed_split=self._fixed is not None)
        self.speed_model: SpeedModel | None = None
        self._loader: UnevenDataLoader | None = None
        self._step = 0
        self._identified = False

    @property
    def plan(self) -> Plan | None:
        """The split in force (``None`` before :meth:`uneven_dataloader`)."""
        return self.runtime.plan

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        ddp = super().setup_module(module)
        # Fabric's DDP takes no comm hook; the weighted all-reduce is what makes uneven batches exact
        ddp.register_comm_hook(self.runtime.hook, weighted_allreduce_hook)
        # CUDA events on a GPU, the host clock elsewhere; the compute starts when DDP hands the batch to the module
        self.runtime.use_timer(step_timer_for(self.root_device))
        runtime = self.runtime
        ddp.module.register_forward_pre_hook(lambda module, args: runtime.timer.inner_forward_start())
        return ddp

    def uneven_dataloader(self, dataloader: DataLoader) -> UnevenDataLoader:
        """The training loader, rebuilt so that each rank takes its share of every global batch.

        Pass the result to ``fabric.setup_dataloaders(..., use_distributed_sampler=False)``: the uneven sampler
        already shards the data. The dataset, ``collate_fn``, workers and ``shuffle`` are kept.
        """
        if self._fixed is not None and self._fixed.world_size != self.world_size:
            raise ValueError(
                f"`local_batch_sizes` has {self._fixed.world_size} entries but the world size is {self.world_size}."
            )
        if self.speed_model is None:
            bounds = BatchBounds.parse(self._bounds, self.world_size)
            self.speed_model = SpeedModel(self.world_size, self._speed_settings, bounds)
            self.runtime.bounds = bounds
        plan = self._fixed or self.runtime.plan
        if plan is None:
            plan = Plan(even_split(loader_batch_size(dataloader) * self.world_size, self.world_size))
        loader = rebuild_uneven(dataloader, plan, self.global_rank)
        self.runtime.plan, self.runtime.sampler, self._loader = plan, loader.uneven_sampler, loader
        return loader

    @contextmanager
    def step(self) -> Iterator[tuple[int, ...]]:
        """Around one training step's forward and backward: weights the all-reduce for the batch in hand, times the
        step, and afterwards re-plans on every rank when due. Yields every rank's sample count in this step."""
        loader = self._loader
        if loader is None or not loader.pending_steps:
            raise RuntimeError("`step()` needs a batch drawn from the loader that `uneven_dataloader` returned.")
        position, sizes = loader.pending_steps.popleft()
        rank = self.global_rank
        self.runtime.step_sizes = sizes
        self.runtime.hook.weight = sizes[rank] / sum(sizes)
        timer = self.runtime.timer
        timer.start()
        timer.forward_start()
        yield sizes
        timer.backward_done()
        timer.finish(self._step, rank, sizes[rank])
        self._step += 1
        if self._fixed is None:
            epoch_end = position == len(loader.uneven_sampler) - 1
            if epoch_end or self.schedule.due(self._step, self._identified, balance=True):
                self.replan()

    def replan(self) -> Plan | None:
        """Gather every rank's timing, let rank zero decide a split of the same total, adopt it on every rank.

        Every rank must call it at the same step (:meth:`step` does). The plan applies from the next global batch
        that no rank has drawn yet. Returns the plan adopted, or ``None`` while some rank has no timing yet.
        """
        assert self.speed_model is not None and self.runtime.plan is not None
        # the step records, read now (on CUDA the last ones wait for the device)
        mine = (self.runtime.timer.records(wait=True), self.runtime.batches_yielded)
        gathered: list[Any] = [mine]
        if dist.is_available() and dist.is_initialized():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        self.schedule.replanned(self._step, total_changed=False, balance=True)  # the total never changes here
        decision = None
        if self.global_rank == 0:
            self.speed_model.add([record for records, _ in gathered for record in records])
            if self.speed_model.ready:
                current = self.runtime.plan
                decision = decide(self.speed_model, current, PolicySettings(), None, current.total_batch_size)
        decision = self.broadcast(decision, src=0)
        if decision is None:
            return None
        self._identified = decision.identified
        self.runtime.adopt(decision.plan, from_batch=max(yielded for _, yielded in gathered))
        return decision.plan
