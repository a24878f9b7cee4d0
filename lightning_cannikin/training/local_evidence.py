"""``LocalEvidence``: what one rank alone measures for rank zero's decisions, kept whole through a checkpoint.

Its step records not yet handed to a re-plan, its compute time over its exact summed cost (a cost-aware sampler's
:class:`~lightning_cannikin.training.cost_aware_sampler.CostTimeFit`), and its speed-change check with the ranks'
one-bit vote on it (:class:`~lightning_cannikin.core.change_vote.ChangeVote`). Lightning writes rank zero's callback
state, so every rank's part is gathered into it (the engine's ``state_dict``) and each rank takes its own part back.
"""

from __future__ import annotations

from typing import Any

from lightning_cannikin.core.change_vote import ChangeVote
from lightning_cannikin.core.speed_model import StepRecord
from lightning_cannikin.training.cost_aware_sampler import CostTimeFit
from lightning_cannikin.training.step_timer import StepTimer

__all__ = ["LocalEvidence"]


class LocalEvidence:
    """One rank's evidence for the next re-plan: records read but not yet gathered, its cost fit, its change vote."""

    def __init__(self) -> None:
        self.vote: ChangeVote | None = None  # this rank's speed-change check and the ranks' vote on it
        self.cost_fit = CostTimeFit()
        self.held: list[StepRecord] = []  # records read for a checkpoint: the next re-plan's

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
