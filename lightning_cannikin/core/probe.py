"""The probe: a second batch size for every device whose slope is not measured yet, with a lever that measures it.

A slope fitted from two batch sizes a few samples apart and extrapolated far is noise. The probe starts from the
speed-proportional split the measured speeds imply (so it is already a good plan), moves every unmeasured rank at
least a ``lever`` fraction of its batch away from where it is, within its bounds, and restores the total on the ranks
furthest from their share. A rank that cannot move within its bounds is left where it is.

Pure Python: imports neither torch nor Lightning.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["probe_split"]


def probe_split(
    sizes: Sequence[int],
    speeds: Sequence[float],
    unmeasured: Sequence[int],
    lower: Sequence[int],
    upper: Sequence[int] | None,
    lever: float = 0.25,
) -> tuple[int, ...]:
    """A split of ``sum(sizes)`` that moves every rank in ``unmeasured`` by at least ``lever`` of its batch.

    Args:
        sizes: the split in force.
        speeds: each rank's measured samples per second at its size in ``sizes``.
        unmeasured: ranks that need a second batch size.
        lower: per-rank lower bounds.
        upper: per-rank upper bounds, or ``None``.
        lever: the least fraction of its batch an unmeasured rank moves.

    Returns:
        The probe; ``sizes`` itself when no split of the total gives every lever within the bounds.

    """
    sizes = [int(b) for b in sizes]
    total = sum(sizes)
    hi = list(upper) if upper is not None else [total] * len(sizes)
    share = [total * v / sum(speeds) for v in speeds]
    target = [min(max(round(x), lo), h) for x, lo, h in zip(share, lower, hi, strict=True)]
    levers = {i: max(1, round(lever * sizes[i])) for i in unmeasured}
    for i, least in levers.items():
        if abs(target[i] - sizes[i]) >= least:
            continue
        # too close to where it is: move it a full lever, the way that keeps the total nearest to unchanged
        excess = sum(target) - total
        up = excess < 0 or (excess == 0 and target[i] >= sizes[i])
        for candidate in (sizes[i] + least, sizes[i] - least) if up else (sizes[i] - least, sizes[i] + least):
            if lower[i] <= candidate <= hi[i]:
                target[i] = candidate
                break
    while (excess := sum(target) - total) != 0:
        step = -1 if excess > 0 else 1

        def allowed(i: int, step: int = step) -> bool:
            moved = target[i] + step
            if not lower[i] <= moved <= hi[i]:
                return False
            # an unmeasured rank may move back only as far as its lever allows
            return i not in levers or abs(moved - sizes[i]) >= min(levers[i], abs(target[i] - sizes[i]) + 1)

        candidates = [i for i in range(len(target)) if allowed(i)]
        if not candidates:
            return tuple(sizes)
        # take from the rank furthest above its share (give to the one furthest below), highest rank first
        pick = max(candidates, key=lambda i: ((target[i] - share[i]) * -step, i))
        target[pick] += step
    return tuple(target)
