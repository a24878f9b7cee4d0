"""Each rank's own step timing: forward start to gradients ready, and the all-reduce around it.

One :class:`StepTimer` with two clocks, picked by device (:func:`step_timer_for`):

- :class:`HostClock` (CPU): ``time.perf_counter()`` at each point.
- :class:`CudaEventClock` (CUDA): kernels run asynchronously, so a host clock would time when the CPU *queued* them,
  and the queue can carry the previous step's wait for the slowest rank into a fast rank's time. Instead a
  ``torch.cuda.Event(enable_timing=True)`` is recorded on the current stream at each point and read lazily: a
  finished step waits, unread, until every one of its events reports ``query()`` true (polled as later steps end,
  never waited for) or until the next re-plan, which waits for them. A late record keeps its own step index. Events
  are pooled and re-recorded, not created per step.

The points, the same on both clocks:

- the input: from the loop's request for this step's batch (the training loader's ``on_fetch``, after the previous step
  and whatever ran after it: a re-plan, logging, validation) to this step's start. Between them the loop fetches the
  batch (the loader's wait, collation in the training process) and copies it to the device (Lightning's loop keeps
  one batch ahead, so the batch fetched there is the next one: the same size under a plan in force). On CUDA both
  ends are events on the stream, so the span is what the *device* waited for its input: host work that ran while the
  device was still busy (workers ahead of the loop, a host ahead of the queue) is not in it. On the host clock it is
  the host's wait, the same thing where the work is done when the call returns. An epoch's first step has none (the
  epoch's end, validation and the loader's new iterator lie between);
- the step: batch start (``on_train_batch_start``) to batch end (``on_train_batch_end``);
- forward start: marked by the strategy where every training step passes (its ``training_step``, whatever the
  module calls), then moved to the moment DDP hands the batch to the LightningModule, after DDP's pre-forward work:
  its buffer broadcast is a collective that waits for slower ranks, which is not this device's compute;
- gradients ready: the latest bucket reaching the comm hook (on CUDA, the point in the stream where that bucket's
  gradients are complete); with DDP's own C++ all-reduce (no Python hook, see the strategy), the last parameter's
  gradient accumulated (:mod:`~lightning_cannikin.training.measurement.grad_ready`); without a reduction (an
  accumulation micro-step), the end of backward;
- the all-reduce: from the first bucket reaching the hook (with DDP's own all-reduce: the first gradient ready) to
  the latest reduced bucket coming back. On CUDA that end is recorded in the future's callback, on the stream that
  waits for the collective (NCCL futures complete when the collective is *enqueued*, so a host clock there would
  measure nothing); with DDP's own all-reduce it is the end of backward, which DDP makes wait for the collective.
- after the reduction: from the all-reduce's end (an accumulation micro-step: backward's end) to the step's end, the
  optimizer step and the step's closing work on this rank. Every rank leaves the all-reduce at once, so this is the
  rank's own time, in series with its next input and compute (a slower device's optimizer step takes longer);
- between the steps: from the previous step's end to this step's input request, the loop's own work (a re-plan,
  logging) and any wait there for the other ranks: Lightning's loop (from 2.5.2) broadcasts from rank zero at every
  step's start (its SIGTERM check), where rank zero waits for every rank and each other rank for rank zero. Each
  rank's time from its reduction's end to its next input is ``after`` of one step plus ``gap`` of the next, whichever
  way the loop makes the ranks meet;
- the reductions' own time, through the comm hook only (it sees every bucket): each bucket's reduction from its start
  (its gradients ready and the bucket before it reduced) to its return, summed (``comm_busy``), and the last one's
  (``last_bucket``). A bucket's marks are the moments the step's other marks already take (the latest bucket, the
  latest reduction); a mark a later bucket would move is kept aside instead, so a step of ``K`` buckets costs
  ``2K - 3`` more marks than before (K >= 2).

SyncBatchNorm runs collectives inside forward and backward, and at each of them a rank waits for the slowest one. On
both clocks the wait lands between forward start and gradients ready (on CUDA the compute stream itself waits for
the collective), so under SyncBatchNorm every rank measures about the slowest rank's time: the fitted speeds come
out alike and the balancer leaves the split close to where it is. The strategy warns when a model has such layers.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from lightning_cannikin.core.step_record import StepRecord
from lightning_cannikin.training.measurement.comm_hook import WeightedAllReduceState
from lightning_cannikin.training.measurement.device_memory import DeviceMemory

__all__ = ["CudaEventClock", "HostClock", "StepTimer", "step_timer_for"]

# the points of a step, as indices into its marks; INPUT is where the loop asked for this step's batch, PREVIOUS_END
# where the step before it ended
BATCH, FORWARD, FIRST_BUCKET, LAST_BUCKET, REDUCED, BACKWARD, END, INPUT, PREVIOUS_END = range(9)
_POINTS = 9


class HostClock:
    """Marks are ``time.perf_counter()`` readings: exact on CPU, where the work is done when the call returns."""

    def mark(self, marks: list[Any], point: int) -> None:
        marks[point] = time.perf_counter()

    def ready(self, marks: list[Any]) -> bool:
        return True

    def wait(self, marks: list[Any]) -> None:
        pass

    def seconds(self, marks: list[Any], start: int, end: int) -> float:
        return marks[end] - marks[start]

    def release(self, marks: list[Any]) -> None:
        pass


class CudaEventClock:
    """Marks are CUDA events recorded on the current stream; reading one never waits unless asked to.

    Args:
        event_factory: makes a timing event (``torch.cuda.Event(enable_timing=True)``; a stand-in in tests).

    """

    def __init__(self, event_factory: Callable[[], Any] | None = None) -> None:
        self._factory = event_factory or partial(torch.cuda.Event, enable_timing=True)
        self._pool: list[Any] = []

    def mark(self, marks: list[Any], point: int) -> None:
        event = marks[point]
        if event is None:
            event = marks[point] = self._pool.pop() if self._pool else self._factory()
        event.record()  # a re-record moves the mark: the latest bucket, the latest reduction

    def ready(self, marks: list[Any]) -> bool:
        return all(event is None or event.query() for event in marks)

    def wait(self, marks: list[Any]) -> None:
        for event in marks:
            if event is not None:
                event.synchronize()

    def seconds(self, marks: list[Any], start: int, end: int) -> float:
        return marks[start].elapsed_time(marks[end]) / 1000.0

    def release(self, marks: list[Any]) -> None:
        self._pool.extend(event for event in marks if event is not None)


class StepTimer:
    """Times one rank's training steps (an observer of the comm hook) and hands out :class:`StepRecord` objects.

    Args:
        clock: how a point in the step is marked and read (:class:`HostClock` or :class:`CudaEventClock`).
        memory: the device's memory, for each step's peak and, when records are handed out, the capacity.

    """

    def __init__(self, clock: HostClock | CudaEventClock | None = None, memory: DeviceMemory | None = None) -> None:
        self.clock = clock if clock is not None else HostClock()
        self.memory = memory
        self._marks: list[Any] = [None] * _POINTS
        self._in_step = False
        self._reduced = False
        self._inner_forward_pending = False
        self._blocked = self._blocked_in_compute = 0.0  # host seconds this step waited in collectives (blocked())
        self._buckets = self._returned = 0  # buckets of this step that reached the hook, and that came back
        # finished steps whose marks may not be readable yet, oldest first: (step, rank, batch, peak, marks, blocked,
        # buckets): the marks of the middle buckets' readiness and the earlier reductions' ends follow the step's own
        self._pending: deque[tuple[int, int, int, float | None, list[Any], float, tuple[int, int]]] = deque()
        self._bucket_ready: list[Any] = []  # the step's buckets ready, but the first and the latest
        self._bucket_done: list[Any] = []  # the step's reductions returned, but the latest
        self._spare: list[list[Any]] = []  # cleared mark lists, reused
        # read steps not handed out yet: (step, rank, batch, compute, step time, allreduce, exposed, peak, comm busy,
        # last bucket, host, after, gap)
        self._read: list[tuple] = []
        # called with (batch size, seconds) of every step as it is read, in step order (a local change check): its
        # compute and exposed input wait, what the speed model fits (StepRecord.cost)
        self.listeners: list[Callable[[int, float], None]] = []
        self._input_timed = False  # a step's input wait was measured: the listeners never see one without it

    def start(self, after_input: bool = True) -> None:
        """A training step begins (a step left unfinished, e.g. by an exception, is dropped).

        Args:
            after_input: the time since :meth:`input_starts` was this step's input (``False`` at an epoch's first step:
                the epoch's end lies between).

        """
        marks = self._marks
        input_mark, previous_end = marks[INPUT], marks[PREVIOUS_END]
        marks[INPUT] = marks[PREVIOUS_END] = None
        self._clear(marks)
        if after_input and input_mark is not None:  # the steps follow each other: the input, and what ran between
            marks[INPUT], marks[PREVIOUS_END] = input_mark, previous_end
        else:
            self.clock.release([input_mark, previous_end])
        # the bucket marks of a step left unfinished (none after finish())
        self.clock.release(self._bucket_ready + self._bucket_done)
        self._bucket_ready, self._bucket_done = [], []
        self._buckets = self._returned = 0
        self._in_step = True
        self._reduced = self._inner_forward_pending = False
        self._blocked = self._blocked_in_compute = 0.0
        self.clock.mark(marks, BATCH)

    def input_starts(self) -> None:
        """The loop asks for the next step's batch: from here to the next :meth:`start` is that step's input (a second
        request before it, as a prefetching loop makes, moves the mark to the later one)."""
        if not self._in_step:
            self.clock.mark(self._marks, INPUT)

    def forward_start(self) -> None:
        """The strategy's ``training_step`` begins: every step passes here, whatever the module calls."""
        if self._in_step:
            self.clock.mark(self._marks, FORWARD)
            self._inner_forward_pending = True

    def inner_forward_start(self) -> None:
        """DDP hands the batch to the LightningModule, after its pre-forward work: the forward start moves here once."""
        if self._inner_forward_pending:
            self._inner_forward_pending = False
            self.clock.mark(self._marks, FORWARD)

    def will_reduce(self, sync: bool) -> None:
        """The strategy, before backward: whether DDP reduces the gradients of this backward (``False`` in an
        accumulation micro-step). With DDP's own all-reduce no comm hook tells it."""
        if self._in_step and sync:
            self._reduced = True

    def gradient_ready(self) -> None:
        """A hooked parameter's gradient is ready
        (:class:`~lightning_cannikin.training.measurement.grad_ready.GradientReadiness`, with DDP's own all-reduce):
        the first call of a step marks where gradients start, every call the latest."""
        if self._in_step and self._reduced:
            if self._marks[FIRST_BUCKET] is None:
                self.clock.mark(self._marks, FIRST_BUCKET)
            self.clock.mark(self._marks, LAST_BUCKET)
            self._blocked_in_compute = self._blocked

    def backward_done(self) -> None:
        """Backward returned. A step without a reduction (an accumulation micro-step) ends its compute here; a step
        with one has its all-reduce done here (DDP waits for it in backward), unless the comm hook marked it."""
        if not self._in_step:
            return
        if not self._reduced:
            self.clock.mark(self._marks, BACKWARD)
            self._blocked_in_compute = self._blocked
        elif self._marks[REDUCED] is None and self._marks[LAST_BUCKET] is not None:
            self.clock.mark(self._marks, REDUCED)

    def blocked(self, seconds: float) -> None:
        """The host waited ``seconds`` for other ranks inside a collective of this step (FSDP's per-layer all-gathers
        and reduce-scatters on CPU): not this device's compute, so the waits before the compute's end are taken out of
        it. Host clock only: on CUDA the host does not wait for collectives."""
        if self._in_step:
            self._blocked += seconds

    @property
    def reduced(self) -> bool:
        """Whether gradients were reduced in this step (an optimizer step, not an accumulation micro-step)."""
        return self._reduced

    def before_reduce(self, state: WeightedAllReduceState, bucket: dist.GradBucket) -> None:
        if not self._in_step:
            return  # nobody times this fit (no callback started a step)
        self._reduced = True  # a bucket reached the hook: this backward reduces
        self._buckets += 1
        if self._buckets > 2:  # the latest bucket's mark is a middle bucket's from now on: keep it aside
            self._bucket_ready.append(self._marks[LAST_BUCKET])
            self._marks[LAST_BUCKET] = None
        self.gradient_ready()

    def after_reduce(self, state: WeightedAllReduceState, bucket: dist.GradBucket, reduced: torch.Tensor) -> None:
        if self._in_step:
            self._returned += 1
            if self._returned > 1:  # the latest reduction's end is an earlier one's from now on: keep it aside
                self._bucket_done.append(self._marks[REDUCED])
                self._marks[REDUCED] = None
            self.clock.mark(self._marks, REDUCED)

    def finish(self, step: int, rank: int, batch_size: int | None) -> None:
        """The step ends: its record is read now if its marks are readable, else later (see :meth:`records`)."""
        if not self._in_step:
            return
        self._in_step = False
        marks = self._marks
        if batch_size is None or (marks[LAST_BUCKET] is None and marks[BACKWARD] is None):
            return  # no known batch, or no end of compute: nothing to record (start() clears the marks)
        self._marks = self._spare.pop() if self._spare else [None] * _POINTS
        self.clock.mark(marks, END)
        self.clock.mark(self._marks, PREVIOUS_END)  # the next step's: from here to its input is the loop's
        peak = self.memory.peak() if self.memory is not None else None
        buckets = (self._buckets, self._returned)
        marks += self._bucket_ready + self._bucket_done  # released with the step's own marks once read
        self._bucket_ready, self._bucket_done = [], []
        self._pending.append((step, rank, batch_size, peak, marks, self._blocked_in_compute, buckets))
        self._read_ready(wait=False)

    def records(self, wait: bool = False) -> list[StepRecord]:
        """Hand out every finished step's record not handed out before, in step order.

        Args:
            wait: also read the steps whose marks are not readable yet, waiting for the device (at a re-plan, which
                synchronises anyway). Without it those stay for a later call: nothing is lost.

        """
        self._read_ready(wait)
        if not self._read:
            return []
        capacity = self.memory.capacity() if self.memory is not None else None
        records = [StepRecord.of(*values[:8], capacity, *values[8:]) for values in self._read]
        self._read = []
        return records

    @property
    def latest(self) -> StepRecord | None:
        """The newest record read and not handed out yet (for logging; on CUDA it may be a few steps old)."""
        return StepRecord(*self._read[-1][:8], None, *self._read[-1][8:]) if self._read else None

    def _read_ready(self, wait: bool) -> None:
        clock = self.clock
        while self._pending:
            step, rank, batch_size, peak, marks, blocked, buckets = self._pending[0]
            if wait:
                clock.wait(marks)
            elif not clock.ready(marks):
                return  # later steps are queued behind this one
            self._pending.popleft()
            start = FORWARD if marks[FORWARD] is not None else BATCH
            allreduce = exposed = busy = last = None
            if marks[LAST_BUCKET] is not None:
                compute = clock.seconds(marks, start, LAST_BUCKET)
                if marks[REDUCED] is not None:
                    allreduce = clock.seconds(marks, FIRST_BUCKET, REDUCED)
                    exposed = clock.seconds(marks, LAST_BUCKET, REDUCED)
                    busy, last = self._reductions(marks, *buckets)
            else:
                compute = clock.seconds(marks, start, BACKWARD)
            compute = max(compute - blocked, 0.0)
            step_time = clock.seconds(marks, BATCH, END)
            host = max(clock.seconds(marks, INPUT, BATCH), 0.0) if marks[INPUT] is not None else None
            between = marks[PREVIOUS_END] is not None and marks[INPUT] is not None
            gap = max(clock.seconds(marks, PREVIOUS_END, INPUT), 0.0) if between else None
            # after the reduction (or, in a micro-step, after backward): the optimizer and the step's closing work
            settled = REDUCED if marks[REDUCED] is not None else (BACKWARD if marks[BACKWARD] is not None else None)
            after = None if settled is None else max(clock.seconds(marks, settled, END), 0.0)
            values = (
                step,
                rank,
                batch_size,
                compute,
                step_time,
                allreduce,
                exposed,
                peak,
                busy,
                last,
                host,
                after,
                gap,
            )
            self._read.append(values)
            self._clear(marks)
            self._spare.append(marks)
            self._input_timed = self._input_timed or host is not None
            if host is None and self._input_timed:
                continue  # an epoch's first step: its input wait is unknown, not zero
            for listener in self.listeners:
                listener(batch_size, compute if host is None else compute + host)

    def _reductions(self, marks: list[Any], buckets: int, returned: int) -> tuple[float | None, float | None]:
        """``(comm_busy, last_bucket)`` of a step whose every bucket came back through the hook (else ``None``s):
        bucket ``k``'s reduction starts when it is ready and bucket ``k - 1`` is reduced, and ends when it returns."""
        if buckets < 1 or returned != buckets:
            return None, None  # DDP's own all-reduce, or a reduction not seen
        middle = list(range(_POINTS, _POINTS + buckets - 2))
        ready = [LAST_BUCKET] if buckets == 1 else [FIRST_BUCKET, *middle, LAST_BUCKET]
        done = [*range(_POINTS + max(buckets - 2, 0), _POINTS + max(buckets - 2, 0) + returned - 1), REDUCED]
        busy = last = 0.0
        end = None
        for ready_at, done_at in zip(ready, done, strict=True):
            began = self.clock.seconds(marks, BATCH, ready_at)
            began = began if end is None else max(began, end)
            end = self.clock.seconds(marks, BATCH, done_at)
            last = max(end - began, 0.0)
            busy += last
        return busy, last

    def _clear(self, marks: list[Any]) -> None:
        self.clock.release(marks)
        marks[:] = _NO_MARKS


_NO_MARKS = (None,) * _POINTS


def step_timer_for(device: torch.device) -> StepTimer:
    """CUDA events on a CUDA device, the host clock elsewhere; the device's memory either way."""
    clock = CudaEventClock() if device.type == "cuda" else HostClock()
    return StepTimer(clock, DeviceMemory(device))
