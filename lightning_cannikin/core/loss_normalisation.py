"""The exact per-rank loss weights for each way a loss can be normalised, and the noise statistics that go with them.

One optimizer step sees groups ``j`` = (rank ``i``, accumulation micro-batch ``k``), each holding ``b_j`` samples and
``c_j`` units of a per-sample count the user names (tokens, frames, boxes). The user's loss on a group is one of

- ``"sample_mean"``: the mean over the group's samples (today's default). The step's target is the mean over all
  ``B = sum_j b_j`` samples; the group's weight is ``n * b_j / B``.
- ``"sample_sum"``: the sum over the group's samples. The target is the sum over all samples, the one-process
  gradient; the weight is ``n`` on every group, which undoes DDP's ``1 / n`` (a weight of 1 keeps plain DDP's
  ``sum / n``, the same for any split).
- ``"count_mean"``: the mean over the group's units (every language model's token mean). The target is the mean over
  all ``C = sum_j c_j`` units; the weight is ``n * c_j / C``. The ranks learn ``C`` from one small all-reduce of their
  counts per step, or from the sampler when it knows every sample's count.

The weights multiply the loss before backward; DDP averages the ranks' gradients (``/ n``) and accumulation sums the
micro-batches' gradients. Lightning's automatic optimization divides each micro-batch loss by
``accumulate_grad_batches``: multiply the weights by it there. Through a summing all-reduce (the comm hook) use the
weights divided by ``n``.

Noise statistics (:func:`noise_groups`): the pooled estimator needs every group's *mean* gradient over the same unit
and the group's size in that unit: samples for the sample normalisations, units for ``"count_mean"`` (the noise scale
then comes out in units; ``samples_per_unit`` converts it). A sum's gradient is its mean's times the group's size.

Pure numpy: imports neither torch nor Lightning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "NORMALISATIONS",
    "NoiseGroups",
    "loss_scale_exponent",
    "loss_weights",
    "noise_groups",
    "normalisation_mismatch",
]

NORMALISATIONS = ("sample_mean", "sample_sum", "count_mean")
_ALLREDUCES = ("mean", "sum")


def _check_normalisation(normalisation: str) -> None:
    if normalisation not in NORMALISATIONS:
        raise ValueError(f"`normalisation` must be one of {NORMALISATIONS}, got {normalisation!r}.")


def _counts(value: ArrayLike, name: str) -> np.ndarray:
    """A ``(n, K)`` array of non-negative counts: ``(n,)`` is one micro-batch per rank."""
    array = np.asarray(value, dtype=np.float64)
    if array.ndim == 1:
        array = array[:, None]
    if array.ndim != 2 or array.size == 0:
        raise ValueError(f"`{name}` must have shape (ranks,) or (ranks, micro_batches), got {np.shape(value)}.")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError(f"`{name}` must be finite and non-negative, got {array.tolist()}.")
    return array


def _group_counts(normalisation: str, sample_counts: ArrayLike, unit_counts: ArrayLike | None) -> np.ndarray:
    """The counts a group's loss is normalised by: samples, or the user's units for ``"count_mean"``."""
    _check_normalisation(normalisation)
    samples = _counts(sample_counts, "sample_counts")
    if normalisation != "count_mean":
        return samples
    if unit_counts is None:
        raise ValueError("`normalisation='count_mean'` needs `unit_counts` (e.g. each group's token count).")
    units = _counts(unit_counts, "unit_counts")
    if units.shape != samples.shape:
        raise ValueError(f"`unit_counts` has shape {units.shape} but `sample_counts` has {samples.shape}.")
    return units


def loss_weights(
    normalisation: str,
    sample_counts: ArrayLike,
    unit_counts: ArrayLike | None = None,
    allreduce: str = "mean",
) -> np.ndarray:
    """The factor on each group's loss that makes the reduced gradient exactly the global loss's gradient.

    Args:
        normalisation: ``"sample_mean"``, ``"sample_sum"`` or ``"count_mean"`` (see the module's docstring).
        sample_counts: samples of each rank, ``(n,)``, or of each rank's micro-batches over the step's accumulation
            window, ``(n, K)``.
        unit_counts: the units (tokens) of each group, same shape; needed for ``"count_mean"`` only.
        allreduce: ``"mean"`` where the ranks' gradients are averaged (DDP, FSDP), ``"sum"`` where they are summed.

    Returns:
        Weights shaped ``(n, K)``.

    Raises:
        ValueError: unknown names, malformed counts, or a step without samples (or units).

    """
    if allreduce not in _ALLREDUCES:
        raise ValueError(f"`allreduce` must be one of {_ALLREDUCES}, got {allreduce!r}.")
    counts = _group_counts(normalisation, sample_counts, unit_counts)
    n = counts.shape[0]
    total = counts.sum()
    if total <= 0:
        raise ValueError(
            f"The step has no {'units' if normalisation == 'count_mean' else 'samples'}: {counts.tolist()}."
        )
    weights = np.full(counts.shape, float(n)) if normalisation == "sample_sum" else n * counts / total
    return weights / n if allreduce == "sum" else weights


@dataclass(frozen=True)
class NoiseGroups:
    """What the pooled noise estimator needs from one step, for a normalisation.

    Attributes:
        sizes: ``(n * K,)`` group sizes, rank-major (rank 0's micro-batches first), in samples or units.
        local_factors: multiply each group's raw gradient (of its own, unweighted loss) by this to get its mean
            gradient; the squared norm by its square.
        global_factor: multiply the reduced gradient (of the global target) by this to get the global mean gradient.
        samples_per_unit: ``B / C``: multiply a noise scale in units by it for one in samples (1 for samples).

    """

    sizes: np.ndarray
    local_factors: np.ndarray
    global_factor: float
    samples_per_unit: float


def noise_groups(normalisation: str, sample_counts: ArrayLike, unit_counts: ArrayLike | None = None) -> NoiseGroups:
    """The group sizes and gradient factors that make the pooled noise statistics exact for ``normalisation``.

    Args and shapes as in :func:`loss_weights`. Groups with no samples (or units) carry no gradient: the caller drops
    the groups whose size is 0.
    """
    counts = _group_counts(normalisation, sample_counts, unit_counts).reshape(-1)
    total = float(counts.sum())
    if total <= 0:
        raise ValueError("The step has no samples (or units) to estimate the noise from.")
    if normalisation == "sample_sum":
        local = np.divide(1.0, counts, out=np.zeros_like(counts), where=counts > 0)
        return NoiseGroups(counts, local, 1.0 / total, 1.0)
    samples = float(_counts(sample_counts, "sample_counts").sum())
    return NoiseGroups(counts, np.ones_like(counts), 1.0, samples / total)


def loss_scale_exponent(local_batch_sizes: ArrayLike, losses: ArrayLike) -> float | None:
    """How a rank's loss grows with its local batch, compared within each step: ``loss ~ b ** exponent``.

    A mean over samples gives about 0, a sum about 1. Comparing ranks within the same step cancels the loss's decline
    over training; the exponent is the least-squares slope of ``log loss`` on ``log b`` after removing each step's mean.

    Args:
        local_batch_sizes: ``(steps, n)`` every rank's samples at each observed step.
        losses: ``(steps, n)`` every rank's loss value (as its ``training_step`` returned it) at those steps.

    Returns:
        The exponent, or None when it cannot be told: a non-positive or non-finite loss, or no step whose ranks held
        different batch sizes.

    """
    sizes = np.asarray(local_batch_sizes, dtype=np.float64)
    values = np.asarray(losses, dtype=np.float64)
    if sizes.ndim != 2 or sizes.shape != values.shape:
        raise ValueError(
            f"`local_batch_sizes` and `losses` must both be (steps, ranks), got {sizes.shape}, {values.shape}."
        )
    if not np.all(sizes > 0) or not np.all(np.isfinite(values)) or not np.all(values > 0):
        return None
    x = np.log(sizes) - np.log(sizes).mean(axis=1, keepdims=True)
    y = np.log(values) - np.log(values).mean(axis=1, keepdims=True)
    spread = float((x * x).sum())
    if spread < 1e-12:
        return None
    return float((x * y).sum() / spread)


def normalisation_mismatch(
    normalisation: str, local_batch_sizes: ArrayLike, losses: ArrayLike, min_steps: int = 8
) -> str | None:
    """A warning when the losses observed do not behave like the declared ``normalisation``, else None.

    A mean's scale does not depend on the local batch; a sum's grows in proportion to it. The verdict splits the
    difference (exponent 0.5) and needs ``min_steps`` steps with uneven local batches, so noise alone rarely trips it.
    """
    _check_normalisation(normalisation)
    sizes = np.asarray(local_batch_sizes, dtype=np.float64)
    uneven = int(np.sum(np.ptp(sizes, axis=1) > 0)) if sizes.ndim == 2 else 0
    exponent = loss_scale_exponent(local_batch_sizes, losses) if uneven >= min_steps else None
    if exponent is None or not math.isfinite(exponent):
        return None
    if normalisation in ("sample_mean", "count_mean") and exponent > 0.5:
        return (
            f"The loss grows with the local batch (loss ~ b^{exponent:.2f}), like a sum over samples, but"
            f" `loss_normalisation={normalisation!r}` weights it as a mean: the gradient is weighted wrong. Declare"
            " `loss_normalisation='sample_sum'` or return a mean over the batch."
        )
    if normalisation == "sample_sum" and exponent < 0.5:
        return (
            f"The loss does not grow with the local batch (loss ~ b^{exponent:.2f}), like a mean, but"
            " `loss_normalisation='sample_sum'` weights it as a sum. Declare `loss_normalisation='sample_mean'`"
            " (or 'count_mean') or return a sum over the batch."
        )
    return None
