"""The next-plan decision on rank zero (pure): goodput picks the total batch, OptPerf its split."""

from __future__ import annotations

import pytest

from lightning_cannikin.balancer import SplitBalancer, StepRecord
from lightning_cannikin.plan import Plan
from lightning_cannikin.planner import optimal_split
from lightning_cannikin.replanner import next_plan

SLOPES = (0.001, 0.003)  # seconds per sample: rank 1 is 3x slower
FIXED = 0.020  # seconds per step on every rank


def fitted_balancer(sizes_seen=((24, 8), (16, 16), (20, 12)), upper=None) -> SplitBalancer:
    balancer = SplitBalancer(2, upper=upper)
    step = 0
    for sizes in sizes_seen:
        for _ in range(5):
            records = [
                StepRecord(step, rank, b, FIXED + SLOPES[rank] * b, FIXED + max(SLOPES) * max(sizes) + 0.002)
                for rank, b in enumerate(sizes)
            ]
            balancer.add(records)
            step += 1
    return balancer


def test_without_statistics_the_total_stays_and_the_split_is_optimal():
    balancer = fitted_balancer()
    plan = next_plan(balancer, Plan((16, 16)), noise_scale=None, base_batch_size=32, max_batch_size=1024)
    slopes, offsets = balancer.pieces()
    assert plan.global_batch_size == 32
    assert plan.local_batch_sizes == optimal_split(slopes, offsets, 32).local_batch_sizes == (24, 8)
    assert plan.predicted_step_time == pytest.approx(FIXED + 0.024 + balancer.tail(), rel=1e-6)


def test_goodput_grows_the_batch_only_when_the_noise_scale_pays_for_it():
    balancer = fitted_balancer()
    current = Plan((24, 8))
    # all noise (efficiency ~1 everywhere): the fixed cost per step makes the largest batch the best
    grown = next_plan(balancer, current, noise_scale=1e9, base_batch_size=32, max_batch_size=256)
    assert grown.global_batch_size == 256
    # no noise (each extra sample is worth nothing): stay at the base batch
    kept = next_plan(balancer, current, noise_scale=0.0, base_batch_size=32, max_batch_size=256)
    assert kept.global_batch_size == 32
    # mid-epoch (no max_batch_size passed) the total never changes
    assert next_plan(balancer, current, noise_scale=1e9, base_batch_size=32).global_batch_size == 32


def test_even_split_baseline_and_bounds():
    balancer = fitted_balancer(upper=[20, 64])
    even = next_plan(balancer, Plan((16, 16)), balance=False)
    assert even.local_batch_sizes == (16, 16)
    capped = next_plan(balancer, Plan((16, 16)))
    assert capped.local_batch_sizes == (20, 12), "rank 0's cap binds"
    # with rank 0 capped, every extra sample lands on the 3x slower rank: no larger batch pays, even with E = 1
    kept = next_plan(balancer, Plan((16, 16)), noise_scale=1e9, base_batch_size=32, max_batch_size=1024)
    assert kept.global_batch_size == 32 and kept.local_batch_sizes == (20, 12)
    # uncapped, the same statistics grow the batch to the maximum
    free = next_plan(fitted_balancer(), Plan((16, 16)), noise_scale=1e9, base_batch_size=32, max_batch_size=1024)
    assert free.global_batch_size == 1024


def test_an_unidentified_rank_is_probed_at_a_new_size():
    balancer = fitted_balancer(sizes_seen=((16, 16),))
    assert not balancer.identified
    plan = next_plan(balancer, Plan((16, 16)))
    assert plan.global_batch_size == 32
    assert all(b != 16 for b in plan.local_batch_sizes), plan


def test_a_long_stable_plan_neither_loses_its_slopes_nor_stops_adapting():
    # An epoch far longer than the timing window, all at one plan: the epoch-end decision must still see measured
    # slopes. (It once saw one batch size per rank, so it probed instead of balancing, and never grew the batch.)
    balancer = fitted_balancer(sizes_seen=((16, 16), (20, 12), *[(24, 8)] * 200))
    assert balancer.identified
    assert balancer.models()[1].slope == pytest.approx(SLOPES[1], rel=1e-6)
    current = Plan((24, 8))
    assert next_plan(balancer, current).local_batch_sizes == (24, 8)
    grown = next_plan(balancer, current, noise_scale=1e9, base_batch_size=32, max_batch_size=256)
    assert grown.global_batch_size == 256


def test_an_even_split_adapts_from_the_one_size_prior_while_a_balancing_plan_probes_first():
    balancer = fitted_balancer(sizes_seen=((16, 16),))
    assert not balancer.identified
    # AdaptDL's way: the prior (half the step time fixed) already says a bigger batch pays when every sample counts
    even = next_plan(balancer, Plan((16, 16)), noise_scale=1e9, base_batch_size=32, max_batch_size=256, balance=False)
    assert even.global_batch_size == 256 and even.local_batch_sizes == (128, 128)
    # balancing first measures the slopes: same total, probed split
    probed = next_plan(balancer, Plan((16, 16)), noise_scale=1e9, base_batch_size=32, max_batch_size=256)
    assert probed.global_batch_size == 32 and probed.local_batch_sizes != (16, 16)


def test_a_stale_split_does_not_push_the_total_batch_up():
    # The split in force is far from balanced. At this noise scale a bigger batch (49) beats B0 = 32 by 4.5% at the
    # best split, under the 5% margin, but by 40% over the stale split: re-balancing is the gain, not the batch.
    balancer = fitted_balancer()
    stale = Plan((16, 16))
    assert balancer.predict(stale.local_batch_sizes) > 1.2 * balancer.plan_split(32).step_time
    plan = next_plan(balancer, stale, noise_scale=40.0, base_batch_size=32, max_batch_size=256)
    assert plan.global_batch_size == 32
    assert plan.local_batch_sizes == balancer.plan_split(32).local_batch_sizes
    # and with a clear gain (noise scale 100: +21% at the best split) the batch does grow
    assert next_plan(balancer, stale, noise_scale=100.0, base_batch_size=32, max_batch_size=256).global_batch_size > 32
