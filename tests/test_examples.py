"""The examples as a contract: they import only the public API, and CI runs every one the README and docs name.

The public API an example may use from this package is the top-level package itself: ``import lightning_cannikin``
and ``from lightning_cannikin import X`` where ``X`` is one of its lazy public names (``__all__``, plus the Ray
strategies that need the ``ray`` extra). No submodule of the package (a pruning or a move inside it must not break an
example silently), and nothing ``_``-prefixed from any package (``torch._dynamo``, ``from x import _y``). The same rule
holds for what the YAML and shell examples name (a ``class_path``, ``python -m ...``). Everything else of
``examples/`` (its own helper modules, torch, Lightning, Ray) is allowed.

CI's example step is ``.ci/examples``: its ``run NAME EXPECT COMMAND...`` lines are parsed here, so the list of
examples the docs name and the list CI runs cannot drift apart. Running them is CI's job (about three minutes), not
this file's: these checks only read files.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

import lightning_cannikin

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
CI_EXAMPLES = ROOT / ".ci" / "examples"
PACKAGE = "lightning_cannikin"
# the package's lazy public API: `__all__`, and the names left out of it only because they need the `ray` extra
PUBLIC_NAMES = frozenset(lightning_cannikin.__all__) | frozenset(lightning_cannikin._LAZY)
# a path under examples/ as the docs and the CI script write it
EXAMPLE_PATH = re.compile(r"\bexamples/[\w.-]+\.(?:py|sh|yaml)\b")


def _private(dotted: str) -> bool:
    """A dotted name with a ``_``-prefixed part (``__future__``-style dunders are not private)."""
    parts = dotted.split(".")
    return any(part.startswith("_") and not (part.startswith("__") and part.endswith("__")) for part in parts)


def import_violations(source: str, filename: str = "<example>") -> list[str]:
    """What a Python example imports or reads outside the public API (empty: nothing)."""
    found: list[str] = []
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"line {node.lineno}: `import {alias.name}` (a private module)")
                elif alias.name.startswith(f"{PACKAGE}."):
                    found.append(f"line {node.lineno}: `import {alias.name}` (a submodule of the package)")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            where = f"line {node.lineno}: `from {'.' * node.level}{module} import ...`"
            if _private(module):
                found.append(f"{where} (a private module)")
            elif module.startswith(f"{PACKAGE}."):
                found.append(f"{where} (a submodule of the package)")
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{where}: `{alias.name}` is private")
                elif module == PACKAGE and alias.name not in PUBLIC_NAMES:
                    found.append(f"{where}: `{alias.name}` is not a public name of the package")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == PACKAGE:
            if node.attr not in PUBLIC_NAMES:
                found.append(f"line {node.lineno}: `{PACKAGE}.{node.attr}` is not a public name of the package")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module":
            found.append(f"line {node.lineno}: `import_module(...)` (an import this check cannot read)")
    return found


def named_violations(text: str) -> list[str]:
    """What a YAML or shell example names of the package outside its public API (``lightning_cannikin.X``)."""
    found = []
    for match in re.finditer(rf"\b{PACKAGE}((?:\.\w+)+)", text):
        parts = match.group(1).lstrip(".").split(".")
        if len(parts) != 1 or parts[0] not in PUBLIC_NAMES:
            found.append(f"`{match.group(0)}` is not a public name of the package")
    return found


def ci_runs() -> list[list[str]]:
    """The commands of ``.ci/examples``' ``run`` lines (continuation lines joined), as ``[NAME, EXPECT, *COMMAND]``."""
    text = CI_EXAMPLES.read_text().replace("\\\n", " ")
    return [shlex.split(line)[1:] for line in text.splitlines() if line.startswith("run ")]


def run_by_ci() -> set[str]:
    """Every example path a ``run`` line names, and every one a shell example run there names in its commands."""
    paths = {path for command in ci_runs() for word in command[2:] for path in EXAMPLE_PATH.findall(word)}
    for script in [path for path in paths if path.endswith(".sh")]:
        code = "\n".join(line for line in (ROOT / script).read_text().splitlines() if not line.lstrip().startswith("#"))
        paths |= set(EXAMPLE_PATH.findall(code))
    return paths


def named_by_docs() -> set[str]:
    """Every example path README.md and docs/*.md name."""
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {path for document in documents for path in EXAMPLE_PATH.findall(document.read_text())}


def runnable_examples() -> set[str]:
    """Every file of examples/ a user runs: the shell scripts, and the Python files with a ``__main__`` block."""
    scripts = {f"examples/{path.name}" for path in EXAMPLES.glob("*.sh")}
    mains = {f"examples/{p.name}" for p in EXAMPLES.glob("*.py") if 'if __name__ == "__main__":' in p.read_text()}
    return scripts | mains


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.py")), ids=lambda path: path.name)
def test_a_python_example_imports_only_the_public_api(path: Path) -> None:
    assert import_violations(path.read_text(), str(path)) == []


@pytest.mark.parametrize("path", sorted([*EXAMPLES.glob("*.yaml"), *EXAMPLES.glob("*.sh")]), ids=lambda path: path.name)
def test_a_config_or_shell_example_names_only_the_public_api(path: Path) -> None:
    assert named_violations(path.read_text()) == []


def test_the_import_rule_flags_what_broke_an_example_and_passes_the_public_route() -> None:
    broken = {
        "from lightning_cannikin.training._lightning_compat import launcher_for": "private module",
        "from lightning_cannikin.training.measurement.comm_hook import weighted_allreduce_hook": "submodule",
        "import lightning_cannikin.training.frontends.fsdp": "submodule of the package",
        "from lightning_cannikin import _registration": "private",
        "from lightning_cannikin import BalancingEngine": "not a public name",
        "import lightning_cannikin\nlightning_cannikin.training.engine": "not a public name",
        "import torch._dynamo": "private module",
        "from torch.distributed import _functional_collectives": "private",
        "import importlib\nimportlib.import_module('lightning_cannikin.training.engine')": "cannot read",
    }
    for source, reason in broken.items():
        found = import_violations(source)
        assert len(found) == 1 and reason in found[0], (source, found)
    public = (
        "from __future__ import annotations\nimport lightning_cannikin\nimport torch.distributed as dist\n"
        "from lightning_cannikin import Cannikin, CannikinRayStrategy, UnevenDistributedSampler, __version__\n"
        "from examples.data import load_dataset\nlightning_cannikin.EmulatedCluster\n"
    )
    assert import_violations(public) == []
    assert named_violations("class_path: lightning_cannikin.Cannikin\npython -m lightning_cannikin.tools.cli") == [
        "`lightning_cannikin.tools.cli` is not a public name of the package"
    ]


def test_every_example_the_docs_name_exists() -> None:
    named = named_by_docs()
    assert {"examples/fsdp_cluster.py", "examples/torch_distributed.py"} <= named, "the docs' parse found too little"
    assert sorted(path for path in named if not (ROOT / path).is_file()) == []


def test_ci_runs_every_example_the_docs_name_and_every_runnable_one() -> None:
    ran = run_by_ci()
    assert sorted(named_by_docs() - ran) == [], "named by README.md or docs/ but not run by .ci/examples"
    assert sorted(runnable_examples() - ran) == [], "runnable but not run by .ci/examples"
    assert sorted(path for path in ran if not (ROOT / path).is_file()) == []


def test_ci_runs_each_example_in_its_smoke_mode_and_checks_what_it_prints() -> None:
    runs = ci_runs()
    assert runs, "no `run` line parsed in .ci/examples"
    names = [name for name, *_ in runs]
    assert len(set(names)) == len(names), f"one log per example: {names}"
    for name, expect, *command in runs:
        assert expect.strip(), f"{name}: a run must name a line its example prints at the end"
        assert any("smoke" in word for word in command), f"{name}: not in its smoke mode: {command}"


def test_ci_calls_the_example_step_after_the_wheel_check() -> None:
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "bash .ci/examples" in lines
    assert lines.index("bash .ci/wheel_check") < lines.index("bash .ci/examples")
