"""A rank's device memory: the step's peak, the memory it can use, and a clear error when a step runs out of it.

Capacity is what this process can use now, ``free + reserved``: ``torch.cuda.mem_get_info`` tells the memory nobody
holds on the device (other processes on a shared GPU included), and the caching allocator's ``memory_reserved`` is what
this process holds already (the model, its optimizer state, the cache). The device's ``total_memory`` would count
another job's memory as ours. The fitted peak model (:mod:`lightning_cannikin.core.memory`) turns the capacity into
a cap on the local batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_cannikin.core.plan import BatchBounds

__all__ = ["DeviceMemory", "LocalBatchOutOfMemoryError", "out_of_memory_error"]


class DeviceMemory:
    """Reads one device's memory; on a device without memory statistics (CPU) every reading is ``None``.

    Args:
        device: the rank's device.
        backend: the module with ``max_memory_allocated``, ``reset_peak_memory_stats``, ``mem_get_info`` and
            ``memory_reserved`` (``torch.cuda``; a stand-in in tests).

    """

    def __init__(self, device: torch.device, backend: Any = None) -> None:
        self.device = device
        self._backend = backend if backend is not None else (torch.cuda if device.type == "cuda" else None)

    def peak(self) -> float | None:
        """Peak allocated bytes since the last call (the step's), and restart the counter.

        The caching allocator keeps its statistics on the host, where allocations happen as kernels are queued, so
        reading them does not wait for the device.
        """
        if self._backend is None:
            return None
        peak = float(self._backend.max_memory_allocated(self.device))
        self._backend.reset_peak_memory_stats(self.device)
        return peak

    def capacity(self) -> float | None:
        """Bytes this process can use: free on the device plus what this process's allocator holds."""
        if self._backend is None:
            return None
        free, _total = self._backend.mem_get_info(self.device)
        return float(free) + float(self._backend.memory_reserved(self.device))


class LocalBatchOutOfMemoryError(torch.cuda.OutOfMemoryError):
    """A rank ran out of device memory at the local batch Cannikin gave it (the message says which and how to cap it).

    A subclass of ``torch.cuda.OutOfMemoryError``, so code that catches out-of-memory errors still catches it.
    """


def out_of_memory_error(
    rank: int,
    batch_size: int | None,
    sizes: Sequence[int] | None,
    bounds: BatchBounds | None,
    device: torch.device | None = None,
) -> LocalBatchOutOfMemoryError:
    """The error to raise in place of a plain out-of-memory error in a training step of ``rank``."""
    where = f"rank {rank}" + (f" ({device})" if device is not None else "")
    batch = f"a local batch of {batch_size} samples" if batch_size is not None else "an unknown local batch"
    split = f"; the split in force is {list(sizes)}" if sizes else ""
    if bounds is None:
        limits = "`local_batch_bounds` is not set"
    else:
        upper = None if bounds.upper is None else list(bounds.upper)
        limits = f"`local_batch_bounds` is (lower {list(bounds.lower)}, upper {upper})"
    cap = f" below {batch_size}" if batch_size is not None else ""
    return LocalBatchOutOfMemoryError(
        f"CUDA out of memory on {where} at {batch}{split}; {limits}. Cap this rank: pass"
        f" `Cannikin(local_batch_bounds=(lower, upper))` with a per-rank upper list whose entry {rank} is{cap}, or"
        " lower the DataLoader `batch_size`. Cannikin caps a rank by its memory model: from one batch size the peak"
        " is assumed to grow in proportion to the batch, from two a linear fit."
    )
