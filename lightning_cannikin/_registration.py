"""Register ``strategy="cannikin"`` in Lightning's registry without importing Lightning before the user does.

Lightning's ``StrategyRegistry`` is filled at import time and never looks for plugins, so ``import lightning_cannikin``
must register the names. Importing Lightning for that would cost seconds in every process that only wants the maths,
the simulator or the ``cannikin`` command. So:

* if Lightning is already imported, the names are registered at once;
* otherwise an import hook waits for ``lightning.pytorch`` to finish importing (all of Lightning is loaded by then,
  whichever of its modules the user imported) and registers the names right after it, before the user's
  ``import`` statement returns.

The registry stores a small factory rather than the class, so registering imports nothing of this package: the
factory imports :class:`~lightning_cannikin.training.frontends.strategy.CannikinStrategy` when Lightning builds the
strategy from its name. (A registry entry only has to be callable with its stored init parameters.)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["RAY_REGISTRY_NAMES", "register_launchers", "register_when_lightning_is_imported"]

# a DDP or FSDP2 strategy's registry names: the base name's suffix -> the launcher's start method
_LAUNCHERS: tuple[tuple[str, str], ...] = (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork"), ("_notebook", "fork"))

# the Ray Train strategies' names -> their class in `training.frontends.ray_train` and what they are. Ray starts the
# workers, so there is no launcher variant.
# Registering them imports nothing of Ray; building one without Ray raises an error that says how to install it.
RAY_REGISTRY_NAMES: dict[str, tuple[str, str]] = {
    "cannikin_ray": ("CannikinRayStrategy", "DDP inside Ray Train workers (the `ray` extra)"),
    "cannikin_ray_fsdp": ("CannikinRayFSDPStrategy", "FSDP2 inside Ray Train workers (the `ray` extra)"),
}

_LIGHTNING = "lightning.pytorch"


def _builder(module: str, name: str) -> Callable[..., Any]:
    """What the registry calls to build the strategy class ``name`` of ``module`` from its registry name: the class is
    imported then, not when the name is registered (the Ray strategies' module imports Ray, the ``ray`` extra)."""

    def build(**init_params: Any) -> Any:
        return getattr(importlib.import_module(module), name)(**init_params)

    build.__qualname__ = f"build_{name}"
    return build


def register_launchers(registry: Any, base: str, factory: Callable[..., Any], kind: str) -> None:
    """``base`` (the script launcher) and ``base_spawn``, ``base_fork``, ``base_notebook`` in ``registry``, each built
    by ``factory``; a name already there (a second import, a reload, a registration otherwise) is left alone."""
    for suffix, start_method in _LAUNCHERS:
        if base + suffix not in registry:
            description = f"Cannikin heterogeneity-aware {kind} with `start_method` '{start_method}'"
            registry.register(base + suffix, factory, description=description, start_method=start_method)


def register(registry: Any) -> None:
    """Add the names to ``registry`` (a second call, or a name registered otherwise, is left alone)."""
    training = "lightning_cannikin.training"
    ddp = _builder(f"{training}.frontends.strategy", "CannikinStrategy")
    register_launchers(registry, "cannikin", ddp, "DDP")
    fsdp = _builder(f"{training}.frontends.fsdp", "CannikinModelParallelStrategy")
    register_launchers(registry, "cannikin_fsdp", fsdp, "FSDP2 (sharded data parallel)")
    for name, (cls, kind) in RAY_REGISTRY_NAMES.items():
        if name not in registry:
            factory = _builder(f"{training}.frontends.ray_train", cls)
            registry.register(name, factory, description=f"Cannikin heterogeneity-aware {kind}")


def _register_in_lightning() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    register(StrategyRegistry)


def _fully_imported(name: str) -> bool:
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


class _LoaderThenCall(importlib.abc.Loader):
    """Runs the real loader, puts it back on the module, then calls ``after``."""

    def __init__(self, loader: importlib.abc.Loader, after: Callable[[], None]) -> None:
        self._loader = loader
        self._after = after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        try:
            self._loader.exec_module(module)
        finally:
            module.__loader__ = self._loader
            if module.__spec__ is not None:
                module.__spec__.loader = self._loader
        self._after()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader the other finders return for one module name, once."""

    def __init__(self, name: str, after: Callable[[], None]) -> None:
        self.name = name
        self.after = after

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once, and never while looking up the real spec below
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _LoaderThenCall(spec.loader, self.after)
                return spec
        return None


def register_when_lightning_is_imported() -> None:
    """Register now if Lightning is imported, else as soon as it is (idempotent)."""
    if _fully_imported(_LIGHTNING):
        _register_in_lightning()
        return
    if not any(isinstance(finder, _AfterImportFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImportFinder(_LIGHTNING, _register_in_lightning))
