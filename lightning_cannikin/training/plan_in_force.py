"""``PlanInForce``: the newest plan, and the training sampler (with the loader the engine built) that runs it.

A plan decided mid-epoch starts at a global batch no rank has drawn yet (the loader prefetches), so the step in
progress may still run the plan before it: :meth:`PlanInForce.plan_at` says which plan a batch runs. A plan decided at
an epoch's end, or set before a fit, waits for the next training loader.
"""

from __future__ import annotations

from lightning_cannikin.core.plan import Plan
from lightning_cannikin.training.loader import UnevenDataLoader
from lightning_cannikin.training.sampler import UnevenBatchSampler

__all__ = ["PlanInForce"]


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

    def set_plan(self, plan: Plan, from_batch: int | None = None, interleave: tuple[Plan, int] | None = None) -> None:
        """Put ``plan`` (as many ranks as the plan in force) in force: in the running epoch from global batch
        ``from_batch`` on (``interleave``: :meth:`UnevenBatchSampler.set_plan
        <lightning_cannikin.training.sampler.UnevenBatchSampler.set_plan>`'s), or, with ``None``, when the training
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
