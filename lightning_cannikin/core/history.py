"""The plan history a run keeps: every adopted plan, its prediction and, once it has run, its measured step time.

Pure Python and numpy: imports neither torch nor Lightning.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from lightning_cannikin.core.plan import Plan
from lightning_cannikin.core.speed_model import StepRecord

__all__ = ["NoiseTrail", "PlanHistory", "median_step_time"]


def median_step_time(records: Iterable[StepRecord], local_batch_sizes: Sequence[int]) -> float | None:
    """Measured step time under a split (input waits included, as the prediction): median over steps whose sizes
    match it of the ranks' median."""
    by_step: dict[int, dict[int, StepRecord]] = {}
    for record in records:
        by_step.setdefault(record.step, {})[record.rank] = record
    times = [
        statistics.median(r.cycle for r in step.values())  # a few values: numpy's call costs more
        for step in by_step.values()
        if len(step) == len(local_batch_sizes)
        and all(step[rank].batch_size == b for rank, b in enumerate(local_batch_sizes) if rank in step)
    ]
    return float(np.median(times)) if times else None


class NoiseTrail:
    """The noise-scale estimate and its bounds over a fit, for the run profile's trajectory plot.

    Every estimator update may add a point; past ``max_points`` every other one is dropped and points are kept half
    as often, so a long run keeps an even, bounded trail.

    Args:
        max_points: the most points kept.

    """

    def __init__(self, max_points: int = 1024) -> None:
        self.max_points = max_points
        self.points: list[dict[str, Any]] = []
        self._every = 1
        self._seen = 0

    def add(self, step: int, noise_scale: float | None, bounds: tuple[float, float] | None) -> None:
        """The estimate after ``step`` steps and its bounds (``None``: no spread yet), as they are: the run profile
        writes an infinite one as ``null`` (``build_profile``)."""
        self._seen += 1
        if noise_scale is None or (self._seen - 1) % self._every:
            return
        low, high = (None, None) if bounds is None else bounds
        self.points.append(
            {
                "step": int(step),
                "noise_scale": noise_scale,
                "noise_low": low,
                "noise_high": high,
            }
        )
        if len(self.points) > self.max_points:
            self.points = self.points[::2]
            self._every *= 2


class PlanHistory:
    """One JSON-friendly entry per adopted plan and step, in order (what checkpoints and run profiles store).

    The records seen since the last entry are kept until the next re-plan, when they give that entry its measured
    step time.
    """

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self._since_last: list[StepRecord] = []

    def observe(self, records: Iterable[StepRecord]) -> None:
        """Records of the plan in force; the latest entry gets its measured step time from them."""
        self._since_last.extend(records)
        if self.entries and self.entries[-1]["measured_step_time"] is None:
            latest = self.entries[-1]
            measured = median_step_time(self._since_last, latest["local_batch_sizes"])
            latest["measured_step_time"] = measured
            predicted = latest["predicted_step_time"]
            if measured and predicted is not None:
                # how far the model was off at the split it chose, usually at sizes no rank had run yet
                latest["prediction_error"] = abs(predicted - measured) / measured

    @property
    def prediction_error(self) -> float | None:
        """The latest plan's relative prediction error, once it has been measured."""
        for entry in reversed(self.entries):
            if entry.get("prediction_error") is not None:
                return float(entry["prediction_error"])
        return None

    def append(
        self,
        step: int,
        epoch: int,
        plan: Plan,
        lr_factor: float,
        noise_scale: float | None,
        speed_changes: list[int] | None = None,
    ) -> None:
        """A plan adopted at ``step`` (``speed_changes``: the ranks found to have changed speed); its measurement
        starts afresh.

        One entry per step: a plan decided at the step of the latest entry replaces it, since that one never ran a
        step (the epoch's last batch re-plans on the schedule, and the epoch's end re-plans again at the same step).
        """
        self._since_last = []
        if self.entries and self.entries[-1]["step"] == step:
            superseded = self.entries.pop()
            speed_changes = sorted({*superseded["speed_changes"], *(speed_changes or [])})
        self.entries.append(
            {
                "step": step,
                "epoch": epoch,
                "local_batch_sizes": list(plan.local_batch_sizes),
                "total_batch_size": plan.total_batch_size,
                "predicted_step_time": plan.predicted_step_time,
                "measured_step_time": None,
                "prediction_error": None,
                "lr_factor": lr_factor,
                "noise_scale": noise_scale,
                "speed_changes": list(speed_changes or []),
            }
        )
