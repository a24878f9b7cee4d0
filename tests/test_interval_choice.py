"""The total batch chosen over the whole noise interval (:mod:`lightning_cannikin.core.interval_choice`), judged
against a truth computed here: goodput written out from its definition, on a dense grid of noise scales across the
interval, not from the library's goodput or from the interval's ends alone."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_cannikin.core.interval_choice import TotalOptions

MARGIN = 0.05
B0 = 96
# the large-fixed-cost cluster of the time-to-accuracy benchmark: three devices of 0.5 / 1 / 2 ms a sample and 20 ms a
# step, balanced (each finishes together), so a step of B samples takes 20 ms + B / 3.5 ms
TOTALS = tuple(int(b) for b in np.unique(np.rint(np.geomspace(B0, 768, 40))))


def balanced_time(total: float) -> float:
    return 0.020 + total / 3.5 / 1000.0


def true_goodput(total: float, time: float, phi: float) -> float:
    """Samples a second at ``total``, each worth ``(phi + B0) / (phi + total)`` of a sample at B0 (1 where the noise
    scale is infinite)."""
    worth = 1.0 if math.isinf(phi) else (phi + B0) / (phi + total)
    return total / time * worth


def options(current: int, time=balanced_time, totals=TOTALS) -> TotalOptions:
    return TotalOptions(totals, tuple(time(t) for t in totals), current, time(current), B0, MARGIN)


def phis_across(low: float, high: float) -> np.ndarray:
    """A dense grid of noise scales over ``[low, high]``, ends included (a large finite stand-in for infinity, and
    infinity itself)."""
    top = 1e7 if math.isinf(high) else high
    grid = np.geomspace(max(low, 1e-3), top, 400)
    return np.unique(np.concatenate(([low], grid, [high])))


def shares(total: int, low: float, high: float, time=balanced_time, totals=TOTALS) -> np.ndarray:
    """``total``'s goodput over the best candidate's at each noise scale of the grid."""
    out = []
    for phi in phis_across(low, high):
        best = max(true_goodput(b, time(b), phi) for b in totals)
        out.append(true_goodput(total, time(total), phi) / best)
    return np.asarray(out)


@pytest.mark.parametrize("phi", [0.0, 40.0, 150.0, 380.0, 1000.0, 5000.0, math.inf])
@pytest.mark.parametrize("current", [96, 192, 384])
def test_with_both_bounds_equal_it_is_the_goodput_choice_with_its_margin(phi, current):
    # one noise scale: move to the best total where it gains more than the margin, else stay
    values = {b: true_goodput(b, balanced_time(b), phi) for b in TOTALS}
    best = max(values, key=lambda b: (values[b], -b))
    moves = values[best] > (1 + MARGIN) * true_goodput(current, balanced_time(current), phi)
    choice = options(current).choose(phi, phi)
    assert choice.adopted is moves
    if moves:
        assert choice.batch_size == best


# intervals from tight to wide, finite and not, around break-even noise scales of this cluster
INTERVALS = [(50.0, 120.0), (100.0, math.inf), (200.0, 3000.0), (200.0, math.inf), (400.0, 900.0), (30.0, 20000.0)]
INTERVALS += [(0.0, 300.0), (0.0, math.inf), (1500.0, math.inf), (600.0, 700.0), (5.0, 60.0)]


@pytest.mark.parametrize("low, high", INTERVALS)
@pytest.mark.parametrize("current", [96, 130, 192, 384, 768])
def test_a_move_costs_at_most_the_margin_wherever_the_truth_lies_and_raises_the_share_it_is_sure_of(low, high, current):
    choice = options(current).choose(low, high)
    if not choice.adopted:
        return
    moved = shares(choice.batch_size, low, high)
    stayed = shares(current, low, high)
    # at every noise scale in the interval the new total is no worse than staying, or within the margin of the best
    assert np.all((moved >= stayed * (1 - 1e-12)) | (moved * (1 + MARGIN) >= 1 - 1e-12)), (low, high, current)
    # the least share of the best goodput it reaches across the interval (minimax regret) beats staying's by the margin
    assert moved.min() > (1 + MARGIN) * stayed.min() * (1 - 1e-9), (moved.min(), stayed.min())


@pytest.mark.parametrize("low, high", INTERVALS)
def test_no_allowed_total_is_surer_than_the_one_chosen(low, high):
    # brute force over the candidates: among those a move may go to (near-best at the end it moves away from), none
    # reaches a larger least share across the dense grid than the choice
    current = 96
    choice = options(current).choose(low, high)
    sure = {b: shares(b, low, high).min() for b in TOTALS}
    at_low = shares_at(low)
    allowed = [b for b in TOTALS if b > current and at_low[b] * (1 + MARGIN) >= 1 - 1e-12]
    best_allowed = max((sure[b] for b in allowed), default=0.0)
    if choice.adopted:
        assert sure[choice.batch_size] >= best_allowed * (1 - 1e-9)
    else:
        assert best_allowed <= (1 + MARGIN) * sure[current] * (1 + 1e-9), (best_allowed, sure[current])


def shares_at(phi: float) -> dict[int, float]:
    values = {b: true_goodput(b, balanced_time(b), phi) for b in TOTALS}
    top = max(values.values())
    return {b: v / top for b, v in values.items()}


def test_an_interval_the_lower_end_alone_would_keep_grows_the_total_that_the_truth_wants():
    # the case: growth to 192 pays beyond the margin only above a noise scale of about 380; bounds of
    # (200, 3000) hold truths where 96 wastes a third of the cluster. The lower end alone keeps 96
    assert not options(B0).choose(200.0, 200.0).adopted, "the one-ended rule stays"
    choice = options(B0).choose(200.0, 3000.0)
    assert choice.adopted and 150 <= choice.batch_size <= 260, choice
    grown = choice.batch_size
    for truth in (400.0, 1000.0, 3000.0):  # wherever above break-even the truth lies, the move gains beyond the margin
        kept = true_goodput(B0, balanced_time(B0), truth)
        assert true_goodput(grown, balanced_time(grown), truth) > (1 + MARGIN) * kept, truth


def test_an_infinite_upper_bound_is_defined_and_the_lower_one_caps_the_growth():
    # nothing bounds the noise scale from above: the upper end ranks totals by throughput alone, so a rule that trusted
    # it would go to the cap; the lower end keeps the total within the margin of what it supports
    for low in (0.0, 20.0, 100.0, 300.0, 1000.0):
        choice = options(B0).choose(low, math.inf)
        at_low = shares_at(low)
        assert choice.batch_size == B0 or at_low[choice.batch_size] * (1 + MARGIN) >= 1 - 1e-12, (low, choice)
    assert not options(B0).choose(0.0, math.inf).adopted, "a lower bound of 0 proves no signal: nothing grows"
    assert options(B0).choose(1000.0, math.inf).batch_size < max(TOTALS)


def test_the_total_shrinks_on_the_upper_bound_and_not_past_what_it_supports():
    choice = options(768).choose(20.0, 150.0)
    assert choice.adopted and choice.batch_size < 768
    values = {b: true_goodput(b, balanced_time(b), 150.0) for b in TOTALS}
    assert values[choice.batch_size] * (1 + MARGIN) >= max(values.values()), "near-best at the upper end"


def test_throughput_flat_in_the_total_never_grows_it():
    # every sample costs the same: a larger total only loses efficiency, at every noise scale
    def per_sample(total):
        return total / 1000.0

    for low, high in INTERVALS:
        assert not options(B0, time=per_sample).choose(low, high).adopted, (low, high)


def test_bad_bounds_and_options_are_refused_and_options_round_trip():
    with pytest.raises(ValueError, match="low <= high"):
        options(B0).choose(300.0, 200.0)
    with pytest.raises(ValueError, match="margin"):
        TotalOptions((96,), (0.05,), 96, 0.05, B0, -0.1)
    with pytest.raises(ValueError, match="candidate totals"):
        TotalOptions((96, 192), (0.05,), 96, 0.05, B0, 0.1)
    held = options(192)
    assert TotalOptions.from_dict(held.to_dict()) == held
