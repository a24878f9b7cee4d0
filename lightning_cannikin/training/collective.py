"""The two collectives a re-plan needs, as a small interface any frontend can give the balancing engine.

A frontend over another launcher (Ray Train, plain ``torch.distributed``) implements :class:`Collective`; Lightning's
and Fabric's strategies share the methods :class:`StrategyCollective` uses.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch.distributed as dist

__all__ = ["Collective", "StrategyCollective"]


class Collective(Protocol):
    """The two collectives a re-plan needs, over small picklable Python objects; every rank calls them alike."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        ...

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        ...


class StrategyCollective:
    """A :class:`Collective` over a Lightning or a Fabric strategy: the strategy's own ``broadcast`` and rank, and
    torch.distributed's object all-gather (neither strategy gathers objects); a single process gathers itself."""

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy

    @property
    def rank(self) -> int:
        return int(self._strategy.global_rank)

    @property
    def world_size(self) -> int:
        return int(self._strategy.world_size)

    def all_gather(self, obj: Any) -> list[Any]:
        if not (dist.is_available() and dist.is_initialized()):
            return [obj]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._strategy.broadcast(obj, src=src)
