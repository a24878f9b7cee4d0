"""The per-device speed model: from every rank's measured step timings to predicted step times and splits.

Pure: numpy and the project's maths modules only (no torch, no Lightning), so the simulator and the CLI can use it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from numpy.typing import ArrayLike

from lightning_cannikin.core.memory import MemoryFitter
from lightning_cannikin.core.optperf import optimal_split, optperf, step_time
from lightning_cannikin.core.plan import BatchBounds, Plan
from lightning_cannikin.core.timing import (
    CommModel,
    CommTimeFitter,
    ComputeTimeFitter,
    LinearTimeModel,
    step_time_pieces,
)


@dataclass(frozen=True)
class StepRecord:
    """One rank's timing of one training step (seconds).

    Attributes:
        step: the step's index, equal on every rank (ranks advance in lockstep).
        rank: global rank.
        batch_size: samples this rank trained on in the step.
        compute: forward + backward until this rank's gradients were ready (excludes waiting for other ranks).
        step_time: the whole step on this rank, batch start to batch end (includes the all-reduce and the optimizer).
        allreduce: from this rank's first gradient bucket reaching the all-reduce to the last one completing
            (``None`` on steps without a reduction, e.g. accumulation micro-steps).
        exposed: from this rank's last bucket (the end of its backward) to the all-reduce completing: the part of
            the communication that backward did not hide, plus any wait for slower ranks.
        peak_memory: the device's peak allocated bytes during the step (CUDA only).
        memory_capacity: the device's total memory in bytes (CUDA only).

    """

    step: int
    rank: int
    batch_size: int
    compute: float
    step_time: float
    allreduce: float | None = None
    exposed: float | None = None
    peak_memory: float | None = None
    memory_capacity: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SpeedModelSettings:
    """How a :class:`SpeedModel` fits; none of it is fitted state.

    Args:
        half_life: recency half-life of the compute-time fits, in samples, so a device that changes speed is followed.
        tail_window: steps over which the tail's median is taken.
        drift_tolerance: relative change of a rank's median measured/predicted time that restarts its fit.
        max_samples: timing samples kept per rank.

    """

    half_life: float = 50.0
    tail_window: int = 64
    drift_tolerance: float = 0.25
    max_samples: int = 512

    def __post_init__(self) -> None:
        if not float(self.half_life) > 0:
            raise ValueError(f"`half_life` must be positive, got {self.half_life}.")
        if int(self.tail_window) < 1 or int(self.max_samples) < 1:
            raise ValueError(
                f"`tail_window` and `max_samples` must be >= 1, got {self.tail_window}, {self.max_samples}."
            )


class SpeedModel:
    """Learns each rank's compute time ``t_i(b) = a_i b + a0_i`` and the step's tail; predicts and splits by them.

    The *tail* is what a step costs beyond the slowest rank's compute: the exposed part of the all-reduce, the optimizer
    step and the framework's own work. It is the same for every split, so it does not move the optimal split, but it
    makes the predicted step time comparable with the measured one.

    It is the step-time model :func:`lightning_cannikin.core.policy.decide` asks (``optperf``, ``predict``,
    ``plan_split``, ``probe``, the bounds and ``identified``); the simulator's cluster model answers the same calls.

    Args:
        world_size: number of ranks.
        settings: how to fit (default :class:`SpeedModelSettings`).
        bounds: the user's per-rank local batch bounds (default: at least one sample, no cap). On CUDA the fitted
            memory caps tighten the upper bounds.

    """

    def __init__(
        self, world_size: int, settings: SpeedModelSettings | None = None, bounds: BatchBounds | None = None
    ) -> None:
        self.world_size = int(world_size)
        self.settings = settings or SpeedModelSettings()
        bounds = bounds or BatchBounds.parse(None, self.world_size)
        if bounds.world_size != self.world_size:
            raise ValueError(f"`local_batch_bounds` have {bounds.world_size} entries for {self.world_size} ranks.")
        self.lower = list(bounds.lower)
        self.user_upper = None if bounds.upper is None else list(bounds.upper)
        self.drifts: list[int] = []  # ranks whose history was dropped at the last `add`, for logging
        self.memory = [MemoryFitter() for _ in range(self.world_size)]
        self.memory_caps: list[int | None] = [None] * self.world_size
        self.fitters = [self._new_fitter() for _ in range(self.world_size)]
        self.tails: deque[float] = deque(maxlen=int(self.settings.tail_window))
        self.comm_fitter = CommTimeFitter(half_life=self.settings.half_life)
        self._models: list[LinearTimeModel] | None = None  # fitted once per batch of new samples

    def _new_fitter(self) -> ComputeTimeFitter:
        return ComputeTimeFitter(half_life=self.settings.half_life, max_samples=self.settings.max_samples)

    def add(self, records: Iterable[StepRecord]) -> None:
        """Feed the records of all ranks (any order); steps missing a rank contribute no tail sample."""
        by_step: dict[int, list[StepRecord]] = {}
        for record in records:
            if record.rank >= self.world_size:
                raise ValueError(f"A record from rank {record.rank} does not fit a world of {self.world_size}.")
            by_step.setdefault(record.step, []).append(record)
        self.drifts = self._detect_drift(by_step)
        self._models = None
        for step in sorted(by_step):
            step_records = by_step[step]
            for record in step_records:
                self.fitters[record.rank].add(record.batch_size, record.compute)
                if record.peak_memory is not None:
                    self.memory[record.rank].add(record.batch_size, record.peak_memory)
                    if record.memory_capacity is not None:
                        cap = self.memory[record.rank].max_batch_size(record.memory_capacity)
                        # never below the lower bound: a device that cannot hold its minimum is the user's call
                        self.memory_caps[record.rank] = None if cap is None else max(cap, self.lower[record.rank])
            if len(step_records) == self.world_size:
                slowest = max(r.compute for r in step_records)
                self.tails.append(max(0.0, float(np.median([r.step_time for r in step_records])) - slowest))
                reduced = [r for r in step_records if r.allreduce is not None and r.exposed is not None]
                if len(reduced) == self.world_size:
                    # the last rank to finish backward waits for nobody: its times are the communication's own
                    last = max(reduced, key=lambda r: r.compute)
                    self.comm_fitter.add(last.allreduce, last.exposed)  # type: ignore[arg-type]

    def _detect_drift(self, by_step: dict[int, list[StepRecord]], min_samples: int = 4) -> list[int]:
        """Forget a rank's old samples when its new ones disagree with its model as a whole.

        A device that changes speed (another job lands on a shared GPU, thermal throttling) would otherwise be
        followed only as fast as the recency weights let old samples fade; a consistent change of more than
        ``drift_tolerance`` in the median ratio of measured to predicted time starts that rank's model afresh.
        """
        if not self.ready:
            return []
        models = self.models()
        ratios: dict[int, list[float]] = {}
        for step_records in by_step.values():
            for r in step_records:
                predicted = models[r.rank](r.batch_size)
                if predicted > 0:
                    ratios.setdefault(r.rank, []).append(r.compute / predicted)
        drifted = [
            rank
            for rank, values in sorted(ratios.items())
            # a model fitted from one batch size is a guess, not a measurement to drift from
            if len(self.fitters[rank].distinct_batch_sizes) >= 2
            and len(values) >= min_samples
            and abs(float(np.median(values)) - 1.0) > self.settings.drift_tolerance
        ]
        for rank in drifted:
            self.fitters[rank] = self._new_fitter()
        return drifted

    @property
    def upper(self) -> list[int] | None:
        """Per-rank upper bounds: the user's ``local_batch_bounds`` and, on CUDA, the fitted memory caps."""
        if self.user_upper is None and all(c is None for c in self.memory_caps):
            return None
        big = np.iinfo(np.int64).max
        users = self.user_upper or [big] * self.world_size
        return [min(u, big if c is None else c) for u, c in zip(users, self.memory_caps, strict=True)]

    @property
    def ready(self) -> bool:
        """Every rank has at least one timing sample."""
        return all(f.num_samples > 0 for f in self.fitters)

    @property
    def identified(self) -> bool:
        """Every rank has been timed at two or more batch sizes, so its slope is measured rather than assumed."""
        return all(len(f.distinct_batch_sizes) >= 2 for f in self.fitters)

    def models(self) -> list[LinearTimeModel]:
        """The fitted compute-time model of each rank."""
        if self._models is None:
            models = [f.fit() for f in self.fitters]
            if any(m is None for m in models):
                raise RuntimeError("No timing samples yet for some ranks; call `add` first (see `ready`).")
            self._models = models  # type: ignore[assignment]
        return list(self._models)  # type: ignore[arg-type]

    def comm(self) -> CommModel | None:
        """The all-reduce model: its whole time and the part exposed after backward (``None`` before any)."""
        return self.comm_fitter.fit()

    def tail(self) -> float:
        return float(np.median(self.tails)) if self.tails else 0.0

    def pieces(self) -> tuple[np.ndarray, np.ndarray]:
        """Planner inputs: per-rank slopes and offsets of ``g_i(b) = a_i b + a0_i + tail``."""
        return step_time_pieces(self.models(), None, overhead=self.tail())

    @property
    def bounds(self) -> BatchBounds:
        """The bounds in force: the user's and, on CUDA, the fitted memory caps."""
        upper = self.upper
        return BatchBounds(tuple(self.lower), None if upper is None else tuple(upper))

    def plan_split(self, total_batch_size: int) -> Plan:
        """The optimal integer split of ``total_batch_size`` under the bounds, with its predicted step time."""
        slopes, offsets = self.pieces()
        split = optimal_split(slopes, offsets, total_batch_size, self.lower, self.upper)
        return Plan(split.local_batch_sizes, predicted_step_time=split.step_time)

    def optperf(self, total_batch_sizes: Sequence[int], accumulation_steps: ArrayLike = 1) -> np.ndarray:
        """Predicted best step time of each global batch (``inf`` where infeasible), times its micro-steps.

        Every micro-step is predicted at a full step's cost: the tail of a micro-step without a reduction is not
        measured apart, so accumulation is never credited with savings that were not measured.
        """
        slopes, offsets = self.pieces()
        return optperf(slopes, offsets, np.asarray(total_batch_sizes), self.lower, self.upper) * accumulation_steps

    def predict(self, local_batch_sizes: ArrayLike, accumulation_steps: ArrayLike = 1) -> float | np.ndarray:
        """Predicted step time of a split (or of each row of a ``(C, n)`` array of splits), times its micro-steps."""
        slopes, offsets = self.pieces()
        return step_time(slopes, offsets, local_batch_sizes) * accumulation_steps

    def probe(self, local_batch_sizes: Sequence[int], fraction: float = 0.125) -> tuple[int, ...]:
        """Perturb a split so that every rank runs a batch size it has not run yet, keeping the total.

        Ranks alternate up and down by about ``fraction`` of the smallest batch; with an odd number of ranks the last
        one goes up and rank 1 gives twice, so every rank moves and the sum is unchanged.
        """
        sizes = np.asarray(local_batch_sizes, dtype=int)
        n = len(sizes)
        if n < 2:
            return tuple(int(b) for b in sizes)
        signs = np.array([1 if i % 2 == 0 else -1 for i in range(n)])
        if n % 2 == 1:
            signs[-1], signs[1] = 1, signs[1] - 1
        delta = max(1, int(fraction * sizes.min() + 0.5))
        probed = sizes + signs * delta
        upper = np.asarray(self.upper) if self.upper is not None else np.full(n, np.iinfo(np.int64).max)
        if np.any(probed < np.asarray(self.lower)) or np.any(probed > upper):
            return tuple(int(b) for b in sizes)  # no room to probe within the bounds: keep the plan
        return tuple(int(b) for b in probed)

    def state_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "fitters": [f.state_dict() for f in self.fitters],
            "tails": list(self.tails),
            "comm": self.comm_fitter.state_dict(),
            "memory": [f.state_dict() for f in self.memory],
            "memory_caps": list(self.memory_caps),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore fitted state; from a run with another world size only the tail is kept (devices changed)."""
        self._models = None
        if state["world_size"] == self.world_size:
            for fitter, fitter_state in zip(self.fitters, state["fitters"], strict=True):
                fitter.load_state_dict(fitter_state)
            for memory, memory_state in zip(self.memory, state.get("memory", []), strict=False):
                memory.load_state_dict(memory_state)
            self.memory_caps = list(state.get("memory_caps", self.memory_caps))
        self.tails.clear()
        self.tails.extend(state["tails"])
        if "comm" in state:
            self.comm_fitter.load_state_dict(state["comm"])
