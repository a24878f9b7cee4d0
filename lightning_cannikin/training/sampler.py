"""Uneven distributed batch sampling: one shared permutation per epoch, a contiguous slice of it per rank.

Every rank builds the same seeded permutation of the dataset each epoch and walks it one *global batch* at a time.
Global batch ``p`` holds ``sum(b_i)`` consecutive indices of the permutation and rank ``i`` takes its own contiguous
``b_i`` of them. Because the layout depends only on the dataset length, the seed, the epoch and the plan schedule,
every rank knows every other rank's batch sizes without talking to it; the strategy uses that to weight the gradient
all-reduce exactly.

The epoch's tail: when fewer than a full global batch of samples remain, the remainder is split across the ranks in
proportion to the plan (nothing is dropped unless ``drop_last``); a remainder smaller than the number of ranks is
folded into the previous global batch so that no rank ever runs a step with zero samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import Sampler

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


@dataclass(frozen=True)
class GlobalBatch:
    """One step's slice of the permutation: where it starts and how many samples each rank takes."""

    start: int
    local_batch_sizes: tuple[int, ...]

    def rank_slice(self, rank: int) -> slice:
        offset = self.start + sum(self.local_batch_sizes[:rank])
        return slice(offset, offset + self.local_batch_sizes[rank])


def split_like(total: int, plan: Plan) -> tuple[int, ...]:
    """Split ``total`` samples across ranks in proportion to ``plan``, every rank getting at least one.

    Largest-remainder rounding keeps the split deterministic, so every rank computes the same answer.
    """
    weights = plan.local_batch_sizes
    n = len(weights)
    if total < n:
        raise ValueError(f"Cannot split {total} samples across {n} ranks with at least one sample each.")
    spare = total - n
    scale = sum(weights)
    raw = [spare * w / scale for w in weights]
    sizes = [1 + int(r) for r in raw]
    # hand out what rounding down left, largest fractional part first (ties to the lowest rank)
    order = sorted(range(n), key=lambda i: (-(raw[i] - int(raw[i])), i))
    for i in order[: total - sum(sizes)]:
        sizes[i] += 1
    return tuple(sizes)


def epoch_layout(
    num_samples: int, schedule: dict[int, Plan], drop_last: bool = False, resume: tuple[int, int] = (0, 0)
) -> list[GlobalBatch]:
    """Lay one epoch out as global batches.

    Args:
        num_samples: samples in the epoch.
        schedule: the plan in force from each global-batch index on (key 0 must be present). Keys are batch indices,
            not sample offsets, so a plan decided at step ``k`` lands on exactly the same step on every rank.
        drop_last: drop the final partial global batch instead of splitting it.
        resume: ``(batch index, sample offset)`` where an epoch begun by another world size continues: the batches
            before it are placeholders (already consumed), and the layout goes on from that sample.

    """
    if 0 not in schedule:
        raise ValueError("The plan schedule needs an entry for global batch 0.")
    starts = sorted(schedule)
    first_index, cursor = resume
    batches: list[GlobalBatch] = [GlobalBatch(0, ())] * first_index
    plan = schedule[0]
    next_change = 1
    while cursor < num_samples:
        index = len(batches)
        while next_change < len(starts) and starts[next_change] <= index:
            plan = schedule[starts[next_change]]
            next_change += 1
        remaining = num_samples - cursor
        if remaining >= plan.global_batch_size:
            sizes = plan.local_batch_sizes
        elif drop_last:
            break
        elif remaining >= plan.world_size:
            sizes = split_like(remaining, plan)
        elif len(batches) > first_index:
            # too few left to give every rank one: fold them into the previous global batch
            last = batches.pop()
            sizes = split_like(sum(last.local_batch_sizes) + remaining, plan)
            cursor = last.start
        else:
            raise ValueError(
                f"The dataset has {num_samples} samples, fewer than the {plan.world_size} ranks; every rank needs at"
                " least one sample per step. Use a larger dataset or fewer devices."
            )
        batches.append(GlobalBatch(cursor, sizes))
        cursor += sum(sizes)
    return batches


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

    @property
    def num_samples(self) -> int:
        return self.sampler.num_samples

    def set_plan(self, plan: Plan, from_batch: int = 0) -> None:
        """Put ``plan`` in force from global batch ``from_batch`` of the epoch on (later entries are replaced)."""
        if plan.world_size != self.schedule[0].world_size:
            raise ValueError(
                f"The new plan splits across {plan.world_size} ranks but this sampler serves"
                f" {self.schedule[0].world_size}."
            )
        self.schedule = {k: v for k, v in self.schedule.items() if k < from_batch}
        self.schedule[from_batch] = plan
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

    def sizes_at(self, batch_index: int) -> tuple[int, ...]:
        """Every rank's sample count in global batch ``batch_index`` of the current epoch."""
        return self.layout()[batch_index].local_batch_sizes

    def __iter__(self) -> Iterator[list[int]]:
        permutation = self.sampler.permutation()
        index = self.start_batch
        self.yielded = index
        # the layout is re-read per batch: a plan set mid-epoch from a batch not yet yielded takes effect in time
        while index < len(layout := self.layout()):
            batch = layout[index]
            index += 1
            self.yielded = index
            yield permutation[batch.rank_slice(self.rank)]

    def __len__(self) -> int:
        return len(self.layout())
