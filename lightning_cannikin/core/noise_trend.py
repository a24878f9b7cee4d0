"""The current value of a drifting average: a weighted straight-line fit over the moving average's own window.

A moving average over a window of ``tau`` base batches holds the value of about ``tau`` base batches ago: while the
noise scale rises 3x over a run, the run's average holds about two thirds of the current value, and its bounds less.
:class:`TrendFit` fits ``x = level + slope * age`` by least squares with the moving average's weights (``w`` of an
update that is ``s`` base batches old) and reads the fit at age 0, the present: exact for a straight-line drift from
the first updates on, and for a constant one an unbiased estimate whose variance, once settled, is 2.5 times the moving
average's (``integral (2 - u)^2 e^(-2u) du = 5/4`` against ``1/2``): what the bound on the current value pays.

The caller keeps the weighted sums of the values themselves (the moving average's numerators); this keeps the sums
of the ages: ``M_k = sum w s^k``, ``Q_k = sum w^2 s^k`` (k = 0, 1, 2) and ``sum w s x`` per value. When every age
grows by ``d``, ``sum w (s + d)^k`` expands in the old sums, so nothing per update is stored.

Pure Python: imports neither torch nor Lightning.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["Present", "TrendFit"]


class Present(NamedTuple):
    """A :class:`TrendFit` read at age 0."""

    values: list[float]  # each value's fit now (its level at age 0)
    squares: float  # C = sum c^2 of the coefficients the levels put on the updates: each has variance v * C
    covariance: list[list[float]]  # the per-update residual (co)variances v around the fit, unbiased
    count: float  # the effective updates the weights span, (sum w)^2 / sum w^2, for the spread's degrees of freedom


class TrendFit:
    """The age sums of a weighted straight-line fit whose weights decay as a moving average's.

    Args:
        values: how many values the caller averages (their weighted sums stay the caller's).

    """

    def __init__(self, values: int) -> None:
        self._m = [0.0, 0.0, 0.0]  # sum w, sum w s, sum w s^2
        self._q = [0.0, 0.0, 0.0]  # sum w^2, sum w^2 s, sum w^2 s^2
        self._aged = [0.0] * values  # sum w s x, per value

    def update(self, factor: float, age_step: float, old_sums: Sequence[float]) -> None:
        """Age every past update by ``age_step`` base batches and decay its weight by ``factor``, then add an update at
        age 0 with weight ``1 - factor``, as the moving average does; ``old_sums`` are the caller's ``sum w x`` before
        this update (``sum w (s + d) x = sum w s x + d sum w x``; the new update, at age 0, adds nothing to it)."""
        if len(old_sums) != len(self._aged):
            raise ValueError(f"`old_sums` must hold {len(self._aged)} sums, got {len(old_sums)}.")
        d = age_step
        m0, m1, m2 = self._m
        self._m = [factor * m0 + (1.0 - factor), factor * (m1 + d * m0), factor * (m2 + 2.0 * d * m1 + d * d * m0)]
        q0, q1, q2 = self._q
        f2 = factor * factor
        self._q = [f2 * q0 + (1.0 - factor) ** 2, f2 * (q1 + d * q0), f2 * (q2 + 2.0 * d * q1 + d * d * q0)]
        self._aged = [factor * (aged + d * total) for aged, total in zip(self._aged, old_sums, strict=True)]

    def copy_from(self, other: TrendFit, weight_scale: float) -> None:
        """Take ``other``'s sums, every weight multiplied by ``weight_scale`` (the caller restarts its averages from
        scaled sums)."""
        self._m = [weight_scale * m for m in other._m]
        self._q = [weight_scale * weight_scale * q for q in other._q]
        self._aged = [weight_scale * a for a in other._aged]

    def present(self, sums: Sequence[float], products: Sequence[Sequence[float]]) -> Present | None:
        """The fit read now, from the caller's weighted sums ``sum w x`` (``sums``, one per value) and ``sum w x y``
        (``products``, a square table over the values).

        Returns:
            ``None`` while the ages cannot yet tell a slope from a level (too few distinct ages for a residual).

        """
        m0, m1, m2 = self._m
        det = m0 * m2 - m1 * m1
        if m0 <= 0.0 or det <= 1e-9 * m0 * m2:
            return None
        q0, q1, q2 = self._q
        # E[sum w r^2] = v (M0 - tr(M^-1 Q)) for the residuals r of a weighted fit (M = X'WX, Q = X'W^2X)
        kept = m0 - (m2 * q0 - 2.0 * m1 * q1 + m0 * q2) / det
        if kept <= 0.0:
            return None
        levels = [(m2 * total - m1 * aged) / det for total, aged in zip(sums, self._aged, strict=True)]
        slopes = [(m0 * aged - m1 * total) / det for total, aged in zip(sums, self._aged, strict=True)]
        # the normal equations leave sum w r_i r_j = sum w x_i x_j - level_i sum w x_j - slope_i sum w s x_j
        covariance = [
            [(products[i][j] - levels[i] * sums[j] - slopes[i] * self._aged[j]) / kept for j in range(len(sums))]
            for i in range(len(sums))
        ]
        squares = (m2 * m2 * q0 - 2.0 * m2 * m1 * q1 + m1 * m1 * q2) / (det * det)
        return Present(levels, squares, covariance, (m0 * m0) / q0)

    def state_dict(self) -> dict:
        """The sums, as plain floats."""
        return {"m": list(self._m), "q": list(self._q), "aged": list(self._aged)}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._m = [float(v) for v in state_dict["m"]]
        self._q = [float(v) for v in state_dict["q"]]
        self._aged = [float(v) for v in state_dict["aged"]]
