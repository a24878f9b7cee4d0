"""Any ``IterableDataset`` under ``strategy="cannikin"``: every rank reads the whole stream and keeps its slice.

A stream without an index (Hugging Face ``datasets`` streaming, WebDataset, a plain generator) cannot be given uneven
per-rank shares without a coordinator, so every rank reads the same stream, cuts it into global batches
(:func:`~lightning_cannikin.core.stream_shares.global_batches`: the plan's sizes, the remainder split as for map-style
data) and keeps its contiguous slice of each. That is exact and needs nothing from the data set, but reading and
decoding cost the world size times a single reader's, which the strategy says once at the start; LitData's
``StreamingDataset`` (:mod:`lightning_cannikin.training.data.streaming`) reads every item once.

The user's DataLoader keeps its workers (they read the stream as they would for one process) and its collate function
(applied to the rank's slice in the main process). The stream must give every rank the same items in the same order:
a shuffle must be seeded alike on every rank, and a stream already split by node (``split_dataset_by_node``, a
WebDataset ``nodesplitter``) is refused. Before each epoch the ranks compare a digest of its first global batch and
stop together with a clear error when they differ. Plans change at epoch boundaries; gradient accumulation is not
supported (a window's later sizes are not known until they are read).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_cannikin.core.plan import Plan
from lightning_cannikin.core.stream_shares import global_batches
from lightning_cannikin.training.data.loader import UnevenDataLoader, kept_arguments
from lightning_cannikin.training.data.sampler import UnevenBatchSampler
from lightning_cannikin.training.data.stream_checks import check_replicable

__all__ = ["ReplicatedStreamLoader", "StreamSliceSampler", "rebuild_replicated"]


class StreamSliceSampler(UnevenBatchSampler):
    """Reads the stream in the main process and hands the loader one global batch position at a time; every rank's
    sizes of a global batch are known once it has been read (the epoch's length only at its end)."""

    mid_epoch_plans = False  # the engine re-plans at epoch ends only

    def __init__(self, read: Callable[[], Iterator[Any]], rank: int, plan: Plan, drop_last: bool = False) -> None:
        super().__init__(max(plan.global_batch_size, 1), rank, plan, shuffle=False, drop_last=drop_last)
        self._read = read
        self._sizes: dict[int, tuple[int, ...]] = {}
        self.slices: dict[int, list[Any]] = {}  # this rank's items of each position handed out, until fetched
        self.in_epoch = False

    def set_plan(self, plan: Plan, from_batch: int = 0, interleave: tuple[Plan, int] | None = None) -> None:
        if from_batch > 0 and self.in_epoch:
            raise RuntimeError(
                f"A replicated stream's split changes at epoch boundaries only (a plan from global batch {from_batch})."
            )
        self.schedule = {0: plan}

    def sizes_at(self, batch_index: int) -> tuple[int, ...]:
        return self._sizes[batch_index]

    def __len__(self) -> int:
        raise TypeError("A replicated stream's length is known only at the end of its epoch.")

    def __iter__(self) -> Iterator[list[int]]:
        plan = self.schedule[0]
        self._sizes, self.slices, self.in_epoch = {}, {}, True
        self.yielded = self.start_batch
        try:
            for position, (items, sizes) in enumerate(
                global_batches(self._read(), plan.local_batch_sizes, self.drop_last)
            ):
                self._sizes[position] = sizes
                if position == 0:
                    check_first_batch(items, plan)
                if position < self.start_batch:  # a resumed epoch: read past what was trained on
                    continue
                mine = sum(sizes[: self.rank])
                self.slices[position] = items[mine : mine + sizes[self.rank]]
                self.yielded = position + 1
                yield [position]
        finally:
            self.in_epoch = False


def check_first_batch(items: list[Any], plan: Plan) -> None:
    """The ranks compare a digest of the epoch's first global batch (one small all-gather) and all raise the same
    error when they differ: a stream that is not the same on every rank would give wrong batches, and could end on
    different steps."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    hasher = hashlib.sha256()
    try:
        _fingerprint(items, hasher)
        digest = hasher.hexdigest()[:16]
    except Exception:  # items that neither are tensors, arrays, containers nor pickle: their count only
        digest = f"{len(items)} items"
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (digest, list(plan.local_batch_sizes)))
    if len({repr(entry) for entry in every}) > 1:
        ranks = ", ".join(f"rank {r}: {d} under plan {p}" for r, (d, p) in enumerate(every))
        raise ValueError(
            f"The ranks read different first global batches of the training stream ({ranks}). Every rank reads the"
            " whole stream and keeps its slice: it must give every rank the same items in the same order (seed its"
            " shuffle alike on every rank; do not split it by rank), and every rank must run the same plan."
        )


def _fingerprint(value: Any, hasher: Any) -> None:
    """Feed ``value``'s content to ``hasher`` alike in every process (a tensor's pickle is not: it names storages)."""
    if isinstance(value, torch.Tensor):
        hasher.update(f"tensor{tuple(value.shape)}{value.dtype}".encode())
        hasher.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        hasher.update(f"array{value.shape}{value.dtype}".encode())
        hasher.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict):
        hasher.update(b"dict")
        for key in sorted(value, key=repr):
            hasher.update(repr(key).encode())
            _fingerprint(value[key], hasher)
    elif isinstance(value, (list, tuple)):
        hasher.update(f"{type(value).__name__}{len(value)}".encode())
        for item in value:
            _fingerprint(item, hasher)
    elif value is None or isinstance(value, (bool, int, float, str, bytes)):
        hasher.update(repr(value).encode())
    else:
        hasher.update(pickle.dumps(value))


class _Positions(Dataset):
    """``view[position]`` is this rank's collated slice of the global batch the sampler just read."""

    def __init__(self, sampler: StreamSliceSampler, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.sampler, self.collate_fn = sampler, collate_fn

    def __len__(self) -> int:
        raise TypeError("A replicated stream has no length.")

    def __getitem__(self, position: int) -> Any:
        return self.collate_fn(self.sampler.slices.pop(position))


def _one(batch: list[Any]) -> Any:
    return batch[0]


def _items(batch: Any) -> Any:
    return batch


class ReplicatedStreamLoader(UnevenDataLoader):
    """An :class:`UnevenDataLoader` whose positions come from a stream every rank reads whole."""

    def state_dict(self) -> dict[str, Any]:
        # Lightning's fetcher reads one batch ahead of a loader without a length (to know the epoch's last): the
        # position saved is that of the batches whose steps began, so the resume reads past those only
        state = super().state_dict()
        state["batches_consumed"] -= len(self.pending_steps)
        return state

    def _resume_position(self) -> int:
        restore = self._restore
        sampler = self.uneven_sampler
        if restore is not None and restore.get("epoch") == sampler.sampler.epoch:
            plans = {Plan.from_dict(plan) for _, plan in restore["schedule"]}
            if len(plans) != 1 or next(iter(plans)).world_size != sampler.schedule[0].world_size:
                raise ValueError(
                    "The checkpoint's epoch of a replicated stream ran on another world size; it cannot be continued"
                    " here. Resume on the same devices, or from a checkpoint saved at an epoch's end."
                )
        return super()._resume_position()


def rebuild_replicated(dataloader: DataLoader, plan: Plan, rank: int, world_size: int) -> ReplicatedStreamLoader:
    """The training loader over ``dataloader``'s ``IterableDataset``: every rank reads the stream with the user's
    workers and keeps its slice of each global batch under ``plan``."""
    check_replicable(dataloader)
    dataset: IterableDataset = dataloader.dataset  # type: ignore[assignment]
    options = kept_arguments(dataloader)
    options.pop("collate_fn", None)  # the stream is read item by item here; the rank's slice is collated afterwards

    def read() -> Iterator[Any]:
        # single items in the stream's own order (the workers' interleaving is the DataLoader's, the same everywhere)
        return iter(DataLoader(dataset, batch_size=None, collate_fn=_items, **options))

    rank_zero_info(
        f"Cannikin: the training stream ({type(dataset).__name__}) has no per-rank shares, so each of the"
        f" {world_size} ranks reads and decodes all of it and keeps its slice of each global batch: {world_size}x a"
        " single reader's input cost. LitData's `StreamingDataset` reads every item once (`litdata.optimize`)."
    )
    sampler = StreamSliceSampler(read, rank, plan, drop_last=bool(dataloader.drop_last))
    return ReplicatedStreamLoader(_Positions(sampler, dataloader.collate_fn), batch_sampler=sampler, collate_fn=_one)
