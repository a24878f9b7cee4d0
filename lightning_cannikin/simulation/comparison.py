"""All policies on one job and cluster, side by side, plus hindsight-tuned fixed-batch DDP.

Pure numpy: imports neither torch nor Lightning.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from lightning_cannikin.core.goodput import CANDIDATES
from lightning_cannikin.simulation.engine import (
    POLICIES,
    ClusterModel,
    PolicyResult,
    _NoiseGrid,
    candidate_grid,
    default_batch_size,
    simulate,
)

__all__ = ["Comparison", "best_fixed_batch_time", "compare"]


def best_fixed_batch_time(
    model: ClusterModel, max_batch_size: int | None = None, cells: int = 1000, candidates: int = CANDIDATES
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
    progress = _NoiseGrid(job, cells)
    steps = np.asarray([progress.steps(int(t)) for t in totals])
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

    def reduction(self, baseline: str, policy: str = "cannikin") -> float:
        """Fraction of the baseline's time-to-target that ``policy`` saves (0.4 = 40% less time)."""
        return 1.0 - self.time(policy) / self.time(baseline)

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
                "final_accumulation": r.final_plan.accumulation_steps,
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
        replans: the noise grid's resolution, ``replans * cells_per_replan`` progress cells (:func:`simulate`: the
            re-plans come when the training run's Replanner says).
        tuned_ddp: also compute hindsight-tuned fixed-batch DDP.
        **kwargs: passed to :func:`simulate` (``cells_per_replan``, ``candidates``, ``margin``).

    """
    start = default_batch_size(model, max_batch_size) if batch_size is None else int(batch_size)
    results = {p: simulate(model, p, start, max_batch_size, replans, **kwargs) for p in policies}  # type: ignore[arg-type]
    tuned = best_fixed_batch_time(model, max_batch_size) if tuned_ddp else None
    return Comparison(
        model.job.name, model.cluster.spec(), results, tuned, model.network_time, start, model.job.max_validated_batch
    )
