"""``PlanInForce``: the newest plan, and the training sampler (with the loader the engine built) that runs it; and the
``RunningStep``, the plan and sizes the step in progress runs.

A plan decided mid-epoch starts at a global batch no rank has drawn yet (the loader prefetches), so the step in
progress may still run the plan before it: :meth:`PlanInForce.plan_at` says which plan a batch runs. A plan decided at
an epoch's end, or set before a fit, waits for the next training loader.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from lightning_cannikin.core.controller import Message
from lightning_cannikin.core.plan import BatchBounds, Plan
from lightning_cannikin.training.data.loader import UnevenDataLoader
from lightning_cannikin.training.data.sampler import UnevenBatchSampler

__all__ = ["PlanInForce", "RunningStep"]


@dataclass(frozen=True)
class RunningStep:
    """The step in progress: the ``plan`` it runs (a plan decided mid-epoch starts at a later batch than the decision,
    because the loader prefetches), every rank's sample count ``sizes``, and that plan's learning-rate factor and
    AdaScale gain (B0-steps of progress the step makes)."""

    plan: Plan | None = None
    sizes: tuple[int, ...] | None = None
    lr_factor: float = 1.0
    gain: float = 1.0


class PlanInForce:
    """The newest plan and the sampler that runs it (``None`` for each until set)."""

    def __init__(self) -> None:
        self.plan: Plan | None = None  # the newest plan (steps already prefetched may still run the one before it)
        self.sampler: UnevenBatchSampler | None = None
        self.loader: UnevenDataLoader | None = None  # the training loader, where the engine built it

    def use_loader(self, plan: Plan | None, sampler: UnevenBatchSampler | None) -> None:
        """The training sampler built with ``plan`` (``None``: the fit ended; the plan stays)."""
        self.plan, self.sampler = plan if plan is not None else self.plan, sampler
        self.loader = None

    def first_plan(self, total: int, accumulation: int, fixed: Sequence[int] | None, bounds: BatchBounds) -> Plan:
        """The plan a fit's training loader starts from: the ``fixed`` split, else the plan in force (an earlier
        fit's, a checkpoint's) at this ``accumulation``, else ``total`` (the loader's batch size on every rank) split
        evenly within the ``bounds``."""
        if fixed is not None:
            return Plan(tuple(fixed), accumulation)
        if self.plan is not None:
            return replace(self.plan, accumulation_steps=accumulation)
        return bounds.first_plan(total, accumulation)

    def resume(self, saved: dict[str, Any], world_size: int) -> tuple[Plan, Message | None]:
        """Put a checkpoint's ``saved`` plan in force on ``world_size`` ranks (the global batch kept, split evenly on
        other devices). Returns the plan, and a message where the number of ranks changed."""
        plan = Plan.from_dict(saved).resized(world_size)
        self.set_plan(plan)
        ranks = len(saved["local_batch_sizes"])
        if ranks == world_size:
            return plan, None
        text = (
            f"Cannikin: resuming a {ranks}-rank run on {world_size} ranks; keeping the global batch of"
            f" {plan.global_batch_size}, split evenly until the new devices are timed."
        )
        return plan, Message(text)

    def set_plan(self, plan: Plan, from_batch: int | None = None, interleave: tuple[Plan, int] | None = None) -> None:
        """Put ``plan`` (as many ranks as the plan in force) in force: in the running epoch from global batch
        ``from_batch`` on (``interleave``: :meth:`UnevenBatchSampler.set_plan
        <lightning_cannikin.training.data.sampler.UnevenBatchSampler.set_plan>`'s), or, with ``None``, when the training
        DataLoader is next built."""
        if self.plan is not None and plan.world_size != self.plan.world_size:
            raise ValueError(
                f"The plan splits across {plan.world_size} ranks, but the world size is {self.plan.world_size}."
            )
        self.plan = plan
        if from_batch is not None and self.sampler is not None:
            self.sampler.set_plan(plan, from_batch, interleave)

    @property
    def epoch_length(self) -> int | None:
        """Global batches in the running epoch (``None`` without a training loader)."""
        try:
            return len(self.sampler) if self.sampler is not None else None
        except TypeError:  # a stream read whole by every rank: its length is known at its end only
            return None

    @property
    def batches_yielded(self) -> int:
        """Global batches the training sampler has handed out this epoch (a mid-epoch plan starts at or after it)."""
        return self.sampler.yielded if self.sampler is not None else 0

    @property
    def mid_epoch_plans(self) -> bool:
        """Whether a plan may start within the running epoch (a stream's shares change only at its end)."""
        return getattr(self.sampler, "mid_epoch_plans", True)

    def next_batch(self) -> tuple[int, tuple[int, ...]] | None:
        """The next global batch the engine's loader handed out: its position and every rank's sample count."""
        pending = self.loader.pending_steps if self.loader is not None else None
        return pending.popleft() if pending else None

    def plan_at(self, position: int) -> Plan | None:
        """The plan global batch ``position`` of the running epoch runs."""
        return self.sampler.plan_at(position) if self.sampler is not None else self.plan
