"""The collectives the balancing engine needs, as a small interface any frontend can give it.

A frontend over another launcher (Ray Train, plain ``torch.distributed``) implements :class:`Collective`; Lightning's
and Fabric's strategies share the methods :class:`StrategyCollective` uses, and end the process group at the
interpreter's exit through :func:`end_process_group_at_exit`.
"""

from __future__ import annotations

import atexit
import functools
import signal
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lightning_cannikin.core.change_vote import Ballot
from lightning_cannikin.training.measurement.host_transfer import HostTransfer, PinnedTransfer

__all__ = ["Collective", "StrategyCollective", "end_process_group_at_exit"]


class Collective(Ballot, Protocol):
    """The collectives a re-plan needs, over small picklable Python objects, and one vote that nobody waits for
    (:meth:`max_later`: start finding the largest value over the ranks without waiting; the returned function reads the
    answer, called a while later, without waiting either); every rank calls them alike."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def host_runs_ahead(self) -> bool:
        """Whether the host may run steps ahead of the device (CUDA): reading an exchange a step after it was issued
        could then wait for the device."""
        ...

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        ...

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        ...


class StrategyCollective:
    """A :class:`Collective` over a Lightning or a Fabric strategy: its rank and device, and the objects of a re-plan
    through torch's object collectives (they pickle on the host and travel on the group's device); a single process
    gathers itself."""

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy
        self._transfer: HostTransfer | PinnedTransfer | None = None
        self._vote_tensors: list[torch.Tensor] = []  # votes whose answer was read, reused by the next ones

    @property
    def rank(self) -> int:
        return int(self._strategy.global_rank)

    @property
    def world_size(self) -> int:
        return int(self._strategy.world_size)

    @property
    def host_runs_ahead(self) -> bool:
        return torch.device(self._strategy.root_device).type == "cuda"

    def all_gather(self, obj: Any) -> list[Any]:
        if not (dist.is_available() and dist.is_initialized()):
            return [obj]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=src)
        return holder[0]

    def max_later(self, value: int) -> Callable[[], int]:
        if not (dist.is_available() and dist.is_initialized()):
            return lambda: value
        # a vote's tensor is reused once its answer was read (one is in flight at a time): a new tensor per vote cost
        # more than the collective's own call on CPU
        vote = self._vote_tensors.pop() if self._vote_tensors else torch.empty(1, device=self._strategy.root_device)
        vote.fill_(float(value))
        work = dist.all_reduce(vote, op=dist.ReduceOp.MAX, async_op=True)
        if self._transfer is None:
            self._transfer = PinnedTransfer() if vote.is_cuda else HostTransfer()
        transfer, reusable = self._transfer, self._vote_tensors
        handle = transfer.start(vote, work)

        def read() -> int:
            answer = int(transfer.read(handle)[0])
            reusable.append(vote)
            return answer

        return read


@functools.cache  # registered once a process, however many strategies ask
def end_process_group_at_exit() -> None:
    """Destroy the default process group when the interpreter exits, whatever its backend.

    Lightning does this for NCCL only. A gloo group left to the interpreter's exit makes torch abort the process now
    and then ("terminate called without an active exception", measured on torch 2.13: 11 of 60 three-rank jobs),
    which ``torchrun`` or SLURM reports as a failed rank after a fit that ended well.
    """
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return  # never created, or the user (or Ray Train) ended it already
    interrupt = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl+C now would abort the teardown half-way
    try:
        dist.destroy_process_group()
    finally:
        signal.signal(signal.SIGINT, interrupt)
