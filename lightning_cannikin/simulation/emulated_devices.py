"""The cost model of emulated devices: what a heterogeneous device adds to a step, with what real devices do to it.

Device ``r`` holding ``b`` samples at step ``s`` costs ``fixed_ms[r] + per_sample_ms[r] * max(b, saturation[r])``
milliseconds, times a warm-up factor over the first steps, plus per-step jitter. The options model what real GPUs
do and the clean linear emulator does not: noise (``jitter_ms``), slower first steps (allocator, caches,
autotuning, input workers: ``warmup_steps`` and ``warmup_factor``), and a step time that is flat below a saturation
batch (a GPU is not busy at small batches: ``saturation_batch``), and a device shared with another job or an input
pipeline that stalls every few steps (``contention``). Every option is off by default.

A rank's host has a cost of its own, outside the device's step: ``host_fixed_ms[r] + host_per_sample_ms[r] * b`` to
prepare each batch of ``b`` samples (loading, decoding, collation on a slower or busier host). Where the training
process does it (no loader workers), it is in series with the device's step.

:class:`~lightning_cannikin.EmulatedCluster` sleeps for these costs inside training steps; tests replay them without
Lightning. Pure Python and numpy: imports neither torch nor Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["EmulatedDevices"]


# the options that take one value per rank or one for all
_PER_RANK = ("per_sample_ms", "fixed_ms", "saturation_batch", "host_per_sample_ms", "host_fixed_ms", "optimizer_ms")


def _per_rank(name: str, value: float | Sequence[float]) -> tuple[float, ...] | float:
    if isinstance(value, (int, float)):
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"`{name}` must be finite and >= 0, got {value}.")
        return float(value)
    values = tuple(float(v) for v in value)
    if not values or any(not (v >= 0 and math.isfinite(v)) for v in values):
        raise ValueError(f"`{name}` must be non-negative and finite, one per rank, got {list(values)}.")
    return values


def _of(value: tuple[float, ...] | float, rank: int) -> float:
    return value if isinstance(value, float) else value[rank]


@dataclass(frozen=True)
class EmulatedDevices:
    """Per-rank emulated step costs.

    Args:
        per_sample_ms: milliseconds per sample on each rank (one value per rank, or one for all).
        fixed_ms: milliseconds per step on each rank, whatever the batch.
        speed_changes: from a step on, new ``per_sample_ms`` (e.g. ``{200: [1.0, 3.0]}``: rank 1 three times slower).
        jitter_ms: standard deviation of a Gaussian noise added to each step (the total never goes below zero).
        warmup_steps: the first steps are slower: step ``s < warmup_steps`` costs ``1 + (warmup_factor - 1) *
            (1 - s / warmup_steps)`` times its cost, decaying to normal.
        warmup_factor: how much slower step 0 is (>= 1).
        saturation_batch: below this local batch the step costs as much as at it (one value per rank, or one for
            all; 0: linear down to one sample).
        contention: ``{rank: (factor, every)}``: that rank's whole cost is ``factor`` times higher on every
            ``every``-th step (steps ``0, every, 2 * every, ...``): another job sharing its GPU, an input pipeline
            that stalls periodically. E.g. ``{2: (2.5, 3)}``: rank 2 is 2.5x slower every third step.
        seed: seed of the jitter; each (rank, step) draws its own, so runs are reproducible.
        host_per_sample_ms: milliseconds per sample of the rank's host to prepare a batch (one value per rank, or
            one for all), slept in the input pipeline (:meth:`~lightning_cannikin.EmulatedCluster.collate_fn`).
        host_fixed_ms: milliseconds per batch of the rank's host, whatever its size.
        optimizer_ms: milliseconds of each rank's optimizer step (one value per rank, or one for all), after its
            gradients are reduced: outside the compute span, in series with the rank's next step.

    """

    per_sample_ms: tuple[float, ...] | float
    fixed_ms: tuple[float, ...] | float = 0.0
    speed_changes: Mapping[int, tuple[float, ...] | float] = field(default_factory=dict)
    jitter_ms: float = 0.0
    warmup_steps: int = 0
    warmup_factor: float = 1.0
    saturation_batch: tuple[float, ...] | float = 0.0
    seed: int = 0
    contention: Mapping[int, tuple[float, int]] = field(default_factory=dict)
    host_per_sample_ms: tuple[float, ...] | float = 0.0
    host_fixed_ms: tuple[float, ...] | float = 0.0
    optimizer_ms: tuple[float, ...] | float = 0.0

    def __post_init__(self) -> None:
        for name in _PER_RANK:
            object.__setattr__(self, name, _per_rank(name, getattr(self, name)))
        changes = {int(step): _per_rank("speed_changes", value) for step, value in dict(self.speed_changes).items()}
        object.__setattr__(self, "speed_changes", changes)
        _per_rank("jitter_ms", self.jitter_ms)
        object.__setattr__(self, "contention", _check_contention(self.contention))
        if int(self.warmup_steps) < 0:
            raise ValueError(f"`warmup_steps` must be >= 0, got {self.warmup_steps}.")
        if not self.warmup_factor >= 1.0:
            raise ValueError(f"`warmup_factor` must be >= 1, got {self.warmup_factor}.")

    def check_world_size(self, world_size: int) -> None:
        """Raise if an option holds one value per rank for another world size, or names a rank outside it."""
        values = [(name, getattr(self, name)) for name in _PER_RANK]
        for name, value in values + [("speed_changes", value) for value in self.speed_changes.values()]:
            if isinstance(value, tuple) and len(value) != world_size:
                raise ValueError(
                    f"`{name}` has {len(value)} entries but the world size is {world_size}."
                    " Give one value per rank, or a single number for all ranks."
                )
        outside = [rank for rank in self.contention if rank >= world_size]
        if outside:
            raise ValueError(f"`contention` names ranks {outside} but the world size is {world_size}.")

    def clean_ms(self, rank: int, batch_size: int, step: int = 0) -> float:
        """The cost without jitter or warm-up, contention included: what a perfect model of the device predicts."""
        per_sample = self.per_sample_ms
        for change_step in sorted(self.speed_changes):
            if change_step <= step:
                per_sample = self.speed_changes[change_step]
        samples = max(float(batch_size), _of(self.saturation_batch, rank))
        factor, every = self.contention.get(rank, (1.0, 1))
        stall = factor if step % every == 0 else 1.0
        return (_of(self.fixed_ms, rank) + _of(per_sample, rank) * samples) * stall

    def delay_ms(self, rank: int, batch_size: int, step: int = 0) -> float:
        """The emulated extra time of ``rank`` for a local batch of ``batch_size`` samples at training step ``step``."""
        cost = self.clean_ms(rank, batch_size, step)
        if step < self.warmup_steps:
            cost *= 1.0 + (self.warmup_factor - 1.0) * (1.0 - step / self.warmup_steps)
        if self.jitter_ms > 0:
            cost += float(np.random.default_rng([self.seed, rank, step]).normal(0.0, self.jitter_ms))
        return max(cost, 0.0)

    def host_ms(self, rank: int, batch_size: int) -> float:
        """What ``rank``'s host spends preparing a batch of ``batch_size`` samples."""
        return _of(self.host_fixed_ms, rank) + _of(self.host_per_sample_ms, rank) * float(batch_size)

    def optimizer_ms_of(self, rank: int) -> float:
        """What ``rank``'s optimizer step costs, after its gradients are reduced."""
        return _of(self.optimizer_ms, rank)

    def lead_ms(self, rank: int, meeting: str = "none") -> float:
        """How long after the all-reduce ``rank`` can start its next input, as its optimizer steps and the loop allow:
        ``"none"``, at once after its own optimizer step (the ranks next meet at the all-reduce); ``"barrier"``, after
        the slowest rank's; ``"broadcast"``, as a broadcast from rank zero releases it (Lightning's loop at each step's
        start since 2.5.2, on gloo): rank zero once every rank is there, another once rank zero and itself are."""
        if meeting not in ("none", "barrier", "broadcast"):
            raise ValueError(f"`meeting` must be 'none', 'barrier' or 'broadcast', got {meeting!r}.")
        own = self.optimizer_ms_of(rank)
        if meeting == "none" or not isinstance(self.optimizer_ms, tuple):
            return own
        if meeting == "barrier" or rank == 0:
            return max(self.optimizer_ms)
        return max(own, self.optimizer_ms[0])

    def step_ms(self, rank: int, batch_size: int, step: int = 0, meeting: str = "none") -> float:
        """``rank``'s whole clean share of a step, in series: from the all-reduce, the wait for its optimizer step as
        the loop meets (:meth:`lead_ms`), its host's input and its device's compute (the slowest rank's share is the
        step, before the all-reduce)."""
        return self.lead_ms(rank, meeting) + self.host_ms(rank, batch_size) + self.clean_ms(rank, batch_size, step)


def _check_contention(value: Mapping[int, tuple[float, int]]) -> dict[int, tuple[float, int]]:
    out = {}
    for rank, spec in dict(value).items():
        try:
            factor, every = float(spec[0]), spec[1]
        except (TypeError, IndexError, ValueError):
            factor, every = math.nan, 0
        if isinstance(rank, bool) or int(rank) != rank or rank < 0:
            raise ValueError(f"`contention` keys must be ranks (integers >= 0), got {rank!r}.")
        if not (factor >= 1 and math.isfinite(factor)) or isinstance(every, bool) or int(every) != every or every < 1:
            raise ValueError(
                "`contention` maps a rank to (factor >= 1, every >= 1 steps), e.g. {2: (2.5, 3)};"
                f" got {rank}: {spec!r}."
            )
        out[int(rank)] = (factor, int(every))
    return out
