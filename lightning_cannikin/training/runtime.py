"""What the strategy and the Cannikin callback share during a fit, in one small object the strategy owns.

The callback reads it through ``trainer.strategy.runtime`` and never imports the strategy: the strategy writes the
step's sizes and accumulation window and applies the learning-rate factor; the callback writes the bounds, the
factor and the plans it decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_cannikin.core.plan import BatchBounds, Plan
from lightning_cannikin.training.comm_hook import WeightedAllReduceState
from lightning_cannikin.training.grad_stats import GradientNormObserver
from lightning_cannikin.training.sampler import UnevenBatchSampler
from lightning_cannikin.training.step_timer import StepTimer

__all__ = ["RuntimeState"]


@dataclass
class RuntimeState:
    """Shared state of one fit.

    Attributes:
        fixed_split: the user fixed the split (``local_batch_sizes``); nothing may re-plan it.
        plan: the plan in force (``None`` before the training loader is built).
        bounds: per-rank local batch bounds, set by the callback; the first plan respects them.
        lr_factor: multiplier of the learning rate for each optimizer step, set by the callback.
        step_sizes: every rank's sample count in the training step in progress, set by the strategy.
        accumulation_window: every rank's sample count in each micro-batch of the accumulation window in progress.
        hook: the weighted all-reduce's state; its observers see every gradient bucket.
        timer: this rank's step timer, an observer of the hook (the host clock until the strategy knows the device:
            :meth:`use_timer`).
        sampler: the training loader's uneven sampler, once built.
        noise: the noise statistics' observer, set by the callback when it measures them (``None``: not measured).

    """

    fixed_split: bool = False
    plan: Plan | None = None
    bounds: BatchBounds | None = None
    lr_factor: float = 1.0
    step_sizes: tuple[int, ...] | None = None
    accumulation_window: tuple[tuple[int, ...], ...] = ()
    hook: WeightedAllReduceState = field(default_factory=WeightedAllReduceState)
    timer: StepTimer = field(default_factory=StepTimer)
    sampler: UnevenBatchSampler | None = None
    noise: GradientNormObserver | None = None

    def __post_init__(self) -> None:
        self.hook.observers.append(self.timer)

    def use_timer(self, timer: StepTimer) -> None:
        """Time with ``timer`` from now on (it takes the old one's place among the hook's observers)."""
        observers = self.hook.observers
        observers[observers.index(self.timer)] = timer
        self.timer = timer

    @property
    def batches_yielded(self) -> int:
        """Global batches the training sampler has handed out this epoch (a mid-epoch plan starts at or after it)."""
        return self.sampler.yielded if self.sampler is not None else 0

    def adopt(self, plan: Plan, from_batch: int | None = None, interleave: tuple[Plan, int] | None = None) -> None:
        """Put ``plan`` in force.

        Args:
            plan: the new split; it must split across as many ranks as the plan in force.
            from_batch: apply it to the current epoch from this global batch on. ``None`` leaves the running epoch
                alone: the plan takes effect when the training DataLoader is next built.
            interleave: ``(other, steps)``: for ``steps`` global batches from ``from_batch`` alternate ``plan`` and
                ``other`` (same global batch), then keep ``plan``. A probe interleaved with the split it left is
                timed beside it, so a trend in the device's speed (its first steps) cannot read as a slope.

        """
        if self.plan is not None and plan.world_size != self.plan.world_size:
            raise ValueError(
                f"The plan splits across {plan.world_size} ranks, but the world size is {self.plan.world_size}."
            )
        self.plan = plan
        if from_batch is None or self.sampler is None:
            return
        other, steps = interleave if interleave is not None else (plan, 0)
        if other.global_batch_size != plan.global_batch_size:
            steps = 0  # the epoch's layout would change length: never for a probe, which keeps the total
        for offset in range(steps):  # increasing batches: each entry keeps the ones before it
            self.sampler.set_plan(plan if offset % 2 == 0 else other, from_batch + offset)
        self.sampler.set_plan(plan, from_batch + steps)
