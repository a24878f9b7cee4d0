"""An optimizer's family, read from what it holds (its per-parameter state), not from its class name.

See :mod:`lightning_cannikin.core.lr_scaling` for what each family gets and why.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_cannikin.core.lr_scaling import optimizer_family

__all__ = ["optimizer_family_of", "unwrapped"]


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


def optimizer_family_of(optimizer: Any) -> str | None:
    """What the optimizer holds decides its family (``None`` before its first step)."""
    state = getattr(unwrapped(optimizer), "state", {})
    return optimizer_family(frozenset(key for value in state.values() for key in value))
