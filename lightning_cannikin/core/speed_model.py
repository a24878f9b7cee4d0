"""The per-device speed model: from every rank's measured step timings to predicted step times and splits.

Pure: numpy and the project's maths modules only (no torch, no Lightning), so the simulator and the CLI can use it.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from lightning_cannikin.core.change import DRIFT_TOLERANCE, ChangeWatch
from lightning_cannikin.core.evidence import trusted_bounds
from lightning_cannikin.core.expected import Scenarios, expected_split, relative_jitter, stall_scenarios
from lightning_cannikin.core.memory import MemoryFitter
from lightning_cannikin.core.optperf import optimal_split, optperf, step_time, with_micro_steps
from lightning_cannikin.core.plan import BatchBounds, Plan
from lightning_cannikin.core.probe import PROBE_LEVER, probe_split
from lightning_cannikin.core.step_record import StepRecord
from lightning_cannikin.core.timing import (
    HALF_LIFE,
    CommModel,
    CommTimeFitter,
    ComputeTimeFitter,
    LinearTimeModel,
    step_time_pieces,
)

# how far past the largest local batch a rank has run a plan may take it: far enough that a total can double at each
# decision once timed, near enough that the lines are still evidence there (three rounds of x2 timed on the way
# rather than one x3.5 jump on a line timed at small batches)
EVIDENCE_REACH = 2.0


@dataclass(frozen=True)
class SpeedModelSettings:
    """How a :class:`SpeedModel` fits; none of it is fitted state.

    Args:
        half_life: recency half-life of the compute-time fits, in samples, so a device that changes speed is followed.
        tail_window: steps over which the tail's median is taken.
        drift_tolerance: relative change of a rank's time at a batch size it has already run that counts as a change
            of speed, once three in four of its latest 16 steps show it (smaller changes are followed by the fits'
            recency weighting).
        max_samples: timing samples kept per rank.
        warmup_samples: each rank's first samples after a start (or a restart) are left out of its fit: real
            devices are slower in their first steps (allocator, caches, autotuning, input workers).
        probe_lever: a probe moves every unmeasured rank by at least this fraction of its batch, so that its slope
            comes from a real lever rather than a few samples extrapolated far.
        evidence_reach: no plan gives a rank more than this many times the largest local batch it has run (probes
            and warm-up steps included): a line timed at small batches predicts nothing far beyond them (a fixed cost
            that stops paying, a cache that stops fitting), so a decision moves as far as its evidence reaches and the
            next one, timed there, goes on. ``None``: no such bound (a what-if on a saved profile).

    """

    half_life: float = HALF_LIFE
    tail_window: int = 64
    drift_tolerance: float = DRIFT_TOLERANCE
    max_samples: int = 512
    warmup_samples: int = 4
    probe_lever: float = PROBE_LEVER
    evidence_reach: float | None = EVIDENCE_REACH

    def __post_init__(self) -> None:
        # `half_life` and `max_samples` are checked by the sample windows every SpeedModel builds from them
        if int(self.warmup_samples) < 0 or not 0 < self.probe_lever <= 1:
            raise ValueError(f"`warmup_samples` must be >= 0 and `probe_lever` in (0, 1], got {self}.")
        if self.evidence_reach is not None and not self.evidence_reach > 1:
            raise ValueError(f"`evidence_reach` must be > 1 or None, got {self.evidence_reach}.")
        if int(self.tail_window) < 1:
            raise ValueError(f"`tail_window` must be >= 1, got {self.tail_window}.")


class SpeedModel:
    """Learns each rank's cost ``t_i(b) = a_i b + a0_i`` and the step's tail; predicts and splits by them.

    A rank's cost is its whole share of a step. Its line fits :attr:`StepRecord.cost`: the time its device waited for
    the input (the loader, collation, the copy), then its compute. The two are in series on the critical path, so they
    add: handing a rank more samples hands its host more loading as well. Host work that overlaps the device (workers
    that keep ahead) is never in the measured wait, so it costs nothing here, until a larger batch makes it show.
    Then its time from the all-reduce's end to its next input (:attr:`StepRecord.after` of one step and ``gap`` of the
    next: the optimizer step, the loop's own work, and where the loop makes the ranks meet in between, the wait
    there), in series with its next step, so a rank whose optimizer step is slower gets fewer samples where nothing
    evens it out: kept apart from the line (:meth:`after_offsets`), since an accumulation window pays its optimizer
    step once, not once a micro-step.

    The *tail* is what a step costs beyond the slowest rank's share: the exposed part of the all-reduce and the
    framework's work outside every rank's measured spans. It is the same for every split, so it does not move the
    optimal split, but it makes the predicted step time comparable with the measured one.
    :func:`~lightning_cannikin.core.policy.decide` asks it (the simulator's cluster model answers the same calls).

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
        self.fitters = [
            ComputeTimeFitter(half_life=self.settings.half_life, max_samples=self.settings.max_samples)
            for _ in range(self.world_size)
        ]
        self.largest_run = [0] * self.world_size  # each rank's largest local batch run, warm-up and probes included
        self.tails: deque[float] = deque(maxlen=int(self.settings.tail_window))
        # the fraction of the last rank's compute done when its first gradient bucket was ready
        self.first_bucket_shares: deque[float] = deque(maxlen=int(self.settings.tail_window))
        # the tail past the reduction that no rank's own share holds (each rank's optimizer step is in `afters`)
        self.after_reduction: deque[float] = deque(maxlen=int(self.settings.tail_window))
        # each rank's time from a reduction's end to its next input, a micro-step, per optimizer step (over the
        # window's micro-steps); per rank, its latest reducing step's (step, after) and the open window's (time, steps)
        self.afters: list[deque[float]] = [deque(maxlen=int(self.settings.tail_window)) for _ in range(world_size)]
        self._last_after: list[tuple[int, float] | None] = [None] * self.world_size
        self._window_after: list[tuple[float | None, int]] = [(None, 0)] * self.world_size
        self.comm_fitter = CommTimeFitter(half_life=self.settings.half_life)
        # every rank's (batch size, compute) of the latest complete steps, with the step: which ranks were slow together
        self._joint: deque[tuple[int, tuple[int, ...], tuple[float, ...]]]
        self._joint = deque(maxlen=int(self.settings.tail_window))
        # what the fits give (the models, the planner's pieces, the after offsets, the recurring stalls), found once
        # per batch of new samples: the pieces are asked hundreds of times a decision
        self._cache: dict[str, Any] = {}
        self._warm = [0] * self.world_size  # samples each rank has had since its start; the first ones are left out
        self._hosted = [False] * self.world_size  # ranks whose records measure their input wait
        self._restart_step = 0  # records from this step on count towards the warm-up (restarted)
        self.watch = ChangeWatch(self.world_size, self.settings.drift_tolerance)  # each rank's changes of speed

    def add(self, records: Iterable[StepRecord]) -> None:
        """Feed the records of all ranks (any order); steps missing a rank contribute no tail sample."""
        records = list(records)
        for record in records:
            if record.rank >= self.world_size:
                raise ValueError(f"A record from rank {record.rank} does not fit a world of {self.world_size}.")
            if record.host is not None:
                self._hosted[record.rank] = True
            self.largest_run[record.rank] = max(self.largest_run[record.rank], int(record.batch_size))
        by_step: dict[int, list[StepRecord]] = {}
        for record in records:
            # a rank whose input wait is measured has it unmeasured at an epoch's first step: not a zero wait
            if record.host is not None or not self._hosted[record.rank]:
                by_step.setdefault(record.step, []).append(record)
        kept: dict[int, list[StepRecord]] = {}
        warming_steps = set()
        for step in sorted(by_step):
            for record in by_step[step]:
                if self._warm[record.rank] < self.settings.warmup_samples and step >= self._restart_step:
                    self._warm[record.rank] += 1
                    warming_steps.add(step)
                else:
                    kept.setdefault(record.rank, []).append(record)
        rescaled = self._detect_drift(kept)
        self.drifts = sorted(rescaled)
        self._cache = {}
        for rank_records in kept.values():
            for record in rank_records:
                self._add_sample(record)
        for step in sorted(set(by_step) - warming_steps):
            self._add_step(by_step[step])
        for rank, (ratio, first) in rescaled.items():
            self._rescale_joint(rank, ratio, first)

    def _add_sample(self, record: StepRecord) -> None:
        self.fitters[record.rank].add(record.batch_size, record.cost)
        self._add_after(record)
        if record.peak_memory is not None:
            self.memory[record.rank].add(record.batch_size, record.peak_memory)
            if record.memory_capacity is not None:
                cap = self.memory[record.rank].max_batch_size(record.memory_capacity)
                # never below the lower bound: a device that cannot hold its minimum is the user's call
                self.memory_caps[record.rank] = None if cap is None else max(cap, self.lower[record.rank])

    def _add_after(self, record: StepRecord) -> None:
        """The rank's time from the previous step's reduction to this step's input (that step's ``after`` and this
        one's ``gap``), once per optimizer step, over the window's micro-steps; a step that reduces closes the window.

        Only a time that starts at a reduction: every rank leaves it together, so the time to the next input is the
        rank's own, or the same for every rank where the loop makes them meet. After a micro-step the ranks did not
        meet, and a wait there holds the others' compute.
        """
        rank = record.rank
        previous = self._last_after[rank]
        self._last_after[rank] = (
            None if record.after is None or record.allreduce is None else (record.step, record.after)
        )
        lead, micro_steps = self._window_after[rank]
        if record.gap is not None and previous is not None and previous[0] == record.step - 1:
            lead = previous[1] + record.gap
        micro_steps += 1
        if record.allreduce is not None:
            if lead is not None:
                self.afters[rank].append(lead / micro_steps)
            lead, micro_steps = None, 0
        self._window_after[rank] = (lead, micro_steps)

    def _add_step(self, step_records: list[StepRecord]) -> None:
        """The step's tail and all-reduce, from a step every rank reported."""
        if len(step_records) != self.world_size:
            return
        ordered = sorted(step_records, key=lambda r: r.rank)
        self._joint.append((ordered[0].step, tuple(r.batch_size for r in ordered), tuple(r.cost for r in ordered)))
        # a rank's own share: its input wait (host), its compute and its optimizer step after the reduction
        slowest = max(r.own for r in step_records)
        tail = max(0.0, statistics.median(r.cycle for r in step_records) - slowest)
        self.tails.append(tail)
        reduced = [r for r in step_records if r.allreduce is not None and r.exposed is not None]
        if len(reduced) == self.world_size:
            # the last rank to be ready waits for nobody: its times are the communication's own
            last = max(reduced, key=lambda r: r.own)
            # the reduction's own time: a span from the first bucket also holds the backward it overlapped
            busy = last.allreduce if last.comm_busy is None else last.comm_busy
            self.after_reduction.append(max(0.0, tail - last.exposed))  # type: ignore[operator]  # the framework
            self.comm_fitter.add(busy, last.exposed if last.last_bucket is None else last.last_bucket)  # type: ignore[arg-type]
            if last.cost > 0:
                before_first_bucket = last.cost - (last.allreduce - last.exposed)  # type: ignore[operator]
                self.first_bucket_shares.append(min(max(before_first_bucket / last.cost, 0.0), 1.0))

    def _detect_drift(self, kept: dict[int, list[StepRecord]]) -> dict[int, tuple[float, int]]:
        """``{rank: (ratio, first step of the change)}`` for the ranks whose speed changed clearly
        (:class:`ChangeWatch`); ``kept`` is left with what their fits take."""
        if not self.ready:
            return {}
        drifted = {}
        for rank, rank_records in sorted(kept.items()):
            ratio = self.watch.judge(rank, rank_records, self.models()[rank], self.fitters[rank].distinct_batch_sizes)
            if ratio is not None:
                self.fitters[rank].rescale(ratio)  # the device keeps its measured slope at its new speed
                drifted[rank] = (ratio, min((r.step for r in rank_records), default=0))
        return drifted

    def _rescale_joint(self, rank: int, ratio: float, first: int) -> None:
        """Scale ``rank``'s compute in the joint records before ``first`` by ``ratio``, as its fit's old samples: at
        the old speed they would read as a recurring stall (or a lull) of the rescaled model, and the expected step
        time would keep the rank at its old share."""
        for index, (step, sizes, times) in enumerate(self._joint):
            if step < first:
                scaled = tuple(t * ratio if i == rank else t for i, t in enumerate(times))
                self._joint[index] = (step, sizes, scaled)

    @property
    def changing(self) -> bool:
        """The last :meth:`add` rescaled a rank to a clear change of speed (``drifts``) or holds a suspected one."""
        return bool(self.drifts) or self.watch.suspected

    @property
    def caps(self) -> list[int] | None:
        """Per-rank caps: the user's ``local_batch_bounds`` and, on CUDA, the fitted memory caps."""
        if self.user_upper is None and all(c is None for c in self.memory_caps):
            return None
        big = np.iinfo(np.int64).max
        users = self.user_upper or [big] * self.world_size
        return [min(u, big if c is None else c) for u, c in zip(users, self.memory_caps, strict=True)]

    @property
    def upper(self) -> list[int] | None:
        """Per-rank upper bounds of the next plan: the :attr:`caps`, and ``evidence_reach`` times the largest local
        batch each rank has run (never below its lower bound; no such bound on a rank not yet run)."""
        caps, reach = self.caps, self.settings.evidence_reach
        if reach is None or not any(self.largest_run):
            return caps
        big = np.iinfo(np.int64).max
        evidence = [
            max(int(reach * b), lo) if b > 0 else big for b, lo in zip(self.largest_run, self.lower, strict=True)
        ]
        return evidence if caps is None else [min(c, e) for c, e in zip(caps, evidence, strict=True)]

    def upper_for(self, total_batch_size: int) -> list[int] | None:
        """The upper bounds a split of ``total_batch_size`` takes: :attr:`upper`, or the :attr:`caps` alone where the
        evidence's reach cannot hold that total (a total no decision chose: a later fit's larger DataLoader batch)."""
        upper = self.upper
        if upper is not None and sum(upper) < int(total_batch_size):
            return self.caps
        return upper

    @property
    def ready(self) -> bool:
        """Every rank has at least one timing sample."""
        return all(f.num_samples > 0 for f in self.fitters)

    @property
    def identified(self) -> bool:
        """Every rank that can move has been timed at two or more batch sizes: its slope is measured, not assumed."""
        return all(len(self.fitters[i].distinct_batch_sizes) >= 2 for i in self._movable())

    def _movable(self) -> list[int]:
        """Ranks whose bounds leave them more than one batch size."""
        upper = self.upper
        return [i for i in range(self.world_size) if upper is None or upper[i] > self.lower[i]]

    def models(self) -> list[LinearTimeModel]:
        """The fitted compute-time model of each rank."""
        models = self._cached("models", lambda: [f.fit() for f in self.fitters])
        if any(m is None for m in models):
            raise RuntimeError("No timing samples yet for some ranks; call `add` first (see `ready`).")
        return list(models)

    def comm(self) -> CommModel | None:
        """The all-reduce model: its whole time and the part exposed after backward (``None`` before any)."""
        return self.comm_fitter.fit()

    def tail(self) -> float:
        """The median time a step costs beyond its slowest rank's own share (0 before any complete step)."""
        return float(np.median(self.tails)) if self.tails else 0.0

    def after_offsets(self) -> np.ndarray:
        """Each rank's time from a reduction's end to its next input, a micro-step (0 before any is measured): the
        median over its latest optimizer steps of the window's such times over its micro-steps. A window of ``k``
        micro-steps then costs a rank ``k (t_i(b) + o_i)``, its optimizer step once, and a split by ``t_i(b) + o_i``
        is that of the window. Where the loop makes the ranks meet before the input, each ``o_i`` holds the rank's
        wait there, as the step runs: at a barrier the slowest one's for every rank, and the split is by the lines
        alone; at Lightning's broadcast from rank zero, rank zero waits for every rank and each other rank for rank
        zero. A median, so that one long step (a checkpoint written by one rank, a re-plan) moves nothing."""
        return self._cached(
            "after", lambda: np.array([float(np.median(after)) if after else 0.0 for after in self.afters])
        )

    def pieces(self) -> tuple[np.ndarray, np.ndarray]:
        """Planner inputs: the per-rank pieces of the two-regime step model, once the all-reduce is measured.

        Compute-bound, rank ``i`` costs ``t_i(b) + c_last + o``, with ``c_last`` the last bucket's reduction and ``o``
        what a step costs outside every rank's own share (a rank's optimizer step is in its ``t_i``).
        Communication-bound, the all-reduce can start only when every rank's first bucket is ready, after a share
        ``s`` of its own share of the step, and lasts ``c``: ``s t_i(b) + c + o``. Both are
        exact for a bucket timeline whose buckets are alike, whatever the regime the records came from, once ``c``
        and ``c_last`` are the reductions' own times (``StepRecord.comm_busy``, ``last_bucket``).
        Where the all-reduce hides behind backward the second piece never binds, and the split is the compute-only
        one; where it does not, OptPerf(B) for other totals sees the communication floor.
        """
        return self._cached("fitted", lambda: self._pieces_of(self.models()))

    def _cached(self, key: str, build: Callable[[], Any]) -> Any:
        """What ``build()`` makes, kept until new samples arrive; writing to its arrays raises (callers share them)."""
        if key not in self._cache:
            value = build()
            for array in value if isinstance(value, tuple) else (value,):
                if isinstance(array, np.ndarray):
                    array.flags.writeable = False
            self._cache[key] = value
        return self._cache[key]

    def _pieces_of(self, models: Sequence[LinearTimeModel]) -> tuple[np.ndarray, np.ndarray]:
        comm, tail, afters = self.comm(), self.tail(), self.after_offsets()
        if comm is None or not self.first_bucket_shares or not self.after_reduction:
            return step_time_pieces(models, None, overhead=tail + afters)
        share = float(np.median(self.first_bucket_shares))
        # the two-regime form with the measured share: forward_fraction = share and no further backward fraction
        overhead = float(np.median(self.after_reduction)) + afters
        return step_time_pieces(models, comm, backward_fraction=0.0, forward_fraction=share, overhead=overhead)

    @property
    def jitter(self) -> float:
        """Two standard errors of two predicted step times' difference (:func:`relative_jitter` spread, per-size
        medians of the latest steps: 1.2533 x a mean's error): a smaller predicted gain is no evidence."""
        n = len(self._joint)
        return 2.5066 * relative_jitter(self._ratios()) * (2.0 / n) ** 0.5 if n >= 2 and self.ready else 0.0

    def scenarios(self) -> Scenarios | None:
        """The recurring stalls of the latest steps (:func:`~lightning_cannikin.core.expected.stall_scenarios`), or
        ``None`` when no rank stalls: then every prediction is the deterministic step time and every split OptPerf's."""
        return self._cached("scenarios", lambda: stall_scenarios(self._ratios()))

    def _ratios(self) -> np.ndarray:
        """Every rank's latest measured over predicted compute times, one row per complete step."""
        models = self.models()
        sizes, times = (np.array([j[k] for j in self._joint], float).reshape(-1, self.world_size) for k in (1, 2))
        predicted = np.column_stack([m(sizes[:, i]) for i, m in enumerate(models)]) if len(sizes) else sizes
        return times / np.maximum(predicted, 1e-12)

    def _expected(self, splits: np.ndarray, scenarios: Scenarios) -> np.ndarray:
        slopes, offsets = self.pieces()
        # the part no device's speed scales, piece for piece (a knee adds its flat pieces there too)
        _, fixed = self._cached(
            "fixed", lambda: self._pieces_of([LinearTimeModel(0.0, 0.0, m.knee) for m in self.models()])
        )
        return scenarios.expected(slopes, offsets, fixed, np.atleast_2d(splits))

    @property
    def bounds(self) -> BatchBounds:
        """The bounds in force: the user's and, on CUDA, the fitted memory caps (not the evidence's reach)."""
        upper = self.caps
        return BatchBounds(tuple(self.lower), None if upper is None else tuple(upper))

    def plan_split(self, total_batch_size: int) -> Plan:
        """The split of ``total_batch_size`` under the bounds with the least expected step time, and that time.

        Without recurring stalls that is OptPerf's exact integer split; with them, a descent from it on the expected
        slowest rank (:func:`~lightning_cannikin.core.expected.expected_split`). A rank whose times are flat where
        it was timed stays near there (:meth:`trusted_bounds`) whenever the total allows it.
        """
        slopes, offsets = self.pieces()
        trusted = self.trusted_bounds(total_batch_size)
        lower, upper = trusted if trusted is not None else (np.asarray(self.lower), self.upper_for(total_batch_size))
        split = optimal_split(slopes, offsets, total_batch_size, lower, upper)
        scenarios = self.scenarios()
        if scenarios is None:
            return Plan(split.local_batch_sizes, predicted_step_time=split.step_time)
        upper = np.full(self.world_size, np.iinfo(np.int64).max) if upper is None else np.asarray(upper)
        sizes = expected_split(lambda b: self._expected(b, scenarios), split.local_batch_sizes, lower, upper)
        return Plan(sizes, predicted_step_time=float(self._expected(np.array([sizes]), scenarios)[0]))

    def trusted_bounds(self, total_batch_size: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Per-rank ``(lower, upper)`` sizes whose times the evidence supports, or ``None`` if ``total_batch_size``
        does not fit them (:func:`~lightning_cannikin.core.evidence.trusted_bounds`)."""
        return trusted_bounds(
            self.fitters,
            self.models(),
            self.lower,
            self.upper_for(total_batch_size),
            total_batch_size,
            self.settings.probe_lever,
        )

    def timed(self, local_batch_sizes: Sequence[int]) -> bool:
        """Whether no rank's size lies beyond the sizes it was timed at lately (fewer samples always count)."""
        return all(int(b) <= max(f.timed_sizes() or (0,)) for f, b in zip(self.fitters, local_batch_sizes, strict=True))

    def supports(self, local_batch_sizes: Sequence[int]) -> bool:
        """Whether every rank's size lies where its times are evidence (:meth:`trusted_bounds`; ``True`` for a total
        no evidence can support)."""
        trusted = self.trusted_bounds(sum(int(b) for b in local_batch_sizes))
        if trusted is None:
            return True
        sizes = np.asarray(local_batch_sizes)
        return bool(np.all((trusted[0] <= sizes) & (sizes <= trusted[1])))

    def optperf(self, total_batch_sizes: Sequence[int], accumulation_steps: ArrayLike = 1) -> np.ndarray:
        """Predicted best step time of each global batch (``inf`` where infeasible), per optimizer step of
        ``accumulation_steps`` micro-steps; with recurring stalls, the expected time of OptPerf's split of each (an
        upper bound on the expected optimum).

        Accumulation is priced as it runs: the micro-steps before the last reduce nothing, so they cost the ranks'
        compute (input wait included) at the split, and only the last one costs a whole step, the all-reduce and the
        step's tail included (:meth:`micro_step_time`).

        Within the caps alone, not the evidence's reach: a total's worth is what the fitted lines give its best split
        (the goodput choice is a target); the split a plan adopts stays within the reach (:meth:`plan_split`).
        """
        slopes, offsets = self.pieces()
        totals = np.asarray(total_batch_sizes)
        times = optperf(slopes, offsets, totals, self.lower, self.caps)
        scenarios = self.scenarios()
        if scenarios is not None:
            flat = times.reshape(-1)
            for index in np.flatnonzero(np.isfinite(flat)):
                flat[index] = self._expected(np.array([self._split(int(totals.reshape(-1)[index]))]), scenarios)[0]
            times = flat.reshape(times.shape)
        return with_micro_steps(
            times, totals, accumulation_steps, lambda total: float(self.micro_step_time(self._split(total))[0])
        )

    def _split(self, total_batch_size: int) -> tuple[int, ...]:
        """OptPerf's split of a total under the model's pieces and caps (:meth:`optperf`'s)."""
        slopes, offsets = self.pieces()
        return optimal_split(slopes, offsets, total_batch_size, self.lower, self.caps).local_batch_sizes

    def predict(self, local_batch_sizes: ArrayLike, accumulation_steps: ArrayLike = 1) -> float | np.ndarray:
        """Predicted (expected) time of an optimizer step at a split (or of each row of a ``(C, n)`` array of splits)
        of ``accumulation_steps`` micro-steps: the last a whole step, the others their compute
        (:meth:`micro_step_time`)."""
        splits = np.asarray(local_batch_sizes)
        scenarios = self.scenarios()
        if scenarios is None:
            slopes, offsets = self.pieces()
            times = step_time(slopes, offsets, splits)
        else:
            times = self._expected(splits, scenarios)
            times = float(times[0]) if splits.ndim == 1 else times
        extra = np.asarray(accumulation_steps) - 1
        if np.any(extra > 0):
            micro = self.micro_step_time(np.atleast_2d(splits))
            times = times + extra * (float(micro[0]) if splits.ndim == 1 else micro)
        return times

    def micro_step_time(self, splits: np.ndarray) -> np.ndarray:
        """Predicted (expected) time of an accumulation micro-step at each split ``(C, n)``: the slowest rank's
        compute, input wait included, and its share of the window's optimizer steps (:meth:`after_offsets`); no
        reduction and no step tail (a micro-step reduces nothing)."""
        slopes, offsets = self._cached(
            "micro", lambda: step_time_pieces(self.models(), None, overhead=self.after_offsets())
        )
        scenarios = self.scenarios()
        if scenarios is None:
            return np.atleast_1d(step_time(slopes, offsets, splits))
        # nothing in a micro-step but the optimizer's share is beyond the devices' speed (a knee's flat piece scales)
        fixed = np.broadcast_to(self.after_offsets()[:, None], offsets.shape)
        return scenarios.expected(slopes, offsets, fixed, np.atleast_2d(splits))

    def probe(self, local_batch_sizes: Sequence[int]) -> tuple[int, ...]:
        """A split of the same total that gives every unmeasured rank a second batch size with a real lever.

        See :func:`~lightning_cannikin.core.probe.probe_split`: it starts from the speed-proportional split the
        times already measured imply (samples per second at the batch each rank runs now).
        """
        sizes = [int(b) for b in local_batch_sizes]
        unmeasured = [i for i in self._movable() if len(self.fitters[i].distinct_batch_sizes) < 2]
        if len(sizes) < 2 or not unmeasured or not self.ready:
            return tuple(sizes)
        models = self.models()
        speeds = []
        for i, b in enumerate(sizes):
            typical = self.fitters[i].typical(b)
            seconds = typical if typical is not None else float(models[i](b))
            speeds.append(b / seconds if seconds > 0 else 1.0)
        upper = self.upper_for(sum(sizes))
        return probe_split(sizes, speeds, unmeasured, self.lower, upper, self.settings.probe_lever)

    def state_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "fitters": [f.state_dict() for f in self.fitters],
            "tails": list(self.tails),
            "first_bucket_shares": list(self.first_bucket_shares),
            "after_reduction": list(self.after_reduction),
            "afters": [list(after) for after in self.afters],
            "comm": self.comm_fitter.state_dict(),
            "memory": [f.state_dict() for f in self.memory],
            "memory_caps": list(self.memory_caps),
            "warm": list(self._warm),
            "largest_run": list(self.largest_run),
            # what the next decisions read beyond the fits: the change watch (a rescale still to confirm, a suspected
            # change held apart) and the latest complete steps (the recurring stalls, the jitter that is the split's
            # margin)
            "watch": self.watch.state_dict(),
            "joint": [[step, list(sizes), list(times)] for step, sizes, times in self._joint],
            "hosted": list(self._hosted),
        }

    def restarted(self, first_step: int = 0) -> None:
        """The devices restarted (a resumed run) before step ``first_step``: they warm up again, so their first
        samples from it on are left out anew (records of earlier steps, saved with the checkpoint, are not warm-up),
        and no time from before the restart runs on into one after it (the optimizer step's span to the next input).
        What was measured before (the fits, the change watch, the latest steps) stays. Every resume calls it after
        loading, so none of it is saved."""
        self._warm = [0] * self.world_size
        self._restart_step = int(first_step)
        self._window_after = [(None, 0)] * self.world_size
        self._last_after = [None] * self.world_size

    def load_state_dict(self, state: dict) -> None:
        """Restore fitted state; from a run with another world size only the tail is kept (devices changed)."""
        self._cache = {}
        self.watch.clear()
        self._joint.clear()
        self._window_after = [(None, 0)] * self.world_size  # not saved: a resume restarts the devices (restarted)
        self._last_after = [None] * self.world_size
        warm = state.get("warm")
        same = state["world_size"] == self.world_size
        self._warm = list(warm) if same and warm is not None else [self.settings.warmup_samples] * self.world_size
        if same:
            # checkpoints older than these: an empty watch and no latest steps (they refill at the next re-plans)
            if "watch" in state:
                self.watch.load_state_dict(state["watch"], lambda r: StepRecord(**r), LinearTimeModel.from_dict)
            self._joint.extend(
                (int(j), tuple(int(b) for b in sizes), tuple(times)) for j, sizes, times in state.get("joint", [])
            )
            self._hosted = [bool(h) for h in state.get("hosted", self._hosted)]
            for fitter, fitter_state in zip(self.fitters, state["fitters"], strict=True):
                fitter.load_state_dict(fitter_state)
            # checkpoints older than the reach: the largest size each rank's fit still holds
            largest = [max(f.distinct_batch_sizes, default=0) for f in self.fitters]
            self.largest_run = [int(b) for b in state.get("largest_run", largest)]
            for memory, memory_state in zip(self.memory, state.get("memory", []), strict=False):
                memory.load_state_dict(memory_state)
            self.memory_caps = list(state.get("memory_caps", self.memory_caps))
            for after, kept in zip(self.afters, state.get("afters", [[]] * self.world_size), strict=True):
                after.clear()
                after.extend(kept)
        for name in ("tails", "first_bucket_shares", "after_reduction"):
            getattr(self, name).clear()
            getattr(self, name).extend(state.get(name, []))
        if "comm" in state:
            self.comm_fitter.load_state_dict(state["comm"])
