"""Each rank's own step timing: forward start to gradients ready, and the all-reduce around it.

The timer is an observer of the weighted comm hook: the step's first bucket reaching the hook starts the all-reduce,
its latest bucket marks the end of this rank's backward compute (waiting for slower ranks comes after it), and the
latest bucket's completion ends the all-reduce. Host clock (``time.perf_counter``): on CPU, and on CUDA it times
kernel *launches*, not the kernels (an event-based timer is the follow-up).

SyncBatchNorm runs collectives inside forward: a rank that waits there for slower ranks counts the wait as its own
compute, so with SyncBatchNorm the measured speeds are pulled towards the slowest device's.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from lightning_cannikin.core.speed_model import StepRecord
from lightning_cannikin.training.comm_hook import WeightedAllReduceState

__all__ = ["StepTimer"]


class StepTimer:
    """Times one rank's training steps; :meth:`finish` turns a step into a :class:`StepRecord`."""

    def __init__(self) -> None:
        self._in_step = False
        self._batch_start = 0.0
        self._forward_start: float | None = None
        self._backward_end: float | None = None
        self._first_entry: float | None = None
        self._last_entry: float | None = None
        self._last_done: float | None = None
        self._handle: Any = None

    def attach(self, module: torch.nn.Module) -> None:
        """Start the compute clock when ``module``'s forward begins: after DDP's own pre-forward work (buffer
        broadcast), which can wait on other ranks and is not this device's compute."""
        self.detach()
        self._handle = module.register_forward_pre_hook(self._on_forward)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._in_step and self._forward_start is None:
            self._forward_start = time.perf_counter()

    def start(self) -> None:
        """A training step begins: forget the previous one."""
        self._forward_start = self._backward_end = None
        self._first_entry = self._last_entry = self._last_done = None
        self._in_step = True
        self._batch_start = time.perf_counter()

    def backward_done(self) -> None:
        self._backward_end = time.perf_counter()

    @property
    def reduced(self) -> bool:
        """Whether gradients were reduced in this step (an optimizer step, not an accumulation micro-step)."""
        return self._last_entry is not None

    def before_reduce(self, state: WeightedAllReduceState, bucket: dist.GradBucket) -> None:
        now = time.perf_counter()
        if self._first_entry is None:
            self._first_entry = now
        self._last_entry = now

    def after_reduce(self, state: WeightedAllReduceState, bucket: dist.GradBucket, reduced: torch.Tensor) -> None:
        self._last_done = time.perf_counter()

    def finish(self, step: int, rank: int, batch_size: int | None, device: torch.device) -> StepRecord | None:
        """The step's record, or ``None`` when it had no known batch or no end of compute."""
        now = time.perf_counter()
        self._in_step = False
        # gradients are ready when the last bucket reaches the comm hook; without a reduction (accumulation
        # micro-step) backward's end is the end of compute
        compute_end = self._last_entry if self.reduced else self._backward_end
        if batch_size is None or compute_end is None:
            return None
        start = self._forward_start if self._forward_start is not None else self._batch_start
        allreduce = exposed = None
        if self._first_entry is not None and self._last_entry is not None and self._last_done is not None:
            allreduce, exposed = self._last_done - self._first_entry, self._last_done - self._last_entry
        peak, capacity = _memory_peak(device)
        return StepRecord(
            step, rank, batch_size, compute_end - start, now - self._batch_start, allreduce, exposed, peak, capacity
        )


def _memory_peak(device: torch.device) -> tuple[float | None, float | None]:
    """This step's peak allocated bytes and the device's capacity, on CUDA; the peak counter restarts."""
    if device.type != "cuda":
        return None, None
    peak = float(torch.cuda.max_memory_allocated(device))
    torch.cuda.reset_peak_memory_stats(device)
    return peak, float(torch.cuda.get_device_properties(device).total_memory)
