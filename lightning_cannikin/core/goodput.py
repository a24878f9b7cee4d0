"""Statistical efficiency, AdaScale gain and goodput of a total batch size (see docs/architecture.md).

With the noise scale ``phi = tr(Sigma) / |G|^2`` (per-sample covariance, in samples) and the initial total batch B0,
one step at total batch B makes as much progress as ``r(B) = (phi + B0) / (phi + B) * B / B0`` steps at B0 (the
AdaScale gain), so each sample is worth ``E(B) = r(B) * B0 / B = (phi + B0) / (phi + B)`` of a sample at B0 (the
statistical efficiency). Goodput is throughput times efficiency: ``B / step_time(B) * E(B)``.

Without statistics (``noise_scale=None``) these functions take ``phi = 0``, AdaptDL's prior (gradient norm 1,
variance 0): ``E(B) = B0 / B`` and ``r(B) = 1``. That is exact at B = B0 and, elsewhere, pessimistic about large
batches, so a caller that forgets to wait for statistics is not pushed to the largest batch. ``phi = inf`` (no
detectable signal) gives ``E = 1`` and ``r = B / B0``.

Pure numpy: imports neither torch nor Lightning.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "ADAPT_MARGIN",
    "adascale_gain",
    "candidate_batch_sizes",
    "efficiency",
    "goodput",
]

# the relative goodput gain a change of total must exceed (hysteresis), the one default of every rule and tool that
# chooses a total: 2%, smaller than AdaptDL's 5% on a point estimate, since the bounds already keep the choice from
# chasing noise (the gpu-mix time-to-accuracy run, CannikinSettings.adapt_margin)
ADAPT_MARGIN = 0.02
# geometric candidate totals a decision weighs between the base batch and the cap: about 4% apart from 32 to 256
CANDIDATES = 50


def _scalar_or_array(x: np.ndarray) -> float | np.ndarray:
    return float(x) if x.ndim == 0 else x


def _check(base_batch_size: float, batches_positive: bool, phis_valid: bool, batch_size: object, noise: object) -> None:
    """The one check of the inputs, for plain numbers and for arrays alike."""
    if base_batch_size <= 0:
        raise ValueError(f"`base_batch_size` must be positive, got {base_batch_size}.")
    if not batches_positive:
        raise ValueError(f"Batch sizes must be positive, got {batch_size}.")
    if not phis_valid:  # also rejects NaN
        raise ValueError(f"`noise_scale` must be >= 0 or None, got {noise}.")


def _scalar_efficiency(noise_scale: float | None, batch_size: float, base_batch_size: float) -> float:
    """The same as :func:`_efficiency` for plain numbers, in plain floats: the callback asks at every step."""
    phi = 0.0 if noise_scale is None else float(noise_scale)
    _check(base_batch_size, batch_size > 0, phi >= 0.0, batch_size, noise_scale)
    if math.isinf(phi):
        return 1.0
    return (phi + base_batch_size) / (phi + float(batch_size))


def _plain(*values: object) -> bool:
    return all(value is None or isinstance(value, (int, float)) for value in values)


def _efficiency(noise_scale: ArrayLike | None, batch_size: ArrayLike, base_batch_size: float) -> np.ndarray:
    batch = np.asarray(batch_size, dtype=np.float64)
    phi = np.asarray(0.0 if noise_scale is None else noise_scale, dtype=np.float64)
    _check(base_batch_size, not np.any(batch <= 0), bool(np.all(phi >= 0.0)), batch_size, noise_scale)
    phi, batch = np.broadcast_arrays(phi, batch)
    finite = np.isfinite(phi)
    safe_phi = np.where(finite, phi, 0.0)  # inf + B0 over inf + B would be NaN; its limit is 1
    return np.where(finite, (safe_phi + base_batch_size) / (safe_phi + batch), 1.0)


def efficiency(noise_scale: ArrayLike | None, batch_size: ArrayLike, base_batch_size: float) -> float | np.ndarray:
    """Statistical efficiency ``E(B) = (phi + B0) / (phi + B)``, relative to the base batch.

    Args:
        noise_scale: ``phi`` in samples, ``math.inf`` allowed; None (no statistics yet) means ``phi = 0``. May be an
            array (e.g. a noise scale that changes over training); it broadcasts with ``batch_size``.
        batch_size: one or many total batch sizes B.
        base_batch_size: B0.

    Returns:
        A float for scalar inputs, otherwise an array of the broadcast shape. ``E(B0) = 1``.

    """
    if _plain(noise_scale, batch_size):
        return _scalar_efficiency(noise_scale, batch_size, base_batch_size)  # type: ignore[arg-type]
    return _scalar_or_array(_efficiency(noise_scale, batch_size, base_batch_size))


def adascale_gain(noise_scale: ArrayLike | None, batch_size: ArrayLike, base_batch_size: float) -> float | np.ndarray:
    """AdaScale gain ``r(B) = E(B) * B / B0``: B0-steps of progress per step at B; exactly 1 at B = B0.

    Args:
        noise_scale: ``phi`` in samples (scalar or array); None means ``phi = 0``, so the gain is 1 for every B.
        batch_size: one or many total batch sizes B; broadcasts with ``noise_scale``.
        base_batch_size: B0.

    Returns:
        A float for scalar inputs, otherwise an array of the broadcast shape.

    """
    if _plain(noise_scale, batch_size):
        if batch_size == base_batch_size and base_batch_size > 0:
            return 1.0
        return _scalar_efficiency(noise_scale, batch_size, base_batch_size) * float(batch_size) / base_batch_size  # type: ignore[arg-type]
    batch = np.asarray(batch_size, dtype=np.float64)
    gain = _efficiency(noise_scale, batch, base_batch_size) * batch / base_batch_size
    # E * B / B0 rounds to 1 +- 1 ulp at B = B0; make the documented identity exact.
    gain = np.where(batch == base_batch_size, 1.0, gain)
    return _scalar_or_array(gain)


def goodput(
    batch_size: ArrayLike, step_time: ArrayLike, noise_scale: ArrayLike | None, base_batch_size: float
) -> float | np.ndarray:
    """Goodput ``B / step_time * E(B)``: B0-equivalent samples per second.

    Args:
        batch_size: total batch sizes B.
        step_time: seconds per optimizer step at each B (broadcasts with ``batch_size``). A step time that is not
            finite and positive (``inf`` for an infeasible batch, NaN, 0) yields goodput 0.
        noise_scale: ``phi`` in samples (broadcasts too), or None.
        base_batch_size: B0.

    Returns:
        A float for scalar inputs, otherwise an array.

    """
    batch = np.asarray(batch_size, dtype=np.float64)
    times = np.asarray(step_time, dtype=np.float64)
    batch, times = np.broadcast_arrays(batch, times)
    feasible = np.isfinite(times) & (times > 0)
    safe_times = np.where(feasible, times, 1.0)  # avoid division warnings; those entries are replaced by 0
    value = np.where(feasible, batch / safe_times * _efficiency(noise_scale, batch, base_batch_size), 0.0)
    return _scalar_or_array(value)


def candidate_batch_sizes(lower: int, upper: int, count: int = CANDIDATES) -> np.ndarray:
    """About ``count`` geometrically spaced integer batch sizes from ``lower`` to ``upper``, both included.

    Rounding merges neighbours at the small end, so fewer than ``count`` values may come back.

    Args:
        lower: smallest candidate, >= 1.
        upper: largest candidate, >= ``lower``.
        count: number of geometric points before rounding, >= 2.

    Returns:
        Sorted, unique ``int64`` array.

    """
    lower, upper = int(lower), int(upper)
    if lower < 1:
        raise ValueError(f"`lower` must be >= 1, got {lower}.")
    if lower > upper:
        raise ValueError(f"`lower` ({lower}) must not exceed `upper` ({upper}).")
    if count < 2:
        raise ValueError(f"`count` must be >= 2, got {count}.")
    values = np.rint(np.geomspace(lower, upper, int(count))).astype(np.int64)
    # geomspace pins its ends, but clip anyway so float rounding can never step outside [lower, upper].
    values = np.clip(values, lower, upper)
    return np.unique(np.concatenate(([lower], values, [upper])))
