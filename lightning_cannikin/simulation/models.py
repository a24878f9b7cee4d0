"""Job models fitted from the profiles: per-GPU compute time, network cost with overlap, and noise-scale trajectory.

* Compute: ``t(b) = a*b + a0`` per GPU type, fitted with the project's own :class:`~lightning_cannikin.core.timing.
  ComputeTimeFitter` on single-GPU ``step_time - sync_time``. The simulator's ground truth is the measured profile
  itself (linear interpolation between measured batch sizes), so wherever the linear model is wrong (YOLOv3, NCF)
  the planner mispredicts in simulation exactly as it would on the real GPU.
* Network: Pollux's model fitted on the multi-GPU T4 placements,
  ``T_net(N) = alpha + beta * max(N - 2, 0)`` (``alpha_r, beta_r`` on one node, ``alpha_n, beta_n`` across nodes)
  and per-device iteration time ``g(b) = (c(b)^gamma + T_net^gamma)^(1/gamma)``: gamma = 1 adds communication to
  compute, gamma -> inf hides it completely behind backward.
* Statistics: the gradient noise scale ``B_noise = B0 * grad_var / grad_sqr`` of the job's base run
  (``validation-<B0>.csv``) as a function of training progress; the target is that run's final progress.

Pure numpy (plus scipy for the nonlinear network fit): imports neither torch nor Lightning.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from lightning_cannikin.core.timing import ComputeTimeFitter, LinearTimeModel
from lightning_cannikin.simulation.gpu_profiles import ComputeProfile, ProfileStore, canonical_gpu
from lightning_cannikin.simulation.noise import NoiseModel, noise_model

__all__ = [
    "ComputeModel",
    "JobModel",
    "NetworkModel",
    "fit_compute_model",
    "fit_library_model",
    "fit_network_model",
    "library_step_time",
    "load_job",
]

NETWORK_SCALINGS = ("linear", "log")
"""How the all-reduce cost grows with replicas: Pollux's fitted linear term, or a logarithmic (tree/hierarchical)
term fitted to the same data. They agree on the measured range (up to 64 GPUs) and bracket the extrapolation."""


@dataclass(frozen=True)
class ComputeModel:
    """Single-GPU compute time of one job on one GPU type: the measured profile and its linear fit.

    Attributes:
        profile: the measurements.
        linear: the fitted ``a * b + a0`` (seconds), the library's own model type.

    """

    profile: ComputeProfile
    linear: LinearTimeModel

    @property
    def slope(self) -> float:
        """Fitted ``a`` in seconds per sample."""
        return self.linear.slope

    @property
    def intercept(self) -> float:
        """Fitted ``a0`` in seconds per step."""
        return self.linear.intercept

    @property
    def lower(self) -> int:
        """Smallest measured local batch (the simulator's lower bound per device)."""
        return int(self.profile.batch_sizes[0])

    @property
    def upper(self) -> int:
        """Largest measured local batch (a proxy for the memory cap: the profilers went up to what fitted)."""
        return int(self.profile.batch_sizes[-1])

    def measured(self, batch_size: np.ndarray | float) -> np.ndarray:
        """Ground truth: measured compute seconds, linearly interpolated between measured batch sizes."""
        return np.interp(np.asarray(batch_size, dtype=np.float64), self.profile.batch_sizes, self.profile.seconds)

    def predicted(self, batch_size: np.ndarray | float) -> np.ndarray:
        """The linear model ``a*b + a0``."""
        return self.linear(np.asarray(batch_size, dtype=np.float64))

    def r2(self) -> float:
        """Coefficient of determination of the linear fit on the measured points."""
        y = self.profile.seconds
        residual = float(np.sum((self.predicted(self.profile.batch_sizes) - y) ** 2))
        total = float(np.sum((y - y.mean()) ** 2))
        return 1.0 - residual / total if total > 0 else float("nan")


def fit_compute_model(profile: ComputeProfile) -> ComputeModel:
    """Fit ``t(b) = a*b + a0`` to a profile with the project's own fitter.

    Offline profiles have no time order, so every sample weighs the same: an effectively infinite half-life and a
    window larger than any profile.

    Raises:
        ValueError: the fitter could not fit (fewer than two distinct batch sizes).

    """
    fitter = ComputeTimeFitter(half_life=math.inf, max_samples=max(512, len(profile.batch_sizes)))
    for batch, seconds in zip(profile.batch_sizes, profile.seconds, strict=True):
        fitter.add(int(batch), float(seconds))
    model = fitter.fit()
    if model is None:
        raise ValueError(f"Could not fit a linear model to {profile.job} on {profile.gpu}.")
    return ComputeModel(profile, model)


@dataclass(frozen=True)
class NetworkModel:
    """All-reduce cost and its overlap with backward compute (Pollux's throughput model).

    Attributes:
        alpha_r, beta_r: seconds; cost on one node, ``alpha_r + beta_r * x(N)``.
        alpha_n, beta_n: seconds; cost across nodes.
        gamma: overlap exponent in [1, 10].
        scaling: ``"linear"`` (``x = max(N - 2, 0)``, Pollux) or ``"log"`` (``x = log2(max(N, 2) / 2)``).

    """

    alpha_r: float
    beta_r: float
    alpha_n: float
    beta_n: float
    gamma: float
    scaling: str = "linear"

    def time(self, replicas: np.ndarray | float, multi_node: np.ndarray | bool) -> np.ndarray:
        """``T_net``: zero for one replica, otherwise the intra- or inter-node cost."""
        n = np.asarray(replicas, dtype=np.float64)
        x = np.maximum(n - 2.0, 0.0) if self.scaling == "linear" else np.log2(np.maximum(n, 2.0) / 2.0)
        cost = np.where(multi_node, self.alpha_n + self.beta_n * x, self.alpha_r + self.beta_r * x)
        return np.where(n > 1, cost, 0.0)

    def combine(self, compute: np.ndarray | float, network: np.ndarray | float) -> np.ndarray:
        """Iteration time ``(c^gamma + T_net^gamma)^(1/gamma)`` of one device (max-scaled so gamma=10 is exact)."""
        c = np.asarray(compute, dtype=np.float64)
        t = np.asarray(network, dtype=np.float64)
        top = np.maximum(c, t)
        safe = np.where(top > 0, top, 1.0)
        return np.where(
            top > 0, safe * ((c / safe) ** self.gamma + (t / safe) ** self.gamma) ** (1.0 / self.gamma), 0.0
        )


def fit_network_model(
    replicas: np.ndarray,
    nodes: np.ndarray,
    compute: np.ndarray,
    step_time: np.ndarray,
    scaling: str = "linear",
) -> NetworkModel:
    """Fit ``alpha_r, beta_r, alpha_n, beta_n, gamma`` to multi-GPU step times, compute time given.

    Least squares on log time (errors are relative, and step times span two orders of magnitude), with
    non-negative costs and gamma in [1, 10] as in Pollux.

    Args:
        replicas: GPUs of each measured configuration (>= 2).
        nodes: nodes of each configuration.
        compute: single-GPU compute seconds at each configuration's local batch.
        step_time: measured step seconds.
        scaling: ``"linear"`` or ``"log"``.

    """
    from scipy.optimize import least_squares

    if scaling not in NETWORK_SCALINGS:
        raise ValueError(f"`scaling` must be one of {NETWORK_SCALINGS}, got {scaling!r}.")
    replicas = np.asarray(replicas, dtype=np.float64)
    multi = np.asarray(nodes) > 1
    log_obs = np.log(step_time)

    def residuals(p: np.ndarray) -> np.ndarray:
        model = NetworkModel(p[0], p[1], p[2], p[3], p[4], scaling)
        return np.log(np.maximum(model.combine(compute, model.time(replicas, multi)), 1e-9)) - log_obs

    excess = np.maximum(step_time - compute, 0.0)
    guess_r = float(np.median(excess[~multi])) if np.any(~multi) else 0.01
    guess_n = float(np.median(excess[multi])) if np.any(multi) else guess_r
    best = None
    # Several gamma starts: the objective is not convex in gamma and a single start can stall near gamma = 1.
    for gamma0 in (1.0, 2.0, 4.0):
        start = np.asarray([max(guess_r, 1e-4), 1e-3, max(guess_n, 1e-4), 1e-3, gamma0])
        result = least_squares(residuals, start, bounds=([0, 0, 0, 0, 1.0], [np.inf] * 4 + [10.0]), method="trf")
        if best is None or result.cost < best.cost:
            best = result
    p = best.x
    return NetworkModel(float(p[0]), float(p[1]), float(p[2]), float(p[3]), float(p[4]), scaling)


def library_step_time(
    compute: np.ndarray, network: np.ndarray, share: float | np.ndarray, exposed: float | np.ndarray
) -> np.ndarray:
    """The library's two-regime step model (``core.timing.step_time_pieces``) for one device.

    Compute-bound, the step ends when backward ends plus the exposed part of the all-reduce (``exposed x c``);
    all-reduce bound, the all-reduce starts when the first bucket is ready, after ``share`` of the compute, and
    lasts ``c``: ``max(t + exposed * c, share * t + c)``.
    """
    t, c = np.asarray(compute, dtype=np.float64), np.asarray(network, dtype=np.float64)
    return np.maximum(t + exposed * c, share * t + c)


def fit_library_model(compute: np.ndarray, network: np.ndarray, step_time: np.ndarray) -> tuple[float, float]:
    """``(share, exposed)`` in [0, 1] of :func:`library_step_time`, least squares on log time over a fine grid.

    The library measures both live (the share of compute done when the first bucket is ready, and the all-reduce's
    exposed part); offline profiles only have whole step times, so they are fitted here with the network time given.
    """
    grid = np.linspace(0.0, 1.0, 101)
    share, exposed = np.meshgrid(grid, grid, indexing="ij")
    t = np.asarray(compute, dtype=np.float64)[None, None, :]
    c = np.asarray(network, dtype=np.float64)[None, None, :]
    predicted = library_step_time(t, c, share[..., None], exposed[..., None])  # every grid point at once
    cost = ((np.log(predicted) - np.log(np.asarray(step_time))[None, None, :]) ** 2).sum(axis=-1)
    i, j = np.unravel_index(int(np.argmin(cost)), cost.shape)
    return float(share[i, j]), float(exposed[i, j])


@dataclass(frozen=True)
class JobModel:
    """Everything the simulator knows about one training job.

    Attributes:
        name: job name.
        base_batch_size: B0.
        samples_per_epoch: N (derived from the base run).
        max_validated_batch: the largest total batch with a validation run (Pollux's max batch size).
        compute: per-GPU-type compute models.
        network: all-reduce cost and overlap (fitted on T4).
        noise: noise-scale model.
        library_overlap: ``(share, exposed)`` of the library's two-regime step model
            (:func:`library_step_time`), fitted on the same T4 runs as ``network``: what the simulator *plans* with,
            as the library does (``None``: plan with ``network`` too).

    """

    name: str
    base_batch_size: int
    samples_per_epoch: float
    max_validated_batch: int
    compute: Mapping[str, ComputeModel]
    network: NetworkModel
    noise: NoiseModel
    library_overlap: tuple[float, float] | None = None

    @property
    def target_progress(self) -> float:
        """Progress (in B0-steps) that ends training."""
        return self.noise.target_progress


def t4_network_data(store: ProfileStore, job: str, compute: ComputeModel, table: str = "placements") -> dict:
    """Multi-GPU T4 rows with the single-GPU compute time at the same local batch.

    Args:
        store: profile store.
        job: job name.
        compute: the T4 compute model (its measured profile gives the compute time).
        table: ``"placements"`` (1 to 4 nodes, up to 16 GPUs; used to fit) or ``"scalability"`` (6 to 16 nodes,
            up to 64 GPUs; held out for validation).

    Returns:
        Arrays ``replicas``, ``nodes``, ``local_bsz``, ``compute``, ``step_time``.

    """
    data = store.placements(job) if table == "placements" else store.scalability(job)
    keep = data["num_replicas"] >= 2
    batch = data["local_bsz"][keep]
    return {
        "replicas": data["num_replicas"][keep],
        "nodes": data["num_nodes"][keep],
        "local_bsz": batch,
        "compute": compute.measured(batch),
        "step_time": data["step_time"][keep],
    }


@functools.lru_cache(maxsize=64)
def _load_job_cached(job: str, gpus: tuple[str, ...] | None, shipped: str, sia: str | None, scaling: str) -> JobModel:
    store = ProfileStore(shipped_root=shipped, shared_root=None if sia is None else sia, use_sia=sia is not None)
    runs = store.validation_runs(job)
    base = min(runs)
    noise = noise_model(runs)
    available = store.available_gpus(job)
    wanted = available if gpus is None else {canonical_gpu(g): None for g in gpus}
    compute = {gpu: fit_compute_model(store.compute_profile(job, gpu)) for gpu in wanted}
    t4 = compute["T4"] if "T4" in compute else fit_compute_model(store.compute_profile(job, "T4"))
    rows = t4_network_data(store, job, t4)
    network = fit_network_model(rows["replicas"], rows["nodes"], rows["compute"], rows["step_time"], scaling)
    overlap = fit_library_model(rows["compute"], network.time(rows["replicas"], rows["nodes"] > 1), rows["step_time"])
    return JobModel(
        name=job,
        base_batch_size=int(base),
        samples_per_epoch=store.samples_per_epoch(job),
        max_validated_batch=int(max(runs)),
        compute=compute,
        network=network,
        noise=noise,
        library_overlap=overlap,
    )


def load_job(
    job: str,
    gpus: Iterable[str] | None = None,
    store: ProfileStore | None = None,
    network_scaling: str = "linear",
) -> JobModel:
    """Fit the models of ``job`` for the given GPU types (default: every type with a profile).

    Results are cached per (job, GPU types, data roots, scaling): fitting takes a fraction of a second, but the
    benchmark asks for the same job dozens of times.

    Args:
        job: one of :data:`~lightning_cannikin.simulation.gpu_profiles.JOBS`.
        gpus: GPU types to fit (any accepted spelling).
        store: where the profiles are (default: shipped data plus Sia when found).
        network_scaling: ``"linear"`` (Pollux) or ``"log"``.

    Raises:
        ValueError: a requested GPU type has no profile for this job.

    """
    store = store or ProfileStore()
    key = None if gpus is None else tuple(sorted({canonical_gpu(g) for g in gpus}))
    if key is not None:
        available = store.available_gpus(job)
        missing = [g for g in key if g not in available]
        if missing:
            hint = "" if store.sia_available else "; A100/2080Ti (and V100/RTX6000 for most jobs) need the Sia files"
            raise ValueError(
                f"Job {job!r} has no profile for {', '.join(missing)} (available: {', '.join(available)}{hint})."
            )
    sia = None if store.sia_root is None else str(store.sia_root.parent)
    return _load_job_cached(job, key, str(store.shipped_root), sia, network_scaling)
