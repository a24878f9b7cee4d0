"""How well the simulator's models predict measurements they were not fitted on. Every figure is computed here.

Three checks, each against the profiles:

1. **Compute** (:func:`single_gpu_fits`): the project's fitter on every single-GPU profile; in-sample R^2 and relative
   errors, and leave-one-out errors (fit on all batch sizes but one, predict that one).
2. **Step time on many GPUs** (:func:`network_holdout`): the network model is fitted on T4 placements of 2 to 16 GPUs
   on 1 to 4 nodes, then predicts the held-out ``scalability.csv`` runs (6 to 16 nodes, up to 64 GPUs), once with the
   measured compute time (the simulator's clock) and once with the linear model (what the planner believes); and
   the library's own two-regime step model (:func:`library_step_time`), fitted on the same runs, predicts them too.
3. **Statistical progress** (:func:`progress_holdout`): for every validation run at total batch M > B0, the
   steps needed to reach its final progress as the simulator counts them, compared with the run's measured count;
   in-sample (the run's own statistics are in the model) and leave-one-run-out.

A model "fails" where its median relative error exceeds :data:`TOLERANCE` (10%) or, for a linear compute fit,
where R^2 is below 0.9. Failures are listed by :func:`failures`, not hidden.

Pure numpy: imports neither torch nor Lightning.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from lightning_cannikin.simulation.gpu_profiles import JOBS, ComputeProfile, ProfileStore
from lightning_cannikin.simulation.models import (
    fit_compute_model,
    fit_library_model,
    fit_network_model,
    library_step_time,
    t4_network_data,
)
from lightning_cannikin.simulation.noise import NoiseModel, noise_model

__all__ = [
    "TOLERANCE",
    "failures",
    "fit_library_model",
    "library_step_time",
    "network_holdout",
    "predicted_iterations",
    "progress_holdout",
    "single_gpu_fits",
    "validate",
]

TOLERANCE = 0.10
"""Median relative error above which a model is reported as failing."""

MIN_R2 = 0.9
"""Linear compute fits with a lower R^2 are reported as failing."""


def _relative(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    return np.abs(np.asarray(predicted) - np.asarray(measured)) / np.asarray(measured)


def leave_one_out_errors(profile: ComputeProfile) -> np.ndarray:
    """Relative error at each measured batch size of a linear fit to all the other batch sizes."""
    errors = []
    for i in range(len(profile.batch_sizes)):
        keep = np.arange(len(profile.batch_sizes)) != i
        if keep.sum() < 2:
            continue
        rest = ComputeProfile(
            profile.job, profile.gpu, profile.source, profile.batch_sizes[keep], profile.seconds[keep]
        )
        model = fit_compute_model(rest)
        errors.append(_relative(model.predicted(profile.batch_sizes[i]), profile.seconds[i]))
    return np.asarray(errors, dtype=np.float64)


def single_gpu_fits(store: ProfileStore, jobs: Iterable[str] = JOBS, leave_one_out: bool = True) -> list[dict]:
    """Fit every single-GPU profile with the project's fitter and measure the errors.

    Returns:
        One dict per (job, GPU, source): ``job, gpu, source, used`` (whether the simulator uses this source for the
        type), ``n, b_min, b_max, a_ms, a0_ms, r2, median_err, max_err``, and
        ``loo_median_err`` / ``loo_max_err`` when ``leave_one_out``.

    """
    rows = []
    for job in jobs:
        used = store.available_gpus(job)
        for gpu, source in store.all_profiles(job):
            profile = store.compute_profile(job, gpu, source)
            model = fit_compute_model(profile)
            errors = _relative(model.predicted(profile.batch_sizes), profile.seconds)  # in-sample
            row = {
                "job": job,
                "gpu": gpu,
                "source": source,
                "used": used.get(gpu) == source,
                "n": len(profile.batch_sizes),
                "b_min": int(profile.batch_sizes[0]),
                "b_max": int(profile.batch_sizes[-1]),
                "a_ms": model.slope * 1e3,
                "a0_ms": model.intercept * 1e3,
                "r2": model.r2(),
                "median_err": float(np.median(errors)),
                "max_err": float(errors.max()),
            }
            if leave_one_out:
                loo = leave_one_out_errors(profile)
                row["loo_median_err"] = float(np.median(loo))
                row["loo_max_err"] = float(loo.max())
            rows.append(row)
    return rows


def network_holdout(
    store: ProfileStore, jobs: Iterable[str] = JOBS, scalings: Iterable[str] = ("linear", "log")
) -> list[dict]:
    """Fit the network model on T4 placements (<= 16 GPUs) and predict the held-out 6-16-node runs (<= 64 GPUs).

    Returns:
        One dict per (job, scaling): fitted parameters (ms), in-sample and held-out median/p90 relative errors with
        the measured compute time (``clock``) and with the linear compute model (``planner``), and the row counts.

    """
    rows = []
    for job in jobs:
        t4 = fit_compute_model(store.compute_profile(job, "T4", "pollux"))
        train = t4_network_data(store, job, t4, "placements")
        test = t4_network_data(store, job, t4, "scalability")
        for scaling in scalings:
            net = fit_network_model(train["replicas"], train["nodes"], train["compute"], train["step_time"], scaling)
            train_net = net.time(train["replicas"], train["nodes"] > 1)
            test_net = net.time(test["replicas"], test["nodes"] > 1)
            linear = t4.predicted(test["local_bsz"])
            fit_err = _relative(net.combine(train["compute"], train_net), train["step_time"])
            clock = _relative(net.combine(test["compute"], test_net), test["step_time"])
            plan = _relative(net.combine(linear, test_net), test["step_time"])
            # the library's own two-regime model, with the same network time, fitted on the same runs
            share, exposed = fit_library_model(train["compute"], train_net, train["step_time"])
            library = _relative(library_step_time(linear, test_net, share, exposed), test["step_time"])
            rows.append(
                {
                    "job": job,
                    "scaling": scaling,
                    "alpha_r_ms": net.alpha_r * 1e3,
                    "beta_r_ms": net.beta_r * 1e3,
                    "alpha_n_ms": net.alpha_n * 1e3,
                    "beta_n_ms": net.beta_n * 1e3,
                    "gamma": net.gamma,
                    "train_rows": len(fit_err),
                    "train_max_gpus": int(train["replicas"].max()),
                    "heldout_rows": len(clock),
                    "heldout_max_gpus": int(test["replicas"].max()),
                    "train_median_err": float(np.median(fit_err)),
                    "train_p90_err": float(np.percentile(fit_err, 90)),
                    "heldout_median_err": float(np.median(clock)),
                    "heldout_p90_err": float(np.percentile(clock, 90)),
                    "heldout_planner_median_err": float(np.median(plan)),
                    "heldout_planner_p90_err": float(np.percentile(plan, 90)),
                    "library_share": share,
                    "library_exposed": exposed,
                    "heldout_library_median_err": float(np.median(library)),
                    "heldout_library_p90_err": float(np.percentile(library, 90)),
                }
            )
    return rows


def predicted_iterations(noise: NoiseModel, batch_size: int, target: float, cells: int = 4000) -> float:
    """Optimizer steps at a fixed total batch to reach ``target`` progress, as the simulator counts them."""
    edges = np.linspace(0.0, target, cells + 1)
    mids = 0.5 * (edges[1:] + edges[:-1])
    phi = noise(mids, batch_size)
    base = noise.base_batch_size
    gain = (phi + base) / (phi + batch_size) * (batch_size / base)
    return float(np.sum(np.diff(edges) / gain))


def progress_holdout(store: ProfileStore, jobs: Iterable[str] = JOBS) -> list[dict]:
    """Steps to each run's final progress: measured vs the simulator's count, in-sample and leave-one-run-out.

    Leaving out the largest run makes its prediction an extrapolation from the next smaller run.

    Returns:
        One dict per (job, M > B0): ``measured``, ``predicted``, ``heldout_predicted`` and signed relative errors
        ``err`` and ``heldout_err`` (positive: the simulator needs more steps than the real run, i.e. it is
        pessimistic about batch M).

    """
    rows = []
    for job in jobs:
        runs = store.validation_runs(job)
        model = noise_model(runs)
        for run in model.runs[1:]:
            measured = float(run.iteration[-1])
            target = float(run.progress[-1])
            inside = predicted_iterations(model, run.batch_size, target)
            outside = predicted_iterations(model.without(run.batch_size), run.batch_size, target)
            rows.append(
                {
                    "job": job,
                    "batch_size": run.batch_size,
                    "base_batch_size": model.base_batch_size,
                    "measured": measured,
                    "predicted": inside,
                    "heldout_predicted": outside,
                    "err": inside / measured - 1.0,
                    "heldout_err": outside / measured - 1.0,
                }
            )
    return rows


def failures(report: dict) -> list[str]:
    """Human-readable list of the models that miss the tolerance, from a :func:`validate` report."""
    out = []
    for row in report.get("single_gpu", []):
        loo = row.get("loo_median_err", row["median_err"])
        if row["r2"] < MIN_R2 or loo > TOLERANCE:
            out.append(
                f"compute {row['job']}/{row['gpu']} ({row['source']}): linear fit R2={row['r2']:.3f}, "
                f"leave-one-out median error {loo * 100:.1f}%"
            )
    for row in report.get("network", []):
        if row["scaling"] != report.get("scaling", "linear"):
            continue
        worst = max(row["heldout_median_err"], row["heldout_planner_median_err"])
        if worst > TOLERANCE:
            out.append(
                f"step time {row['job']} on 6-16 T4 nodes: held-out median error {row['heldout_median_err'] * 100:.1f}%"
                f" (clock), {row['heldout_planner_median_err'] * 100:.1f}% (planner's linear model)"
            )
    by_job: dict[str, list[float]] = {}
    for row in report.get("progress", []):
        by_job.setdefault(row["job"], []).append(abs(row["heldout_err"]))
    for job, errs in by_job.items():
        if np.median(errs) > TOLERANCE:
            out.append(f"statistical progress {job}: leave-one-run-out median |error| {np.median(errs) * 100:.1f}%")
    return out


def validate(
    store: ProfileStore | None = None, jobs: Iterable[str] = JOBS, scaling: str = "linear", leave_one_out: bool = True
) -> dict:
    """Run all three checks.

    Returns:
        ``{"single_gpu": [...], "network": [...], "progress": [...], "scaling": scaling, "failures": [...],
        "sia_available": bool}``.

    """
    store = store or ProfileStore()
    jobs = tuple(jobs)
    report = {
        "sia_available": store.sia_available,
        "scaling": scaling,
        "single_gpu": single_gpu_fits(store, jobs, leave_one_out),
        "network": network_holdout(store, jobs),
        "progress": progress_holdout(store, jobs),
    }
    report["failures"] = failures(report)
    return report
