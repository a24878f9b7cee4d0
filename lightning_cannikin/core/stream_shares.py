"""Uneven per-rank shares of a chunked stream: which items each rank and each of its workers reads in every step.

A chunked data set (LitData's ``optimize`` output) is ``N`` items stored in chunks of known sizes; item ``i`` is the
``i``-th over the chunks in storage order. One epoch is laid out as global batches by
:func:`~lightning_cannikin.core.layout.epoch_layout`, exactly as for map-style data: every rank ``r`` takes ``b_r``
items per step, ``S = N // B`` full steps with ``B = sum(b_r)``, and the remainder ``N - S*B`` is split in proportion
to the plan (folded into the last full step when it has fewer items than ranks), so every item is used once and every
rank runs the same number of steps with at least one item in each.

What differs from map-style data is where each rank's items come from. Reading a stream is cheap only in order, so
each rank reads one contiguous run of the epoch's chunk order (whole chunks, cut at single items only where two ranks
meet, as LitData cuts them), and within a rank each DataLoader worker reads one contiguous block of that run: step
``k`` of a rank is produced by worker ``k % num_workers`` (the order a DataLoader asks its workers in), so a worker's
block holds exactly the items of its steps. With ``shuffle`` the chunk order is a seeded permutation per epoch and
the items of each chunk are permuted within the worker's block, which reads its chunks one after another, as
LitData's own shuffle does (keeping together the items its reader decodes as one window, where it has windows).
Everything is a function of ``(chunk sizes, every rank's step sizes, rank, workers, shuffle, seed, epoch)``, so a rank
can rebuild any step of the epoch (a resume) without asking anyone.

A plan changed mid-epoch (:func:`replanned_shares`) deals the items the steps before it left afresh, under the new
plan, the same way; the plan history of the epoch is then part of what the ids are a function of.

Pure: numpy only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import islice
from typing import Any

import numpy as np

from lightning_cannikin.core.layout import epoch_layout
from lightning_cannikin.core.plan import Plan, proportional_sizes

__all__ = ["global_batches", "item_order", "rank_span", "replanned_shares", "share_key"]


def item_order(chunk_sizes: Sequence[int], shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The epoch's items, whole chunks in (seeded, shuffled) chunk order, each chunk's items in storage order."""
    sizes = np.asarray(chunk_sizes, dtype=np.int64)
    if sizes.ndim != 1 or (sizes < 0).any():
        raise ValueError(f"`chunk_sizes` must be non-negative item counts, got {list(chunk_sizes)}.")
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])) if len(sizes) else sizes
    chunks = np.arange(len(sizes))
    if shuffle:
        chunks = np.random.RandomState([int(seed), int(epoch)]).permutation(chunks)
    if not len(chunks):
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(starts[c], starts[c] + sizes[c], dtype=np.int64) for c in chunks])


def rank_span(step_sizes: Sequence[Sequence[int]], rank: int) -> tuple[int, int]:
    """``(offset, count)`` of ``rank``'s run in the epoch's item order: the ranks' runs in rank order, each as long
    as the rank's items over the epoch's steps."""
    totals = np.asarray(step_sizes, dtype=np.int64).reshape(len(step_sizes), -1).sum(axis=0)
    if not 0 <= rank < len(totals):
        raise ValueError(f"`rank` must be in [0, {len(totals)}), got {rank}.")
    return int(totals[:rank].sum()), int(totals[rank])


def replanned_shares(
    chunk_sizes: Sequence[int],
    schedule: Mapping[int, Plan],
    rank: int,
    num_workers: int,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
    window: int = 0,
    cache: dict[tuple, _Segment] | None = None,
) -> list[np.ndarray]:
    """``rank``'s item ids for every step of an epoch whose plan changes at the steps ``schedule`` names.

    The epoch is cut into segments where the plan changes. The first is dealt as the module's docstring deals a whole
    epoch under its plan. At a change at step ``k``, every rank knows which items the steps before ``k`` took (each
    rank's ids are a function of the same rank-independent inputs), so the items left, in the epoch's item order, are
    dealt afresh under the new plan for the rest of the epoch (runs per rank, blocks per worker, as for a whole epoch;
    the within-chunk shuffle seeded by ``(seed, epoch, k)`` too). A segment is dealt from the schedule up to its own
    start only, so the steps a rank drew before a change was known keep their items when it is: every item is used
    once, and the same seed, data and plan history give the same ids. A change to the plan already in force deals
    nothing anew.

    Args:
        chunk_sizes: items in each chunk, in storage order.
        schedule: the plan in force from each step on (key 0 present), as :func:`~lightning_cannikin.core.layout.
            epoch_layout` takes it.
        rank: the rank whose steps are returned.
        num_workers: the rank's DataLoader workers (0: one).
        shuffle: a seeded chunk order per epoch, and a shuffle within each worker's chunks.
        seed: the shared seed.
        epoch: the epoch.
        drop_last: drop the epoch's last, partial global batch.
        window: the reader's decode window (items of a chunk deserialized together; 0: per item or whole chunks):
            the shuffle within a chunk keeps each window's items together.
        cache: a dict kept between calls for the same data, epoch and settings: segments already dealt are reused
            (a change mid-epoch then deals the items left once, not the epoch again).

    """
    if 0 not in schedule:
        raise ValueError("The plan schedule needs an entry for step 0.")
    total = sum(int(c) for c in chunk_sizes)
    layout = epoch_layout(total, dict(schedule), drop_last)
    starts = _deal_starts(schedule, len(layout))
    cache = {} if cache is None else cache
    sizes_of_chunks = np.asarray(chunk_sizes, dtype=np.int64)
    steps: list[np.ndarray] = []
    pool: np.ndarray | None = None
    used: set[tuple] = set()
    for j, start in enumerate(starts):
        # the segment is dealt from what was known when it began: the schedule up to its start
        known = {k: plan for k, plan in schedule.items() if k <= start}
        key = tuple((k, plan.local_batch_sizes) for k, plan in sorted(known.items()))
        used.add(key)
        if key not in cache:
            if pool is None:  # the epoch's first segment: the whole item order
                pool = item_order(chunk_sizes, shuffle, seed, epoch)
            sizes = [batch.local_batch_sizes for batch in epoch_layout(total, known, drop_last)[start:]]
            prefix = ([int(seed), int(epoch)] + ([start] if start else [])) if shuffle else None
            cache[key] = _Segment(start, pool, sizes, prefix)
        segment = cache[key]
        stop = starts[j + 1] if j + 1 < len(starts) else len(layout)
        steps.extend(segment.deal(rank, sizes_of_chunks, num_workers, window)[: stop - start])
        if j + 1 < len(starts):  # the items the segment's steps took, on every rank, leave the pool
            pool = segment.left_at(stop, total, sizes_of_chunks, num_workers, window)
    for key in [key for key in cache if key not in used]:  # segments of a schedule since replaced
        del cache[key]
    return steps


class _Segment:
    """Steps from ``start`` on dealt from ``pool`` under the split known at ``start``; each rank's ids dealt once, when
    asked (another rank's only when a later segment needs to know what it took)."""

    def __init__(self, start: int, pool: np.ndarray, sizes: list[tuple[int, ...]], prefix: list[int] | None) -> None:
        self.start, self.pool, self.sizes, self.prefix = start, pool, sizes, prefix
        self.deals: dict[int, list[np.ndarray]] = {}
        self.left: dict[int, np.ndarray] = {}

    def left_at(self, stop: int, total: int, chunk_sizes: np.ndarray, num_workers: int, window: int) -> np.ndarray:
        """The pool's items that no rank took in the segment's steps before ``stop``, in the pool's order."""
        if stop not in self.left:
            taken = np.zeros(total, dtype=bool)
            for rank in range(len(self.sizes[0])):
                for ids in self.deal(rank, chunk_sizes, num_workers, window)[: stop - self.start]:
                    taken[ids] = True
            self.left[stop] = self.pool[~taken[self.pool]]
        return self.left[stop]

    def deal(self, rank: int, chunk_sizes: np.ndarray, num_workers: int, window: int) -> list[np.ndarray]:
        if rank not in self.deals:
            self.deals[rank] = _deal(
                self.pool, chunk_sizes, self.sizes, rank, num_workers, self.prefix, self.start, window
            )
        return self.deals[rank]


def _deal_starts(schedule: Mapping[int, Plan], num_steps: int) -> list[int]:
    """The steps where the items left are dealt afresh: 0, and every step of the epoch where the split changes."""
    starts, current = [0], schedule[0].local_batch_sizes
    for k in sorted(schedule):
        sizes = schedule[k].local_batch_sizes
        if 0 < k < num_steps and sizes != current:
            starts.append(k)
        current = sizes
    return starts


def _deal(
    items: np.ndarray,
    chunk_sizes: np.ndarray,
    step_sizes: Sequence[Sequence[int]],
    rank: int,
    num_workers: int,
    shuffle_seed: list[int] | None,
    first_step: int = 0,
    window: int = 0,
) -> list[np.ndarray]:
    """``rank``'s ids of ``step_sizes``' steps, dealt from ``items`` (in order): the ranks' runs in rank order, the
    workers' blocks in worker order within a run (step ``first_step + i`` is worker ``(first_step + i) % workers``'),
    each block shuffled within its chunks (and decode windows of ``window`` items) where ``shuffle_seed`` is given."""
    if int(np.asarray(step_sizes, dtype=np.int64).sum()) > len(items):
        raise ValueError(f"The steps hold more items than the {len(items)} the chunks have.")
    offset, count = rank_span(step_sizes, rank)
    mine = items[offset : offset + count]
    workers = max(1, int(num_workers))
    sizes = [int(step[rank]) for step in step_sizes]
    owner = [(first_step + i) % workers for i in range(len(sizes))]
    # worker w serves its steps in order: its block holds exactly their items, blocks in worker order
    counts = [sum(size for size, w in zip(sizes, owner, strict=True) if w == worker) for worker in range(workers)]
    bounds = np.concatenate(([0], np.cumsum(counts)))
    blocks = [mine[bounds[w] : bounds[w + 1]] for w in range(workers)]
    if shuffle_seed is not None:
        ends = np.cumsum(chunk_sizes)
        seeds = [[*shuffle_seed, rank, w] for w in range(workers)]
        blocks = [_shuffle_within_chunks(block, chunk_sizes, ends, seeds[w], window) for w, block in enumerate(blocks)]
    cursors = [0] * workers
    steps = []
    for size, w in zip(sizes, owner, strict=True):
        steps.append(blocks[w][cursors[w] : cursors[w] + size])
        cursors[w] += size
    return steps


def _shuffle_within_chunks(
    block: np.ndarray, chunk_sizes: np.ndarray, chunk_ends: np.ndarray, seed: list[int], window: int = 0
) -> np.ndarray:
    """``block``'s items permuted within each chunk, the chunks kept in their order: a worker reads one chunk after
    another (a chunk switch per item costs LitData's reader about 40x a read in order), as LitData's own shuffle
    does. With a ``window`` of at least 2 (LitData's decode window: it deserializes the aligned items ``[kW, (k+1)W)``
    of a chunk together and keeps the last such window), the items are permuted within each aligned window and the
    windows of a chunk are permuted, so every window is decoded once, not again at every return to it."""
    if len(block) < 2:
        return block
    chunks = np.searchsorted(chunk_ends, block, side="right")
    random = np.random.RandomState(seed)
    keys = random.random_sample(len(block))
    runs = np.cumsum(np.r_[0, np.diff(chunks) != 0])
    if window < 2:
        return block[np.lexsort((keys, runs))]
    windows = (block - (chunk_ends[chunks] - chunk_sizes[chunks])) // window
    # a run holds one chunk's items in ascending order, so each window's items are adjacent: one random key per
    # window, the order of a run's windows
    group = np.cumsum(np.r_[0, (np.diff(runs) != 0) | (np.diff(windows) != 0)])
    window_keys = random.random_sample(int(group[-1]) + 1)[group]
    return block[np.lexsort((keys, window_keys, runs))]


def share_key(**fields: object) -> str:
    """A short digest of what a rank's shares depend on (JSON-able values): ranks compare it before an epoch, so a
    rank with another plan, seed, data set or worker count stops with a clear error instead of reading other items."""
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def global_batches(
    items: Iterable[Any], local_batch_sizes: Sequence[int], drop_last: bool = False
) -> Iterator[tuple[list[Any], tuple[int, ...]]]:
    """A stream of unknown length cut into global batches: ``(the batch's items, every rank's count)``, rank ``r``
    taking the ``r``-th contiguous slice.

    The steps are :func:`~lightning_cannikin.core.layout.epoch_layout`'s for the stream's length, found by reading one
    global batch ahead: full batches of the plan, then the remainder split in proportion to the plan (folded into
    the last full batch when it has fewer items than ranks; dropped with ``drop_last``). For a stream every rank
    reads whole (an ``IterableDataset`` without per-rank shares).

    Raises:
        ValueError: when the stream has fewer items than ranks.

    """
    sizes = tuple(int(b) for b in local_batch_sizes)
    total, world = sum(sizes), len(sizes)
    stream = iter(items)
    previous: list[Any] | None = None
    while True:
        batch = list(islice(stream, total))
        if len(batch) == total:
            if previous is not None:
                yield previous, sizes
            previous = batch
            continue
        if batch and not drop_last:
            if len(batch) >= world:
                if previous is not None:
                    yield previous, sizes
                previous, last = None, batch
            elif previous is not None:  # too few left to give every rank one: fold them into the last full batch
                previous, last = None, previous + batch
            else:
                raise ValueError(f"The stream has {len(batch)} items, fewer than the {world} ranks.")
            yield last, proportional_sizes(len(last), sizes)
        if previous is not None:
            yield previous, sizes
        return
