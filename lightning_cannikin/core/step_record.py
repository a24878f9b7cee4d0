"""One rank's timing of one training step: what the step timer measures and the speed model fits.

Pure Python: imports neither torch nor Lightning.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from operator import attrgetter
from typing import Any

__all__ = ["StepRecord"]


@dataclass(frozen=True)
class StepRecord:
    """One rank's timing of one training step (seconds).

    Attributes:
        step: the step's index, equal on every rank (ranks advance in lockstep).
        rank: global rank.
        batch_size: samples this rank trained on in the step.
        compute: forward + backward until this rank's gradients were ready (excludes waiting for other ranks).
        step_time: the whole step on this rank, batch start to batch end (includes the all-reduce and the optimizer).
        allreduce: from this rank's first gradient bucket reaching the all-reduce to the last one completing
            (``None`` on steps without a reduction, e.g. accumulation micro-steps).
        exposed: from this rank's last bucket (the end of its backward) to the all-reduce completing: the part of
            the communication that backward did not hide, plus any wait for slower ranks.
        peak_memory: the device's peak allocated bytes during the step (CUDA only).
        memory_capacity: the memory this rank can use in bytes: free plus what it holds (CUDA only).
        comm_busy: the time the reduction itself ran: the sum over buckets of each bucket's all-reduce, from its
            start (its gradients ready and the previous bucket done) to its completion. Unlike ``allreduce`` it
            holds no wait for compute, so it is the communication's cost in either regime (``None``: not measured;
            ``allreduce`` stands in, exact only where the reduction is the bottleneck).
        last_bucket: the last bucket's all-reduce alone, from its start to its completion: what is left after
            backward when the reduction keeps up (``None``: not measured; ``exposed`` stands in, exact only where
            backward hides the reduction).
        host: the time this rank's device waited for its input, from the loop's request to the training loader to
            this step's start: the wait for the batch, collation, the copy to the device (``None``: not measured, e.g.
            an epoch's first step). Host work that loader workers or a host running ahead of the device hide is not in
            it, so it is exactly the input pipeline's share of the critical path, in series with ``compute``.
        after: this rank's own time after its gradients were reduced (an accumulation micro-step: after its
            backward), to the step's end: the optimizer step and the step's closing work, on the device's clock on
            CUDA (``None``: not measured). Every rank leaves the all-reduce together, so a rank that takes longer here
            (a slower device's optimizer step, a slower host's bookkeeping) reaches the next all-reduce later: it is
            in series with the next step's input and compute. It is not in ``cost``: an accumulation window pays its
            optimizer step once, not once a micro-step, so the speed model keeps it apart (per optimizer step).
        gap: from the previous step's end to this step's input request (``None``: not measured, e.g. an epoch's first
            step): the loop's work between the steps, and any wait there for other ranks. With the previous step's
            ``after`` it is this rank's whole time from its last reduction to its next input: its own work where the
            ranks do not meet in between, the slowest rank's where they do (Lightning's loop broadcasts at every
            step's start), so the same measure serves either loop.

    """

    step: int
    rank: int
    batch_size: int
    compute: float
    step_time: float
    allreduce: float | None = None
    exposed: float | None = None
    peak_memory: float | None = None
    memory_capacity: float | None = None
    comm_busy: float | None = None
    last_bucket: float | None = None
    host: float | None = None
    after: float | None = None
    gap: float | None = None

    @property
    def cost(self) -> float:
        """This rank's input's exposed wait, then its compute: what grows with its batch. The speed model fits it, and
        adds each rank's time ``after`` the reduction apart, so a split balances the whole step."""
        return self.compute + self.host if self.host is not None else self.compute

    @property
    def own(self) -> float:
        """Everything this rank does in the step by itself: ``cost`` and its time ``after`` the reduction."""
        return self.cost + self.after if self.after is not None else self.cost

    @property
    def cycle(self) -> float:
        """The whole step on this rank as training sees it: the exposed input wait, then batch start to batch end."""
        return self.step_time + self.host if self.host is not None else self.step_time

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, *values: Any) -> StepRecord:
        """A record of every field's value in order, built as unpickling builds one: the step timer hands out and the
        ranks gather hundreds at each re-plan, where the frozen ``__init__`` (a guarded setattr per field) and the
        default pickling (a dict per record) were most of the gather's cost."""
        record = object.__new__(cls)
        record.__dict__.update(zip(_FIELDS, values, strict=True))
        return record

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _record_of, _values(self)  # the values alone, in field order


_FIELDS = tuple(f.name for f in fields(StepRecord))
_values = attrgetter(*_FIELDS)


def _record_of(*values: Any) -> StepRecord:
    return StepRecord.of(*values)
