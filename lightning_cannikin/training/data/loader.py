"""The training DataLoader the strategy hands to Lightning: the user's loader, re-batched unevenly.

It keeps the user's dataset, collate_fn, workers and pinning, swaps in an :class:`UnevenBatchSampler`, and counts
global batches as they *leave* the iterator (the sampler itself runs ahead with workers and prefetching). That count
is the rank-independent position Lightning saves in checkpoints through :meth:`state_dict`, and it tells the
strategy which global batch the training step in progress belongs to.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from lightning_cannikin.core.layout import epoch_layout
from lightning_cannikin.core.plan import Plan
from lightning_cannikin.training.data.cost_aware_sampler import CostAwareBatchSampler, SampleCosts, resolve_costs
from lightning_cannikin.training.data.sampler import UnevenBatchSampler
from lightning_cannikin.training.data.stream_checks import (
    check_replicable,
    check_streaming,
    is_litdata,
    is_litdata_loader,
)

# DataLoader arguments carried over from the user's loader unchanged.
_KEPT_ARGUMENTS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
)


class UnevenDataLoader(DataLoader):
    """A DataLoader over an :class:`UnevenBatchSampler` that tracks its position in the epoch.

    Attributes:
        pending_steps: ``(global batch index, every rank's sizes)`` of batches handed out but not yet trained on,
            oldest first; the engine pops one per training step
            (:meth:`~lightning_cannikin.training.engine.BalancingEngine.begin_step`).
        on_fetch: called when the loop asks for a batch after the epoch's first (set by the engine's
            :meth:`~lightning_cannikin.training.engine.BalancingEngine.training_loader`: the input's share of a step
            is timed from here).

    """

    def __init__(self, dataset: Dataset, batch_sampler: UnevenBatchSampler, **kwargs: Any) -> None:
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self.pending_steps: deque[tuple[int, tuple[int, ...]]] = deque()
        self.on_fetch: Callable[[], None] | None = None
        self.iterated = False  # a batch has been drawn from this loader
        self._position = 0
        self._restore: dict | None = None

    @property
    def uneven_sampler(self) -> UnevenBatchSampler:
        assert isinstance(self.batch_sampler, UnevenBatchSampler)
        return self.batch_sampler

    def __iter__(self) -> Iterator[Any]:
        # A generator, so lazy: Lightning creates an iterator while setting up data, before it selects the epoch,
        # and may discard it. Everything epoch-dependent (the resume position, the schedule) is decided at the first
        # `next()`.
        self.iterated = True
        sampler = self.uneven_sampler
        start = self._resume_position()
        if start == 0:
            sampler.collapse_schedule()  # a fresh epoch starts under the latest plan
        sampler.start_batch = self._position = start
        self.pending_steps.clear()
        for batch in super().__iter__():
            self.pending_steps.append((self._position, sampler.sizes_at(self._position)))
            self._position += 1
            yield batch
            if self.on_fetch is not None:  # resumed: the loop asks for the next batch, which the loop below fetches
                self.on_fetch()

    def _resume_position(self) -> int:
        """The global batch to continue from: the checkpoint's, if it is for this very epoch, else 0."""
        restore, self._restore = self._restore, None
        sampler = self.uneven_sampler
        if restore is None or restore["epoch"] != sampler.sampler.epoch or restore["batches_consumed"] <= 0:
            return 0
        position = int(restore["batches_consumed"])
        schedule = {int(k): Plan.from_dict(plan) for k, plan in restore["schedule"]}
        if all(plan.world_size == sampler.schedule[0].world_size for plan in schedule.values()):
            # the epoch's layout up to the checkpoint must be rebuilt exactly, mid-epoch re-plans included
            sampler.schedule = schedule
            return position
        # another world size began this epoch: find where its samples end and continue from there with ours
        consumed = epoch_layout(sampler.num_samples, schedule, sampler.drop_last)[:position]
        cursor = consumed[-1].start + sum(consumed[-1].local_batch_sizes)
        sampler.resume = (position, cursor)
        return position

    def state_dict(self) -> dict[str, Any]:
        """Rank-independent position: Lightning stores it with the fit loop's combined loader."""
        sampler = self.uneven_sampler
        return {
            "epoch": sampler.sampler.epoch,
            "batches_consumed": self._position,
            "schedule": [[k, plan.to_dict()] for k, plan in sorted(sampler.schedule.items())],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume lazily: applied on the next ``iter()`` and only if it is for the same epoch."""
        self._restore = dict(state)


def sampling_options(dataloader: DataLoader) -> tuple[bool, int]:
    """Read ``(shuffle, seed)`` off the sampler Lightning or the user put in the loader."""
    sampler = dataloader.sampler
    # Lightning wraps a user's own sampler in a DistributedSampler subclass; look through it
    inner = getattr(getattr(sampler, "dataset", None), "_sampler", None)
    if inner is not None:
        sampler = inner
    if type(sampler) is DistributedSampler:
        return sampler.shuffle, sampler.seed
    if type(sampler) is RandomSampler:
        return True, 0
    if type(sampler) is SequentialSampler:
        return False, 0
    raise ValueError(
        f"The training DataLoader uses a custom sampler ({type(sampler).__name__}). Cannikin must own the sampler to"
        " split each global batch unevenly; pass `shuffle=True/False` instead of a sampler, or use `strategy='ddp'`."
    )


def loader_batch_size(dataloader: DataLoader) -> int:
    """The per-device batch size of Lightning's convention, from ``batch_size`` or the batch sampler."""
    if dataloader.batch_size is not None:
        return int(dataloader.batch_size)
    batch_size = getattr(dataloader.batch_sampler, "batch_size", None)
    if batch_size is None:
        raise ValueError(
            "The training DataLoader has no `batch_size` (a custom `batch_sampler`?). Give the DataLoader a"
            " `batch_size`: Cannikin uses it as the initial per-device batch size."
        )
    return int(batch_size)


def check_trainable(dataloader: DataLoader, global_batch_size: int) -> tuple[bool, int]:
    """Refuse a training loader Cannikin cannot split, with the fix; returns its ``(shuffle, seed)``.

    Cheap (it reads the loader and the dataset's length), so the launching process can run it before it spawns.

    Raises:
        ValueError: for DataLoader subclasses, streams Cannikin cannot split exactly
            (:mod:`~lightning_cannikin.training.data.stream_checks`), custom samplers, or a global batch larger than the
            dataset.

    """
    dataset = dataloader.dataset
    streamed = is_litdata(dataset)
    if type(dataloader) not in (DataLoader, UnevenDataLoader) and not (streamed and is_litdata_loader(dataloader)):
        raise ValueError(
            f"The training DataLoader is a subclass ({type(dataloader).__name__}). Cannikin rebuilds the training"
            " loader around its own batch sampler, which would drop what the subclass adds. Use a plain"
            " `torch.utils.data.DataLoader` (move the subclass's logic into the Dataset, `collate_fn` or"
            " `worker_init_fn`: all are kept), or use `strategy='ddp'`."
        )
    if streamed:  # LitData's StreamingDataset: exact uneven shares of the stream (training/data/streaming.py)
        return check_streaming(dataloader)
    if isinstance(dataset, IterableDataset):
        # any other stream: every rank reads it whole and keeps its slice of each global batch (replicated_stream.py)
        return check_replicable(dataloader)
    options = sampling_options(dataloader)
    num_samples = len(dataset)  # type: ignore[arg-type]
    if global_batch_size > num_samples:
        raise ValueError(
            f"The total batch size {global_batch_size} is larger than the training dataset ({num_samples} samples)."
            " Lower the DataLoader `batch_size` or `local_batch_sizes`."
        )
    return options


def rebuild_uneven(
    dataloader: DataLoader, plan: Plan, rank: int, sample_costs: SampleCosts | None = None
) -> UnevenDataLoader:
    """A copy of ``dataloader`` whose batches follow ``plan`` on this ``rank`` (:func:`check_trainable` first);
    with ``sample_costs``, each global batch is split by cost (:class:`CostAwareBatchSampler`)."""
    shuffle, seed = check_trainable(dataloader, plan.global_batch_size)
    dataset = dataloader.dataset
    num_samples = len(dataset)  # type: ignore[arg-type]
    options = {"shuffle": shuffle, "seed": seed, "drop_last": dataloader.drop_last}
    costs = resolve_costs(sample_costs, dataset)
    if costs is None:
        batch_sampler = UnevenBatchSampler(num_samples, rank=rank, plan=plan, **options)
    else:
        batch_sampler = CostAwareBatchSampler(num_samples, rank, plan, costs, **options)
    return UnevenDataLoader(dataset, batch_sampler=batch_sampler, **kept_arguments(dataloader))


def kept_arguments(dataloader: DataLoader) -> dict[str, Any]:
    """The user's DataLoader arguments a rebuilt training loader keeps (workers, collate function, pinning, ...)."""
    kwargs = {name: getattr(dataloader, name) for name in _KEPT_ARGUMENTS if hasattr(dataloader, name)}
    if kwargs.get("num_workers", 0) == 0:
        # DataLoader rejects these without workers, even at their defaults' off values
        kwargs.pop("prefetch_factor", None)
        kwargs["persistent_workers"] = False
    return kwargs
