"""Where a speed model's predictions are evidence: the sizes each rank was timed at, and how far beyond them to go.

Pure numpy: imports neither torch nor Lightning.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lightning_cannikin.core.timing import ComputeTimeFitter, LinearTimeModel

__all__ = ["trusted_bounds"]


def trusted_bounds(
    fitters: Sequence[ComputeTimeFitter],
    models: Sequence[LinearTimeModel],
    lower_bounds: Sequence[int],
    upper_bounds: Sequence[int] | None,
    total_batch_size: int,
    probe_lever: float,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Per-rank ``(lower, upper)`` sizes whose times the evidence supports within the user's (and memory) bounds, or
    ``None`` if ``total_batch_size`` does not fit them (a new total: every rank must extrapolate, and the settling
    re-plan times it there).

    A rank whose time is flat where it was timed lately (sizes worth a fresh sample in the recency-weighted fit;
    flat: the per-sample part is under a tenth of its time at the largest, or the knee lies above it) has shown
    no slope: a line through its flat region (below its saturation batch) predicts nothing far away, and a
    split relying on it can cost twice its prediction. It may go half a probe's lever beyond its largest timed size
    (``probe_lever / 2``, at least two samples: a step past an unseen knee costs at most that) and no further, each
    walk re-planned once timed (``Decision.untimed``), so it walks to its knee through timed sizes instead
    of jumping across it. A rank that showed its slope, and fewer samples on any rank (times are monotone), are
    not bounded.
    """
    lever = 1.0 + probe_lever / 2
    total = int(total_batch_size)
    upper = np.minimum(np.full(len(fitters), total) if upper_bounds is None else np.array(upper_bounds), total)
    for rank, (fitter, model) in enumerate(zip(fitters, models, strict=True)):
        sizes = fitter.timed_sizes()
        largest = sizes[-1]
        flat = model.knee >= largest or model.slope * largest < 0.1 * float(model(largest))
        if flat:
            upper[rank] = min(upper[rank], max(int(np.ceil(largest * lever)), largest + 2))
    lower = np.asarray(lower_bounds)
    if not (np.all(lower <= upper) and lower.sum() <= total <= upper.sum()):
        return None
    return lower, upper
