"""The split of the total batch across devices: the single source of truth shared by strategy, sampler and callback.

Pure Python: imports neither torch nor Lightning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    """How one optimizer step's samples are split across the ranks.

    Args:
        local_batch_sizes: samples per micro-batch on each rank, indexed by global rank. Every entry is at least 1:
            a rank that runs a step with no samples would contribute a gradient of an empty mean.
        accumulation_steps: micro-batches per optimizer step, the same on every rank so steps stay in lockstep.
        predicted_step_time: the planner's prediction of one micro-step's wall time in seconds, if known.

    """

    local_batch_sizes: tuple[int, ...]
    accumulation_steps: int = 1
    predicted_step_time: float | None = None

    def __post_init__(self) -> None:
        sizes = tuple(int(b) for b in self.local_batch_sizes)
        if not sizes:
            raise ValueError("`local_batch_sizes` must name at least one rank.")
        bad = [b for b in sizes if b < 1]
        if bad:
            raise ValueError(
                f"`local_batch_sizes` must be positive integers, got {list(sizes)}."
                " Give every rank at least one sample per step."
            )
        if int(self.accumulation_steps) < 1:
            raise ValueError(f"`accumulation_steps` must be >= 1, got {self.accumulation_steps}.")
        object.__setattr__(self, "local_batch_sizes", sizes)
        object.__setattr__(self, "accumulation_steps", int(self.accumulation_steps))

    @property
    def world_size(self) -> int:
        """Number of ranks the plan splits across."""
        return len(self.local_batch_sizes)

    @property
    def global_batch_size(self) -> int:
        """Samples in one micro-step across all ranks (one global batch of the sampler)."""
        return sum(self.local_batch_sizes)

    @property
    def total_batch_size(self) -> int:
        """Samples that contribute to one optimizer step across all ranks and micro-batches."""
        return self.global_batch_size * self.accumulation_steps

    @classmethod
    def even(cls, batch_size: int, world_size: int, accumulation_steps: int = 1) -> Plan:
        """The plan plain DDP uses: ``batch_size`` samples on every rank."""
        return cls((int(batch_size),) * int(world_size), accumulation_steps)

    def with_sizes(self, local_batch_sizes: Sequence[int], predicted_step_time: float | None = None) -> Plan:
        """A copy with another split (same accumulation)."""
        return Plan(tuple(local_batch_sizes), self.accumulation_steps, predicted_step_time)

    def to_dict(self) -> dict:
        """A JSON- and checkpoint-friendly form."""
        return {
            "local_batch_sizes": list(self.local_batch_sizes),
            "accumulation_steps": self.accumulation_steps,
            "predicted_step_time": self.predicted_step_time,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        """Inverse of :meth:`to_dict`."""
        return cls(tuple(data["local_batch_sizes"]), data.get("accumulation_steps", 1), data.get("predicted_step_time"))
