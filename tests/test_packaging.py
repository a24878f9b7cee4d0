"""What a user installs: every import declared, ``py.typed``, and the CLI's pure commands free of torch and Lightning.

The wheel itself (built, installed into a fresh environment and run from another directory) is checked by
``.ci/wheel_check``, which ``.ci/run`` calls.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lightning_cannikin"
HEAVY = ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "matplotlib")


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _imports(paths: list[Path]) -> dict[str, bool]:
    """Third-party top-level module -> whether some file imports it at module level (not inside a function or an
    ``if TYPE_CHECKING:`` block)."""
    found: dict[str, bool] = {}
    for path in paths:
        tree = ast.parse(path.read_text())
        lazy: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.If)):
                lazy.update(id(child) for child in ast.walk(node) if child is not node)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("lightning_cannikin", "examples", "tests", "__future__"):
                    continue
                found[top] = found.get(top, False) or id(node) not in lazy
    return found


def _declared(project: dict) -> set[str]:
    """Every distribution the package declares: its dependencies and its user-facing extras (`test` and `dev` are
    for working on the package, not for using it)."""
    extras = project["optional-dependencies"]
    return _requirement_names(project["dependencies"]).union(
        *(_requirement_names(extras[x]) for x in ("plots", "cli", "ray", "litdata"))
    )


def _distribution(module: str, declared: set[str]) -> str:
    dists = importlib.metadata.packages_distributions().get(module)
    if not dists and module in declared:
        return module  # an optional dependency this environment does not have (`rich` without the `cli` extra)
    assert dists, f"{module} is imported but no installed distribution provides it"
    return dists[0].lower().replace("_", "-")


# an extra's own module, which imports it at module level: nothing imports the module before the user asks for it
EXTRA_MODULES = {"ray": PACKAGE / "training" / "frontends" / "ray_train.py"}


def _eager_imports_of(module: str, paths: list[Path]) -> list[str]:
    """The files that import ``module`` (a module of this package) at module level."""
    found = []
    for path in paths:
        tree = ast.parse(path.read_text())
        lazy = {id(c) for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.If)) for c in ast.walk(n)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == module and id(node) not in lazy:
                found.append(path.name)
    return found


def test_every_import_of_the_package_is_declared():
    project = _pyproject()["project"]
    required, declared = _requirement_names(project["dependencies"]), _declared(project)
    files = sorted(PACKAGE.rglob("*.py"))
    imports = _imports([path for path in files if path not in EXTRA_MODULES.values()])
    undeclared = {m: _distribution(m, declared) for m in imports if _distribution(m, declared) not in declared}
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    # an optional dependency may only be imported lazily, so that the package works without it
    eager_optional = [m for m, eager in imports.items() if eager and _distribution(m, declared) in declared - required]
    assert not eager_optional, f"optional dependencies imported at module level: {eager_optional}"
    # except by its extra's own module, which the rest of the package imports only lazily
    for extra, path in EXTRA_MODULES.items():
        assert extra in _requirement_names(project["optional-dependencies"][extra]), extra
        extra_imports = set(_imports([path])) - set(imports)
        assert extra_imports <= {extra}, f"{path.name} imports undeclared {extra_imports - {extra}}"
        module = ".".join(("lightning_cannikin", *path.relative_to(PACKAGE).with_suffix("").parts))
        assert not _eager_imports_of(module, files), f"{module} is imported at module level"


def test_every_declared_dependency_is_used():
    project = _pyproject()["project"]
    files = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "examples").glob("*.py"))
    used = {_distribution(m, _declared(project)) for m in _imports(files)}
    unused = _requirement_names(project["dependencies"]) - used
    assert not unused, f"declared but never imported by the package or its examples: {unused}"


def test_the_wheel_marks_the_package_typed():
    assert (PACKAGE / "py.typed").is_file()
    package_data = _pyproject()["tool"]["setuptools"]["package-data"]["lightning_cannikin"]
    assert "py.typed" in package_data and any(entry.startswith("data/") for entry in package_data)


def _imported_modules(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``python -X importtime ARGS`` and read back every module the interpreter imported."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *args], capture_output=True, text=True, timeout=120, cwd=cwd, check=False
    )
    modules = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    modules.discard("package")  # the header line
    return done, modules


def _profile(tmp_path: Path) -> Path:
    from lightning_cannikin.core.plan import BatchBounds
    from lightning_cannikin.core.profile import build_profile, save_profile
    from lightning_cannikin.core.speed_model import SpeedModel, SpeedModelSettings, StepRecord

    rng = np.random.default_rng(0)
    model = SpeedModel(2, SpeedModelSettings(), BatchBounds.parse(None, 2))
    records = []
    for step, split in enumerate([(16, 16)] * 6 + [(20, 12)] * 6):
        compute = [a * b + 0.005 + rng.normal(0.0, 1e-5) for a, b in zip((0.001, 0.003), split, strict=True)]
        records += [StepRecord(step, r, split[r], compute[r], max(compute) + 0.002) for r in (0, 1)]
    model.add(records)
    return save_profile(tmp_path / "cannikin_profile.json", build_profile(model, []))


def test_the_cli_commands_import_neither_torch_nor_lightning(tmp_path):
    cli = ["-m", "lightning_cannikin.tools.cli"]
    done, modules = _imported_modules([*cli, "simulate", "--help"], tmp_path)
    assert done.returncode == 0 and "usage: cannikin simulate" in done.stdout, done.stderr[-2000:]
    # the measurement works: the simulator and its maths were imported, and nothing heavy
    assert {"lightning_cannikin.simulation.engine", "lightning_cannikin.core.policy", "numpy"} <= modules
    assert not {m for m in modules if m.split(".")[0] in HEAVY}, sorted(m for m in modules if "torch" in m)[:5]

    done, modules = _imported_modules([*cli, "plan", str(_profile(tmp_path)), "-b", "32", "--json"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["optimal"]["local_batch_sizes"][0] > 16, "rank 0 is 3x faster: it gets more"
    assert "lightning_cannikin.core.profile" in modules
    assert not {m for m in modules if m.split(".")[0] in HEAVY}


def test_import_is_lazy_and_registers_the_strategy_once_lightning_is_imported(tmp_path):
    # one process (Lightning costs ~15 s to import): the package first, Lightning afterwards
    code = """
import json, sys
heavy = lambda: sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "lightning"))
report = {}
import lightning_cannikin.tools.cli
report["after_cli"] = heavy()
import lightning_cannikin
from lightning_cannikin import Plan
report["after_package"] = heavy()
import lightning.pytorch as pl
from lightning.pytorch.strategies import StrategyRegistry
report["registered"] = sorted(n for n in StrategyRegistry if n.startswith("cannikin"))
trainer = pl.Trainer(strategy="cannikin_fork", devices=2, accelerator="cpu", logger=False)
report["strategy"] = type(trainer.strategy).__module__ + "." + type(trainer.strategy).__qualname__
report["start_method"] = trainer.strategy._start_method
sharded = pl.Trainer(strategy="cannikin_fsdp_fork", devices=2, accelerator="cpu", logger=False).strategy
report["fsdp"] = [type(sharded).__qualname__, sharded._start_method]
report["ray"] = sorted(m for m in sys.modules if m.split(".")[0] == "ray")  # `cannikin_ray` registered, Ray not
report["loader_restored"] = type(pl.__spec__.loader).__module__
# and with Lightning imported first: registered at import
import importlib
for name in report["registered"]:
    StrategyRegistry.remove(name)
importlib.reload(lightning_cannikin)
report["registered_again"] = sorted(n for n in StrategyRegistry if n.startswith("cannikin"))
print(json.dumps(report))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["after_cli"] == [] and report["after_package"] == [], report
    ddp = ["cannikin", "cannikin_fork", "cannikin_notebook", "cannikin_spawn"]
    fsdp = ["cannikin_fsdp", "cannikin_fsdp_fork", "cannikin_fsdp_notebook", "cannikin_fsdp_spawn"]
    assert report["registered"] == sorted([*ddp, *fsdp, "cannikin_ray", "cannikin_ray_fsdp"])
    assert report["ray"] == []
    assert report["fsdp"] == ["CannikinModelParallelStrategy", "fork"]
    assert report["strategy"] == "lightning_cannikin.training.frontends.strategy.CannikinStrategy"
    assert report["start_method"] == "fork"
    assert report["loader_restored"] != "lightning_cannikin._registration", "the import hook must put the loader back"
    assert report["registered_again"] == report["registered"]


def test_every_public_name_resolves():
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_cannikin

    assert isinstance(StrategyRegistry.get("cannikin"), lightning_cannikin.CannikinStrategy)
    for name in lightning_cannikin.__all__:
        assert getattr(lightning_cannikin, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        _ = lightning_cannikin.missing
