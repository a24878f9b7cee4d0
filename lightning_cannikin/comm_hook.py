"""The weighted gradient all-reduce: each rank scales its bucket by ``b_i / B`` and the ranks sum.

Every rank's loss is a mean over its own ``b_i`` samples, so plain DDP's average over ranks over-weights the small
batches of slow devices. Weighting by the rank's share of the step's samples and summing gives the exact mean
gradient over all ``B`` samples.

No ``from __future__ import annotations`` here: DDP checks the hook's return annotation against the real
``torch.futures.Future[torch.Tensor]`` object, and a string annotation fails that check.
"""

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class WeightedAllReduceState:
    """What the hook needs each step, set by the strategy before backward.

    Attributes:
        process_group: the group to reduce over (None: the default group).
        weight: this rank's share ``b_i / B`` of the samples of the optimizer step in progress.
        calls: buckets reduced so far (cheap evidence that the hook runs, on CPU too).
        observers: callables ``(state, bucket, reduced_future)`` run for each bucket, e.g. timing or the noise-scale
            estimator; each returns nothing and must not block.

    """

    process_group: Any = None
    weight: float = 1.0
    calls: int = 0
    observers: list = field(default_factory=list)


def weighted_allreduce_hook(
    state: WeightedAllReduceState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: ``sum_i (b_i / B) * grad_i`` over the ranks."""
    state.calls += 1
    tensor = bucket.buffer()
    if state.weight != 1.0:
        tensor.mul_(state.weight)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=state.process_group, async_op=True)
    future = work.get_future().then(lambda fut: fut.value()[0])
    for observer in state.observers:
        observer(state, bucket, future)
    return future
