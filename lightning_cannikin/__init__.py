"""lightning-cannikin: heterogeneity-aware data-parallel training for PyTorch Lightning.

Importing the package registers ``strategy="cannikin"`` (and ``cannikin_spawn``, ``cannikin_fork``,
``cannikin_notebook``), the sharded ``strategy="cannikin_fsdp"`` (and its ``_spawn``, ``_fork``, ``_notebook``), and
``strategy="cannikin_ray"`` and ``"cannikin_ray_fsdp"`` (in Ray Train workers; the ``ray`` extra) in Lightning's
strategy registry. The package itself is lazy: its public names are imported on first use, and the registration waits
until Lightning is imported, so the maths, the simulator and the ``cannikin`` command (``lightning_cannikin.tools.cli``)
never pay for importing torch or Lightning (nor Ray). See :mod:`._registration`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_cannikin.__about__ import __version__
from lightning_cannikin._registration import register_when_lightning_is_imported

if TYPE_CHECKING:  # the names below, for type checkers and IDEs; at run time `__getattr__` imports them on first use
    from lightning_cannikin.core.plan import Plan
    from lightning_cannikin.training.data.sampler import UnevenDistributedSampler
    from lightning_cannikin.training.emulator import EmulatedCluster
    from lightning_cannikin.training.frontends.callback import Cannikin
    from lightning_cannikin.training.frontends.fabric import CannikinFabricStrategy
    from lightning_cannikin.training.frontends.fsdp import CannikinModelParallelStrategy
    from lightning_cannikin.training.frontends.ray_train import CannikinRayFSDPStrategy as CannikinRayFSDPStrategy
    from lightning_cannikin.training.frontends.ray_train import (
        CannikinRayStrategy as CannikinRayStrategy,  # not in __all__
    )
    from lightning_cannikin.training.frontends.strategy import CannikinStrategy
    from lightning_cannikin.training.schedules import progress_lr_lambda
    from lightning_cannikin.training.settings import CannikinSettings

# public name -> the module that defines it
_LAZY = {
    "Plan": "lightning_cannikin.core.plan",
    "Cannikin": "lightning_cannikin.training.frontends.callback",
    "CannikinSettings": "lightning_cannikin.training.settings",
    "CannikinStrategy": "lightning_cannikin.training.frontends.strategy",
    "CannikinFabricStrategy": "lightning_cannikin.training.frontends.fabric",
    "CannikinModelParallelStrategy": "lightning_cannikin.training.frontends.fsdp",
    # these need the `ray` extra: importable by name but left out of `__all__` (a star import must not need Ray)
    "CannikinRayStrategy": "lightning_cannikin.training.frontends.ray_train",
    "CannikinRayFSDPStrategy": "lightning_cannikin.training.frontends.ray_train",
    "EmulatedCluster": "lightning_cannikin.training.emulator",
    "UnevenDistributedSampler": "lightning_cannikin.training.data.sampler",
    "progress_lr_lambda": "lightning_cannikin.training.schedules",
}

__all__ = [
    "Cannikin",
    "CannikinFabricStrategy",
    "CannikinModelParallelStrategy",
    "CannikinSettings",
    "CannikinStrategy",
    "EmulatedCluster",
    "Plan",
    "UnevenDistributedSampler",
    "__version__",
    "progress_lr_lambda",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # imported once; later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


register_when_lightning_is_imported()
