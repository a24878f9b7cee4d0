"""How an exchange of noise statistics reaches the host without anyone waiting for it: a step after it was issued.

On CPU it is read by waiting for its (long finished) collective; on CUDA it is copied to pinned host memory behind the
collective, on the stream, and read once its event has passed.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HostTransfer", "PinnedTransfer"]


class HostTransfer:
    """An exchange on CPU: read it by waiting for its collective (long done, a step after it was issued)."""

    def start(self, tensor: torch.Tensor, work: Any) -> Any:
        return work, tensor

    def read(self, handle: Any) -> list[float]:
        work, tensor = handle
        work.wait()
        return tensor.tolist()


class PinnedTransfer:
    """An exchange on CUDA: copied to pinned host memory behind the collective, on the stream; read once its event
    has passed (a step later it has), so reading never drains the device's queue."""

    def __init__(self) -> None:
        self._buffers: dict[int, list[torch.Tensor]] = {}
        self._events: list[torch.cuda.Event] = []

    def start(self, tensor: torch.Tensor, work: Any) -> Any:
        work.wait()  # on NCCL: the current stream waits for the collective; the host does not
        pool = self._buffers.setdefault(tensor.numel(), [])
        host = pool.pop() if pool else torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        event = self._events.pop() if self._events else torch.cuda.Event()
        event.record()
        return host, event

    def read(self, handle: Any) -> list[float]:
        host, event = handle
        event.synchronize()
        values = host.tolist()
        self._buffers[host.numel()].append(host)
        self._events.append(event)
        return values
