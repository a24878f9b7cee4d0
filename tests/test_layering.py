"""The maths layer stays free of torch, Lightning and torch.distributed, as the design promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_cannikin"

# every module that holds maths (models, planner, estimators, goodput, scaling rules) or plain tooling on top of it
PURE_MODULES = [
    "balancer",
    "goodput",
    "lr_scaling",
    "memory_model",
    "noise_scale",
    "perf_model",
    "plan",
    "planner",
    "profile",
    "replanner",
    "sample_window",
    "simulation.engine",
    "simulation.models",
    "simulation.validation",
]


def test_maths_modules_import_neither_torch_nor_lightning():
    # The package __init__ imports Lightning (it registers the strategy), so the package is set up here as a bare
    # module with the right __path__: importing a submodule then runs that module and its own imports, nothing else.
    code = f"""
import importlib, json, sys, types
package = types.ModuleType("lightning_cannikin")
package.__path__ = [{str(PACKAGE)!r}]
sys.modules["lightning_cannikin"] = package
simulation = types.ModuleType("lightning_cannikin.simulation")
simulation.__path__ = [{str(PACKAGE / "simulation")!r}]
sys.modules["lightning_cannikin.simulation"] = simulation
leaks = {{}}
for name in {PURE_MODULES!r}:
    importlib.import_module("lightning_cannikin." + name)
    leaks[name] = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "lightning", "pytorch_lightning"))
print(json.dumps(leaks))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    leaks = json.loads(result.stdout)
    assert list(leaks) == PURE_MODULES
    assert all(not modules for modules in leaks.values()), {name: m[:3] for name, m in leaks.items() if m}
