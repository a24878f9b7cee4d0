"""Where a step's time goes, and what holds Cannikin back from the ideal: pure arithmetic on measured medians.

Each rank's steady step (its cycle: from the previous step's end to this one's end) is split into parts that add up to
it exactly:

- ``lines``: the compute its calibrated solo line gives at its batch (the rank alone at its share);
- ``interference``: the measured compute (forward start to the last gradient ready) less that;
- ``input``: the host input, from the loader's fetch to the batch's start;
- ``broadcast``: the step's end to the loader's fetch: the loop's work between steps and its wait at the broadcast
  Lightning (>= 2.5.2) makes from rank zero, with ``.item()``, at every step's start;
- ``allreduce``: the last gradient ready to the all-reduce's end (the reduction and the wait for slower ranks);
- ``optimizer``: the all-reduce's end to the step's end (the optimizer step);
- ``other``: the rest (the batch's start to the forward's, and medians that do not add up exactly).

The ranks meet at the all-reduce and at the broadcast, so every rank's cycle is the same, and so are its two halves:
from the broadcast to the all-reduce's end, and from there to the next broadcast. The step's critical path takes the
first half from the last rank to reach the all-reduce (the least time there: its input, compute and the reduction)
and the second from the last rank to reach the broadcast (the least time there: its optimizer step and the broadcast
itself). DDP's all-reduce, broadcast wait and optimizer step on that path are the fixed per-step costs, which no split
shrinks. With
``T*`` the optimal split's step on the solo compute lines and ``T_even`` the even split's (``max_i line_i(B / n)``),
the ideal Cannikin / DDP ratio is ``(T* + fixed) / (T_even + fixed)``.

Measured over ideal, ``C_c / C_d - I_c / I_d`` with ``C = I + excess`` on each side, is exactly
``sum_p (excess_c[p] - ideal * excess_d[p]) / C_d`` over the parts ``p``: each part's contribution to the shortfall in
ratio points, the largest of which is what holds Cannikin back.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

PARTS = ("lines", "interference", "input", "broadcast", "allreduce", "optimizer", "other")
FIXED = ("allreduce", "broadcast", "optimizer")
# what each part is called in a sentence
PART_NAMES = {
    "lines": "the split (solo compute on the lines at the chosen batch, against the optimal split)",
    "interference": "interference (compute beyond the rank's solo line)",
    "input": "host input (the loader's fetch to the batch's start)",
    "broadcast": "the wait at the loop's broadcast (step end to the loader's fetch)",
    "allreduce": "the all-reduce (last gradient ready to its end)",
    "optimizer": "the optimizer step (all-reduce end to step end)",
    "other": "other (batch start to forward start; medians)",
}


def fit_line(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``(a, a0)`` of ``t = a * b + a0``; the slope is kept positive (a device never gets faster with
    more samples; a flat measurement stays a tiny slope, so water-filling stays defined)."""
    mean_b, mean_t = statistics.fmean(sizes), statistics.fmean(seconds)
    spread = sum((b - mean_b) ** 2 for b in sizes)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in zip(sizes, seconds, strict=True)) / spread if spread else 0.0
    slope = max(slope, 1e-12)
    return slope, mean_t - slope * mean_b


def line_time(line: Sequence[float], batch: float) -> float:
    """A line's time at ``batch`` (its intercept clipped at 0)."""
    return line[0] * batch + max(line[1], 0.0)


def water_fill(lines: Sequence[Sequence[float]], total: float) -> tuple[float, list[float]]:
    """The shortest step ``T*`` for ``total`` samples over devices whose step takes ``a_i * b + a0_i`` (continuous
    split, ``b_i >= 0``, intercepts clipped at 0) and that split: every rank with work ends at ``T*``."""

    def load(limit: float) -> float:
        return sum(max(0.0, (limit - max(a0, 0.0)) / a) for a, a0 in lines)

    low, high = 0.0, max(line_time(line, total) for line in lines)
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if load(middle) < total else (low, middle)
    return high, [max(0.0, (high - max(a0, 0.0)) / a) for a, a0 in lines]


def fraction_of_ideal(measured: float | None, ideal: float | None) -> float | None:
    """``(1 - measured) / (1 - ideal)``: 1 where Cannikin saved all the ideal allows, 0 where it saved nothing."""
    if measured is None or ideal is None or 1.0 - ideal < 0.02:
        return None
    return (1.0 - measured) / (1.0 - ideal)


def rank_parts(row: Mapping[str, Any], line_ms: Sequence[float]) -> dict[str, float] | None:
    """One rank's steady medians (``batch``, ``compute_ms``, ``host_ms``, ``gap_ms``, ``exposed_ms``, ``after_ms``,
    ``cycle_ms``) split into :data:`PARTS` (ms) against its solo compute line (ms); ``None`` where one is missing."""
    keys = ("batch", "compute_ms", "host_ms", "gap_ms", "exposed_ms", "after_ms", "cycle_ms")
    if any(row.get(key) is None for key in keys):
        return None
    solo = line_time(line_ms, row["batch"])
    parts = {
        "lines": solo,
        "interference": row["compute_ms"] - solo,
        "input": row["host_ms"],
        "broadcast": row["gap_ms"],
        "allreduce": row["exposed_ms"],
        "optimizer": row["after_ms"],
    }
    parts["other"] = row["cycle_ms"] - sum(parts.values())
    return parts


# the parts of a step after the all-reduce: on the critical path, the last rank to reach the broadcast's
AFTER_REDUCTION = ("optimizer", "broadcast")


def critical_ranks(rows: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The last rank to reach the all-reduce (the least time from its last gradient to the reduction's end) and the
    last to reach the broadcast (the least time from its step's end to its fetch)."""
    ranks = range(len(rows))
    return {
        "allreduce": min(ranks, key=lambda rank: rows[rank]["exposed_ms"]),
        "broadcast": min(ranks, key=lambda rank: rows[rank]["gap_ms"]),
    }


def critical_path(parts: Sequence[Mapping[str, float]], critical: Mapping[str, int]) -> dict[str, float]:
    """The step's parts on its critical path: up to the all-reduce's end from the last rank there, the rest from the
    last rank at the broadcast; ``other`` keeps the cycle of the first (every rank's cycle is the same)."""
    first, second = parts[critical["allreduce"]], parts[critical["broadcast"]]
    path = {key: second[key] if key in AFTER_REDUCTION else first[key] for key in PARTS}
    path["other"] = sum(first.values()) - sum(v for k, v in path.items() if k != "other")
    return path


def decompose(
    rows: Mapping[str, Sequence[Mapping[str, Any]]], lines_ms: Sequence[Sequence[float]], total: float
) -> dict[str, Any] | None:
    """The ideal from the solo lines and DDP's fixed costs, every rank's parts, and each part's share of the shortfall.

    Args:
        rows: per strategy (``"ddp"``, ``"cannikin"``), every rank's steady medians (see :func:`rank_parts`).
        lines_ms: every rank's solo compute line ``(ms a sample, ms)``.
        total: the global batch.

    Returns:
        ``None`` where a strategy or a rank's median is missing; else ``ideal_ratio``, ``ideal_ratio_lines`` (without
        the fixed costs), ``fixed_ms``, the parts per strategy and rank and on the critical path, the critical ranks,
        ``measured_ratio`` (the critical path's cycles), ``contributions`` (ratio points per part, adding up to
        measured less ideal), ``cause`` (the part contributing most) and ``cause_line`` (one sentence with the numbers).

    """
    if any(not rows.get(strategy) for strategy in ("ddp", "cannikin")):
        return None
    parts = {s: [rank_parts(row, line) for row, line in zip(rows[s], lines_ms, strict=True)] for s in rows}
    if any(p is None for s in ("ddp", "cannikin") for p in parts[s]):
        return None
    best, split = water_fill(lines_ms, total)
    even = max(line_time(line, total / len(lines_ms)) for line in lines_ms)
    critical = {s: critical_ranks(rows[s]) for s in ("ddp", "cannikin")}
    path = {s: critical_path(parts[s], critical[s]) for s in ("ddp", "cannikin")}
    ddp, cannikin = path["ddp"], path["cannikin"]
    fixed = {key: ddp[key] for key in FIXED}
    fixed_ms = sum(fixed.values())
    ideal = (best + fixed_ms) / (even + fixed_ms)
    ideal_of = {"ddp": even, "cannikin": best}

    def excess(strategy: str, part: Mapping[str, float]) -> dict[str, float]:
        """Each part over what the ideal model gives it: the lines over T* (or T_even), the fixed costs over DDP's."""
        over = {key: part[key] - fixed.get(key, 0.0) for key in PARTS}
        over["lines"] = part["lines"] - ideal_of[strategy]
        return over

    cycle_d, cycle_c = sum(ddp.values()), sum(cannikin.values())
    over_d, over_c = excess("ddp", ddp), excess("cannikin", cannikin)
    contributions = {key: (over_c[key] - ideal * over_d[key]) / cycle_d for key in PARTS}
    measured = cycle_c / cycle_d
    cause = max(PARTS, key=lambda key: contributions[key])
    result = {
        "ideal_ratio": ideal,
        "ideal_ratio_lines": best / even,
        "ideal_split": [round(b, 1) for b in split],
        "ideal_compute_ms": best,
        "even_compute_ms": even,
        "fixed_ms": fixed,
        "critical_ranks": critical,
        "parts_ms": parts,
        "path_ms": path,
        "excess_ms": {"ddp": over_d, "cannikin": over_c},
        "cycle_ms": {"ddp": cycle_d, "cannikin": cycle_c},
        "measured_ratio": measured,
        "fraction_of_ideal": fraction_of_ideal(measured, ideal),
        "contributions": contributions,
        "cause": cause,
    }
    result["cause_line"] = cause_line(result)
    return result


def cause_line(decomposition: Mapping[str, Any]) -> str:
    """One sentence: the part that holds Cannikin back most, with its numbers."""
    measured, ideal = decomposition["measured_ratio"], decomposition["ideal_ratio"]
    cause = decomposition["cause"]
    points = decomposition["contributions"][cause]
    shortfall = measured - ideal
    if shortfall <= 0.0 or points <= 0.0:
        return f"Cannikin at {measured:.3f}x DDP's step reaches the ideal {ideal:.3f}x: nothing holds it back"
    mine = decomposition["path_ms"]["cannikin"][cause]
    theirs = decomposition["path_ms"]["ddp"][cause]
    reference = "T*" if cause == "lines" else "DDP's"
    against = decomposition["ideal_compute_ms"] if cause == "lines" else theirs
    return (
        f"{PART_NAMES[cause]} holds Cannikin back most: {points:+.3f} of the {shortfall:+.3f} ratio points between "
        f"measured {measured:.3f}x and ideal {ideal:.3f}x ({mine:.2f} ms a step on Cannikin's critical path against "
        f"{reference} {against:.2f} ms)"
    )
