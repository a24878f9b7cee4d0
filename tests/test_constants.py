"""The constants table of ``docs/constants.md`` against the code: every module-level constant of
``lightning_cannikin/core/`` has its row with its value, every row names one that exists, and no name is defined in
two modules (a value defined twice drifts apart)."""

from __future__ import annotations

import ast
import importlib
import math
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "lightning_cannikin" / "core"
ROW = re.compile(r"^\| `(?P<name>_?[A-Z][A-Z0-9_]*)` \| `(?P<module>\w+)` \| (?P<value>[^|]+) \|")


def _a_number(node: ast.expr) -> bool:
    """Whether ``node`` is written as a number: literals, arithmetic and other constants' names, nothing read from an
    object (``SpeedModelSettings().max_samples`` copies a default defined elsewhere: not a constant of its own)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int | float) and not isinstance(node.value, bool)
    if isinstance(node, ast.BinOp):
        return _a_number(node.left) and _a_number(node.right)
    if isinstance(node, ast.UnaryOp):
        return _a_number(node.operand)
    return isinstance(node, ast.Name) and node.id.lstrip("_")[:1].isupper()


def constants_in_code() -> list[tuple[str, str]]:
    """``(module, name)`` of every module-level assignment of an upper-case name in the core written as a number,
    once for each definition."""
    found = []
    for path in sorted(CORE.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            for target in targets:
                if isinstance(target, ast.Name) and target.id.upper() == target.id and _a_number(value):
                    found.append((path.stem, target.id))
    return found


def rows_in_docs() -> dict[tuple[str, str], float]:
    text = (ROOT / "docs" / "constants.md").read_text()
    rows = {}
    for line in text.splitlines():
        match = ROW.match(line)
        if match:
            key = (match["module"], match["name"])
            assert key not in rows, f"{key} has two rows"
            rows[key] = float(match["value"].strip().replace(",", ""))
    return rows


def test_every_core_constant_has_its_row_with_its_value_and_every_row_its_constant() -> None:
    code, docs = set(constants_in_code()), rows_in_docs()
    assert len(docs) >= 30, "the table's rows were not read"
    assert sorted(set(code) - set(docs)) == [], "constants without a row in docs/constants.md"
    assert sorted(set(docs) - set(code)) == [], "rows for constants the code does not define"
    for (module, name), documented in docs.items():
        value = getattr(importlib.import_module(f"lightning_cannikin.core.{module}"), name)
        assert math.isclose(value, documented, rel_tol=1e-3), (module, name, value, documented)


def test_no_constant_is_defined_in_two_modules() -> None:
    names: dict[str, list[str]] = {}
    for module, name in constants_in_code():
        names.setdefault(name, []).append(module)
    assert {name: modules for name, modules in names.items() if len(modules) > 1} == {}
