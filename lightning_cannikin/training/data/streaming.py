"""LitData's ``StreamingDataset`` under ``strategy="cannikin"``: uneven per-rank shares of a chunked stream.

The user's ``StreamingDataset`` and ``StreamingDataLoader`` stay as they are; the strategy rebuilds the training loader
around them as it does for map-style data. Which items a rank reads in each step is
:mod:`~lightning_cannikin.core.stream_shares`' (every item once per epoch, steps of the plan, the same
number of steps on every rank); the loader's workers read them through the data set's own ``dataset[i]`` (LitData's
chunk reader, its ``transform`` and cache), and the user's collate function batches them. LitData's shuffler and its
resume state are not used: its ``get_chunks_and_intervals_per_workers`` gives every rank an even share, and its
resume re-stripes the stream evenly whenever the ranks' batch sizes differ (Lightning saves rank zero's loader state
only), which would read items twice and miss others. The position this loader saves is rank-independent (the epoch,
the global batches consumed, the plan), so every rank rebuilds its own place from rank zero's state exactly.

The plan may change mid-epoch, at any global batch no rank has drawn yet (the engine re-plans as for map-style data):
the items the batches before it took are known to every rank, and the items left are dealt afresh under the new plan
(:func:`~lightning_cannikin.core.stream_shares.replanned_shares`), so every item is still used once; the epoch's plan
history (the sampler's schedule) is in the saved state, so a resume deals the same. Before each epoch the ranks
compare a digest of everything their shares depend on and stop together with a clear error when any differs.

LitData is optional (``pip install "lightning-cannikin[litdata]"``): it is imported here only when a data set from it
is given, and this module is what the rest of the package reaches it through.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from lightning_cannikin.core.plan import Plan
from lightning_cannikin.core.stream_shares import replanned_shares, share_key
from lightning_cannikin.training.data.loader import UnevenDataLoader
from lightning_cannikin.training.data.sampler import UnevenBatchSampler
from lightning_cannikin.training.data.stream_checks import check_streaming

__all__ = ["StreamShareSampler", "StreamingUnevenLoader", "rebuild_streaming"]


def read_layout(dataset: Any) -> tuple[list[int], int]:
    """``(items in each chunk in storage order, the reader's decode window)`` of a LitData ``StreamingDataset``.

    The decode window is how many aligned items of a chunk LitData's reader deserializes together (it keeps the last
    such window; 0: item by item or whole chunks), which the shuffle within a chunk keeps together. Both are read off
    LitData's private cache and item loader (the `litdata` extra pins the versions tested); a reader without the
    attribute counts as item by item.
    """
    from litdata.utilities.env import _WorkerEnv

    cache = dataset._create_cache(worker_env=_WorkerEnv.detect())
    # each interval is (chunk start, region start, region end, chunk end); `dataset[i]` counts region items
    sizes = [int(interval[2]) - int(interval[1]) for interval in cache.get_chunk_intervals()]
    loader = getattr(getattr(cache, "_reader", None), "_item_loader", None)
    window = getattr(loader, "_batch_rows", None)
    return sizes, int(window) if isinstance(window, int) and window > 1 else 0


class StreamShareSampler(UnevenBatchSampler):
    """This rank's item ids of a chunked stream, one list per global batch of the epoch.

    The epoch's layout (every rank's size in each step, plans set mid-epoch included) is :class:`UnevenBatchSampler`'s;
    the ids are :func:`~lightning_cannikin.core.stream_shares.replanned_shares`'. Lightning selects the epoch through
    ``sampler.set_epoch``, as for map-style data.

    Args:
        chunk_sizes: items in each chunk of the data set, in storage order.
        rank: this process's global rank.
        plan: the split of the epoch.
        num_workers: the loader's workers (each reads one contiguous block of the rank's share).
        shuffle: a seeded chunk order and item order per epoch.
        seed: the shared seed.
        drop_last: drop the epoch's last, partial global batch.
        window: the reader's decode window (:func:`read_layout`): the shuffle within a chunk keeps its items together.

    """

    def __init__(
        self,
        chunk_sizes: list[int],
        rank: int,
        plan: Plan,
        num_workers: int,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        window: int = 0,
    ) -> None:
        super().__init__(sum(chunk_sizes), rank, plan, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.chunk_sizes = list(chunk_sizes)
        self.num_workers = int(num_workers)
        self.window = int(window)
        self._shares: list[np.ndarray] | None = None
        self._shares_key: tuple | None = None
        self._segments: dict[tuple, Any] = {}  # the epoch's dealt segments, reused when a plan change adds one

    def set_plan(self, plan: Plan, from_batch: int = 0, interleave: tuple[Plan, int] | None = None) -> None:
        if 0 < from_batch < self.yielded:
            raise RuntimeError(
                f"A plan for the stream from global batch {from_batch} comes too late: this rank has drawn"
                f" {self.yielded} batches of the epoch already, and their items cannot move. Put it in force from"
                " the next batch no rank has drawn (the engine does)."
            )
        super().set_plan(plan, from_batch, interleave)

    def reading(self) -> dict[str, Any]:
        """How this rank reads the stream, apart from the epoch and its plans: what a resume must repeat."""
        return {
            "items": self.num_samples,
            "seed": self.sampler.seed,
            "shuffle": self.sampler.shuffle,
            "num_workers": self.num_workers,
            "window": self.window,
        }

    def key(self) -> dict[str, Any]:
        """Everything this rank's shares depend on, which every rank must agree on."""
        return {
            "epoch": self.sampler.epoch,
            "plan": [[k, list(plan.local_batch_sizes)] for k, plan in sorted(self.schedule.items())],
            **self.reading(),
            "chunks": share_key(sizes=self.chunk_sizes),
            "drop_last": self.drop_last,
            "start": self.start_batch,
        }

    def shares(self) -> list[np.ndarray]:
        """This rank's ids in every global batch of the current epoch under the plans in force (cached until the
        epoch or the schedule changes; a plan set mid-epoch deals only the items left)."""
        schedule = tuple((k, plan.local_batch_sizes) for k, plan in sorted(self.schedule.items()))
        key = (self.sampler.epoch, schedule, self.drop_last)
        if self._shares is None or key != self._shares_key:
            previous = self._shares_key
            if previous is None or (previous[0], previous[2]) != (key[0], key[2]):
                self._segments = {}  # another epoch (or `drop_last`): nothing dealt before applies
            self._shares = replanned_shares(
                self.chunk_sizes,
                self.schedule,
                self.rank,
                self.num_workers,
                self.sampler.shuffle,
                self.sampler.seed,
                self.sampler.epoch,
                self.drop_last,
                self.window,
                cache=self._segments,
            )
            self._shares_key = key
        return self._shares

    def __iter__(self) -> Iterator[list[int]]:
        check_agreement(self.key())
        yield from super().__iter__()

    def _rank_indices(self, batch_index: int) -> list[int]:
        # the shares are re-read per batch: a plan set mid-epoch from a batch not yet drawn deals the items left
        return self.shares()[batch_index].tolist()


def check_agreement(key: dict[str, Any]) -> None:
    """Every rank compares what its shares depend on before an epoch (one small all-gather); all ranks raise the same
    clear error when any differs, so none reads another's items or waits in a collective."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (share_key(**key), key))
    if len({digest for digest, _ in every}) == 1:
        return
    fields = sorted({name for _, k in every for name in k if any(other[name] != k[name] for _, other in every)})
    table = "; ".join(
        f"{name}: " + ", ".join(f"rank {r}={k[name]}" for r, (_, k) in enumerate(every)) for name in fields
    )
    raise ValueError(
        f"The ranks disagree on what splits the stream ({table}). Every rank must train with the same plan, data"
        " set, seed, shuffle and `num_workers` (a plan set on one rank only, a DataLoader built differently per rank)."
    )


class _StreamItems(Dataset):
    """The stream as a map-style view (``view[i]`` is ``dataset[i]``): the loader's workers read the ids they get."""

    def __init__(self, stream: Any, num_items: int) -> None:
        self.stream = stream
        self.num_items = num_items

    def __len__(self) -> int:
        return self.num_items

    def __getitem__(self, index: int) -> Any:
        return self.stream[int(index)]


class StreamingUnevenLoader(UnevenDataLoader):
    """An :class:`UnevenDataLoader` over a LitData ``StreamingDataset``; its state names the stream's settings too,
    which a resume must repeat."""

    @property
    def stream_sampler(self) -> StreamShareSampler:
        assert isinstance(self.batch_sampler, StreamShareSampler)
        return self.batch_sampler

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "stream": self.stream_sampler.reading()}

    def _resume_position(self) -> int:
        restore = self._restore
        if restore is not None and restore.get("epoch") == self.stream_sampler.sampler.epoch:
            saved, reading = restore.get("stream"), self.stream_sampler.reading()
            if saved != reading:
                raise ValueError(
                    f"The checkpoint's training loader read the stream with {saved}, this run with"
                    f" {reading}. Resume with the same data set, seed, shuffle, `num_workers` and LitData"
                    " version (its decode window), or start the epoch afresh."
                )
            sizes = {Plan.from_dict(plan).world_size for _, plan in restore["schedule"]}
            if sizes != {self.stream_sampler.schedule[0].world_size}:
                raise ValueError(
                    f"The checkpoint's epoch of a streaming data set ran on {sorted(sizes)} ranks, this run has"
                    f" {self.stream_sampler.schedule[0].world_size}; its shares cannot be continued here. Resume on"
                    " the same number of devices, or from a checkpoint saved at an epoch's end."
                )
        return super()._resume_position()


def rebuild_streaming(dataloader: DataLoader, plan: Plan, rank: int, kept: dict[str, Any]) -> StreamingUnevenLoader:
    """The training loader over ``dataloader``'s ``StreamingDataset`` with this ``rank``'s shares under ``plan``
    (``kept``: the user's loader arguments carried over: workers, collate function, pinning)."""
    shuffle, seed = check_streaming(dataloader)
    dataset = dataloader.dataset
    chunk_sizes, window = read_layout(dataset)
    num_items = sum(chunk_sizes)
    if plan.global_batch_size > num_items:
        raise ValueError(
            f"The total batch size {plan.global_batch_size} is larger than the streaming data set ({num_items} items)."
            " Lower the DataLoader `batch_size` or `local_batch_sizes`."
        )
    # LitData's own `drop_last` (on by default when distributed) evens out the ranks' lengths, which the shares do
    # already: every item is kept unless the torch DataLoader itself drops the epoch's last partial batch
    drop_last = bool(getattr(dataloader, "drop_last", False))
    workers = int(kept.get("num_workers", 0))
    sampler = StreamShareSampler(
        chunk_sizes, rank, plan, workers, shuffle=shuffle, seed=seed, drop_last=drop_last, window=window
    )
    return StreamingUnevenLoader(_StreamItems(dataset, num_items), batch_sampler=sampler, **kept)
