"""What a frontend's strategy and the balancing engine share during a fit, in one small object the strategy owns.

The engine reaches it through the strategy's ``runtime`` and never imports a strategy. One writer per field:

- the strategy (Lightning's or Fabric's), through :meth:`RuntimeState.use_loader` and :meth:`RuntimeState.begin_step`:
  the loader's sampler and first plan, the step's sizes, accumulation window, weights, learning-rate factor and gain;
- the engine, through :meth:`RuntimeState.attach` and :meth:`RuntimeState.adopt`: the bounds, the noise observer,
  the learning-rate rule, and the plans it decides.

The step weights over the accumulation window (``b_i / B`` for a loss averaged over samples, or those of the declared
normalisation) are computed here and nowhere else (:meth:`begin_step`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from lightning_cannikin.core.optperf import most_even_split
from lightning_cannikin.core.plan import BatchBounds, Plan, even_split
from lightning_cannikin.training.comm_hook import WeightedAllReduceState
from lightning_cannikin.training.cost_aware_sampler import CostTimeFit
from lightning_cannikin.training.grad_stats import GradientNormObserver
from lightning_cannikin.training.loss_weights import LossScaleCheck, check_normalisation, step_weights
from lightning_cannikin.training.sampler import UnevenBatchSampler
from lightning_cannikin.training.step_timer import StepTimer

__all__ = ["RuntimeState"]


@dataclass
class RuntimeState:
    """Shared state of one fit.

    Attributes:
        fixed_split: the user fixed the split (``local_batch_sizes``); nothing may re-plan it.
        plan: the plan in force (``None`` before the training loader is built).
        bounds: per-rank local batch bounds, set by the engine; the first plan respects them.
        scale: ``total batch -> (lr factor, AdaScale gain)``, set by the engine (``None``: 1 and 1).
        lr_factor: multiplier of the learning rate for the step in progress: the one of the plan that step runs.
        gain: the AdaScale gain of the step in progress (B0-steps of progress it makes).
        step_sizes: every rank's sample count in the training step in progress.
        accumulation_window: every rank's sample count in each micro-batch of the accumulation window in progress (a
            count mean's units in samples' worth): the noise statistics' group sizes.
        loss_factor: what this rank's loss is multiplied by in the step in progress (the weight, where the loss
            carries it, and the micro-batch's share of the window).
        hook: the weighted all-reduce's state; its observers see every gradient bucket.
        timer: this rank's step timer, an observer of the hook (the host clock until the strategy knows the device:
            :meth:`use_timer`).
        sampler: the training loader's uneven sampler, once built.
        noise: the noise statistics' observer, set by the engine when it measures them (``None``: not measured).
        noise_observer_type: what the engine builds it as: the strategy's choice (FSDP reads its reduce-scatters).
        normalisation: how the user's loss is normalised (:mod:`~lightning_cannikin.training.loss_weights`): the
            step weights and the noise statistics follow it.
        step_units: every rank's count (tokens) in the step in progress, all-gathered by the strategy for a count mean
            when the sampler does not know the samples' counts.
        losses: each step's local loss beside the step's sizes, for the check against ``normalisation``.
        step_position: the global batch of the step in progress.
        cost_fit: this rank's compute time over its exact summed cost (a cost-aware sampler's time model).

    """

    fixed_split: bool = False
    plan: Plan | None = None
    bounds: BatchBounds | None = None
    scale: Callable[[int], tuple[float, float]] | None = None
    lr_factor: float = 1.0
    gain: float = 1.0
    step_sizes: tuple[int, ...] | None = None
    accumulation_window: tuple[tuple[int, ...], ...] = ()
    loss_factor: float = 1.0
    hook: WeightedAllReduceState = field(default_factory=WeightedAllReduceState)
    timer: StepTimer = field(default_factory=StepTimer)
    sampler: UnevenBatchSampler | None = None
    noise: GradientNormObserver | None = None
    noise_observer_type: type[GradientNormObserver] = GradientNormObserver
    normalisation: str = "sample_mean"
    step_units: tuple[float, ...] | None = None
    losses: LossScaleCheck = field(default_factory=LossScaleCheck)
    step_position: int | None = None
    cost_fit: CostTimeFit = field(default_factory=CostTimeFit)
    _weights_key: tuple | None = field(default=None, repr=False, compare=False)  # the last step's weights, kept
    _weights: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.hook.observers.append(self.timer)
        self.losses.normalisation = check_normalisation(self.normalisation)

    def _window_units(self, indices: list[int]) -> list[tuple[float, ...]] | None:
        """Every rank's units in each micro-batch of the window, for a count mean: from the sampler when it knows every
        sample's count (no collective), else this step's all-gathered units (one micro-batch per step only)."""
        if self.normalisation != "count_mean":
            return None
        units_at = getattr(self.sampler, "units_at", None)
        if units_at is not None:
            return [units_at(q) for q in indices]
        if self.step_units is None or len(indices) > 1:
            raise ValueError(
                "`loss_normalisation='count_mean'` needs every micro-batch's count: give the strategy `sample_costs`"
                " (the sampler then knows every sample's count, with gradient accumulation too) or `batch_units` (a"
                " function of the local batch, all-gathered each step; without gradient accumulation)."
            )
        return [self.step_units]

    def use_timer(self, timer: StepTimer) -> None:
        """Time with ``timer`` from now on (it takes the old one's place among the hook's observers)."""
        observers = self.hook.observers
        observers[observers.index(self.timer)] = timer
        timer.listeners = self.timer.listeners
        self.timer = timer

    def attach(
        self,
        bounds: BatchBounds,
        noise: GradientNormObserver | None,
        scale: Callable[[int], tuple[float, float]] | None,
    ) -> None:
        """The engine's part: the bounds, the noise observer (among the hook's observers) and the LR rule."""
        if noise is not None and noise not in self.hook.observers:
            self.hook.observers.append(noise)  # through the comm hook, if there is one
        self.bounds, self.noise, self.scale = bounds, noise, scale

    def first_plan(self, global_batch_size: int, world_size: int, accumulation: int = 1) -> Plan:
        """The plan a fit starts from: ``global_batch_size`` as even as the bounds allow (the same total)."""
        bounds = self.bounds
        if bounds is None:
            return Plan(even_split(global_batch_size, world_size), accumulation)
        lowest, upper = sum(bounds.lower), bounds.upper
        source = f"the initial global batch of {global_batch_size} (the DataLoader's batch_size x {world_size} ranks)"
        if lowest > global_batch_size:
            raise ValueError(
                f"`local_batch_bounds` lower bounds {list(bounds.lower)} need at least {lowest} samples per step, more"
                f" than {source}. Raise the DataLoader `batch_size` to at least {-(-lowest // world_size)}, or lower"
                " the lower bounds."
            )
        if upper is not None and sum(upper) < global_batch_size:
            raise ValueError(
                f"`local_batch_bounds` upper bounds {list(upper)} hold at most {sum(upper)} samples per step, fewer"
                f" than {source}. Lower the DataLoader `batch_size` to at most {max(1, sum(upper) // world_size)}, or"
                " raise the upper bounds."
            )
        split = most_even_split(global_batch_size, world_size, bounds.lower, bounds.upper)
        return Plan(split.local_batch_sizes, accumulation)

    def use_loader(self, plan: Plan | None, sampler: UnevenBatchSampler | None) -> None:
        """The strategy's part: the training loader it built with ``plan`` (``None`` at the fit's end)."""
        self.plan, self.sampler = plan, sampler

    def begin_step(
        self, position: int | None, sizes: tuple[int, ...] | None, rank: int, accumulation: int = 1, end: int = -1
    ) -> None:
        """The strategy's part: global batch ``position`` of the epoch, with every rank's ``sizes``, starts.

        Sets the step's weights for the exact mean over the accumulation window it belongs to, and its learning-rate
        factor and gain: those of the plan the step runs (a plan decided mid-epoch starts at a later batch than the
        decision, because the loader prefetches; its factor starts with it).

        The hook weight is this rank's share of the window's samples. When micro-batches within the window differ in
        size (the epoch's last, partial batch), each micro-batch's loss is rescaled so that the rank's accumulated
        gradient is still the mean over its own samples; the loss comes divided by ``accumulation`` (Lightning
        divides it; a Fabric loop does as Lightning), which the factor undoes.

        Args:
            position: the global batch's index in the epoch (``None``: outside a training step).
            sizes: every rank's sample count in it.
            rank: this rank.
            accumulation: micro-batches per optimizer step.
            end: where the window is closed early (the epoch's last batch, ``limit_train_batches``); ``-1``: the
                epoch's end.

        """
        self.step_sizes, self.step_position = sizes, position
        if position is None or sizes is None:
            return
        indices = [position]
        if accumulation > 1 and self.sampler is not None:
            first = (position // accumulation) * accumulation
            last = len(self.sampler) if end < 0 else min(end, len(self.sampler))
            last = min(first + accumulation, last)
            # an epoch resumed on another world size has placeholders (no sizes) for the batches it did not run
            indices = [q for q in range(first, max(last, position + 1)) if q == position or self.sampler.sizes_at(q)]
        window = [sizes if q == position else self.sampler.sizes_at(q) for q in indices]  # type: ignore[union-attr]
        units, micro = self._window_units(indices), indices.index(position)
        key = (self.normalisation, tuple(window), rank, micro) if units is None else None
        if key is None or key != self._weights_key:  # most steps repeat the last one's sizes
            weights = step_weights(self.normalisation, window, units, rank, micro)
            self._weights_key, self._weights = key, weights
        weights = self._weights
        self.accumulation_window = weights.noise_sizes
        hook = self.hook
        hook.weight, hook.micro_weight, hook.unit_scale = weights.rank, weights.micro, weights.unit_scale
        hook.global_scale = float(sum(map(sum, window))) if self.normalisation == "sample_sum" else 1.0
        # the weight on the loss (where the loss carries it), times n where DDP's own all-reduce averages
        weight = hook.weight * hook.mean_over if hook.weight_in_loss else 1.0
        self.loss_factor = accumulation * hook.micro_weight * weight
        plan = self.sampler.plan_at(position) if self.sampler is not None else self.plan
        total = plan.total_batch_size if plan is not None else sum(sizes) * accumulation
        self.lr_factor, self.gain = self.scale(total) if self.scale is not None else (1.0, 1.0)

    def timed_size(self, rank: int, step: int = 0) -> int | None:
        """The size ``rank``'s step in progress (the engine's ``step``) is timed at: its samples, or with a cost-aware
        sampler its summed cost in samples of average cost (the speed model then fits the time over the cost; the
        exact cost goes to :attr:`cost_fit`)."""
        sizes, position = self.step_sizes, self.step_position
        if sizes is None:
            return None
        load_of = getattr(self.sampler, "load_of", None)
        if load_of is None or position is None:
            return sizes[rank]
        units = self.sampler.units_at(position)[rank]  # type: ignore[union-attr]
        self.cost_fit.load(step, units)
        return load_of(units)

    def learning_rate_scaled(self, optimizer: Any) -> AbstractContextManager[None]:
        """The optimizer's learning rates times the step's factor for this step only, restored afterwards, so any LR
        scheduler keeps its own values (a factor of 1, most steps, touches nothing)."""
        return nullcontext() if self.lr_factor == 1.0 else _scaled(optimizer, self.lr_factor)

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


@contextmanager
def _scaled(optimizer: Any, factor: float) -> Iterator[None]:
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr
