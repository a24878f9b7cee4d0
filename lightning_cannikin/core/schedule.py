"""When to re-plan mid-epoch: every few steps while some device's speed is unmeasured, and on a fixed cadence.

Pure Python: imports neither torch nor Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ReplanSchedule"]


@dataclass
class ReplanSchedule:
    """Mid-epoch re-plan cadence; epoch ends always re-plan.

    Args:
        warmup_steps: while some rank's slope is not measured (``identified`` false), re-plan every this many steps:
            the first re-plan probes a second batch size on every rank, the next one balances. Not used when the
            split is even (an even split probes nothing, so it would re-plan forever for no change).
        every_n_steps: also re-plan every this many steps (``None``: never on a cadence).

    """

    warmup_steps: int = 8
    every_n_steps: int | None = None
    last_replan_step: int = 0
    settle_at: int | None = None  # a re-plan due once a new total batch has been timed at its new sizes

    def __post_init__(self) -> None:
        if int(self.warmup_steps) < 1:
            raise ValueError(f"`warmup_steps` must be >= 1, got {self.warmup_steps}.")
        if self.every_n_steps is not None and int(self.every_n_steps) < 1:
            raise ValueError(f"`replan_every_n_steps` must be a positive integer or None, got {self.every_n_steps}.")

    def due(self, step: int, identified: bool, balance: bool) -> bool:
        """Whether the ranks re-plan after ``step`` steps (the same answer on every rank)."""
        warming_up = balance and not identified and step % self.warmup_steps == 0
        periodic = self.every_n_steps is not None and step - self.last_replan_step >= self.every_n_steps
        settling = self.settle_at is not None and step >= self.settle_at
        return warming_up or periodic or settling

    def replanned(self, step: int, total_changed: bool, balance: bool) -> None:
        """A re-plan happened after ``step`` steps. A new total puts every rank at sizes its model extrapolated to:
        re-split once ``warmup_steps`` steps have timed them there (an even split has nothing to re-split)."""
        self.last_replan_step = step
        self.settle_at = step + self.warmup_steps if total_changed and balance else None
