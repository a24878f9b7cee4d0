"""The performance model: per-device compute time fitted online, the all-reduce cost, and the planner's pieces.

Compute time of a device for a local batch ``b`` is ``t(b) = a * b + a0``, fitted from
recency-weighted ``(b, seconds)`` samples with a robust regression so that stragglers and a device that changes speed
(another job arrives on a shared GPU) do not derail the plan. The gradient all-reduce costs ``c`` seconds, of which
``c_last`` are exposed after backward. :func:`step_time_pieces` turns both into the ``(slopes, offsets)`` pieces that
:mod:`lightning_cannikin.core.optperf` minimises over.

Pure numpy: imports neither torch nor Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from lightning_cannikin.core.change import MAD_TO_SD
from lightning_cannikin.core.sample_window import BatchSizeWindow, SampleWindow

__all__ = [
    "HALF_LIFE",
    "CommModel",
    "CommTimeFitter",
    "ComputeTimeFitter",
    "LinearTimeModel",
    "step_time_pieces",
]

# The timing fits' recency: a sample's weight halves every this many steps (each default below is this one).
HALF_LIFE = 50.0

# Up to this many distinct batch sizes, fit a line through the per-size weighted medians instead of a Huber regression.
_MEDIAN_FIT_MAX_SIZES = 8

# Forward is about a third of forward + backward for most networks (backward computes two gradients per layer).
DEFAULT_FORWARD_FRACTION = 1.0 / 3.0


def _check_nonnegative(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"`{name}` must be finite and >= 0, got {value}.")
    return value


@dataclass(frozen=True)
class LinearTimeModel:
    """Compute time of one device: ``slope * max(batch_size, knee) + intercept`` seconds.

    A GPU is not busy at small batches: below its saturation batch (the ``knee``) a step costs what it costs at the
    knee, above it the time grows linearly. ``knee = 0`` (the default) is a straight line.

    Args:
        slope: seconds per sample (``a_i``), >= 0.
        intercept: seconds per step independent of the batch (``a0_i``), >= 0.
        knee: the batch size below which the time is flat, >= 0.

    """

    slope: float
    intercept: float
    knee: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "slope", _check_nonnegative("slope", self.slope))
        object.__setattr__(self, "intercept", _check_nonnegative("intercept", self.intercept))
        object.__setattr__(self, "knee", _check_nonnegative("knee", self.knee))

    def __call__(self, batch_size: ArrayLike) -> float | np.ndarray:
        """Predicted seconds for a batch size (float) or an array of them (array)."""
        if isinstance(batch_size, (int, float)) or np.ndim(batch_size) == 0:  # Python numbers first: asked per record
            return self.slope * max(float(batch_size), self.knee) + self.intercept
        return self.slope * np.maximum(np.asarray(batch_size, dtype=np.float64), self.knee) + self.intercept

    def to_dict(self) -> dict:
        """A JSON- and checkpoint-friendly form."""
        out = {"slope": self.slope, "intercept": self.intercept}
        return {**out, "knee": self.knee} if self.knee else out

    @classmethod
    def from_dict(cls, data: dict) -> LinearTimeModel:
        """Inverse of :meth:`to_dict`."""
        return cls(data["slope"], data["intercept"], data.get("knee", 0.0))


@dataclass(frozen=True)
class CommModel:
    """Cost of the gradient all-reduce, the same on every rank.

    Args:
        allreduce: seconds of the whole all-reduce (``c``).
        exposed: seconds of it left after backward ends (``c_last``), ``0 <= exposed <= allreduce``.

    """

    allreduce: float
    exposed: float

    def __post_init__(self) -> None:
        allreduce = _check_nonnegative("allreduce", self.allreduce)
        exposed = _check_nonnegative("exposed", self.exposed)
        if exposed > allreduce:
            raise ValueError(f"`exposed` ({exposed}) cannot exceed `allreduce` ({allreduce}).")
        object.__setattr__(self, "allreduce", allreduce)
        object.__setattr__(self, "exposed", exposed)

    def to_dict(self) -> dict:
        """A JSON- and checkpoint-friendly form."""
        return {"allreduce": self.allreduce, "exposed": self.exposed}

    @classmethod
    def from_dict(cls, data: dict) -> CommModel:
        """Inverse of :meth:`to_dict`."""
        return cls(data["allreduce"], data["exposed"])


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The lower weighted median: the smallest value holding at least half the weight at or below it."""
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, 0.5 * cumulative[-1])])


class _WindowedFitter:
    """What the fitters share: a bounded window of samples, its size and contents, and their checkpoint form."""

    _keys: tuple[str, str]  # the state_dict's names of a sample's two halves
    _types: tuple[type, type]  # and their types

    def __init__(self, window: SampleWindow) -> None:
        self._window = window

    @property
    def num_samples(self) -> int:
        """Samples in the window."""
        return len(self._window)

    def samples(self) -> list[tuple]:
        """The samples in the window, oldest first."""
        return self._window.pairs()

    def state_dict(self) -> dict:
        """The samples as JSON-friendly lists (the settings stay with the constructor)."""
        pairs = self._window.pairs()
        return {self._keys[0]: [u for u, _ in pairs], self._keys[1]: [v for _, v in pairs]}

    def load_state_dict(self, state: dict) -> None:
        """Replace the samples with those of :meth:`state_dict`."""
        self._window.restore(state[self._keys[0]], state[self._keys[1]], self._types)


class ComputeTimeFitter(_WindowedFitter):
    """Fits one device's :class:`LinearTimeModel` from ``(batch_size, seconds)`` samples.

    With two or more distinct batch sizes it runs a Huber regression weighted by recency: stragglers (a step ten times
    slower because of a hiccup) get bounded influence, and old samples fade so a device that changes speed is followed
    within about ``half_life`` samples. With a single batch size the slope is unidentifiable, so half the robust mean
    time is taken as the intercept and the rest as per-sample cost (AdaptDL's prior).

    Args:
        half_life: age in samples at which a sample's weight halves; ``math.inf`` weighs all samples equally.
        max_samples: samples kept. The oldest are dropped, except a few of the previous batch size, so that the slope
            stays measured however long one plan runs.

    """

    _keys, _types = ("batch_sizes", "seconds"), (int, float)

    def __init__(self, half_life: float = HALF_LIFE, max_samples: int = 512) -> None:
        super().__init__(BatchSizeWindow(max_samples, half_life))

    def add(self, batch_size: int, seconds: float) -> None:
        """Record one measurement; non-finite or non-positive times (a clock glitch, a skipped step) are ignored."""
        if isinstance(batch_size, bool) or not float(batch_size).is_integer() or batch_size < 1:
            raise ValueError(f"`batch_size` must be a positive integer, got {batch_size}.")
        seconds = float(seconds)
        if math.isfinite(seconds) and seconds > 0:
            self._window.append(int(batch_size), seconds)

    @property
    def distinct_batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes present in the window, ascending."""
        return self._window.distinct_batch_sizes()

    def timed_sizes(self) -> tuple[int, ...]:
        """The batch sizes whose samples still weigh at least one fresh sample (the newest's always), ascending: where
        the fit is evidence now (an old size kept for the slope has faded below it)."""
        if not len(self._window):
            return ()
        sizes, _ = self._window.columns()
        weights = self._window.weights()
        return tuple(int(b) for b in np.unique(sizes) if weights[sizes == b].sum() >= 1.0)

    def typical(self, batch_size: int) -> float | None:
        """The recency-weighted median time at one batch size (``None``: no sample there)."""
        if not len(self._window):
            return None
        sizes, seconds = self._window.columns()
        at = sizes == batch_size
        if not at.any():
            return None
        return _weighted_median(seconds[at], self._window.weights()[at])

    def rescale(self, factor: float) -> None:
        """Multiply every sample's time by ``factor``: a device whose speed changed by that much, kept identified."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"`factor` must be finite and > 0, got {factor}.")
        pairs = self._window.pairs()
        self._window.restore([b for b, _ in pairs], [t * factor for _, t in pairs], self._types)

    def fit(self) -> LinearTimeModel | None:
        """The current model, or ``None`` before the first sample."""
        if not len(self._window):
            return None
        sizes, seconds = self._window.columns()
        weights = self._window.weights()
        if len(np.unique(sizes)) < 2:
            return self._prior(sizes, seconds, weights)
        distinct = np.unique(sizes)
        if len(distinct) <= _MEDIAN_FIT_MAX_SIZES:
            # Online, a plan repeats a few batch sizes many times: the weighted median per size already rejects
            # stragglers, and a weighted line through those few points is exact and cheaper still than the Huber fit
            # (which re-plans on rank zero would otherwise wait for).
            medians = np.array([_weighted_median(seconds[sizes == b], weights[sizes == b]) for b in distinct])
            mass = np.array([weights[sizes == b].sum() for b in distinct])
            slope, intercept = (float(v) for v in np.polyfit(distinct, medians, 1, w=np.sqrt(mass)))
            hinge = _hinge(distinct, medians, np.sqrt(mass), slope, intercept)
            if hinge is not None:
                return hinge
        else:
            slope, intercept = _huber(sizes, seconds, weights, fit_intercept=True)
        if slope <= 0:
            # Time did not grow with the batch in this window: the slope is unknown, not zero, and a zero slope would
            # make the planner pour every sample onto this device. Fall back to the one-size prior.
            return self._prior(sizes, seconds, weights)
        if intercept < 0:
            # A negative fixed cost is noise around a small one: refit a line through the origin.
            if len(distinct) <= _MEDIAN_FIT_MAX_SIZES:
                slope = float(np.sum(mass * distinct * medians) / np.sum(mass * distinct * distinct))
            else:
                slope, _ = _huber(sizes, seconds, weights, fit_intercept=False)
            intercept = 0.0
        return LinearTimeModel(slope, intercept)

    @staticmethod
    def _prior(sizes: np.ndarray, seconds: np.ndarray, weights: np.ndarray) -> LinearTimeModel:
        # Robust "mean": the recency-weighted median step time, at the recency-weighted median batch size.
        typical = _weighted_median(seconds, weights)
        size = _weighted_median(sizes, weights)
        return LinearTimeModel(0.5 * typical / size, 0.5 * typical)


def _hinge(
    sizes: np.ndarray, medians: np.ndarray, w: np.ndarray, slope: float, intercept: float
) -> LinearTimeModel | None:
    """A flat-then-linear model through per-size medians, if it explains them clearly better than the line.

    Each size with a smaller one below it and a larger one above is tried as the knee; the fit is a weighted line in
    ``max(b, knee)``. It is kept when its slope and intercept are non-negative and its weighted squared error is under
    a quarter of the line's: the flat region of a saturating GPU, not noise, bends the line. The sizes above the knee
    set the slope even when their weights have faded (the flat ones say nothing about it), so a rank balanced into
    its flat region keeps the slope it showed above the knee.
    """
    if len(sizes) < 3:
        return None
    line_error = float(np.sum((w * (slope * sizes + intercept - medians)) ** 2))
    best: tuple[float, LinearTimeModel] | None = None
    for knee in sizes[1:-1]:
        x = np.maximum(sizes, knee).astype(np.float64)
        a, a0 = (float(v) for v in np.polyfit(x, medians, 1, w=w))
        error = float(np.sum((w * (a * x + a0 - medians)) ** 2))
        if a > 0 and a0 >= 0 and (best is None or error < best[0]):
            best = (error, LinearTimeModel(a, a0, float(knee)))
    if best is None or not best[0] < 0.25 * line_error:
        return None
    return best[1]


def _huber(
    sizes: np.ndarray, seconds: np.ndarray, weights: np.ndarray, fit_intercept: bool, epsilon: float = 1.35
) -> tuple[float, float]:
    """Recency-weighted Huber fit of ``seconds ~ slope * sizes (+ intercept)``, returned in the original units.

    Iteratively reweighted least squares: residuals beyond ``epsilon`` robust standard deviations (``MAD_TO_SD`` x
    their weighted median absolute value) weigh in inversely to their size, so a straggler step moves the line as little
    as Huber's loss lets it. Two unknowns: each round is one small least-squares solve (about a millisecond for the
    whole fit, where scikit-learn's L-BFGS took tens on rank zero while every other rank waited).
    """
    # Work in units of the mean size and the median time: the tolerance below is then relative.
    x_scale = float(np.mean(sizes))
    y_scale = float(np.median(seconds))
    x, y = sizes / x_scale, seconds / y_scale
    design = np.stack([x, np.ones_like(x)], axis=1) if fit_intercept else x[:, None]
    robust = np.ones_like(y)
    coef = np.zeros(design.shape[1])
    for _ in range(50):
        root = np.sqrt(weights * robust)
        new = np.linalg.lstsq(design * root[:, None], y * root, rcond=None)[0]
        converged = bool(np.allclose(new, coef, rtol=1e-7, atol=1e-10))
        coef = new
        if converged:
            break
        residuals = np.abs(y - design @ coef)
        scale = MAD_TO_SD * _weighted_median(residuals, weights)
        if not scale > 0:
            break  # the line goes through the bulk of the samples exactly: nothing to down-weight
        robust = np.minimum(1.0, epsilon * scale / np.maximum(residuals, 1e-300))
    slope = float(coef[0]) * y_scale / x_scale
    return slope, (float(coef[1]) * y_scale if fit_intercept else 0.0)


class CommTimeFitter(_WindowedFitter):
    """Fits the :class:`CommModel` from ``(allreduce_seconds, exposed_seconds)`` samples by recency-weighted medians.

    The all-reduce time does not depend on the local batch, so a robust location is the whole model.

    Args:
        half_life: age in samples at which a sample's weight halves; ``math.inf`` weighs all samples equally.
        max_samples: samples kept (the oldest are dropped).

    """

    _keys, _types = ("allreduce", "exposed"), (float, float)

    def __init__(self, half_life: float = HALF_LIFE, max_samples: int = 512) -> None:
        super().__init__(SampleWindow(max_samples, half_life))

    def add(self, allreduce_seconds: float, exposed_seconds: float) -> None:
        """Record one step; samples with a non-finite or negative time are ignored.

        Zero is kept: a single device has nothing to reduce. An exposed time above the all-reduce time (two clocks'
        jitter) is clamped to it.
        """
        allreduce, exposed = float(allreduce_seconds), float(exposed_seconds)
        if math.isfinite(allreduce) and math.isfinite(exposed) and allreduce >= 0 and exposed >= 0:
            self._window.append(allreduce, min(exposed, allreduce))

    def fit(self) -> CommModel | None:
        """The current model, or ``None`` before the first sample."""
        if not len(self._window):
            return None
        allreduce, exposed = self._window.columns()
        weights = self._window.weights()
        total = _weighted_median(allreduce, weights)
        return CommModel(total, min(_weighted_median(exposed, weights), total))


def step_time_pieces(
    compute: Sequence[LinearTimeModel],
    comm: CommModel | None,
    backward_fraction: float | None = None,
    forward_fraction: float = DEFAULT_FORWARD_FRACTION,
    overhead: ArrayLike = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """The planner's ``(slopes, offsets)``, each of shape ``(n, K)``, from per-device compute models and the comm model.

    - ``comm`` is None: ``K = 1``, the compute time alone.
    - ``backward_fraction`` is None: ``K = 1``, ``t_i(b) + c_last`` (exact when every device is compute-bound).
    - otherwise ``K = 2``, the two regimes: compute bottleneck ``t_i(b) + c_last`` and communication
      bottleneck ``f_i(b) + r * k_i(b) + c``, with forward ``f_i = forward_fraction * t_i`` and backward
      ``k_i = (1 - forward_fraction) * t_i``.

    Args:
        compute: one model per device.
        comm: the all-reduce model, or None to ignore communication.
        backward_fraction: ``r``, the fraction of backward done when the first gradient bucket is ready.
        forward_fraction: forward's share of the compute time.
        overhead: seconds a step costs on top, whatever the split: one value for every device (the framework's
            work), or one per device (its optimizer step).

    """
    if len(compute) == 0:
        raise ValueError("`compute` must hold one model per device, got none.")
    a = np.array([m.slope for m in compute], dtype=np.float64)
    a0 = np.array([m.intercept for m in compute], dtype=np.float64)
    extra = np.broadcast_to(np.asarray(overhead, dtype=np.float64), a.shape)
    if not np.all(np.isfinite(extra) & (extra >= 0)):
        raise ValueError(f"`overhead` must be finite and >= 0, got {overhead}.")
    knees = np.array([getattr(m, "knee", 0.0) for m in compute], dtype=np.float64)
    if np.any(knees > 0):
        # every piece g is non-decreasing, so g(max(b, knee)) = max(g(b), g(knee)): one flat piece per piece
        models = [LinearTimeModel(m.slope, m.intercept) for m in compute]
        slopes, offsets = step_time_pieces(models, comm, backward_fraction, forward_fraction, overhead)
        flat = slopes * knees[:, None] + offsets
        return np.concatenate([slopes, np.zeros_like(slopes)], axis=1), np.concatenate([offsets, flat], axis=1)
    if comm is None:
        return a[:, None], (a0 + extra)[:, None]
    if backward_fraction is None:
        return a[:, None], (a0 + comm.exposed + extra)[:, None]
    r = float(backward_fraction)
    phi = float(forward_fraction)
    if not 0.0 <= r <= 1.0:
        raise ValueError(f"`backward_fraction` must be in [0, 1], got {backward_fraction}.")
    if not 0.0 <= phi <= 1.0:
        raise ValueError(f"`forward_fraction` must be in [0, 1], got {forward_fraction}.")
    # Communication bottleneck: the all-reduce starts once forward and a fraction r of backward are done.
    share = phi + r * (1.0 - phi)
    slopes = np.stack([a, share * a], axis=1)
    offsets = np.stack([a0 + comm.exposed, share * a0 + comm.allreduce], axis=1) + extra[:, None]
    return slopes, offsets
