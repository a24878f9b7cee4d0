"""``LocalEvidence``: what one rank alone measures for rank zero's decisions, kept whole through a checkpoint.

Its step records not yet handed to a re-plan, its compute time over its exact summed cost (a cost-aware sampler's
:class:`~lightning_cannikin.training.data.cost_aware_sampler.CostTimeFit`), and its speed-change check with the ranks'
one-bit vote on it (:class:`~lightning_cannikin.core.change_vote.ChangeVote`). Lightning writes rank zero's callback
state, so every rank's part is gathered into it (the engine's ``state_dict``) and each rank takes its own part back.
"""

from __future__ import annotations

from typing import Any

from lightning_cannikin.core.change import LocalChangeCheck
from lightning_cannikin.core.change_vote import ChangeVote
from lightning_cannikin.core.speed_model import StepRecord
from lightning_cannikin.training.collective import Collective
from lightning_cannikin.training.data.cost_aware_sampler import CostTimeFit
from lightning_cannikin.training.measurement.step_timer import StepTimer

__all__ = ["LocalEvidence"]


class LocalEvidence:
    """One rank's evidence for the next re-plan: records read but not yet gathered, its cost fit, its change vote."""

    def __init__(self) -> None:
        self.vote: ChangeVote | None = None  # this rank's speed-change check and the ranks' vote on it
        self.cost_fit = CostTimeFit()
        self.held: list[StepRecord] = []  # records read for a checkpoint: the next re-plan's

    def watch_speed(self, collective: Collective | None, tolerance: float, timer: StepTimer) -> None:
        """Check this rank's own step times for a change of speed, and vote on it with the ranks over ``collective``
        (``None``: no vote: one rank, an even or fixed split, or checks off)."""
        self.vote = None
        if collective is not None:
            check = LocalChangeCheck(tolerance)
            self.vote = ChangeVote(check, collective, not collective.host_runs_ahead, cast_before_backward=True)
            timer.listeners[:] = [check.observe]  # its own times, as the timer reads them

    def timed_size(
        self, sampler: Any, position: int | None, sizes: tuple[int, ...] | None, rank: int, step: int
    ) -> int | None:
        """The size this rank's step is timed at: its samples, or with a cost-aware sampler its summed cost in samples
        of average cost (the speed model then fits the time over the cost; the exact cost goes to the cost fit)."""
        load_of = getattr(sampler, "load_of", None)
        if sizes is None or load_of is None or position is None:
            return None if sizes is None else sizes[rank]
        units = sampler.units_at(position)[rank]
        self.cost_fit.load(step, units)
        return load_of(units)

    def take(self, timer: StepTimer) -> tuple[list[StepRecord], tuple[float, float] | None]:
        """Every record not yet handed to a re-plan (on CUDA the last ones wait for the device: the gather that
        follows synchronises anyway), and this rank's time over its exact cost with them."""
        records, self.held = self.held + timer.records(wait=True), []
        return records, self.cost_fit.add(records)

    def state_dict(self, timer: StepTimer) -> dict[str, Any]:
        """This rank's part of a checkpoint (the timer's records read now, and still handed to the next re-plan)."""
        self.held += timer.records(wait=True)
        return {
            "vote": self.vote.state_dict() if self.vote is not None else None,
            "cost_fit": self.cost_fit.state_dict(),
            "records": [record.to_dict() for record in self.held],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's part of a checkpoint back."""
        if self.vote is not None and state["vote"] is not None:
            self.vote.load_state_dict(state["vote"])
        self.cost_fit.load_state_dict(state["cost_fit"])
        self.held = [StepRecord(**record) for record in state["records"]]

    def restarted(self) -> None:
        """The device starts again: its first times are its warm-up, left out of its change check."""
        if self.vote is not None:
            self.vote.check.restarted()
