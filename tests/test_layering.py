"""The package's floors hold: core/ is pure, tools/ and simulation/ are free of torch and Lightning, no import cycle.

Every file is found by walking the package, so a new module is checked without anyone adding it to a list.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_cannikin"
NAME = "lightning_cannikin"

# What each floor may import from outside the package (first component of the module name), besides the stdlib.
PURE_EXTERNALS = {"numpy", "sklearn", "scipy"}
TOOL_EXTERNALS = PURE_EXTERNALS | {"matplotlib", "rich"}
FRAMEWORKS = {"torch", "lightning", "pytorch_lightning", "lightning_fabric", "typing_extensions", "ray"}
# The floors, lowest first: a module may import its own floor and the floors below it, never one above.
FLOORS = ("core", "simulation", "tools", "training")


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join((NAME, *parts))] = path
    return modules


def _imports(path: Path, module: str) -> set[str]:
    """Every module ``path`` imports, at any depth of the file (lazy imports inside functions count too)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.add(target)
            # `from pkg import sub` imports the submodule when it is one
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m in _imports(path, name) if m in modules and m != name} for name, path in modules.items()}


def _floor(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in FLOORS else None


def test_the_package_has_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            # a module imports its package's __init__ on the way: only arrows between real modules can cycle
            if node.startswith(target + "."):
                continue
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target] if target in path else [node, target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def test_floors_import_only_downwards():
    upward = []
    for module, targets in _graph().items():
        floor = _floor(module)
        if floor is None:
            continue
        for target in targets:
            other = _floor(target)
            if other is not None and FLOORS.index(other) > FLOORS.index(floor):
                upward.append(f"{module} -> {target}")
    assert not upward, upward


def test_pure_floors_import_no_framework():
    # the simulator reads cluster specs from YAML files too (PyYAML comes with Lightning)
    allowed = {"core": PURE_EXTERNALS, "simulation": PURE_EXTERNALS | {"yaml"}, "tools": TOOL_EXTERNALS | {"yaml"}}
    stdlib = sys.stdlib_module_names
    leaks = []
    modules = _modules()
    for module, path in modules.items():
        floor = _floor(module) or (module.split(".")[1] if module.count(".") == 1 else None)
        if floor not in allowed:
            continue
        for target in _imports(path, module):
            top = target.split(".")[0]
            if top in (NAME, "__future__") or top in stdlib or top in allowed[floor]:
                continue
            leaks.append(f"{module} imports {target}")
    assert not leaks, leaks


def test_pure_modules_run_without_torch_or_lightning():
    # The package __init__ imports Lightning (it registers the strategy), so the package and its floors are set up
    # here as bare modules with the right __path__: importing a submodule then runs that module and its own imports.
    pure = [
        m
        for m in _modules()
        if _floor(m) in ("core", "simulation", "tools") and not m.endswith((".core", ".simulation", ".tools"))
    ]
    assert len(pure) >= 20, pure  # the walk found the floors
    packages = [(NAME, str(PACKAGE))] + [(f"{NAME}.{f}", str(PACKAGE / f)) for f in ("core", "simulation", "tools")]
    code = f"""
import importlib, json, sys, types
for name, path in {packages!r}:
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
leaks = {{}}
for name in {pure!r}:
    importlib.import_module(name)
    leaks[name] = sorted(m for m in sys.modules if m.split(".")[0] in {sorted(FRAMEWORKS)!r})
print(json.dumps(leaks))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    leaks = json.loads(result.stdout)
    assert list(leaks) == pure
    assert all(not modules for modules in leaks.values()), {name: m[:3] for name, m in leaks.items() if m}


# ---- the balancing engine and its frontends -------------------------------------------------------------------

OPTIONAL_EXTRAS = {"ray"}  # what a module of the package may need that an installation may lack

FRONTENDS = (
    "training/frontends/callback.py",
    "training/frontends/lightning_hooks.py",
    "training/frontends/fabric.py",
    "training/frontends/strategy.py",
    "training/frontends/fsdp.py",
    "training/frontends/uneven_strategy.py",
    "training/frontends/ray_train.py",
)
PROTOCOL_CALLS = {"all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "decide"}


def _calls(path: Path) -> set[str]:
    """The names every call in ``path`` calls (``f(...)`` and ``x.f(...)`` alike)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
    return names


def test_no_frontend_gathers_broadcasts_or_decides_on_its_own():
    for frontend in FRONTENDS:
        found = _calls(PACKAGE / frontend) & PROTOCOL_CALLS
        assert not found, f"{frontend} calls {found}: the protocol belongs to training/engine.py"
    assert {"all_gather", "broadcast", "decide"} <= _calls(PACKAGE / "training/engine.py")


# the engine's private parts, and the all-reduce state's fields: a frontend that names one reaches behind the step API
BEHIND_THE_ENGINE = {
    "runtime",
    "timer",
    "observers",
    "hook_state",
    "weight_in_loss",
    "mean_over",
    "micro_weight",
    "unit_scale",
    "global_scale",
    "local_scale",
    "will_reduce",
    "start_step",
    "after_micro_step",
}


def _behind_the_engine(source: str, public: set[str]) -> set[str]:
    """What ``source`` reaches behind the engine's step API: an attribute it reads on an engine (``engine.x``,
    ``self.engine.x``, ``self._engine.x``) that is private or not the engine's, or a name of the engine's parts."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
        if name.lstrip("_") in BEHIND_THE_ENGINE:
            found.add(name)
        if isinstance(node, ast.Attribute):
            owner = node.value
            on_engine = (owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")) in (
                "engine",
                "_engine",
            )
            if on_engine and (name.startswith("_") or name not in public):
                found.add(f"engine.{name}")
    return found


def test_the_frontends_drive_the_engine_through_its_declared_api_only():
    from lightning_cannikin.training.engine import ENGINE_API, BalancingEngine

    public = {name for name in dir(BalancingEngine) if not name.startswith("_")}
    public |= {name for name in vars(BalancingEngine()) if not name.startswith("_")}  # plan, step_sizes, ...
    assert public == ENGINE_API, f"undeclared: {public - ENGINE_API}; declared, absent: {ENGINE_API - public}"
    used = set()
    for frontend in (*FRONTENDS, "training/frontends/launch_checks.py"):
        source = (PACKAGE / frontend).read_text()
        found = _behind_the_engine(source, set(ENGINE_API))
        assert not found, f"{frontend} reaches behind the engine's step API: {sorted(found)}"
        used |= _on_the_engine(source)
    assert used <= ENGINE_API and len(used) >= len(ENGINE_API) - 4, sorted(ENGINE_API - used)
    # the check can fail: what the strategies of the last release did
    old = "runtime.timer.will_reduce(True)\nruntime.hook.weight_in_loss = True\nself._engine._timer.start()"
    assert _behind_the_engine(old, set(ENGINE_API)) >= {"timer", "weight_in_loss", "will_reduce", "engine._timer"}
    assert _behind_the_engine("self.engine.replanner.every_n_steps", set(ENGINE_API)) == {"engine.replanner"}


def _on_the_engine(source: str) -> set[str]:
    """The attributes ``source`` names on an engine (``engine.x``, ``self.engine.x``, ``self._engine.x``)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")) in ("engine", "_engine"):
                names.add(node.attr)
    return names


def test_the_strategies_own_the_engine_and_the_callback_reads_the_strategys():
    from lightning_cannikin import Cannikin, CannikinFabricStrategy, CannikinStrategy
    from lightning_cannikin.training.engine import BalancingEngine

    callback, fabric, strategy = Cannikin(max_batch_size=64), CannikinFabricStrategy(), CannikinStrategy()
    for engine in (fabric.engine, strategy.engine):
        assert type(engine) is BalancingEngine
    with pytest.raises(RuntimeError, match="no engine before a fit"):
        callback.engine  # noqa: B018 (the callback builds none: it configures the strategy's)
    assert callback.plan is None and callback.history == [] and callback.lr_factor == 1.0
    graph = _graph()
    for frontend in ("training.frontends.uneven_strategy", "training.frontends.fabric"):
        assert f"{NAME}.training.engine" in graph[f"{NAME}.{frontend}"], frontend
    callback = f"{NAME}.training.frontends.callback"
    assert f"{NAME}.training.engine" not in graph[callback], "the callback builds no engine"


def test_the_strategy_does_not_import_the_callback_even_indirectly():
    graph = _graph()
    seen, todo = set(), [f"{NAME}.training.frontends.strategy"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    assert f"{NAME}.training.frontends.callback" not in seen
    assert not any(m.startswith(f"{NAME}.tools") for m in graph[f"{NAME}.training.engine"]), "the profile is core's"


def test_private_lightning_and_torch_names_are_reached_through_the_compat_module_only():
    # `x._name` attribute reads and `_Name` imports from lightning or torch, outside training/_lightning_compat.py
    compat = PACKAGE / "training" / "_lightning_compat.py"
    leaks = []
    for path in (PACKAGE / "training").rglob("*.py"):
        if path == compat:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("lightning", "torch"):
                leaks += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                base = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
                if base in ("torch", "dist", "trainer", "loop", "fit_loop", "autograd", "Variable", "scaler"):
                    leaks.append(f"{path.name}: {base}.{node.attr}")
    assert not leaks, leaks


def test_private_names_inherited_from_lightning_classes_are_declared_in_the_compat_module():
    # `self._name` in a subclass of a Lightning or torch class, where the base class defines `_name` (a class attribute
    # or an attribute its own code sets): a private seam like any other, so it must be listed, with what it relies on
    import importlib
    import re

    from lightning_cannikin.training._lightning_compat import INHERITED_PRIVATE_NAMES

    found: dict[str, set[str]] = {}
    for path in sorted((PACKAGE / "training").rglob("*.py")):
        try:
            module = importlib.import_module(".".join((NAME, *path.relative_to(PACKAGE).with_suffix("").parts)))
        except ModuleNotFoundError as error:
            if error.name in OPTIONAL_EXTRAS:
                continue  # an extra's own module (ray_train without Ray): nothing to inherit from here
            raise
        for node in ast.walk(ast.parse(path.read_text())):
            cls = getattr(module, node.name, None) if isinstance(node, ast.ClassDef) else None
            if not isinstance(cls, type):
                continue
            bases = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] in ("lightning", "torch")]
            sources = [_source(b) for b in bases]
            for attribute in ast.walk(node):
                name = attribute.attr if isinstance(attribute, ast.Attribute) else ""
                owner = getattr(attribute, "value", None)
                if not (name.startswith("_") and not name.startswith("__") and getattr(owner, "id", "") == "self"):
                    continue
                pattern = re.compile(rf"self\.{name}\b")
                if any(name in vars(b) for b in bases) or any(pattern.search(source) for source in sources):
                    found.setdefault(name, set()).add(f"{path.name}:{node.name}")
    assert set(found) <= set(INHERITED_PRIVATE_NAMES), {
        n: w for n, w in found.items() if n not in INHERITED_PRIVATE_NAMES
    }
    assert {"_launcher", "_start_method", "_ddp_comm_wrapper", "_data_parallel_size"} <= set(found), (
        "the check sees them"
    )


def _source(cls: type) -> str:
    """A class's source, or nothing where it has none to show (built in C, or made at run time)."""
    import inspect

    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""
