"""Uneven distributed batch sampling: one shared permutation per epoch, a contiguous slice of it per rank.

Every rank builds the same seeded permutation each epoch and walks it one global batch at a time, laid out by
:func:`lightning_cannikin.core.layout.epoch_layout`; every rank therefore knows every other rank's batch sizes, which
the strategy uses to weight the gradient all-reduce exactly. :class:`UnevenDistributedSampler` is the same sampler for
a plain ``torch.distributed`` loop (no Lightning needed; see ``examples/torch_distributed.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence, Sized

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from lightning_cannikin.core.layout import GlobalBatch, epoch_layout
from lightning_cannikin.core.plan import Plan


class EpochPermutation(Sampler[int]):
    """The permutation every rank shares for one epoch; Lightning calls :meth:`set_epoch` on it.

    Args:
        num_samples: length of the map-style dataset.
        shuffle: draw a fresh seeded permutation each epoch; otherwise ``0..num_samples-1``.
        seed: base seed; the epoch's permutation is seeded with ``seed + epoch`` so that ranks agree.

    """

    def __init__(self, num_samples: int, shuffle: bool = True, seed: int = 0) -> None:
        self.num_samples = int(num_samples)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose permutation is drawn next."""
        self.epoch = int(epoch)

    def permutation(self) -> list[int]:
        """The indices of the current epoch, in the order all ranks consume them."""
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.permutation())

    def __len__(self) -> int:
        return self.num_samples


class UnevenBatchSampler(Sampler[list[int]]):
    """Yields this rank's index lists: ``b_rank`` consecutive indices of each global batch.

    Args:
        num_samples: length of the map-style dataset.
        rank: this process's global rank.
        plan: the split in force from the first batch of the epoch on.
        shuffle: shuffle the shared permutation each epoch.
        seed: shared seed (must be equal on all ranks).
        drop_last: drop the final partial global batch.

    """

    def __init__(
        self,
        num_samples: int,
        rank: int,
        plan: Plan,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"`rank` must be in [0, {plan.world_size}), got {rank}.")
        self.sampler = EpochPermutation(num_samples, shuffle=shuffle, seed=seed)
        self.rank = rank
        self.drop_last = drop_last
        self.schedule: dict[int, Plan] = {0: plan}
        self.start_batch = 0
        # (batch index, sample offset) when continuing an epoch that a different world size began
        self.resume: tuple[int, int] = (0, 0)
        # global batches handed out so far this epoch; a mid-epoch plan may only start at or after it
        self.yielded = 0
        self._layout: list[GlobalBatch] | None = None
        self._layout_key: tuple | None = None
        self._permutation: tuple[int, list[int]] | None = None  # (epoch, its permutation)

    @property
    def num_samples(self) -> int:
        return self.sampler.num_samples

    def set_plan(self, plan: Plan, from_batch: int = 0, interleave: tuple[Plan, int] | None = None) -> None:
        """Put ``plan`` in force from global batch ``from_batch`` of the epoch on (later entries are replaced);
        ``interleave``: ``(other, steps)``: for ``steps`` global batches alternate ``plan`` and ``other`` (the same
        global batch) first. A probe interleaved with the split it left is timed beside it, so a trend in the device's
        speed (its first steps) cannot read as a slope."""
        if plan.world_size != self.schedule[0].world_size:
            raise ValueError(
                f"The new plan splits across {plan.world_size} ranks but this sampler serves"
                f" {self.schedule[0].world_size}."
            )
        other, steps = interleave if interleave is not None else (plan, 0)
        if other.global_batch_size != plan.global_batch_size:
            steps = 0  # the epoch's layout would change length: never for a probe, which keeps the total
        self.schedule = {k: v for k, v in self.schedule.items() if k < from_batch}
        for offset in range(steps + 1):  # increasing batches: each entry keeps the ones before it
            self.schedule[from_batch + offset] = other if offset % 2 else plan
        self.schedule[from_batch + steps] = plan
        if 0 not in self.schedule:
            self.schedule[0] = plan

    def collapse_schedule(self) -> None:
        """Keep only the latest plan, from batch 0: what a new epoch starts with."""
        self.schedule = {0: self.schedule[max(self.schedule)]}
        self.resume = (0, 0)

    def layout(self) -> list[GlobalBatch]:
        """The current epoch's global batches (cached until the plan schedule changes)."""
        key = (self.num_samples, tuple(sorted(self.schedule.items())), self.drop_last, self.resume)
        if self._layout is None or key != self._layout_key:
            self._layout = epoch_layout(self.num_samples, self.schedule, self.drop_last, self.resume)
            self._layout_key = key
        return self._layout

    def plan_at(self, batch_index: int) -> Plan:
        """The plan global batch ``batch_index`` of the current epoch runs (a probe alternates two of one total)."""
        return self.schedule[max((k for k in self.schedule if k <= batch_index), default=0)]

    def sizes_at(self, batch_index: int) -> tuple[int, ...]:
        """Every rank's sample count in global batch ``batch_index`` of the current epoch."""
        return self.layout()[batch_index].local_batch_sizes

    def _epoch_permutation(self) -> list[int]:
        """The current epoch's shared permutation (drawn once per epoch)."""
        epoch = self.sampler.epoch
        if self._permutation is None or self._permutation[0] != epoch:
            self._permutation = (epoch, self.sampler.permutation())
        return self._permutation[1]

    def __iter__(self) -> Iterator[list[int]]:
        index = self.start_batch
        self.yielded = index
        # the layout is re-read per batch: a plan set mid-epoch from a batch not yet yielded takes effect in time
        while index < len(self.layout()):
            index += 1
            self.yielded = index
            yield self._rank_indices(index - 1)

    def _rank_indices(self, batch_index: int) -> list[int]:
        """This rank's indices of global batch ``batch_index``: its contiguous slice of the batch."""
        return self._epoch_permutation()[self.layout()[batch_index].rank_slice(self.rank)]

    def __len__(self) -> int:
        return len(self.layout())


class UnevenDistributedSampler(UnevenBatchSampler):
    """Uneven local batches for any ``torch.distributed`` training loop: a DataLoader's ``batch_sampler``.

    Every rank draws the same seeded permutation each epoch and takes ``local_batch_sizes[rank]`` consecutive indices
    of each global batch. Every rank yields the same number of batches (so no rank waits forever in an all-reduce) and
    every sample is drawn exactly once per epoch: the last, partial global batch is split in proportion to the sizes
    (folded into the previous one when it has fewer samples than ranks) unless ``drop_last``.

    Every rank's loss is a mean over its own batch, so averaging gradients over ranks, as DDP does, over-weights the
    small batches. Multiply each rank's loss by the world size times :meth:`weight` (its share of the step's samples)
    and DDP's own average is the exact mean gradient over the global batch (equally: weight each rank's gradient by
    :meth:`weight` and *sum* over the ranks).

    Args:
        dataset: the map-style dataset, or its length.
        local_batch_sizes: samples per step of each rank, in global rank order (at least one each).
        rank: this process's global rank; default: ``torch.distributed``'s, which then also checks the world size.
        shuffle: a fresh seeded permutation each epoch (call :meth:`set_epoch`); otherwise the dataset's order.
        seed: the permutation's seed, equal on every rank.
        drop_last: drop the last, partial global batch.

    Example::

        sampler = UnevenDistributedSampler(dataset, local_batch_sizes=[48, 16])
        loader = DataLoader(dataset, batch_sampler=sampler)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for step, (x, y) in enumerate(loader):
                loss = loss_fn(ddp(x), y)  # the mean loss over this rank's batch
                (loss * (dist.get_world_size() * sampler.weight(step))).backward()
                optimizer.step()
                optimizer.zero_grad()

    """

    def __init__(
        self,
        dataset: Sized | int,
        local_batch_sizes: Sequence[int],
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        plan = Plan(tuple(local_batch_sizes))
        if rank is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError("Pass `rank=`: torch.distributed is not initialized, so the rank is unknown.")
            rank = dist.get_rank()
            if dist.get_world_size() != plan.world_size:
                raise ValueError(
                    f"`local_batch_sizes` has {plan.world_size} entries but the world size is"
                    f" {dist.get_world_size()}. Give one size per rank."
                )
        num_samples = dataset if isinstance(dataset, int) else len(dataset)
        if plan.global_batch_size > num_samples:
            raise ValueError(
                f"The global batch of {plan.global_batch_size} (`local_batch_sizes`={list(plan.local_batch_sizes)}) is"
                f" larger than the dataset ({num_samples} samples). Lower `local_batch_sizes`."
            )
        super().__init__(num_samples, rank, plan, shuffle=shuffle, seed=seed, drop_last=drop_last)

    @property
    def local_batch_sizes(self) -> tuple[int, ...]:
        """The sizes in force from the epoch's first batch."""
        return self.schedule[0].local_batch_sizes

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's permutation (call it with the same epoch on every rank before iterating)."""
        self.sampler.set_epoch(epoch)

    def set_local_batch_sizes(self, local_batch_sizes: Sequence[int]) -> None:
        """A new split for the epochs to come (call it between epochs, with the same sizes on every rank)."""
        self.set_plan(Plan(tuple(local_batch_sizes)), from_batch=0)

    def weight(self, batch_index: int) -> float:
        """This rank's share of the samples of global batch ``batch_index``: its gradient's weight in a summing
        all-reduce."""
        sizes = self.sizes_at(batch_index)
        return sizes[self.rank] / sum(sizes)
