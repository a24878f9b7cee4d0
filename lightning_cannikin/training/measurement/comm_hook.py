"""The weighted gradient all-reduce: each rank's gradient is scaled by ``b_i / B`` and the ranks sum.

Every rank's loss is a mean over its own ``b_i`` samples, so plain DDP's average over ranks over-weights the small
batches of slow devices. Weighting by the rank's share of the step's samples and summing gives the exact mean
gradient over all ``B`` samples. The hook scales each bucket, unless the strategy already put the weight on the loss
(``WeightedAllReduceState.weight_in_loss``: one scalar product instead of a pass over every gradient).

No ``from __future__ import annotations`` here: DDP checks the hook's return annotation against the real
``torch.futures.Future[torch.Tensor]`` object, and a string annotation fails that check.
"""

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist


class BucketObserver(Protocol):
    """Sees each gradient bucket on its way through the all-reduce (timing, noise-scale statistics)."""

    def before_reduce(self, state: "WeightedAllReduceState", bucket: dist.GradBucket) -> None: ...

    def after_reduce(self, state: "WeightedAllReduceState", bucket: dist.GradBucket, reduced: torch.Tensor) -> None: ...


@dataclass
class WeightedAllReduceState:
    """What the hook needs each step, set by the strategy before backward, and what it saw.

    Attributes:
        process_group: the group to reduce over (None: the default group).
        weight: this rank's share ``b_i / B`` of the samples of the optimizer step in progress.
        micro_weight: the current micro-batch's share of this rank's accumulated gradient (1 without accumulation).
        weight_in_loss: the strategy already put ``weight`` on the loss (one scalar product instead of a pass over
            every bucket): the hook only sums.
        mean_over: what the loss carries beyond ``weight``: the world size where DDP's own all-reduce averages
            (``n * b_i / B`` on the loss makes its mean the weighted mean), 1 through this hook.
        unit_scale: the micro-batch's gradient over its mean gradient (its sample count for a loss summed over
            samples, else 1); observers of local gradients divide it out.
        global_scale: the reduced gradient over the global mean gradient (the step's samples for a summed loss).
        calls: buckets reduced so far (cheap evidence that the hook runs, on CPU too).
        observers: :class:`BucketObserver` objects called for every bucket (the step timer, the gradient-norm
            observer); they must not block.

    """

    process_group: Any = None
    weight: float = 1.0
    micro_weight: float = 1.0
    weight_in_loss: bool = False
    mean_over: int = 1
    unit_scale: float = 1.0
    global_scale: float = 1.0
    calls: int = 0
    observers: list[BucketObserver] = field(default_factory=list)

    @property
    def local_scale(self) -> float:
        """What this rank's local gradient carries besides its own mean: the micro-batch's share, the rank's weight when
        the loss carries it, a summed loss's sample count (observers of local gradients divide it out)."""
        scale = self.micro_weight * self.weight * self.mean_over if self.weight_in_loss else self.micro_weight
        return scale * self.unit_scale


def weighted_allreduce_hook(
    state: WeightedAllReduceState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: ``sum_i (b_i / B) * grad_i`` over the ranks."""
    state.calls += 1
    observers = state.observers
    for observer in observers:
        observer.before_reduce(state, bucket)
    tensor = bucket.buffer()
    if state.weight != 1.0 and not state.weight_in_loss:
        tensor.mul_(state.weight)
    # the process group's own call: `dist.all_reduce` adds Python checks and logging on every bucket of every step
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    work = group.allreduce([torch.view_as_real(tensor) if tensor.is_complex() else tensor], _SUM)

    def finished(future: torch.futures.Future) -> torch.Tensor:
        reduced = future.value()[0]
        for observer in observers:
            observer.after_reduce(state, bucket, reduced)
        return tensor if tensor.is_complex() else reduced  # a complex bucket was reduced as its real view

    return work.get_future().then(finished)


_SUM = dist.AllreduceOptions()
_SUM.reduceOp = dist.ReduceOp.SUM
