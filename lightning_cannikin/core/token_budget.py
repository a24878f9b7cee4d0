"""Global batches cut by a cost budget (tokens) instead of a sample count.

The epoch's permutation is walked in order and cut into consecutive global batches, each taking samples until the
next would exceed the budget. Pure: every rank cuts the same batches from the same permutation and costs.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["token_budget_batches"]


def token_budget_batches(costs: ArrayLike, budget: float, min_samples: int = 1) -> list[tuple[int, int]]:
    """Cut a sequence of samples (the epoch's permutation order) into consecutive global batches by a cost budget.

    Each batch takes samples until adding the next would exceed ``budget``, and never fewer than ``min_samples``
    (the number of ranks); the last, short batch is folded into the previous one when it has fewer than
    ``min_samples`` samples. Deterministic, so every rank cuts the same batches.

    Returns:
        ``[(start, stop), ...]`` half-open ranges covering every sample once.

    """
    c = np.asarray(costs, dtype=np.float64)
    if c.ndim != 1 or not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ValueError("`costs` must be a 1-d sequence of finite, non-negative numbers.")
    if not budget > 0:
        raise ValueError(f"`budget` must be positive, got {budget}.")
    if min_samples < 1:
        raise ValueError(f"`min_samples` must be at least 1, got {min_samples}.")
    batches: list[tuple[int, int]] = []
    start, total = 0, 0.0
    for i, cost in enumerate(c.tolist()):
        if i - start >= min_samples and total + cost > budget:
            batches.append((start, i))
            start, total = i, 0.0
        total += cost
    if start < len(c):
        if len(c) - start < min_samples and batches:
            start = batches.pop()[0]
        batches.append((start, len(c)))
    return batches
