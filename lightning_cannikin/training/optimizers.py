"""An optimizer's family, read from what it holds (its per-parameter state), not from its class name; and the
learning rates of one step scaled by its factor.

See :mod:`lightning_cannikin.core.lr_scaling` for what each family gets and why.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_cannikin.core.lr_scaling import optimizer_family

__all__ = ["FamilyWatch", "scaled_learning_rates", "unwrapped"]


def unwrapped(optimizer: Any) -> Any:
    """The optimizer that holds the state: under Lightning's ``LightningOptimizer`` (``_optimizer``), Fabric's
    ``_FabricOptimizer`` (``optimizer``) and wrappers such as ``ZeroRedundancyOptimizer`` (``optim``)."""
    for _ in range(4):
        inner = next(
            (
                getattr(optimizer, name)
                for name in ("_optimizer", "optim", "optimizer")
                if isinstance(getattr(optimizer, name, None), torch.optim.Optimizer)
            ),
            None,
        )
        if inner is None:
            return optimizer
        optimizer = inner
    return optimizer


class FamilyWatch:
    """The training optimizer's family, read once it can be told: Adam-family once the optimizer holds a second
    moment (at once on a resume, else after its first step). Asked every step, it costs nothing once read, and nothing
    while the optimizer still holds no state (plain SGD never does)."""

    def __init__(self, optimizer: Any = None) -> None:
        self.optimizer = optimizer
        self.inner: Any = None  # the optimizer that holds the state, once read
        self.family: str | None = None

    def read(self) -> bool:
        """Whether the family was read just now (``False`` once read, or while nothing tells it yet)."""
        if self.optimizer is None or self.family is not None:
            return False
        if self.inner is not None and not getattr(self.inner, "state", None):
            return False  # it still holds nothing: as read last time
        self.inner = unwrapped(self.optimizer)
        state = getattr(self.inner, "state", {})  # what it holds decides its family (``None`` before its first step)
        self.family = optimizer_family(frozenset(key for value in state.values() for key in value))
        return True


@contextmanager
def scaled_learning_rates(optimizer: Any, factor: float) -> Iterator[None]:
    """Every parameter group's learning rate times ``factor`` for one step, restored afterwards, so that any LR
    scheduler keeps its own values (a factor of 1 touches nothing)."""
    if factor == 1.0:
        yield
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr
