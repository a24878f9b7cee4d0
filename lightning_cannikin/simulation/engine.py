"""Simulate training to a job's target on a heterogeneous cluster under four policies.

* ``ddp``: plain DDP. Fixed total batch, even split; a step lasts as long as the slowest device.
* ``cannikin_fixed``: Cannikin's OptPerf split at the same fixed total batch (the library with
  ``max_batch_size=None``: balance only).
* ``adaptdl``: even split with a goodput-adaptive total batch (AdaptDL/Pollux, blind to heterogeneity).
* ``cannikin``: OptPerf split and goodput-adaptive total batch.

**Step time.** Device ``i`` holding ``b`` samples computes for ``c_i(b)``; the all-reduce term ``T_net`` is common to
all devices (it depends on the gradient size and the number of replicas), and communication overlaps backward as in
Pollux: ``g_i(b) = (c_i(b)^gamma + T_net^gamma)^(1/gamma)``. A step lasts ``max_i g_i(b_i)``. With ``s`` micro-steps of
gradient accumulation (when the batch does not fit the devices' memory caps) only the last one all-reduces:
``(s - 1) * max_i c_i(b_i) + max_i g_i(b_i)``. Because ``T_net`` is common and the overlap is increasing in ``c``,
``max_i g_i = overlap(max_i c_i)``: the split that minimises the slowest device's compute time also minimises the
step time, so the planner (:func:`lightning_cannikin.core.optperf.optperf`) works on the compute models and the
network term is applied to its result, exactly.

**One policy.** The adaptive policies re-plan with the library's own :func:`lightning_cannikin.core.policy.decide`:
:class:`ClusterModel` answers the same calls as the callback's fitted speed model, so the simulated choice of total
batch, accumulation and split is the decision a live run would make from the same models. The policy prices a
step of ``s`` micro-steps as ``s`` micro-steps; the clock charges ``(s - 1) * c + overlap(c)``. They re-plan when a
live run would: the training run's :class:`~lightning_cannikin.core.replanner.Replanner` is asked after every step
(at the noise scale, known exactly), and mid-epoch re-plans keep the accumulation, which changes at epoch ends.

**What the planner knows vs the clock.** The planner and the goodput choice use the linear models ``a_i*b + a0_i``
fitted by the project's fitter (what a live Cannikin run would learn) and the library's own two-regime step model
(``max(c + exposed * T_net, share * c + T_net)``, fitted on the same runs as the Pollux overlap): the model the
callback plans with. The clock charges the measured profiles (interpolated between measured batch sizes) through
the Pollux overlap, the model that predicts the held-out runs best, so where the library's models are wrong the
plan is worse in simulation too. Both step models are increasing in the slowest device's compute, so the split is
the same under either; only the total batch the goodput choice makes can differ.

**Progress** follows Pollux: a step at total batch B adds ``r(B) = B * E(B) / B0`` B0-steps of progress,
``E(B) = (phi + B0) / (phi + B)``, where ``phi`` is the noise scale at the current progress measured at the batch in
force (interpolated between the job's validation runs, as Pollux's simulator does); training ends at the base run's
final progress.

Pure numpy: imports neither torch nor Lightning.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike

from lightning_cannikin.core import optperf as planner
from lightning_cannikin.core.goodput import ADAPT_MARGIN, CANDIDATES, adascale_gain, candidate_batch_sizes
from lightning_cannikin.core.plan import Plan, even_split
from lightning_cannikin.core.policy import Decision, PolicySettings, accumulated, decide
from lightning_cannikin.core.replanner import Replanner
from lightning_cannikin.simulation.cluster import Cluster
from lightning_cannikin.simulation.models import JobModel, library_step_time

__all__ = [
    "POLICIES",
    "ClusterModel",
    "PolicyResult",
    "candidate_grid",
    "default_batch_size",
    "replan",
    "replanner_for",
    "simulate",
]

POLICIES: tuple[str, ...] = ("ddp", "cannikin_fixed", "adaptdl", "cannikin")
"""Policy names, in report order."""

ADAPTIVE = frozenset({"adaptdl", "cannikin"})
BALANCED = frozenset({"cannikin_fixed", "cannikin"})


class ClusterModel:
    """A job on a cluster: per-device bounds, the planner's model and the ground-truth clock.

    It is a :class:`~lightning_cannikin.core.policy.StepTimeModel` (``optperf``, ``predict``, ``plan_split``, the
    bounds): what :func:`~lightning_cannikin.core.policy.decide` asks of the callback's fitted speed model.

    Args:
        job: fitted job model; must have a compute model for every GPU type in the cluster.
        cluster: the cluster.
        network_time: override of the all-reduce term ``T_net`` in seconds (default: the job's fitted network model
            at this cluster's size); ``0`` simulates a free network.

    Raises:
        ValueError: the job lacks a profile for one of the cluster's GPU types.

    """

    def __init__(self, job: JobModel, cluster: Cluster, network_time: float | None = None) -> None:
        missing = [g for g in cluster.gpu_types if g not in job.compute]
        if missing:
            raise ValueError(f"Job {job.name!r} has no compute model for {', '.join(missing)}.")
        self.job = job
        self.cluster = cluster
        self.world_size = cluster.num_devices
        fitted = float(job.network.time(self.world_size, cluster.multi_node))
        self.network_time = fitted if network_time is None else float(network_time)
        counts = [g.count for g in cluster.groups]
        models = [job.compute[g.gpu] for g in cluster.groups]
        starts = np.cumsum([0, *counts[:-1]])
        self._groups = [(m, int(s), int(c)) for m, s, c in zip(models, starts, counts, strict=True)]
        self.lower = np.repeat([m.lower for m in models], counts).astype(np.int64)
        self.upper = np.repeat([m.upper for m in models], counts).astype(np.int64)
        # The planner needs non-decreasing device times: a fitted negative slope (A40 at large batch, where the input
        # pipeline limits it) reads as "flat" to it; the clock still charges the measured times.
        self.slopes = np.repeat([max(m.slope, 0.0) for m in models], counts).astype(np.float64)
        self.offsets = np.repeat([m.intercept for m in models], counts).astype(np.float64)

    # ----------------------------------------------------------------------------------------------- time models
    def overlap(self, compute: np.ndarray | float) -> np.ndarray:
        """Iteration time of the slowest device given its compute time (network term applied)."""
        return self.job.network.combine(compute, self.network_time)

    def planned(self, compute: np.ndarray | float) -> np.ndarray:
        """Iteration time of the slowest device as the *library* predicts it: its two-regime model
        (:func:`~lightning_cannikin.simulation.models.library_step_time`) with the job's fitted share and exposed
        part, so the simulated decisions are the library's. The clock (:meth:`true_step_time`) keeps :meth:`overlap`,
        the model validated best on the measured runs."""
        if self.job.library_overlap is None:
            return self.overlap(compute)
        share, exposed = self.job.library_overlap
        return library_step_time(compute, self.network_time, share, exposed)

    def _step(
        self, compute_max: np.ndarray | float, accumulation: np.ndarray | int, planned: bool = False
    ) -> np.ndarray:
        """``s`` micro-steps of the slowest device: ``s - 1`` without a reduction, the last one through the clock's
        overlap, or the library's step model when ``planned``."""
        c = np.asarray(compute_max, dtype=np.float64)
        return (np.asarray(accumulation) - 1) * c + (self.planned(c) if planned else self.overlap(c))

    def true_compute(self, local_batch_sizes: Sequence[int] | np.ndarray) -> float:
        """Slowest device's measured compute seconds for a split."""
        b = np.asarray(local_batch_sizes, dtype=np.float64)
        return max(float(m.measured(b[s : s + c]).max()) for m, s, c in self._groups)

    def true_step_time(self, plan: Plan) -> float:
        """Step time on the measured profiles."""
        return float(self._step(self.true_compute(plan.local_batch_sizes), plan.accumulation_steps))

    def predicted_step_time(self, plan: Plan) -> float:
        """The planner's prediction for a plan."""
        return float(self.predict(plan.local_batch_sizes, plan.accumulation_steps))

    # ------------------------------------------------------------------------------------------------ policies
    def capacity(self, policy: str) -> int:
        """Largest total batch of one micro-step (an even split is bound by the smallest memory cap)."""
        if policy in BALANCED:
            return int(self.upper.sum())
        return self.world_size * int(self.upper.min())

    def minimum(self, policy: str) -> int:
        """Smallest total batch of one micro-step (an even split is bound by the largest lower bound)."""
        if policy in BALANCED:
            return int(self.lower.sum())
        return self.world_size * int(self.lower.max())

    def accumulation(self, policy: str, total: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
        """Micro-steps and micro-batch total for each requested total batch, within the policy's caps, as the policy
        accumulates (:func:`~lightning_cannikin.core.policy.accumulated`). A request below the policy's smallest
        feasible batch is raised to it (the candidate grids never ask for one)."""
        return accumulated(total, self.minimum(policy), self.capacity(policy))

    def plan(self, policy: str, total: int) -> Plan:
        """The plan a fixed-batch policy runs at total batch ``total``."""
        steps, micro = (int(x) for x in self.accumulation(policy, total))
        sizes = self.plan_split(micro).local_batch_sizes if policy in BALANCED else even_split(micro, self.world_size)
        return Plan(sizes, steps)

    # --------------------------------------------------------------------------- the policy's step-time model
    identified = True  # the planner's linear models are known: nothing to probe

    def optperf(self, total_batch_sizes: Sequence[int] | np.ndarray, accumulation_steps: ArrayLike = 1) -> np.ndarray:
        """Predicted best step time of each global batch run ``accumulation_steps`` times (``inf`` if infeasible)."""
        totals = np.asarray(total_batch_sizes)
        compute = planner.optperf(self.slopes, self.offsets, totals, self.lower, self.upper)
        return self._step(compute, np.asarray(accumulation_steps), planned=True)

    def predict(self, local_batch_sizes: ArrayLike, accumulation_steps: ArrayLike = 1) -> float | np.ndarray:
        """Predicted step time of a split (or of each row of a ``(C, n)`` array), network term applied."""
        compute = planner.step_time(self.slopes, self.offsets, local_batch_sizes)
        times = self._step(compute, np.asarray(accumulation_steps), planned=True)
        return float(times) if np.ndim(times) == 0 else times

    def plan_split(self, total_batch_size: int) -> Plan:
        """The OptPerf split of a global batch, with its predicted micro-step time."""
        split = planner.optimal_split(self.slopes, self.offsets, total_batch_size, self.lower, self.upper)
        return Plan(split.local_batch_sizes, predicted_step_time=self.predict(split.local_batch_sizes))

    def probe(self, local_batch_sizes: Sequence[int]) -> tuple[int, ...]:
        """Nothing to measure: the split is kept."""
        return tuple(local_batch_sizes)

    def effective_total(self, policy: str, total: int) -> int:
        """The total batch a policy actually runs when asked for ``total`` (accumulation rounds it up)."""
        steps, micro = self.accumulation(policy, total)
        return int(steps * micro)


@dataclass
class PolicyResult:
    """Outcome of one policy.

    Attributes:
        policy: policy name.
        time_to_target: simulated seconds to reach the target progress.
        steps: optimizer steps.
        samples: samples processed.
        mean_batch_size: samples / steps.
        final_plan: the plan at the end.
        trajectory: ``(progress, total batch, true step time)`` at the start and after every re-plan.
        prediction_error: median over re-plans of ``|predicted - true| / true`` step time.
        replan_seconds: wall time of each re-plan (candidates' step times plus the choice), adaptive policies only.

    """

    policy: str
    time_to_target: float
    steps: float
    samples: float
    mean_batch_size: float
    final_plan: Plan
    trajectory: list[tuple[float, int, float]] = field(default_factory=list)
    prediction_error: float = float("nan")
    replan_seconds: list[float] = field(default_factory=list)

    @property
    def max_batch_size(self) -> int:
        """Largest total batch the policy ran."""
        return max(b for _, b, _ in self.trajectory)

    def split_by_type(self, cluster: Cluster) -> dict[str, float]:
        """Mean local batch (per micro-step) of each GPU type in the final plan."""
        out: dict[str, list[int]] = {}
        for gpu, b in zip(cluster.device_types(), self.final_plan.local_batch_sizes, strict=True):
            out.setdefault(gpu, []).append(b)
        return {gpu: float(np.mean(v)) for gpu, v in out.items()}


def candidate_grid(model: ClusterModel, policy: str, max_batch_size: int, count: int = CANDIDATES) -> np.ndarray:
    """Candidate total batches of an adaptive policy.

    A geometric grid from B0 to the cap that depends only on the job (so clusters are compared on the same grid),
    cut to what the policy can run, plus its smallest feasible batch.
    """
    base = model.job.base_batch_size
    lowest = max(base, model.minimum(policy))
    cap = max(max_batch_size, lowest)
    grid = candidate_batch_sizes(base, max(cap, base + 1), count)
    grid = grid[(grid >= lowest) & (grid <= cap)]
    return np.unique(np.concatenate(([lowest], grid)))


def default_batch_size(model: ClusterModel, max_batch_size: int | None = None) -> int:
    """DDP's fixed total batch and every policy's starting batch: B0 on every device, within the validated range.

    B0 is the batch the job was tuned for on one GPU; scaling out with the same per-device batch is what a DDP user
    does (Lightning's ``batch_size`` is per device). The per-device batch is clipped to the profiled range of every
    device, and the total to the largest validated batch (no statistics exist beyond it), unless even the smallest
    profiled batch on every device exceeds that.
    """
    job = model.job
    cap = job.max_validated_batch if max_batch_size is None else int(max_batch_size)
    per_device = min(max(job.base_batch_size, int(model.lower.max())), int(model.upper.min()))
    return max(min(model.world_size * per_device, cap), model.minimum("ddp"))


def replan(
    model: ClusterModel,
    policy: str,
    plan: Plan,
    noise_scale: float,
    max_batch_size: int,
    margin: float = ADAPT_MARGIN,
    candidates: int = CANDIDATES,
    adapt_total: bool = True,
    mid_epoch: bool = False,
) -> Decision:
    """One re-plan of an adaptive policy: the library's :func:`~lightning_cannikin.core.policy.decide` on the model.

    ``adaptdl`` splits evenly, ``cannikin`` by OptPerf; both reach totals beyond the memory caps by accumulation, which
    changes at epoch ends only, as in training: a ``mid_epoch`` re-plan keeps the accumulation in force.
    ``adapt_total``: the total may change (the Replanner's word: ``Replanner.after_step``).
    """
    # the cluster model is the truth, free of timing noise: no split hysteresis is needed to guard against it
    settings = PolicySettings(
        max_batch_size=max_batch_size,
        balance=policy in BALANCED,
        margin=margin,
        candidates=candidates,
        accumulate=True,
        split_margin=0.0,
    )
    return decide(model, plan, settings, noise_scale, model.job.base_batch_size, adapt_total, mid_epoch=mid_epoch)


def replanner_for(policy: str) -> Replanner:
    """The "when" of a training run of ``policy``: the :class:`~lightning_cannikin.core.replanner.Replanner` with the
    training defaults (``CannikinSettings()``'s cadences, no periodic re-plan, a balancing run's settling), adaptive
    where the total follows the noise scale, and identified from the start (the cluster model is the truth: there is
    nothing to probe or warm up).

    ``adaptdl`` re-plans when a Cannikin run would (its settling re-plans included): it is the same run with the split
    held even, so the two differ by the split alone, and on a homogeneous cluster not at all. A Replanner told that the
    split is even has no settling re-plans; those re-plans keep the plan on the truth but double the routine gap of
    the epoch ends, which moves when an accumulated total is adopted.
    """
    return Replanner(adaptive=policy in ADAPTIVE, identified=True)


def simulate(
    model: ClusterModel,
    policy: str,
    batch_size: int | None = None,
    max_batch_size: int | None = None,
    replans: int = 100,
    cells_per_replan: int = 10,
    candidates: int = CANDIDATES,
    margin: float = ADAPT_MARGIN,
) -> PolicyResult:
    """Run one policy to the job's target.

    The adaptive policies re-plan when training would: step by step, the training run's
    :class:`~lightning_cannikin.core.replanner.Replanner` (:func:`replanner_for`) is asked after every optimizer step
    whether a re-plan, and a reconsideration of the total, is due (at the known noise scale, both of its bounds; an
    epoch ends every ``samples_per_epoch`` samples), and is told what each re-plan adopted. Nothing can fall due
    between the steps where the noise reading changes, a settling re-plan is due, the reconsideration's floor passes
    or an epoch ends, so the run is integrated in chunks between those steps.

    Args:
        model: the job on the cluster.
        policy: one of :data:`POLICIES`.
        batch_size: the fixed total batch of ``ddp``/``cannikin_fixed`` and the starting batch of the adaptive
            policies (default: :func:`default_batch_size`).
        max_batch_size: cap of the adaptive policies (default: the job's largest validated batch, Pollux's limit;
            raised to the smallest feasible batch when that is larger).
        replans: with ``cells_per_replan``, the noise grid's resolution: the run's progress is cut into
            ``replans * cells_per_replan`` cells, and the noise scale known to the policy (and the progress a step
            makes) is that of the cell a step ends in. It no longer sets the number of re-plans: the Replanner does.
        cells_per_replan: see ``replans``.
        candidates: geometric candidate batch sizes per re-plan.
        margin: goodput improvement required to change the batch size (hysteresis, as in AdaptDL).

    Returns:
        The :class:`PolicyResult`.

    """
    if policy not in POLICIES:
        raise ValueError(f"Unknown policy {policy!r}; choose from {', '.join(POLICIES)}.")
    for name, value in (("replans", replans), ("cells_per_replan", cells_per_replan)):
        if int(value) < 1:
            raise ValueError(f"`{name}` must be a positive integer (the noise grid's resolution), got {value}.")
    job = model.job
    start = default_batch_size(model, max_batch_size) if batch_size is None else int(batch_size)
    if start < model.minimum(policy):
        raise ValueError(
            f"Batch size {start} is below the smallest feasible batch {model.minimum(policy)} of {policy}."
        )
    # raised to the smallest feasible batch, so that a mid-epoch re-plan (its accumulation fixed) has a candidate
    cap = max(job.max_validated_batch if max_batch_size is None else int(max_batch_size), model.minimum(policy))
    grid = _NoiseGrid(job, int(replans) * int(cells_per_replan))
    plan = model.plan(policy, model.effective_total(policy, start))
    if policy in ADAPTIVE:
        return _adaptive_run(model, policy, plan, grid, cap, margin, candidates)
    # a fixed total never re-plans: the truth gives the same plan at every step
    true_time = model.true_step_time(plan)
    total = plan.total_batch_size
    steps = grid.steps(total)
    predicted = model.predicted_step_time(plan)
    return PolicyResult(
        policy=policy,
        time_to_target=steps * true_time,
        steps=steps,
        samples=steps * total,
        mean_batch_size=float(total),
        final_plan=plan,
        trajectory=[(0.0, int(total), true_time)],
        prediction_error=abs(predicted - true_time) / true_time,
    )


class _NoiseGrid:
    """The run's progress cut into cells: the noise scale known after a step is the one at the start of its cell (at
    the total in force), and a step in a cell makes the AdaScale gain at its midpoint."""

    def __init__(self, job: JobModel, cells: int) -> None:
        self.job = job
        self.cells = cells
        self.edges = np.linspace(0.0, job.target_progress, cells + 1)
        self.mids = 0.5 * (self.edges[1:] + self.edges[:-1])
        self.widths = np.diff(self.edges)
        self._by_total: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _at(self, total: int) -> tuple[np.ndarray, np.ndarray]:
        if total not in self._by_total:
            job = self.job
            gains = np.asarray(adascale_gain(job.noise(self.mids, total), total, job.base_batch_size), dtype=float)
            self._by_total[total] = (np.asarray(job.noise(self.edges[:-1], total), dtype=float), gains)
        return self._by_total[total]

    def gains(self, total: int) -> np.ndarray:
        """Progress per step in each cell at ``total``."""
        return self._at(total)[1]

    def noise(self, total: int) -> np.ndarray:
        """The known noise scale of each cell at ``total``."""
        return self._at(total)[0]

    def steps(self, total: int) -> float:
        """Optimizer steps to the target at a fixed ``total``."""
        return float(np.sum(self.widths / self.gains(total)))


def _adaptive_run(
    model: ClusterModel, policy: str, plan: Plan, grid: _NoiseGrid, cap: int, margin: float, candidates: int
) -> PolicyResult:
    """Run an adaptive policy step by step under the training run's Replanner, in chunks where nothing can be due."""
    replanner = replanner_for(policy)
    epoch = float(model.job.samples_per_epoch)
    epochs = math.isfinite(epoch) and epoch > 0  # a job without a data set size has no epoch ends
    edges, cells = grid.edges, grid.cells
    total = plan.total_batch_size
    gains, noise = grid.gains(total), grid.noise(total)
    true_time = model.true_step_time(plan)
    trajectory = [(0.0, int(total), true_time)]
    errors = [abs(model.predicted_step_time(plan) - true_time) / true_time]
    replan_seconds: list[float] = []
    progress, cell, step = 0.0, 0, 0
    epoch_left = epoch  # samples left in the epoch in progress
    elapsed = steps = samples = 0.0
    while cell < cells:
        # the next step after which something may be due: the noise reading changes (the first step that ends in the
        # next cell), an epoch's end, a settling re-plan, the floor of the total's reconsideration, the cadence
        due_at = [step + max(1, math.ceil((edges[cell + 1] - progress) / gains[cell]))]
        if epochs:
            due_at.append(step + max(1, math.ceil(epoch_left / total)))
        floor, every = replanner.adapt_every_n_steps, replanner.every_n_steps
        for at in (
            replanner.settle_at,
            None if floor is None else replanner.last_adapt_step + floor,
            None if every is None else replanner.last_replan_step + every,
        ):
            if at is not None and at > step:
                due_at.append(at)
        target = min(due_at)
        # run the steps up to it, cell by cell (the last step may end at the target progress)
        left = float(target - step)
        while left > 0.0 and cell < cells:
            room = (edges[cell + 1] - progress) / gains[cell]
            if room > left:
                progress += left * gains[cell]
                left = 0.0
            else:
                left -= room
                progress, cell = float(edges[cell + 1]), cell + 1
        ran = target - step - left
        steps += ran
        samples += ran * total
        elapsed += ran * true_time
        epoch_left -= ran * total
        step = target
        if cell >= cells:
            break
        epoch_end = epochs and epoch_left <= 0.0
        if epoch_end:
            epoch_left = epoch  # the epoch's last batch is split, not dropped: the next epoch starts afresh
        phi = float(noise[cell])
        bounds = (phi, phi)
        replanner.voted(False)  # the truth's speeds never change: no rank's check ever fires
        due, adapt = replanner.after_step(step, bounds, epoch_end=epoch_end)
        if not due:
            continue
        tick = time.perf_counter()
        decision = replan(model, policy, plan, phi, cap, margin, candidates, adapt, mid_epoch=not epoch_end)
        replan_seconds.append(time.perf_counter() - tick)
        replanner.followed(step, plan, decision, adapt, bounds)
        plan = decision.plan
        total = plan.total_batch_size
        gains, noise = grid.gains(total), grid.noise(total)  # cached per total
        true_time = model.true_step_time(plan)
        trajectory.append((float(progress), int(total), true_time))
        errors.append(abs(model.predicted_step_time(plan) - true_time) / true_time)
    return PolicyResult(
        policy=policy,
        time_to_target=elapsed,
        steps=steps,
        samples=samples,
        mean_batch_size=samples / steps,
        final_plan=plan,
        trajectory=trajectory,
        prediction_error=float(np.median(errors)),
        replan_seconds=replan_seconds,
    )
