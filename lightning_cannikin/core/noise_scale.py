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
from statistics import NormalDist

import numpy as np

from lightning_cannikin.core.noise_trend import Present, TrendFit

__all__ = ["NoiseScaleEstimator", "pooled_moments", "t_quantile"]

MIN_EFFECTIVE_STEPS = 10.0  # steps the moving average must span before its spread is estimated
# the share of runs whose bounds may exclude the truth at any point, however long the run and however often it looks
NOISE_BOUND_LEVEL = 0.05
# the nearly independent looks per window that run_bounds() splits each window's share of its level over, measured by
# benchmarks/noise_coverage.py: 16 just held 5% of runs at B0 every step (the first window, where the effective count
# grows from ten, is the hard part); 32 leaves room. Large totals measured rarely would need far fewer
LOOKS_PER_WINDOW = 32.0
# the recent window that tells a change of the statistics from noise spans this share of the run's window: 1/8 caught
# a 4x fall about 300 base batches after it (1/4: about 540; 1/16: about 210, but at 16x B0 a 1/16 window spans under
# ten updates and never has bounds); how often it fires without a change: benchmarks/noise_coverage.py
RECENT_SHARE = 1.0 / 8.0
# the share of NOISE_BOUND_LEVEL that run_bounds() spends on its bound of the *current* noise scale (the straight-line
# fit read now, lightning_cannikin/core/noise_trend.py), the rest going to the window's: the window's bound, at 3/4 of
# the level, is barely wider (the quantile of a tail moves slowly), and in 400 stationary runs a cell the two together
# crossed in 0-4.5% of runs, the window's alone at the full level in 0-3.75% (benchmarks/noise_coverage.py)
PRESENT_SHARE = 0.25
# the looks per window the fit's share is split over: its reading rests on the newest updates (it weighs old ones
# negatively), so it moves faster than the average: at half the level, 32 looks let 4.5-5% of 200 stationary runs
# cross at B0 measured every step where 2.5% was spent, 128 held 1.5-2.5%; at a quarter, 128 beside the window's
# 3/4 let 4.8% of 400 runs cross at B0 (the window alone: 3.5%), 256 4.25% (4.5% over 6,000 updates), at a cost in
# lag of about 1% of low (benchmarks/noise_coverage.py)
PRESENT_LOOKS_PER_WINDOW = 256.0
_NORMAL = NormalDist()


def _floats(values: Sequence[float] | np.ndarray) -> list[float]:
    """Plain floats, flattened: a step has a handful of groups, and numpy's per-call cost would dominate."""
    if isinstance(values, np.ndarray):
        return values.reshape(-1).astype(np.float64).tolist()
    return [float(v) for v in values]


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
    z, b, y = _floats(local_sqr_norms), _floats(group_sizes), float(global_sqr_norm)
    if len(z) != len(b):
        raise ValueError(f"Got {len(z)} local squared norms for {len(b)} group sizes; give one norm per group.")
    if len(z) < 2:
        raise ValueError(f"The noise scale needs at least 2 gradient groups per step, got {len(z)}.")
    if not all(math.isfinite(size) and size > 0 for size in b):
        raise ValueError(f"Group sizes must be positive and finite, got {b}.")
    m, total = len(z), sum(b)
    weighted = sum(size * norm for size, norm in zip(b, z, strict=True))  # sum_j b_j Z_j
    grad_sqr = (m * y - weighted / total) / (m - 1)
    grad_var = (weighted - total * y) / (m - 1)
    return grad_sqr, grad_var


def t_quantile(tail: float, dof: float) -> float:
    """Upper quantile of Student's t: the ``x`` with ``P(T > x) = tail`` for ``dof`` degrees of freedom.

    Hill's closed form (Communications of the ACM, algorithm 396, 1970), for any real ``dof >= 1``: within 1e-5
    relative of the exact quantile for tails from 0.3 down to 1e-10 (``tests/test_noise_scale.py`` checks table
    values), at the cost of a few dozen float operations, since the bounds ask for it after every update.

    Args:
        tail: the upper-tail probability, in (0, 0.5].
        dof: degrees of freedom, at least 1 (real-valued: an effective count need not be whole).

    Returns:
        The quantile, ``>= 0``.

    Raises:
        ValueError: ``tail`` outside (0, 0.5] or ``dof < 1``.

    """
    if not 0.0 < tail <= 0.5:
        raise ValueError(f"`tail` must lie in (0, 0.5], got {tail}.")
    if not dof >= 1.0:
        raise ValueError(f"`dof` must be at least 1, got {dof}.")
    two_sided = 2.0 * tail
    if dof == 1.0:
        return 1.0 / math.tan(two_sided * math.pi / 2.0)
    if dof == 2.0:
        return math.sqrt(2.0 / (two_sided * (2.0 - two_sided)) - 2.0)
    n = dof
    a = 1.0 / (n - 0.5)
    b = 48.0 / (a * a)
    c = ((20700.0 * a / b - 98.0) * a - 16.0) * a + 96.36
    d = ((94.5 / (b + c) - 3.0) / b + 1.0) * math.sqrt(a * math.pi / 2.0) * n
    y = (d * two_sided) ** (2.0 / n)
    if y > 0.05 + a:
        # moderate tails: a corrected expansion around the normal quantile
        x = _NORMAL.inv_cdf(tail)
        y = x * x
        if n < 5.0:
            c += 0.3 * (n - 4.5) * (x + 0.6)
        c = (((0.05 * d * x - 5.0) * x - 7.0) * x - 2.0) * x + b + c
        y = (((((0.4 * y + 6.3) * y + 36.0) * y + 94.5) / c - y - 3.0) / b + 1.0) * x
        y = math.expm1(a * y * y)
    else:
        # far tails with few degrees of freedom: an expansion of the tail itself
        y = ((1.0 / (((n + 6.0) / (n * y) - 0.089 * d - 0.822) * (n + 2.0) * 3.0) + 0.5 / (n + 4.0)) * y - 1.0) * (
            n + 1.0
        ) / (n + 2.0) + 1.0 / y
    return math.sqrt(n * y)


class NoiseScaleEstimator:
    """Exponential moving averages of ``|G|^2`` and ``tr(Sigma)``, and the noise scale they imply.

    The statistics of a run change (a new data mix, a learning-rate drop), and a moving average over about a thousand
    base batches holds the old ones long after: a noise scale that falls 4x kept ``low`` above the new truth for
    some 3,000 base batches. So a *recent* window, :data:`RECENT_SHARE` as long, runs beside the run's own, and when
    the two windows' run-level bounds no longer overlap (:meth:`run_bounds` at :data:`NOISE_BOUND_LEVEL`, each from
    its own spread), the statistics changed: the run's averages restart from the recent window's, weighted as the
    samples it spans weigh in the run's window (:attr:`restarts` counts these).

    A change that is a drift (the noise scale of a run rises as the loss falls, some 3x over a run) never makes the
    windows disjoint, and the run's average holds a past value all along. So a straight-line fit over the run's window
    (:class:`~lightning_cannikin.core.noise_trend.TrendFit`) reads the statistics *now*, and :meth:`run_bounds` holds
    what both its bounds and the window's allow (:data:`PRESENT_SHARE` of the level spent on the fit's).

    Args:
        base_batch_size: B0, the total batch whose update gets decay ``decay``; a B-sample update decays the
            averages by ``decay ** (B / B0)``.
        decay: per-B0-batch decay of the moving averages, in (0, 1).
        follow_changes: keep the recent window and restart on a change (the recent window itself does not).
        follow_trend: bound the current value too (:class:`~lightning_cannikin.core.noise_trend.TrendFit`), and let
            :meth:`run_bounds` hold what both bounds allow (the recent window's own bounds do not).

    """

    def __init__(
        self, base_batch_size: int, decay: float = 0.999, follow_changes: bool = True, follow_trend: bool = True
    ) -> None:
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
        self._cross_biased = 0.0  # the products of the two single-step estimates: their covariance, for Fieller's bound
        self.num_updates = 0
        self._samples = 0.0  # samples folded in (``steps * B`` per update): how many windows the run has seen
        self._spread_known = False
        # bounds() and run_bounds() answers by (method, argument): asked every step, kept until the next update
        self._answers: dict[tuple[str, float], tuple[float, float] | None] = {}
        self._recent = self._new_recent() if follow_changes else None
        self.follow_trend = follow_trend
        # the ages of what the averages hold, for the fit that reads them at the present (kept by the recent window
        # too: a restart takes them over); None after loading a state saved without them, whose ages are unknown
        self._trend: TrendFit | None = TrendFit(2)
        self.restarts = 0  # the changes of the statistics followed (:meth:`_follow_change`)

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
        grad_sqr, grad_var = pooled_moments(z, b, global_sqr_norm)
        factor = self.decay ** (steps * sum(b) / self.base_batch_size)
        if self._trend is not None:
            self._trend.update(factor, steps * sum(b) / self.base_batch_size, (self._sqr_biased, self._var_biased))
        self._sqr_biased = factor * self._sqr_biased + (1.0 - factor) * grad_sqr
        self._var_biased = factor * self._var_biased + (1.0 - factor) * grad_var
        self._weight = factor * self._weight + (1.0 - factor)
        self._sqr_sq_biased = factor * self._sqr_sq_biased + (1.0 - factor) * grad_sqr**2
        self._var_sq_biased = factor * self._var_sq_biased + (1.0 - factor) * grad_var**2
        self._weight_sq = factor**2 * self._weight_sq + (1.0 - factor) ** 2
        self._cross_biased = factor * self._cross_biased + (1.0 - factor) * grad_sqr * grad_var
        self.num_updates += 1
        self._samples += steps * sum(b)
        self._answers = {}
        if self._recent is not None:
            self._recent.update(z, b, global_sqr_norm, steps)
            self._follow_change()
        return True

    def _new_recent(self) -> NoiseScaleEstimator:
        """An empty recent window: the same base batch, :data:`RECENT_SHARE` of this window's samples."""
        return NoiseScaleEstimator(
            self.base_batch_size, self.decay ** (1.0 / RECENT_SHARE), follow_changes=False, follow_trend=False
        )

    def _follow_change(self) -> None:
        """Restart the averages from the recent window's where the two windows' run-level bounds are disjoint: the
        statistics changed. The recent sums are scaled so that they weigh what the samples they span weigh in this
        window (``1 - decay ** (its window / B0)``): new updates then dilute them as they would the newest part of an
        undisturbed average, and the spread, the effective count and the bounds carry over at once (no gap in
        which the total and the gain would wait)."""
        recent = self._recent
        ours = self.window_bounds(NOISE_BOUND_LEVEL)
        theirs = recent.window_bounds(NOISE_BOUND_LEVEL) if recent is not None else None
        if recent is None or ours is None or theirs is None or (theirs[1] >= ours[0] and theirs[0] <= ours[1]):
            return
        scale = (1.0 - self.decay ** (recent.window_samples / self.base_batch_size)) / recent._weight
        self._sqr_biased, self._var_biased = recent._sqr_biased * scale, recent._var_biased * scale
        self._sqr_sq_biased, self._var_sq_biased = recent._sqr_sq_biased * scale, recent._var_sq_biased * scale
        self._cross_biased = recent._cross_biased * scale
        self._weight, self._weight_sq = recent._weight * scale, recent._weight_sq * scale * scale
        self._spread_known = recent._spread_known
        if recent._trend is not None:
            self._trend = self._trend or TrendFit(2)
            self._trend.copy_from(recent._trend, scale)
        self._answers = {}
        self.restarts += 1

    @property
    def present_noise_scale(self) -> float | None:
        """The straight-line fit's reading of the noise scale now (:class:`~.noise_trend.TrendFit`), ``None`` until
        the ages tell a slope or where the ages are unknown; ``inf`` when its ``|G|^2`` is not
        positive but its variance is, 0.0 when the variance is not positive. The decisions read it only through
        :meth:`run_bounds`."""
        present = self._present()
        return None if present is None else _ratio(*present.values)

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
        return None if sqr is None or var is None else _ratio(sqr, var)

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

    @property
    def window_samples(self) -> float:
        """Samples the moving averages span, ``B0 / (1 - decay)``: two windows apart, the averages nearly share none."""
        return self.base_batch_size / (1.0 - self.decay)

    @property
    def windows_seen(self) -> float:
        """``1 + samples folded in / window_samples``: the nearly independent windows the run has looked through."""
        return 1.0 + self._samples / self.window_samples

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
        key = ("bounds", sigmas)
        if key not in self._answers:
            self._answers[key] = self._compute_bounds(sigmas)
        return self._answers[key]

    def run_bounds(self, level: float = NOISE_BOUND_LEVEL) -> tuple[float, float] | None:
        """``(low, high)`` wide enough that over a whole run, however long and however often it is asked, ``low`` ever
        exceeds the true noise scale in at most about ``level`` of runs, where :meth:`bounds` holds per look only.

        Three changes from :meth:`bounds`, each for a measured failure or cost:

        - the spread is itself estimated from the ``n_eff = 1 / share`` effective steps the average spans (ten to a few
          tens early in a run, or for large totals measured rarely), so the width is a Student-t quantile with
          ``n_eff - 1`` degrees of freedom, on the spread corrected for its ``1 - 1 / n_eff`` bias;
        - the engine looks after every update: ``level`` is spent over the run's windows (:attr:`windows_seen`,
          ``k``), ``level / k**2`` per window (``k`` grows continuously, and ``integral_1^inf dk / k**2 = 1``), split
          over ``LOOKS_PER_WINDOW`` looks in each, a count measured on the moving average's correlated looks
          (``benchmarks/noise_coverage.py``): each look asks the tail ``level / (LOOKS_PER_WINDOW * k**2)``;
        - the ratio is bounded by Fieller's method with the two averages' covariance (:meth:`_fieller`), narrower than
          adding the two errors, which assumes a correlation of -1.

        The width grows slowly with the run's length (the quantile of a tail shrinking as ``1 / k**2``): that is the
        price of a guarantee for runs of any length. ``high`` is the mirror image, not calibrated on its own.

        Both the window's average and the present (the straight-line fit's reading now, :class:`~.noise_trend.TrendFit`,
        once it spans ``MIN_EFFECTIVE_STEPS``, with :data:`PRESENT_SHARE` of the level over
        :data:`PRESENT_LOOKS_PER_WINDOW` looks) are bounded, and the bounds are what both allow: without a drift both
        hold the truth, so ``low`` is crossed in at most ``level`` of runs still; in a rise the present's ``low`` is
        the higher. Where the present's bounds leave out the average's point estimate (or the two are disjoint), the
        average is stale and the present's bounds are returned alone: in a fall, ``low`` then comes down with it.

        Args:
            level: the fraction of runs in which the bound may ever be crossed, in (0, 1).

        Returns:
            ``None`` whenever :meth:`bounds` is ``None`` (the spread is not yet known).

        Raises:
            ValueError: ``level`` outside (0, 1).

        """
        if not 0.0 < level < 1.0:
            raise ValueError(f"`level` must lie in (0, 1), got {level}.")
        key = ("run", level)
        if key in self._answers:
            return self._answers[key]
        present = self._present_bounds(level * PRESENT_SHARE) if self.follow_trend else None
        window = self.window_bounds(level if present is None else level * (1.0 - PRESENT_SHARE))
        if present is None or window is None:
            result = window
        else:
            low, high = max(window[0], present[0]), min(window[1], present[1])
            average = self.noise_scale
            # where the present's bounds leave out the average, the average is stale (a drift, or a change the recent
            # window has not yet proven): the window's bounds then hold a past value, and the present is what the
            # decisions are for; else both hold the present, and so does what they share
            stale = average is not None and not present[0] <= average <= present[1]
            result = present if stale or low > high else (low, high)
        self._answers[key] = result
        return result

    def _width(self, level: float, looks: float = LOOKS_PER_WINDOW, fitted: int = 1) -> float:
        """The Student-t width of one look at ``level`` over the run (:meth:`run_bounds`), ``looks`` per window, on a
        spread around ``fitted`` fitted parameters."""
        share = self._weight_sq / self._weight**2
        k = self.windows_seen
        # one update at a large total measured one step in several can weigh more than the rest of the average:
        # below two effective steps the spread holds less than one degree of freedom, and one (the widest
        # quantile, continuous with the count) is all it may claim
        return t_quantile(level / (looks * k * k), max(1.0 / share - fitted, 1.0))

    def _moments(self) -> tuple[float, float, float, float, float]:
        """The averages of the single-step estimates of ``|G|^2`` and ``tr(Sigma)``, and the estimates' weighted
        variances and covariance around them: the window's (the fit that reads the present takes its own around the
        fitted line; around a drift, these hold the drift too)."""
        weight = self._weight
        sqr, var = self._sqr_biased / weight, self._var_biased / weight
        sqr_var = max(self._sqr_sq_biased / weight - sqr * sqr, 0.0)
        var_var = max(self._var_sq_biased / weight - var * var, 0.0)
        return sqr, var, sqr_var, var_var, self._cross_biased / weight - sqr * var

    def window_bounds(self, level: float = NOISE_BOUND_LEVEL) -> tuple[float, float] | None:
        """Run-level bounds on the moving average's noise scale at ``level``, as :meth:`run_bounds` computes them but
        for the window alone: the run's average, not its present (what :meth:`run_bounds` returned before the fit;
        ``benchmarks/noise_coverage.py`` compares the two)."""
        if self.standard_errors() is None:
            return None
        share = self._weight_sq / self._weight**2
        sqr, var, sqr_var, var_var, cov = self._moments()
        scale = 1.0 / (1.0 - share)  # the weighted spreads are low by 1 - share: over the weights' n_eff - 1
        return _fieller(
            self._width(level), sqr, var, sqr_var * scale * share, var_var * scale * share, cov * scale * share
        )

    def _present_bounds(self, level: float) -> tuple[float, float] | None:
        """Run-level bounds on the *current* noise scale at ``level``: Fieller's bounds on the straight-line fit's
        readings at age 0 (:class:`~lightning_cannikin.core.noise_trend.TrendFit`), with the spread around the fitted
        line, once the fit spans ``MIN_EFFECTIVE_STEPS`` (``1 / C``); the tail split over
        :data:`PRESENT_LOOKS_PER_WINDOW` looks a window, on two fitted parameters."""
        present = self._present()
        if present is None or self.standard_errors() is None or present.squares * MIN_EFFECTIVE_STEPS > 1.0:
            return None
        (sqr, var), squares, cov = present.values, present.squares, present.covariance
        return _fieller(
            self._width(level, PRESENT_LOOKS_PER_WINDOW, 2),
            sqr,
            var,
            cov[0][0] * squares,
            cov[1][1] * squares,
            cov[0][1] * squares,
        )

    def _present(self) -> Present | None:
        """The fit read now from the window's sums; ``None`` where the ages are unknown or tell no slope yet."""
        if self._trend is None:
            return None
        sqr_sq, var_sq, cross = self._sqr_sq_biased, self._var_sq_biased, self._cross_biased
        return self._trend.present((self._sqr_biased, self._var_biased), ((sqr_sq, cross), (cross, var_sq)))

    def _compute_bounds(self, sigmas: float) -> tuple[float, float] | None:
        if sigmas == 0:
            phi = self.noise_scale
            return None if phi is None else (phi, phi)
        errors = self.standard_errors()
        if errors is None:
            return None
        sqr_error, var_error = sigmas * errors[0], sigmas * errors[1]
        sqr, var = self._sqr_biased / self._weight, self._var_biased / self._weight
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
            "samples": self._samples,
            "cross_biased": self._cross_biased,
            "recent": None if self._recent is None else self._recent.state_dict(),
            "restarts": self.restarts,
            "trend": None if self._trend is None else self._trend.state_dict(),
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
        # states saved before run_bounds() lack these two
        if "cross_biased" in state_dict:
            self._cross_biased = float(state_dict["cross_biased"])
        else:
            self._cross_biased = self._widest_cross()
        if "samples" in state_dict:
            self._samples = float(state_dict["samples"])
        else:
            self._samples = self._samples_from_weight()
        self.restarts = int(state_dict.get("restarts", 0))
        # a state saved before the fit holds averages of unknown ages: only the window bounds them, until a restart
        trend = state_dict.get("trend")
        self._trend = None if trend is None else TrendFit(2)
        if self._trend is not None:
            self._trend.load_state_dict(trend)
        if self._recent is not None:  # a state saved before the recent window starts one afresh
            recent, self._recent = state_dict.get("recent"), self._new_recent()
            if recent is not None:
                self._recent.load_state_dict(recent)
        self._answers = {}

    def _widest_cross(self) -> float:
        """The products' average for a correlation of -1, where Fieller's bounds are widest (those of :meth:`bounds`).

        The single-step estimates are anti-correlated (-0.3 to -0.7 measured on the synthetic problem); an unknown
        covariance must not be guessed narrower than it can be."""
        if self._weight <= 0:
            return 0.0
        sqr, var, sqr_spread, var_spread, _ = self._moments()
        return self._weight * (sqr * var - math.sqrt(sqr_spread * var_spread))

    def _samples_from_weight(self) -> float:
        """The samples a state saved without them had seen: every update multiplies ``1 - weight`` by its decay, so
        ``1 - weight = decay ** (samples / B0)`` exactly. Once ``weight`` rounds to 1 (after about 37 windows at the
        default decay) only that many are known: a lower bound, so the spending resumes a little early."""
        remaining = max(1.0 - self._weight, 2.0**-53)
        return self.base_batch_size * math.log(remaining) / math.log(self.decay)


def _ratio(sqr: float, var: float) -> float:
    """The noise scale ``var / sqr`` of two averages: 0.0 where the variance is not positive, ``inf`` where only
    ``|G|^2`` is not."""
    if var <= 0.0:
        return 0.0
    return math.inf if sqr <= 0.0 else var / sqr


def _fieller(width: float, sqr: float, var: float, sqr_var: float, var_var: float, cov: float) -> tuple[float, float]:
    """Fieller's bounds on ``phi = tr / |G|^2`` from estimates ``sqr`` of ``|G|^2`` and ``var`` of ``tr`` with
    variances ``sqr_var``, ``var_var`` and covariance ``cov``: ``low`` is the least ``phi >= 0`` at which
    ``D = tr - phi |G|^2`` is no longer ``width`` standard errors above 0, with
    ``se(D)^2 = var_var - 2 phi cov + phi^2 sqr_var``; ``high`` the largest at which it is not ``width`` below 0.
    Adding the two errors, as :meth:`NoiseScaleEstimator.bounds` does, is wider than the ratio needs wherever both
    count."""
    w2 = width * width
    # D(phi) = w se(phi), squared: a phi^2 - 2 b phi + c0 = 0, solved in the form that stays exact when a ~ 0
    c0 = var * var - w2 * var_var
    top = max(sqr, 0.0)  # a negative average is noise: it must not tighten the lower bound
    low = 0.0
    if var > 0.0 and c0 > 0.0:  # else D(0) is within the noise: no phi > 0 is proven
        a, b = top * top - w2 * sqr_var, var * top - w2 * cov
        root = b + math.sqrt(max(b * b - a * c0, 0.0))
        low = c0 / root if root > 0.0 else 0.0
    high = math.inf
    a, b = sqr * sqr - w2 * sqr_var, var * sqr - w2 * cov
    if sqr > 0.0 and a > 0.0:  # |G|^2 is clearly above 0: D turns clearly negative at a finite phi
        high = (b + math.sqrt(max(b * b - a * c0, 0.0))) / a
    return low, max(high, low)
