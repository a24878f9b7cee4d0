"""The uneven shares of a chunked stream (``core/stream_shares.py``), as properties over many shapes; no processes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from lightning_cannikin.core.layout import epoch_layout
from lightning_cannikin.core.plan import Plan
from lightning_cannikin.core.stream_shares import _deal, global_batches, item_order, replanned_shares, share_key


# one plan's whole epoch, dealt as replanned_shares deals its first segment: only these tests call it
def stream_shares(
    chunk_sizes: Sequence[int],
    step_sizes: Sequence[Sequence[int]],
    rank: int,
    num_workers: int,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    window: int = 0,
) -> list[np.ndarray]:
    """``rank``'s item ids for every step of an epoch run under one plan (see the module's docstring).

    Args:
        chunk_sizes: items in each chunk, in storage order (``N`` = their sum).
        step_sizes: every rank's item count in each step of the epoch (``epoch_layout``'s ``local_batch_sizes``);
            their total may be below ``N`` (a dropped last batch): the items at the end of the order are left out.
        rank: the rank whose steps are returned.
        num_workers: the rank's DataLoader workers (0: the main process reads, as one worker).
        shuffle: permute the chunk order and each worker's block, seeded by ``(seed, epoch)``.
        seed: the shared seed.
        epoch: the epoch (a fresh order each).
        window: the reader's decode window (items of a chunk deserialized together; 0: per item or whole chunks):
            the shuffle within a chunk keeps each window's items together.

    """
    items = item_order(chunk_sizes, shuffle, seed, epoch)
    sizes = np.asarray(chunk_sizes, dtype=np.int64)
    prefix = [int(seed), int(epoch)] if shuffle else None
    return _deal(items, sizes, step_sizes, rank, num_workers, prefix, window=window)


def _cases(count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        world = int(rng.integers(1, 6))
        plan = Plan(tuple(int(b) for b in rng.integers(1, 9, size=world)))
        num_chunks = int(rng.integers(1, 30))
        chunk_sizes = [int(c) for c in rng.integers(0, 17, size=num_chunks)]
        if sum(chunk_sizes) < plan.global_batch_size:
            chunk_sizes.append(plan.global_batch_size + int(rng.integers(0, 20)))
        yield plan, chunk_sizes, int(rng.integers(0, 5)), bool(rng.integers(0, 2)), int(rng.integers(0, 1000))


@pytest.mark.parametrize("drop_last", [False, True])
def test_shares_cover_every_item_once_in_steps_of_the_plan(drop_last):
    for plan, chunk_sizes, workers, shuffle, seed in _cases(400, seed=int(drop_last)):
        total = sum(chunk_sizes)
        layout = epoch_layout(total, {0: plan}, drop_last)
        step_sizes = [batch.local_batch_sizes for batch in layout]
        shares = [
            stream_shares(chunk_sizes, step_sizes, rank, workers, shuffle, seed, epoch=3, window=seed % 5)
            for rank in range(plan.world_size)
        ]
        # every rank ends the epoch on the same step
        assert {len(steps) for steps in shares} == {len(layout)}
        full_steps = total // plan.global_batch_size
        for rank, steps in enumerate(shares):
            sizes = [len(step) for step in steps]
            assert sizes == [s[rank] for s in step_sizes]
            assert all(size >= 1 for size in sizes)
            # the full steps before the epoch's tail carry exactly the plan's size
            assert sizes[: full_steps - 1] == [plan.local_batch_sizes[rank]] * max(full_steps - 1, 0)
        taken = np.concatenate([step for steps in shares for step in steps])
        assert len(np.unique(taken)) == len(taken), "an item is read twice"
        if drop_last:
            assert len(taken) == full_steps * plan.global_batch_size
            assert set(taken.tolist()) <= set(range(total))
        else:
            assert sorted(taken.tolist()) == list(range(total))


def test_each_rank_and_worker_reads_one_contiguous_run_of_the_chunk_order():
    for plan, chunk_sizes, workers, shuffle, seed in _cases(200, seed=7):
        total = sum(chunk_sizes)
        step_sizes = [batch.local_batch_sizes for batch in epoch_layout(total, {0: plan})]
        order = item_order(chunk_sizes, shuffle, seed, epoch=1).tolist()
        position = {item: p for p, item in enumerate(order)}
        start = 0
        for rank in range(plan.world_size):
            steps = stream_shares(chunk_sizes, step_sizes, rank, workers, shuffle, seed, epoch=1)
            per_worker = max(1, workers)
            for w in range(per_worker):
                mine = sorted(position[int(i)] for step in steps[w::per_worker] for i in step)
                assert mine == list(range(start, start + len(mine))), "a worker's block is not one run"
                start += len(mine)
        assert start == total


def test_each_worker_reads_its_chunks_one_after_another():
    # a chunk switch per item costs LitData's reader about 40x a read in order: a worker's reads keep each chunk whole
    for plan, chunk_sizes, workers, _, seed in _cases(200, seed=5):
        total = sum(chunk_sizes)
        ends = np.cumsum(chunk_sizes)
        step_sizes = [batch.local_batch_sizes for batch in epoch_layout(total, {0: plan})]
        for rank in range(plan.world_size):
            steps = stream_shares(chunk_sizes, step_sizes, rank, workers, True, seed, epoch=2)
            per_worker = max(1, workers)
            for w in range(per_worker):
                reads = np.concatenate([np.zeros(0, dtype=np.int64), *steps[w::per_worker]])
                chunks = np.searchsorted(ends, reads, side="right")
                switches = int((np.diff(chunks) != 0).sum())
                assert switches == len(np.unique(chunks)) - 1 if len(reads) else True, "a chunk was read in pieces"


@pytest.mark.parametrize("window", [2, 3, 32])
def test_each_decode_window_is_read_in_one_visit(window):
    # LitData deserializes the aligned items [kW, (k+1)W) of a chunk together and keeps the last window only: a worker
    # that came back to a window would decode it again (a within-chunk shuffle across windows read ~10x slower here)
    for plan, chunk_sizes, workers, _, seed in _cases(200, seed=9):
        total = sum(chunk_sizes)
        ends = np.cumsum(chunk_sizes)
        starts = ends - np.asarray(chunk_sizes)
        step_sizes = [batch.local_batch_sizes for batch in epoch_layout(total, {0: plan})]
        for rank in range(plan.world_size):
            steps = stream_shares(chunk_sizes, step_sizes, rank, workers, True, seed, epoch=2, window=window)
            for w in range(max(1, workers)):
                reads = np.concatenate([np.zeros(0, dtype=np.int64), *steps[w :: max(1, workers)]])
                chunks = np.searchsorted(ends, reads, side="right")
                windows = chunks * 10_000 + (reads - starts[chunks]) // window
                visits = 1 + int((np.diff(windows) != 0).sum()) if len(reads) else 0
                assert visits == len(np.unique(windows)), "a decode window was read in two visits"
    # and the items are still shuffled within each window and across a chunk's windows
    one = stream_shares([64], [(64,)], 0, 0, True, 1, 0, window=8)[0]
    assert sorted(one.tolist()) == list(range(64)) and one.tolist() != list(range(64))
    assert sorted(one[:8].tolist()) != list(range(8))


def test_the_order_follows_seed_and_epoch_only():
    chunk_sizes, plan = [8] * 12 + [5], Plan((1, 2, 4))
    step_sizes = [b.local_batch_sizes for b in epoch_layout(sum(chunk_sizes), {0: plan})]

    def run(seed, epoch, shuffle=True):
        return [s.tolist() for s in stream_shares(chunk_sizes, step_sizes, 2, 2, shuffle, seed, epoch)]

    assert run(42, 0) == run(42, 0)
    assert run(42, 0) != run(42, 1)
    assert run(42, 0) != run(43, 0)
    assert run(42, 0, shuffle=False) == run(42, 1, shuffle=False)
    # unshuffled, rank 2 reads the items after ranks 0 and 1, in storage order (worker 0's block, then worker 1's)
    flat = sorted(i for step in run(0, 0, shuffle=False) for i in step)
    assert flat == list(range(sum(chunk_sizes) - len(flat), sum(chunk_sizes)))


def test_bad_input_is_refused_with_the_parameter_named():
    with pytest.raises(ValueError, match="chunk_sizes"):
        stream_shares([4, -1], [(1, 1)], 0, 1)
    with pytest.raises(ValueError, match="rank"):
        stream_shares([4], [(1, 1)], 2, 1)
    with pytest.raises(ValueError, match="more items"):
        stream_shares([1], [(1, 1)], 0, 1)


def test_share_key_changes_with_any_field():
    base = {"plan": [1, 2, 4], "seed": 42, "epoch": 0, "workers": 2}
    assert share_key(**base) == share_key(**dict(reversed(list(base.items()))))
    for name, other in (("plan", [1, 2, 3]), ("seed", 41), ("epoch", 1), ("workers", 1)):
        assert share_key(**{**base, name: other}) != share_key(**base)


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_stream_of_unknown_length_is_cut_as_epoch_layout_cuts_it(drop_last):
    for plan, chunk_sizes, _, _, _ in _cases(300, seed=11 + int(drop_last)):
        total = sum(chunk_sizes)
        expected = [b.local_batch_sizes for b in epoch_layout(total, {0: plan}, drop_last)]
        batches = list(global_batches(iter(range(total)), plan.local_batch_sizes, drop_last))
        assert [sizes for _, sizes in batches] == expected
        taken = [i for items, _ in batches for i in items]
        assert taken == list(range(len(taken)))  # in stream order, each item once
        assert len(taken) == sum(map(sum, expected))
        assert all(len(items) == sum(sizes) for items, sizes in batches)
    with pytest.raises(ValueError, match="fewer than the 3 ranks"):
        list(global_batches(range(2), (1, 1, 1)))


def _replanned_cases(count: int, seed: int):
    """Random epochs whose plan changes at 1-4 steps (the total batch too), probes' alternations included."""
    rng = np.random.default_rng(seed)
    for plan, chunk_sizes, workers, shuffle, case_seed in _cases(count, seed):
        total = sum(chunk_sizes)
        steps = len(epoch_layout(total, {0: plan}))
        schedule = {0: plan}
        for k in sorted(set(rng.integers(1, max(2, steps + 1), size=int(rng.integers(1, 5))).tolist())):
            sizes = tuple(int(b) for b in rng.integers(1, 9, size=plan.world_size))
            if rng.random() < 0.3:  # a probe alternates two splits of one total
                sizes = tuple(sorted(schedule[max(schedule)].local_batch_sizes, reverse=bool(rng.integers(0, 2))))
            schedule[int(k)] = Plan(sizes)
        yield schedule, chunk_sizes, workers, shuffle, case_seed


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_plan_changed_mid_epoch_still_covers_every_item_once(drop_last):
    for schedule, chunk_sizes, workers, shuffle, seed in _replanned_cases(300, seed=21 + int(drop_last)):
        total = sum(chunk_sizes)
        layout = epoch_layout(total, schedule, drop_last)
        world = schedule[0].world_size
        shares = [
            replanned_shares(
                chunk_sizes, schedule, r, workers, shuffle, seed, epoch=4, drop_last=drop_last, window=seed % 5
            )
            for r in range(world)
        ]
        # every rank runs the layout's steps, with its sizes under the plan of each step
        for rank, steps in enumerate(shares):
            assert [len(ids) for ids in steps] == [batch.local_batch_sizes[rank] for batch in layout]
        taken = np.concatenate([ids for steps in shares for ids in steps])
        assert len(np.unique(taken)) == len(taken), "an item is read twice"
        assert len(taken) == sum(sum(batch.local_batch_sizes) for batch in layout)
        if not drop_last:
            assert sorted(taken.tolist()) == list(range(total))


def test_the_steps_drawn_before_a_change_keep_their_items():
    # a rank draws batches ahead of training (workers, prefetching): a plan decided later must not move their items
    for schedule, chunk_sizes, workers, shuffle, seed in _replanned_cases(300, seed=31):
        changes = sorted(k for k in schedule if k > 0)
        for rank in range(schedule[0].world_size):
            cache: dict = {}  # kept across the schedule's growth, as the sampler keeps it through an epoch
            final = replanned_shares(chunk_sizes, schedule, rank, workers, shuffle, seed, epoch=2)
            for k in changes:
                before = {key: plan for key, plan in schedule.items() if key < k}
                known = replanned_shares(chunk_sizes, before, rank, workers, shuffle, seed, epoch=2, cache=cache)
                assert [ids.tolist() for ids in known[:k]] == [ids.tolist() for ids in final[:k]]
            grown = replanned_shares(chunk_sizes, schedule, rank, workers, shuffle, seed, epoch=2, cache=cache)
            assert [ids.tolist() for ids in grown] == [ids.tolist() for ids in final], "the cache changed the ids"


def test_one_plan_deals_as_a_whole_epoch_and_the_order_follows_seed_and_history():
    chunk_sizes, plan, other = [8] * 12 + [5], Plan((1, 2, 4)), Plan((4, 2, 1))
    layout = epoch_layout(sum(chunk_sizes), {0: plan})
    whole = stream_shares(chunk_sizes, [b.local_batch_sizes for b in layout], 2, 2, True, 42, 0)
    assert [s.tolist() for s in replanned_shares(chunk_sizes, {0: plan}, 2, 2, True, 42, 0)] == [
        s.tolist() for s in whole
    ]

    def run(schedule, seed=42):
        return [s.tolist() for s in replanned_shares(chunk_sizes, schedule, 2, 2, True, seed, 0)]

    assert run({0: plan, 5: other}) == run({0: plan, 5: other})
    assert run({0: plan, 5: other}) != run({0: plan, 6: other})
    assert run({0: plan, 5: other}) != run({0: plan, 5: other}, seed=43)
    assert run({0: plan, 5: plan}) == run({0: plan})  # the same split again: nothing is dealt anew
    with pytest.raises(ValueError, match="entry for step 0"):
        replanned_shares(chunk_sizes, {3: plan}, 0, 1)
