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
step time, so the planner (:func:`lightning_cannikin.planner.optperf`) works on the compute models and the network
term is applied to its result, exactly.

**What the planner knows vs the clock.** The planner and the goodput choice use the linear models ``a_i*b + a0_i``
fitted by the project's fitter (what a live Cannikin run would learn). The clock charges the measured profiles
(interpolated between measured batch sizes), so where the linear model is wrong the plan is worse in simulation too.

**Progress** follows Pollux: a step at total batch B adds ``r(B) = B * E(B) / B0`` B0-steps of progress,
``E(B) = (phi + B0) / (phi + B)``, where ``phi`` is the noise scale at the current progress measured at the batch in
force (interpolated between the job's validation runs, as Pollux's simulator does); training ends at the base run's
final progress.

Pure numpy: imports neither torch nor Lightning.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from lightning_cannikin import goodput, planner
from lightning_cannikin.simulation.cluster import Cluster
from lightning_cannikin.simulation.models import JobModel

__all__ = [
    "POLICIES",
    "ClusterModel",
    "Comparison",
    "PolicyResult",
    "StepPlan",
    "adascale_gains",
    "best_fixed_batch_time",
    "candidate_grid",
    "compare",
    "default_batch_size",
    "simulate",
]

POLICIES: tuple[str, ...] = ("ddp", "cannikin_fixed", "adaptdl", "cannikin")
"""Policy names, in report order."""

ADAPTIVE = frozenset({"adaptdl", "cannikin"})
BALANCED = frozenset({"cannikin_fixed", "cannikin"})


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step: ``accumulation`` micro-steps of ``local_batch_sizes``."""

    local_batch_sizes: tuple[int, ...]
    accumulation: int = 1

    @property
    def total_batch_size(self) -> int:
        """Samples per optimizer step."""
        return sum(self.local_batch_sizes) * self.accumulation


class ClusterModel:
    """A job on a cluster: per-device bounds, the planner's model and the ground-truth clock.

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
        self.n = cluster.num_devices
        fitted = float(job.network.time(self.n, cluster.multi_node))
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

    def _step(self, compute_max: np.ndarray | float, accumulation: np.ndarray | int) -> np.ndarray:
        c = np.asarray(compute_max, dtype=np.float64)
        return (np.asarray(accumulation) - 1) * c + self.overlap(c)

    def true_compute(self, local_batch_sizes: Sequence[int] | np.ndarray) -> float:
        """Slowest device's measured compute seconds for a split."""
        b = np.asarray(local_batch_sizes, dtype=np.float64)
        return max(float(m.measured(b[s : s + c]).max()) for m, s, c in self._groups)

    def true_step_time(self, plan: StepPlan) -> float:
        """Step time on the measured profiles."""
        return float(self._step(self.true_compute(plan.local_batch_sizes), plan.accumulation))

    def predicted_step_time(self, plan: StepPlan) -> float:
        """The planner's prediction for a plan."""
        compute = planner.step_time(self.slopes, self.offsets, plan.local_batch_sizes)
        return float(self._step(compute, plan.accumulation))

    # ------------------------------------------------------------------------------------------------ policies
    def capacity(self, policy: str) -> int:
        """Largest total batch of one micro-step (an even split is bound by the smallest memory cap)."""
        if policy in BALANCED:
            return int(self.upper.sum())
        return self.n * int(self.upper.min())

    def minimum(self, policy: str) -> int:
        """Smallest total batch of one micro-step (an even split is bound by the largest lower bound)."""
        if policy in BALANCED:
            return int(self.lower.sum())
        return self.n * int(self.lower.max())

    def accumulation(self, policy: str, total: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
        """Micro-steps and micro-batch total for each requested total batch.

        The fewest micro-steps that fit the caps; the micro-batch total is rounded up, so the effective total batch
        ``steps * micro`` can exceed the request by less than ``steps``. A request below the policy's smallest
        feasible batch is raised to it (the candidate grids never ask for one).
        """
        t = np.asarray(total, dtype=np.int64)
        steps = np.maximum(1, -(-t // self.capacity(policy)))
        micro = np.maximum(-(-t // steps), self.minimum(policy))
        return steps, micro

    def plan(self, policy: str, total: int) -> StepPlan:
        """The plan a policy runs at total batch ``total``."""
        steps, micro = (int(x) for x in self.accumulation(policy, total))
        if policy in BALANCED:
            split = planner.optimal_split(self.slopes, self.offsets, micro, self.lower, self.upper).local_batch_sizes
        else:
            split = planner.even_split(micro, self.n)
        return StepPlan(tuple(int(b) for b in split), steps)

    def predicted_times(self, policy: str, totals: np.ndarray) -> np.ndarray:
        """Predicted step time of each total batch under a policy (one call: the re-plan's cost)."""
        steps, micro = self.accumulation(policy, np.asarray(totals).reshape(-1))
        if policy in BALANCED:
            compute = planner.optperf(self.slopes, self.offsets, micro, self.lower, self.upper)
        else:
            compute = self._even_compute(micro)
        return self._step(compute, steps).reshape(np.shape(totals))

    def _even_compute(self, micro: np.ndarray) -> np.ndarray:
        # An even split puts q + 1 samples on devices before index r (q, r = divmod(B, n)) and q on the rest; with
        # non-decreasing linear models the slowest device is the worst of the two prefix/suffix maxima.
        q, r = np.divmod(np.asarray(micro, dtype=np.int64), self.n)
        lines = self.slopes[None, :] * (q[:, None] + (np.arange(self.n)[None, :] < r[:, None])) + self.offsets
        return lines.max(axis=1)

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
        trajectory: ``(progress, total batch, true step time)`` at every re-plan.
        prediction_error: median over re-plans of ``|predicted - true| / true`` step time.
        replan_seconds: wall time of each re-plan (candidates' step times plus the choice), adaptive policies only.

    """

    policy: str
    time_to_target: float
    steps: float
    samples: float
    mean_batch_size: float
    final_plan: StepPlan
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


def _progress_grid(job: JobModel, cells: int) -> tuple[np.ndarray, np.ndarray]:
    """Cell edges and midpoints over [0, target progress]."""
    edges = np.linspace(0.0, job.target_progress, cells + 1)
    return edges, 0.5 * (edges[1:] + edges[:-1])


def adascale_gains(phi: np.ndarray, total: int, base: int) -> np.ndarray:
    """AdaScale gain ``r = (phi + B0) / (phi + B) * B / B0`` for many noise scales at one total batch.

    Vectorised over ``phi`` (:func:`lightning_cannikin.goodput.adascale_gain` takes one noise scale per call, and
    the integration needs thousands); the tests check it against that function.
    """
    phi = np.asarray(phi, dtype=np.float64)
    if total == base:
        return np.ones_like(phi)
    return (phi + base) / (phi + total) * (total / base)


def candidate_grid(model: ClusterModel, policy: str, max_batch_size: int, count: int = 50) -> np.ndarray:
    """Candidate total batches of an adaptive policy.

    A geometric grid from B0 to the cap that depends only on the job (so clusters are compared on the same grid),
    cut to what the policy can run, plus its smallest feasible batch.
    """
    base = model.job.base_batch_size
    lowest = max(base, model.minimum(policy))
    cap = max(max_batch_size, lowest)
    grid = goodput.candidate_batch_sizes(base, max(cap, base + 1), count)
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
    return max(min(model.n * per_device, cap), model.minimum("ddp"))


def simulate(
    model: ClusterModel,
    policy: str,
    batch_size: int | None = None,
    max_batch_size: int | None = None,
    replans: int = 100,
    cells_per_replan: int = 10,
    candidates: int = 50,
    margin: float = 0.05,
) -> PolicyResult:
    """Run one policy to the job's target.

    Args:
        model: the job on the cluster.
        policy: one of :data:`POLICIES`.
        batch_size: the fixed total batch of ``ddp``/``cannikin_fixed`` and the starting batch of the adaptive
            policies (default: :func:`default_batch_size`).
        max_batch_size: cap of the adaptive policies (default: the job's largest validated batch, Pollux's limit;
            raised to the smallest feasible batch when that is larger).
        replans: re-plans over the run, evenly spaced in progress (the noise scale is known at each).
        cells_per_replan: integration cells between re-plans (the noise scale varies inside an interval).
        candidates: geometric candidate batch sizes per re-plan.
        margin: goodput improvement required to change the batch size (hysteresis, as in AdaptDL).

    Returns:
        The :class:`PolicyResult`.

    """
    if policy not in POLICIES:
        raise ValueError(f"Unknown policy {policy!r}; choose from {', '.join(POLICIES)}.")
    job = model.job
    base = job.base_batch_size
    start = default_batch_size(model, max_batch_size) if batch_size is None else int(batch_size)
    if start < model.minimum(policy):
        raise ValueError(
            f"Batch size {start} is below the smallest feasible batch {model.minimum(policy)} of {policy}."
        )
    cap = job.max_validated_batch if max_batch_size is None else int(max_batch_size)
    edges, mids = _progress_grid(job, replans * cells_per_replan)
    widths = np.diff(edges)
    adaptive = policy in ADAPTIVE
    grid = candidate_grid(model, policy, cap, candidates) if adaptive else np.asarray([start])

    total = model.effective_total(policy, start)
    plan = model.plan(policy, total)
    predicted = model.predicted_step_time(plan)
    true_time = model.true_step_time(plan)
    elapsed = steps = samples = 0.0
    trajectory: list[tuple[float, int, float]] = []
    errors: list[float] = []
    replan_seconds: list[float] = []
    for k in range(replans):
        cells = slice(k * cells_per_replan, (k + 1) * cells_per_replan)
        if adaptive and grid.size > 1:
            tick = time.perf_counter()
            times = model.predicted_times(policy, grid)
            # The live estimator measures the noise scale at the batch in force, so that is what the choice sees.
            phi_now = float(job.noise(edges[k * cells_per_replan], total))
            choice = goodput.choose_batch_size(grid, times, phi_now, base, total, predicted, margin)
            replan_seconds.append(time.perf_counter() - tick)
            if choice.adopted:
                total = model.effective_total(policy, choice.batch_size)
                plan = model.plan(policy, total)
                predicted = model.predicted_step_time(plan)
                true_time = model.true_step_time(plan)
        trajectory.append((float(edges[k * cells_per_replan]), int(total), true_time))
        errors.append(abs(predicted - true_time) / true_time)
        gain = adascale_gains(job.noise(mids[cells], total), total, base)
        n_steps = float(np.sum(widths[cells] / gain))
        steps += n_steps
        samples += n_steps * total
        elapsed += n_steps * true_time
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


def best_fixed_batch_time(
    model: ClusterModel, max_batch_size: int | None = None, cells: int = 1000, candidates: int = 50
) -> tuple[int, float]:
    """Hindsight-tuned DDP: the fixed total batch (even split) with the shortest time to target.

    Tuning the batch needs the finished runs, so no real DDP user has it; it shows how much of Cannikin's gain is
    "a better batch size" and how much is adaptivity and balance.

    Returns:
        ``(batch size, seconds to target)``.

    """
    job = model.job
    cap = job.max_validated_batch if max_batch_size is None else int(max_batch_size)
    grid = candidate_grid(model, "ddp", cap, candidates)
    totals = np.asarray([model.effective_total("ddp", int(t)) for t in grid])
    edges, mids = _progress_grid(job, cells)
    widths = np.diff(edges)
    steps = np.asarray(
        [np.sum(widths / adascale_gains(job.noise(mids, int(t)), int(t), job.base_batch_size)) for t in totals]
    )
    times = np.asarray([model.true_step_time(model.plan("ddp", int(t))) for t in totals]) * steps
    best = int(np.argmin(times))
    return int(totals[best]), float(times[best])


@dataclass
class Comparison:
    """All policies on one job and cluster.

    Attributes:
        job: job name.
        cluster: cluster spec string.
        results: per-policy results.
        ddp_tuned: ``(batch, seconds)`` of hindsight-tuned fixed-batch DDP (a stronger baseline than ``ddp``).
        network_time: the all-reduce term ``T_net`` in seconds.
        start_batch_size: DDP's fixed batch and every policy's starting batch.
        max_validated_batch: the job's largest validated total batch; statistics beyond it are extrapolated.

    """

    job: str
    cluster: str
    results: dict[str, PolicyResult]
    ddp_tuned: tuple[int, float] | None
    network_time: float
    start_batch_size: int
    max_validated_batch: int

    @property
    def extrapolated(self) -> bool:
        """Whether any policy ran a total batch above the largest validated one (noise scale held at that run's)."""
        used = [r.max_batch_size for r in self.results.values()]
        if self.ddp_tuned is not None:
            used.append(self.ddp_tuned[0])
        return max(used) > self.max_validated_batch

    def time(self, policy: str) -> float:
        """Seconds to target of a policy (``"ddp_tuned"`` included)."""
        if policy == "ddp_tuned":
            if self.ddp_tuned is None:
                raise KeyError("ddp_tuned was not computed.")
            return self.ddp_tuned[1]
        return self.results[policy].time_to_target

    def ratio(self, numerator: str, denominator: str) -> float:
        """``time(numerator) / time(denominator)``."""
        return self.time(numerator) / self.time(denominator)

    def reduction(self, baseline: str, policy: str = "cannikin") -> float:
        """Fraction of the baseline's time-to-target that ``policy`` saves (0.4 = 40% less time)."""
        return 1.0 - self.ratio(policy, baseline)

    def to_dict(self) -> dict:
        """JSON-friendly summary (trajectories downsampled to about 20 points)."""
        out: dict = {
            "job": self.job,
            "cluster": self.cluster,
            "network_time_s": self.network_time,
            "start_batch_size": self.start_batch_size,
            "max_validated_batch": self.max_validated_batch,
            "extrapolated": self.extrapolated,
            "policies": {},
        }
        for name, r in self.results.items():
            stride = max(1, len(r.trajectory) // 20)
            out["policies"][name] = {
                "time_to_target_s": r.time_to_target,
                "steps": r.steps,
                "mean_batch_size": r.mean_batch_size,
                "final_batch_size": r.final_plan.total_batch_size,
                "final_accumulation": r.final_plan.accumulation,
                "prediction_error_median": r.prediction_error,
                "replan_ms_median": float(np.median(r.replan_seconds) * 1e3) if r.replan_seconds else None,
                "trajectory": [list(t) for t in r.trajectory[::stride]],
            }
        if self.ddp_tuned is not None:
            out["ddp_tuned"] = {"batch_size": self.ddp_tuned[0], "time_to_target_s": self.ddp_tuned[1]}
        names = set(self.results) | ({"ddp_tuned"} if self.ddp_tuned is not None else set())
        if "cannikin" in names:
            out["cannikin_reduction"] = {b: self.reduction(b) for b in ("ddp", "ddp_tuned", "adaptdl") if b in names}
        if {"cannikin_fixed", "ddp"} <= names:
            out["cannikin_fixed_reduction_vs_ddp"] = self.reduction("ddp", "cannikin_fixed")
        return out


def compare(
    model: ClusterModel,
    policies: Iterable[str] = POLICIES,
    batch_size: int | None = None,
    max_batch_size: int | None = None,
    replans: int = 100,
    tuned_ddp: bool = True,
    **kwargs: int | float,
) -> Comparison:
    """Simulate several policies on the same job and cluster, all starting from the same batch.

    Args:
        model: the job on the cluster.
        policies: which of :data:`POLICIES` to run.
        batch_size: fixed/starting total batch (default: :func:`default_batch_size`).
        max_batch_size: cap of the adaptive policies (and of tuned DDP's search).
        replans: re-plans over the run.
        tuned_ddp: also compute hindsight-tuned fixed-batch DDP.
        **kwargs: passed to :func:`simulate` (``cells_per_replan``, ``candidates``, ``margin``).

    """
    start = default_batch_size(model, max_batch_size) if batch_size is None else int(batch_size)
    results = {p: simulate(model, p, start, max_batch_size, replans, **kwargs) for p in policies}  # type: ignore[arg-type]
    tuned = best_fixed_batch_time(model, max_batch_size) if tuned_ddp else None
    return Comparison(
        model.job.name, model.cluster.spec(), results, tuned, model.network_time, start, model.job.max_validated_batch
    )
