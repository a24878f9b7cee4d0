"""One epoch laid out as global batches: where each starts in the shared permutation and what each rank takes.

Global batch ``p`` holds ``sum(b_i)`` consecutive indices of the epoch's permutation and rank ``i`` takes its own
contiguous ``b_i`` of them. The layout depends only on the dataset length and the plan schedule, so every rank knows
every other rank's batch sizes without talking to it.

The epoch's tail: when fewer than a full global batch of samples remain, the remainder is split across the ranks in
proportion to the plan (nothing is dropped unless ``drop_last``); a remainder smaller than the number of ranks is
folded into the previous global batch, in proportion to that batch's plan, so that no rank ever runs a step with
zero samples and a plan put in force from some batch on never changes a batch before it.

Pure Python: imports neither torch nor Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_cannikin.core.plan import Plan, proportional_sizes

__all__ = ["GlobalBatch", "epoch_layout"]


@dataclass(frozen=True)
class GlobalBatch:
    """One step's slice of the permutation: where it starts and how many samples each rank takes."""

    start: int
    local_batch_sizes: tuple[int, ...]

    def rank_slice(self, rank: int) -> slice:
        offset = self.start + sum(self.local_batch_sizes[:rank])
        return slice(offset, offset + self.local_batch_sizes[rank])


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
    plan = previous = schedule[0]
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
            sizes = proportional_sizes(remaining, plan.local_batch_sizes)
        elif len(batches) > first_index:
            # too few left to give every rank one: fold them into the previous global batch, split by that batch's
            # plan (a plan from this index on must not change a batch before it, which a rank may have drawn)
            last = batches.pop()
            sizes = proportional_sizes(sum(last.local_batch_sizes) + remaining, previous.local_batch_sizes)
            cursor = last.start
        else:
            raise ValueError(
                f"The dataset has {num_samples} samples, fewer than the {plan.world_size} ranks; every rank needs at"
                " least one sample per step. Use a larger dataset or fewer devices."
            )
        batches.append(GlobalBatch(cursor, sizes))
        previous = plan  # (after a fold the epoch is over)
        cursor += sum(sizes)
    return batches
