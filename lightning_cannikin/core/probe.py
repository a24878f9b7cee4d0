"""The probe: a second batch size for every device whose slope is not measured yet, with a lever that measures it.

A slope fitted from two batch sizes a few samples apart and extrapolated far is noise. The probe starts from the
speed-proportional split the measured speeds imply (so it is already a good plan), moves every unmeasured rank at
least a ``lever`` fraction of its batch away from where it is, within its bounds, and restores the total on the ranks
furthest from their share. A rank that cannot move within its bounds is left where it is.

Pure Python: imports neither torch nor Lightning.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

__all__ = ["PROBE_LEVER", "probe_split"]

# a probe moves every unmeasured rank by at least this share of its batch: a slope from a real lever, not from a few
# samples extrapolated far
PROBE_LEVER = 0.25


def probe_split(
    sizes: Sequence[int],
    speeds: Sequence[float],
    unmeasured: Sequence[int],
    lower: Sequence[int],
    upper: Sequence[int] | None,
    lever: float = PROBE_LEVER,
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
            return _full_levers(sizes, share, levers, lower, hi)
        # take from the rank furthest above its share (give to the one furthest below), highest rank first
        pick = max(candidates, key=lambda i: ((target[i] - share[i]) * -step, i))
        target[pick] += step
    return tuple(target)


def _full_levers(
    sizes: list[int], share: list[float], levers: dict[int, int], lower: Sequence[int], hi: Sequence[int]
) -> tuple[int, ...]:
    """Every lever up or down, in the directions that let the total be restored, nearest the speed-proportional share.

    The fallback when the share pulls ranks the wrong way for the bounds (a fast rank capped at the batch it runs must
    go down, so others must go up): each choice of directions moves every unmeasured rank exactly its lever, then the
    total is restored by moving ranks further in their own direction, or measured ranks either way, within bounds.
    Returns ``sizes`` when no choice works (or too many ranks to try them all).
    """
    ranks = sorted(levers)
    if len(ranks) > 12:
        return tuple(sizes)
    total, best, best_cost = sum(sizes), tuple(sizes), float("inf")
    for signs in itertools.product((1, -1), repeat=len(ranks)):
        target, direction = list(sizes), dict(zip(ranks, signs, strict=True))
        if not all(lower[i] <= sizes[i] + d * levers[i] <= hi[i] for i, d in direction.items()):
            continue
        for i, d in direction.items():
            target[i] = sizes[i] + d * levers[i]
        excess = sum(target) - total
        for i in sorted(range(len(target)), key=lambda i: share[i] - target[i], reverse=excess < 0):
            if excess == 0:
                break
            if direction.get(i, -1 if excess > 0 else 1) != (-1 if excess > 0 else 1):
                continue  # a rank moves on only in the direction of its lever
            room = target[i] - lower[i] if excess > 0 else hi[i] - target[i]
            moved = min(room, abs(excess))
            target[i] += -moved if excess > 0 else moved
            excess += -moved if excess > 0 else moved
        cost = max(abs(t - x) for t, x in zip(target, share, strict=True))
        if excess == 0 and cost < best_cost:
            best, best_cost = tuple(target), cost
    return best
