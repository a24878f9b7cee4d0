"""The gradient noise scale of a job as a function of training progress, from its measured validation runs.

* :class:`NoiseTrajectory`: one ``validation-<M>.csv`` run (fixed total batch M), ``|G|^2`` and ``tr(Sigma)/B0``
  against progress, interpolated in log space.
* :class:`NoiseModel`: all runs of a job; the statistics at total batch B are interpolated linearly in B between the
  runs that bracket it, as Pollux's simulator does.

Pure numpy: imports neither torch nor Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

__all__ = ["NoiseModel", "NoiseTrajectory", "noise_model", "noise_trajectory"]


@dataclass(frozen=True)
class NoiseTrajectory:
    """Gradient statistics of one validation run (fixed total batch M) as functions of training progress.

    Attributes:
        batch_size: the run's total batch M.
        base_batch_size: B0; progress is counted in steps at B0, and ``grad_var`` is the variance of a B0-batch.
        progress: progress at the end of each effective epoch (ascending).
        iteration: optimizer steps at M taken to reach each progress value.
        grad_sqr: |G|^2 estimate at each row.
        grad_var: tr(Sigma)/B0 estimate at each row.

    """

    batch_size: int
    base_batch_size: int
    progress: np.ndarray
    iteration: np.ndarray
    grad_sqr: np.ndarray
    grad_var: np.ndarray

    def stats(self, progress: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
        """``(grad_sqr, grad_var)`` at ``progress``, interpolated in log space between rows.

        Row k is written at the end of effective epoch k; before the first row the first row's values hold (the
        live estimator has no earlier value either). Beyond the last row the last values hold.
        """
        p = np.asarray(progress, dtype=np.float64)
        sqr = np.exp(np.interp(p, self.progress, np.log(self.grad_sqr)))
        var = np.exp(np.interp(p, self.progress, np.log(self.grad_var)))
        return sqr, var

    def noise_scale(self, progress: np.ndarray | float) -> np.ndarray:
        """``B_noise = B0 * grad_var / grad_sqr`` in samples."""
        sqr, var = self.stats(progress)
        return self.base_batch_size * var / sqr


def noise_trajectory(run: Mapping[str, np.ndarray], batch_size: int, base_batch_size: int) -> NoiseTrajectory:
    """Wrap one ``validation-<M>.csv`` run; rows that repeat a progress value are dropped (interpolation needs order).

    ``grad_sqr`` and ``grad_var`` are floored at tiny positive values so their logarithms exist (``grad_var`` is
    already floored at 1e-6 by the artifact).
    """
    progress = np.asarray(run["progress"], dtype=np.float64)
    keep = np.concatenate(([True], np.diff(progress) > 0))
    tiny = np.finfo(np.float64).tiny
    return NoiseTrajectory(
        int(batch_size),
        int(base_batch_size),
        progress[keep],
        np.asarray(run["iteration"], dtype=np.float64)[keep],
        np.maximum(np.asarray(run["grad_sqr"], dtype=np.float64)[keep], tiny),
        np.maximum(np.asarray(run["grad_var"], dtype=np.float64)[keep], tiny),
    )


@dataclass(frozen=True)
class NoiseModel:
    """Noise scale as a function of progress and of the total batch in use, from all validation runs of a job.

    The noise scale depends on the run's history: runs at larger M measure larger values (ImageNet's M=12800 run
    has a median of about 41k samples against 11k at B0). As Pollux's simulator does, the statistics at total batch
    B are interpolated linearly in B between the runs that bracket it (clamped to the smallest and largest run).

    Attributes:
        runs: the job's runs, ascending in M; the first is the base run (M = B0).

    """

    runs: tuple[NoiseTrajectory, ...]

    @property
    def base_batch_size(self) -> int:
        """B0."""
        return self.runs[0].batch_size

    @property
    def target_progress(self) -> float:
        """The job's training target: the smallest final progress over its runs (Pollux's definition)."""
        return float(min(run.progress[-1] for run in self.runs))

    def __call__(self, progress: np.ndarray | float, batch_size: float | None = None) -> np.ndarray:
        """Noise scale in samples at ``progress`` (B0-steps) for a run at total batch ``batch_size`` (default B0)."""
        sizes = np.asarray([run.batch_size for run in self.runs], dtype=np.float64)
        b = float(np.clip(self.base_batch_size if batch_size is None else batch_size, sizes[0], sizes[-1]))
        upper = int(np.searchsorted(sizes, b, side="left"))
        if sizes[upper] == b:
            return self.runs[upper].noise_scale(progress)
        lower = upper - 1
        w = (b - sizes[lower]) / (sizes[upper] - sizes[lower])
        sqr_lo, var_lo = self.runs[lower].stats(progress)
        sqr_hi, var_hi = self.runs[upper].stats(progress)
        sqr = (1.0 - w) * sqr_lo + w * sqr_hi
        var = (1.0 - w) * var_lo + w * var_hi
        return self.base_batch_size * var / sqr

    def without(self, batch_size: int) -> NoiseModel:
        """The model without one run (for leave-one-run-out validation); the base run cannot be left out."""
        if batch_size == self.base_batch_size:
            raise ValueError("The base run defines B0 and the target; it cannot be left out.")
        return NoiseModel(tuple(run for run in self.runs if run.batch_size != batch_size))


def noise_model(runs: Mapping[int, Mapping[str, np.ndarray]]) -> NoiseModel:
    """Build the :class:`NoiseModel` of a job from its ``validation-<M>.csv`` runs (keyed by M)."""
    base = min(runs)
    return NoiseModel(tuple(noise_trajectory(runs[m], m, base) for m in sorted(runs)))
