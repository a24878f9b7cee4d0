"""The split of the total batch across devices, its bounds, and the rounding every split rule shares.

:class:`Plan` is the one value type for a split: the strategy, the sampler, the callback, the OptPerf solver and the
simulator all pass it. :class:`BatchBounds` is the one parsed form of ``local_batch_bounds``.
:func:`proportional_sizes` is the one largest-remainder rounding (the sampler's last partial batch and the
speed-proportional baseline both use it).

Pure Python: imports neither torch nor Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_cannikin.core.optperf import most_even_split

__all__ = ["BatchBounds", "Plan", "even_split", "proportional_sizes"]


@dataclass(frozen=True)
class Plan:
    """How one optimizer step's samples are split across the ranks.

    Args:
        local_batch_sizes: samples per micro-batch on each rank, indexed by global rank. Every entry is at least 1:
            a rank that runs a step with no samples would contribute a gradient of an empty mean.
        accumulation_steps: micro-batches per optimizer step, the same on every rank so steps stay in lockstep.
        predicted_step_time: the model's prediction of one micro-step's wall time in seconds, if known.
        time_models: every rank's fitted ``(seconds per step, seconds per unit of cost)`` when the plan was decided
            with every device's speed measured: what a cost-aware sampler splits each global batch by (every rank
            receives the same numbers with the plan).

    """

    local_batch_sizes: tuple[int, ...]
    accumulation_steps: int = 1
    predicted_step_time: float | None = None
    time_models: tuple[tuple[float, float], ...] | None = field(default=None, compare=False)

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
        if self.time_models is not None:
            models = tuple((float(fixed), float(slope)) for fixed, slope in self.time_models)
            if len(models) != len(sizes):
                raise ValueError(f"`time_models` has {len(models)} entries for {len(sizes)} ranks.")
            object.__setattr__(self, "time_models", models)

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

    def resized(self, world_size: int) -> Plan:
        """The plan for another number of ranks (an elastic restart): the same global batch where ``world_size``
        ranks can hold it (one sample each at least), split evenly until the new devices are timed."""
        if world_size == self.world_size:
            return self
        return Plan(even_split(max(self.global_batch_size, world_size), world_size), self.accumulation_steps)

    def to_dict(self) -> dict:
        """A JSON- and checkpoint-friendly form."""
        data: dict[str, Any] = {
            "local_batch_sizes": list(self.local_batch_sizes),
            "accumulation_steps": self.accumulation_steps,
            "predicted_step_time": self.predicted_step_time,
        }
        if self.time_models is not None:
            data["time_models"] = [list(model) for model in self.time_models]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        """Inverse of :meth:`to_dict`."""
        models = data.get("time_models")
        return cls(
            tuple(data["local_batch_sizes"]),
            data.get("accumulation_steps", 1),
            data.get("predicted_step_time"),
            None if models is None else tuple(tuple(model) for model in models),
        )


def even_split(total_batch_size: int, n: int) -> tuple[int, ...]:
    """Plain DDP's split: as even as possible, the remainder on the lowest ranks (zeros when ``B < n``)."""
    if n < 1:
        raise ValueError(f"`n` must be >= 1, got {n}.")
    if total_batch_size < 0:
        raise ValueError(f"`total_batch_size` must be >= 0, got {total_batch_size}.")
    q, r = divmod(int(total_batch_size), int(n))
    return tuple(q + 1 if i < r else q for i in range(n))


def proportional_sizes(total: int, weights: Sequence[float]) -> tuple[int, ...]:
    """Split ``total`` samples in proportion to ``weights``, every entry getting at least one sample.

    The ideal shares are rounded by largest remainders (ties to the lowest index); then any entry left at zero is
    raised to one, the sample taken from the entry furthest above its ideal share (ties to the highest index, so low
    ranks keep more). Deterministic, so every rank computes the same split.

    Raises:
        ValueError: when ``total`` is smaller than the number of entries, or a weight is not finite and positive.

    """
    n = len(weights)
    w = [float(x) for x in weights]
    if n < 1 or any(not (0.0 < x < math.inf) for x in w):
        raise ValueError(f"`weights` must be finite and > 0, one per rank, got {list(weights)}.")
    total = int(total)
    if total < n:
        raise ValueError(f"Cannot split {total} samples across {n} ranks with at least one sample each.")
    scale = sum(w)
    ideal = [total * x / scale for x in w]
    sizes = [math.floor(x) for x in ideal]
    by_remainder = sorted(range(n), key=lambda i: (-(ideal[i] - sizes[i]), i))
    for i in by_remainder[: total - sum(sizes)]:
        sizes[i] += 1
    for i in range(n):
        if sizes[i] < 1:
            sizes[i] = 1
            donor = max((j for j in range(n) if sizes[j] > 1), key=lambda j: (sizes[j] - ideal[j], j))
            sizes[donor] -= 1
    return tuple(sizes)


@dataclass(frozen=True)
class BatchBounds:
    """Per-rank bounds on the local batch: ``lower[i] <= b_i <= upper[i]`` (``upper`` ``None``: no cap).

    Build it with :meth:`parse` from the ``local_batch_bounds`` option.
    """

    lower: tuple[int, ...]
    upper: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.upper is not None and any(lo > hi for lo, hi in zip(self.lower, self.upper, strict=True)):
            raise ValueError(
                f"`local_batch_bounds` lower bounds {list(self.lower)} exceed upper bounds {list(self.upper)}."
            )

    @property
    def world_size(self) -> int:
        return len(self.lower)

    @classmethod
    def check(cls, value: Any) -> None:
        """Validate the shape of a ``local_batch_bounds`` option before the world size is known."""
        cls._halves(value)

    @classmethod
    def parse(cls, value: Any, world_size: int, smallest: int = 1) -> BatchBounds:
        """Per-rank bounds from ``local_batch_bounds``.

        Args:
            value: ``None`` (at least ``smallest`` samples, no cap), an upper bound, or ``(lower, upper)`` where each
                is a scalar, a per-rank sequence, or ``None``.
            world_size: the number of ranks.
            smallest: the lower bound where ``value`` gives none (what the model's layers accept); an upper bound
                below it lowers it, and a lower bound the user gives wins.

        """
        lower, upper = cls._halves(value)
        upper = _per_rank(upper, world_size, None, "upper")
        if lower is None and smallest > 1:
            caps = upper if upper is not None else (smallest,) * world_size
            lower = tuple(min(smallest, cap) for cap in caps)
        return cls(_per_rank(lower, world_size, 1, "lower"), upper)

    @classmethod
    def gives_lower(cls, value: Any) -> bool:
        """Whether a ``local_batch_bounds`` option sets the lower bounds itself."""
        return cls._halves(value)[0] is not None

    def first_plan(self, global_batch_size: int, accumulation: int = 1) -> Plan:
        """The plan a fit starts from: ``global_batch_size`` (the loader's ``batch_size`` on every rank) as even as
        these bounds allow, the same total; a clear error where no split of it fits them."""
        world_size, lowest, upper = self.world_size, sum(self.lower), self.upper
        source = f"the initial global batch of {global_batch_size} (the DataLoader's batch_size x {world_size} ranks)"
        if lowest > global_batch_size:
            raise ValueError(
                f"`local_batch_bounds` lower bounds {list(self.lower)} need at least {lowest} samples per step, more"
                f" than {source}. Raise the DataLoader `batch_size` to at least {-(-lowest // world_size)}, or lower"
                " the lower bounds."
            )
        if upper is not None and sum(upper) < global_batch_size:
            raise ValueError(
                f"`local_batch_bounds` upper bounds {list(upper)} hold at most {sum(upper)} samples per step, fewer"
                f" than {source}. Lower the DataLoader `batch_size` to at most {max(1, sum(upper) // world_size)}, or"
                " raise the upper bounds."
            )
        split = most_even_split(global_batch_size, world_size, self.lower, upper)
        return Plan(split.local_batch_sizes, accumulation)

    @staticmethod
    def _halves(value: Any) -> tuple[Any, Any]:
        if value is None:
            return None, None
        if isinstance(value, int) and not isinstance(value, bool):
            return None, value
        if isinstance(value, tuple) and len(value) == 2:
            return value
        raise ValueError(
            "`local_batch_bounds` must be an upper bound, a (lower, upper) tuple of scalars or per-rank sequences, or"
            f" None; got {value!r}."
        )


def _per_rank(value: Any, n: int, default: int | None, name: str) -> Any:
    if value is None:
        return None if default is None else (default,) * n
    if isinstance(value, int) and not isinstance(value, bool):
        values = (value,) * n
    else:
        values = tuple(int(v) for v in value)
        if len(values) != n:
            raise ValueError(f"`local_batch_bounds` {name} bounds have {len(values)} entries for {n} ranks.")
    if any(v < 1 for v in values):
        raise ValueError(f"`local_batch_bounds` {name} bounds must be >= 1, got {list(values)}.")
    return values
