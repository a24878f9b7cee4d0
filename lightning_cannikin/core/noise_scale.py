"""Gradient noise scale from groups of uneven size (the Cannikin paper's setting).

One optimizer step averages the gradients of several *groups*: with n ranks and K accumulation micro-batches,
every (rank, micro-batch) pair is one group j with b_j samples, and B = sum_j b_j. The caller measures

- ``Z_j = |g_j|^2``, the squared norm of group j's *mean* gradient, taken before the weighted reduction, and
- ``Y = |g|^2``, the squared norm of the exact mean gradient over all B samples, ``g = sum_j (b_j / B) g_j``.

With per-sample gradients of mean G and covariance Sigma, ``E[Z_j] = |G|^2 + tr(Sigma) / b_j`` and
``E[Y] = |G|^2 + tr(Sigma) / B``, so, with m groups,

    |G|^2     ~ (m * Y - sum_j (b_j / B) Z_j) / (m - 1)
    tr(Sigma) ~ (sum_j b_j Z_j - B * Y) / (m - 1)

are unbiased for any split, and reduce to AdaptDL's estimator when every b_j is equal (``tests/test_noise_scale.py``
checks both against AdaptDL's own formula). AdaptDL's formula applied to an uneven split is biased: it weights the
noisy small groups as much as the large ones.

:class:`NoiseScaleEstimator` smooths both single-step estimates with a bias-corrected exponential moving average
whose decay per update is ``decay ** (B / B0)``, so the averaging window is a fixed number of *samples* whatever the
total batch size. The noise scale ``B_noise = tr(Sigma) / |G|^2`` is in samples (per-sample covariance).

For Adam-family optimizers the caller passes the norms of *preconditioned* gradients, ``g / (sqrt(v_hat) + eps)``
with Adam's bias-corrected second-moment estimate, as AdaptDL does: the noise that matters is the noise of the
update direction the optimizer actually takes.

Pure numpy: imports neither torch nor Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["NoiseScaleEstimator", "pooled_moments"]

MIN_EFFECTIVE_STEPS = 10.0  # steps the moving average must span before its spread is estimated


def _floats(values: Sequence[float] | np.ndarray) -> list[float]:
    """Plain floats, flattened: a step has a handful of groups, and numpy's per-call cost would dominate."""
    if isinstance(values, np.ndarray):
        return values.reshape(-1).astype(np.float64).tolist()
    return [float(v) for v in values]


def _as_inputs(local_sqr_norms: Sequence[float], group_sizes: Sequence[float]) -> tuple[list[float], list[float]]:
    z, b = _floats(local_sqr_norms), _floats(group_sizes)
    _check(z, b)
    return z, b


def _check(z: list[float], b: list[float]) -> None:
    if len(z) != len(b):
        raise ValueError(f"Got {len(z)} local squared norms for {len(b)} group sizes; give one norm per group.")
    if len(z) < 2:
        raise ValueError(f"The noise scale needs at least 2 gradient groups per step, got {len(z)}.")
    if not all(math.isfinite(size) and size > 0 for size in b):
        raise ValueError(f"Group sizes must be positive and finite, got {b}.")


def pooled_moments(
    local_sqr_norms: Sequence[float], group_sizes: Sequence[float], global_sqr_norm: float
) -> tuple[float, float]:
    """Single-step unbiased estimates of ``|G|^2`` and the per-sample ``tr(Sigma)`` from uneven groups.

    Args:
        local_sqr_norms: ``Z_j``, squared norm of each group's mean gradient (before the reduction).
        group_sizes: ``b_j``, samples in each group.
        global_sqr_norm: ``Y``, squared norm of the sample-weighted mean gradient over all groups.

    Returns:
        ``(grad_sqr, grad_var_trace)``. Either may be negative on a single step; only their averages are meaningful.

    Raises:
        ValueError: fewer than 2 groups, mismatched lengths or a non-positive group size.

    """
    z, b = _as_inputs(local_sqr_norms, group_sizes)
    return _moments(z, b, float(global_sqr_norm))


def _moments(z: list[float], b: list[float], y: float) -> tuple[float, float]:
    m, total = len(z), sum(b)
    weighted = sum(size * norm for size, norm in zip(b, z, strict=True))  # sum_j b_j Z_j
    grad_sqr = (m * y - weighted / total) / (m - 1)
    grad_var = (weighted - total * y) / (m - 1)
    return grad_sqr, grad_var


class NoiseScaleEstimator:
    """Exponential moving averages of ``|G|^2`` and ``tr(Sigma)``, and the noise scale they imply.

    Args:
        base_batch_size: B0, the total batch whose update gets decay ``decay``; a B-sample update decays the
            averages by ``decay ** (B / B0)``.
        decay: per-B0-batch decay of the moving averages, in (0, 1).

    """

    def __init__(self, base_batch_size: int, decay: float = 0.999) -> None:
        if base_batch_size <= 0:
            raise ValueError(f"`base_batch_size` must be positive, got {base_batch_size}.")
        if not 0.0 < decay < 1.0:
            raise ValueError(f"`decay` must lie in (0, 1), got {decay}.")
        self.base_batch_size = int(base_batch_size)
        self.decay = float(decay)
        # Raw (biased towards 0) EMAs and the total weight they carry; the estimate is their ratio. They stay
        # unclipped so negative single-step estimates still pull the mean down: clipping each step would bias it up.
        self._sqr_biased = 0.0
        self._var_biased = 0.0
        self._weight = 0.0
        # what the confidence needs: averages of the single-step estimates' squares and of the squared weights
        self._sqr_sq_biased = 0.0
        self._var_sq_biased = 0.0
        self._weight_sq = 0.0
        self.num_updates = 0
        self._spread_known = False
        self._bounds: tuple[tuple[int, float], tuple[float, float] | None] | None = None  # kept until the next update

    def update(
        self,
        local_sqr_norms: Sequence[float],
        group_sizes: Sequence[float],
        global_sqr_norm: float,
        steps: int = 1,
    ) -> bool:
        """Fold one optimizer step's norms into the averages.

        Args:
            local_sqr_norms: ``Z_j`` per group (rank x micro-batch).
            group_sizes: ``b_j`` per group.
            global_sqr_norm: ``Y`` of the reduced gradient.
            steps: the optimizer steps this measurement stands for (one step measured in ``steps``): the averages
                decay as over all of their samples, so the window spans as many samples however often it is fed.

        Returns:
            True if the averages changed; False (and nothing changes) when an input is not finite, as after an
            overflowing mixed-precision step, or when there are fewer than 2 groups.

        Raises:
            ValueError: mismatched lengths or a non-positive group size.

        """
        z = _floats(local_sqr_norms)
        if len(z) < 2 or not (all(math.isfinite(v) for v in z) and math.isfinite(float(global_sqr_norm))):
            return False
        b = _floats(group_sizes)
        _check(z, b)
        grad_sqr, grad_var = _moments(z, b, float(global_sqr_norm))
        factor = self.decay ** (steps * sum(b) / self.base_batch_size)
        self._sqr_biased = factor * self._sqr_biased + (1.0 - factor) * grad_sqr
        self._var_biased = factor * self._var_biased + (1.0 - factor) * grad_var
        self._weight = factor * self._weight + (1.0 - factor)
        self._sqr_sq_biased = factor * self._sqr_sq_biased + (1.0 - factor) * grad_sqr**2
        self._var_sq_biased = factor * self._var_sq_biased + (1.0 - factor) * grad_var**2
        self._weight_sq = factor**2 * self._weight_sq + (1.0 - factor) ** 2
        self.num_updates += 1
        self._bounds = None
        return True

    @property
    def grad_sqr(self) -> float | None:
        """Bias-corrected average of ``|G|^2``, clipped at 0; None before the first update."""
        if self.num_updates == 0:
            return None
        return max(self._sqr_biased / self._weight, 0.0)

    @property
    def grad_var(self) -> float | None:
        """Bias-corrected average of the per-sample ``tr(Sigma)``, clipped at 0; None before the first update."""
        if self.num_updates == 0:
            return None
        return max(self._var_biased / self._weight, 0.0)

    @property
    def noise_scale(self) -> float | None:
        """``B_noise = tr(Sigma) / |G|^2`` in samples; None before the first update.

        ``math.inf`` when the averaged ``|G|^2`` is not positive but the variance is (no detectable signal: every
        sample is noise), and 0.0 when the variance is 0. :func:`lightning_cannikin.goodput.efficiency` accepts both.
        """
        sqr, var = self.grad_sqr, self.grad_var
        if sqr is None or var is None:
            return None
        if var <= 0.0:
            return 0.0
        if sqr <= 0.0:
            return math.inf
        return var / sqr

    def steps_spanned(self, total_batch_size: int) -> float:
        """The effective number of updates the moving averages span once settled, each update holding
        ``total_batch_size`` samples: ``(1 + f) / (1 - f)`` with ``f`` the per-update decay. Below
        ``MIN_EFFECTIVE_STEPS`` the spread, and so every bound, is never estimated."""
        factor = self.decay ** (float(total_batch_size) / self.base_batch_size)
        return (1.0 + factor) / (1.0 - factor)

    def largest_bounded_total(self) -> int:
        """The largest total batch at which the averages still span ``MIN_EFFECTIVE_STEPS`` updates (about 200 base
        batches at the default decay)."""
        # the per-update decay f at which (1 + f) / (1 - f) is the minimum count
        settled = (MIN_EFFECTIVE_STEPS - 1.0) / (MIN_EFFECTIVE_STEPS + 1.0)
        return int(math.log(settled) / math.log(self.decay) * self.base_batch_size)

    def never_bounded_at(self, total_batch_size: int) -> str | None:
        """What to tell the user, with the fix, when updates of ``total_batch_size`` samples can never bound the noise
        scale (the averages span too few of them), else ``None``: the total batch and the AdaScale gain would never
        move, in silence."""
        spanned = self.steps_spanned(total_batch_size)
        if spanned >= MIN_EFFECTIVE_STEPS:
            return None
        base = self.base_batch_size
        least = -(-total_batch_size * base // self.largest_bounded_total())
        return (
            f"Cannikin: the noise-scale statistics average over about {round(base / (1 - self.decay)):,} samples"
            f" (`base_batch_size`={base}), only {spanned:.1f} steps of the initial total batch {total_batch_size};"
            f" their spread needs {MIN_EFFECTIVE_STEPS:.0f}, so the noise scale is never bounded and the total batch"
            " and the AdaScale gain never move. Set `base_batch_size` to the total the learning rate was tuned for,"
            f" at least {least} here (the default is the initial total)."
        )

    def standard_errors(self) -> tuple[float, float] | None:
        """Standard errors of the averaged ``|G|^2`` and ``tr(Sigma)`` (None until the average first spans ten
        effective steps, below which the spread itself is unknown).

        From the statistics' own spread: the single-step estimates' variance around their average, times the sum of
        the squared normalised weights of the moving average (one over its effective number of steps).
        """
        if self.num_updates < 2 or self._weight <= 0:
            return None
        share = self._weight_sq / self._weight**2
        if share > 1.0 / MIN_EFFECTIVE_STEPS and not self._spread_known:
            return None  # a spread taken from a handful of steps is itself too uncertain to vouch for anything
        # once known it stays: a larger total weighs each new step more (the window spans samples), which lowers the
        # effective count below ten again for a while; the share widens the errors for it, as it should
        self._spread_known = True
        errors = []
        for first, second in ((self._sqr_biased, self._sqr_sq_biased), (self._var_biased, self._var_sq_biased)):
            mean = first / self._weight
            spread = max(second / self._weight - mean**2, 0.0)
            errors.append(math.sqrt(spread * share))
        return errors[0], errors[1]

    def bounds(self, sigmas: float = 2.0) -> tuple[float, float] | None:
        """``(low, high)``: the noise scales the statistics cannot yet tell apart, ``sigmas`` standard errors wide.

        ``low = max(tr - s * e_tr, 0) / (max(|G|^2, 0) + s * e_G)`` and ``high = (tr + s * e_tr) / (|G|^2 - s * e_G)``,
        with ``e_G``, ``e_tr`` the standard errors of the two averages (:meth:`standard_errors`). ``low`` is finite even
        while the ``|G|^2`` average is zero or negative (far below the noise scale, where ``|G|^2`` is the small
        difference of two large numbers for thousands of steps), and a negative average counts as zero there, so noise
        cannot tighten it: a move that pays under ``low`` pays under the truth with high probability, and the estimate
        proves a direction long before it is precise. ``high`` is ``inf`` until ``|G|^2`` is clearly above zero.

        Args:
            sigmas: the width in standard errors (2: each side holds about 97.5% of the time); 0 gives the point
                estimate on both sides (``noise_scale``, infinite when ``|G|^2`` is not positive) from the first update.

        Returns:
            ``None`` before the averages span ten effective steps (their spread is unknown), or before the first update
            with ``sigmas=0``.

        """
        key = (self.num_updates, sigmas)
        if self._bounds is not None and self._bounds[0] == key:
            return self._bounds[1]  # asked every step, changed only by updates
        self._bounds = key, self._compute_bounds(sigmas)
        return self._bounds[1]

    def _compute_bounds(self, sigmas: float) -> tuple[float, float] | None:
        if sigmas == 0:
            phi = self.noise_scale
            return None if phi is None else (phi, phi)
        errors = self.standard_errors()
        if errors is None:
            return None
        sqr, var = self._sqr_biased / self._weight, self._var_biased / self._weight
        sqr_error, var_error = sigmas * errors[0], sigmas * errors[1]
        top = max(sqr, 0.0) + sqr_error  # a negative average is noise: it must not tighten the bound on |G|^2
        low = max(var - var_error, 0.0) / top if top > 0 else 0.0  # no spread to bound |G|^2 with: proves nothing
        bottom = sqr - sqr_error
        high = (var + var_error) / bottom if bottom > 0 else math.inf
        return low, max(high, low)

    def state_dict(self) -> dict:
        """Everything needed to resume, as plain Python numbers (JSON-friendly)."""
        return {
            "base_batch_size": self.base_batch_size,
            "decay": self.decay,
            "sqr_biased": self._sqr_biased,
            "var_biased": self._var_biased,
            "weight": self._weight,
            "num_updates": self.num_updates,
            "sqr_sq_biased": self._sqr_sq_biased,
            "var_sq_biased": self._var_sq_biased,
            "weight_sq": self._weight_sq,
            "spread_known": self._spread_known,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.base_batch_size = int(state_dict["base_batch_size"])
        self.decay = float(state_dict["decay"])
        self._sqr_biased = float(state_dict["sqr_biased"])
        self._var_biased = float(state_dict["var_biased"])
        self._weight = float(state_dict["weight"])
        self.num_updates = int(state_dict["num_updates"])
        self._sqr_sq_biased = float(state_dict["sqr_sq_biased"])
        self._var_sq_biased = float(state_dict["var_sq_biased"])
        self._weight_sq = float(state_dict["weight_sq"])
        self._spread_known = bool(state_dict["spread_known"])
        self._bounds = None
