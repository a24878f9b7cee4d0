"""The GPU check's few files: ``report.md`` (tables a person reads) from its summary, and one archive of the rest.

Pure text from plain dicts (no torch): :func:`render` takes the check's ``summary.json`` content (its ``gpu_shares``
part holds ``gpu_shares.json``'s ``summary``) and returns the Markdown; :func:`archive` packs a folder into one
``.tar.gz`` and removes it.
"""

from __future__ import annotations

import shutil
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.shortfall import PARTS

PART_HEADERS = ("lines (solo)", "interference", "input", "broadcast wait", "all-reduce", "optimizer", "other")


def _f(value: Any, digits: int = 3, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def shares_table(shares: Mapping[str, Any]) -> list[str]:
    """Per workload: the measured ratios, the ideal with and without the fixed costs, the fraction reached, the
    splits and the one-line cause."""
    rows = []
    for workload, s in (shares.get("summary") or {}).items():
        rows.append(
            [
                workload,
                _f(s.get("measured_ratio_steady"), suffix="x"),
                _f(s.get("measured_ratio_step"), suffix="x"),
                _f(s.get("ideal_ratio"), suffix="x"),
                _f(s.get("ideal_ratio_lines"), suffix="x"),
                _pct(s.get("fraction_of_ideal")),
                _f(s.get("cannikin_split")),
                _f(s.get("ideal_split")),
                str(s.get("pairs", 0)),
            ]
        )
    headers = (
        "workload",
        "measured (steady epochs)",
        "measured (step)",
        "ideal (lines + fixed)",
        "ideal (lines only)",
        "fraction of ideal",
        "Cannikin split",
        "ideal split",
        "pairs",
    )
    return _table(headers, rows)


def decomposition_table(shares: Mapping[str, Any]) -> list[str]:
    """Per workload and strategy, the critical path's parts (ms a step), then each part's ratio points of the gap
    between measured and ideal."""
    rows = []
    for workload, s in (shares.get("summary") or {}).items():
        d = s.get("shortfall")
        if not d:
            rows.append([workload, "(no decomposition: a pair or the calibration is missing)", *[""] * 8])
            continue
        for strategy, name in (("ddp", "DDP"), ("cannikin", "Cannikin")):
            path = d["path_ms"][strategy]
            rows.append([workload, name, _f(d["cycle_ms"][strategy], 2), *(_f(path[p], 2) for p in PARTS)])
        ideal = [_f(d["ideal_compute_ms"], 2), *("" for _ in PARTS[1:])]
        for index, key in enumerate(PARTS):
            if key in d["fixed_ms"]:
                ideal[index] = _f(d["fixed_ms"][key], 2)
        rows.append([workload, "ideal (Cannikin)", _f(d["ideal_compute_ms"] + sum(d["fixed_ms"].values()), 2), *ideal])
        gap = d["measured_ratio"] - d["ideal_ratio"]
        contributions = [f"{d['contributions'][p]:+.3f}" for p in PARTS]
        rows.append([workload, "ratio points of the gap", f"{gap:+.3f}", *contributions])
    return _table(("workload", "", "cycle", *PART_HEADERS), rows)


def ranks_table(shares: Mapping[str, Any]) -> list[str]:
    """Every rank's steady medians (ms) and its parts, per workload and strategy."""
    rows = []
    for workload, s in (shares.get("summary") or {}).items():
        d = s.get("shortfall") or {}
        for strategy, table in (s.get("ranks") or {}).items():
            parts = (d.get("parts_ms") or {}).get(strategy) or [None] * len(table)
            for row, part in zip(table, parts, strict=True):
                values = [_f(part[p], 2) if part else "-" for p in PARTS]
                rows.append(
                    [workload, strategy, str(row["rank"]), _f(row.get("batch"), 0), _f(row.get("cycle_ms"), 2), *values]
                )
    return _table(("workload", "strategy", "rank", "batch", "cycle", *PART_HEADERS), rows)


def tests_table(tests: Sequence[Mapping[str, Any]]) -> list[str]:
    return _table(("test", "status", "s"), [[t["id"], t["status"], _f(t.get("seconds"), 1)] for t in tests])


def render(summary: Mapping[str, Any]) -> str:
    """``report.md``: the verdict, the cause in one line, the ratio table, the decomposition, the ranks, the tests."""
    shares = summary.get("gpu_shares") or {}
    result = shares.get("result") or {}
    lines = [f"# GPU check: {summary['verdict']}", ""]
    if result.get("synthetic"):
        lines += ["**Synthetic numbers**: a dry run (no GPU ran anything); the tables walk the report's code path.", ""]
    lines += [f"Cause: {summary.get('cause') or '-'}", ""]
    facts = [
        ("mode", "dry run" if summary.get("dry_run") else "GPU"),
        ("device", result.get("device")),
        ("sharing", result.get("sharing")),
        ("torch", summary.get("torch")),
        ("seconds", f"{summary.get('seconds')} of a budget of {summary.get('budget')}"),
        ("tests", ", ".join(f"{n} {status}" for status, n in (summary.get("counts") or {}).items()) or "-"),
        ("gpu_shares", shares.get("status")),
    ]
    lines += [f"- {key}: {value}" for key, value in facts if value is not None] + [""]
    if result.get("summary"):
        lines += ["## Cannikin against DDP and the ideal (time ratios: lower is faster)", ""]
        lines += [*shares_table(result), ""]
        for workload, s in result["summary"].items():
            lines.append(f"- {workload}: {s.get('cause') or 'no decomposition'}")
        lines += ["", "## Where a step goes (ms on the critical path; the gap's parts in ratio points)", ""]
        lines += [*decomposition_table(result), "", "## Every rank (ms, steady medians)", ""]
        lines += [*ranks_table(result), ""]
    if shares.get("tail"):
        lines += ["## gpu_shares did not complete: its last lines", "", "```", *shares["tail"], "```", ""]
    if summary.get("error"):
        lines += ["## The check itself failed", "", "```", *summary["error"], "```", ""]
    if summary.get("tests"):
        lines += ["## tests/gpu", "", *tests_table(summary["tests"]), ""]
    lines += ["Files: `summary.json` (the verdict and every ratio), this report, `artifacts.tar.gz` (every log)."]
    return "\n".join(lines) + "\n"


def archive(folder: Path, target: Path) -> list[str]:
    """Pack ``folder`` into ``target`` (a ``.tar.gz``, its members under ``artifacts/``) and remove the folder; the
    members' names."""
    with tarfile.open(target, "w:gz") as tar:
        tar.add(folder, arcname="artifacts")
        names = tar.getnames()
    shutil.rmtree(folder)
    return names
