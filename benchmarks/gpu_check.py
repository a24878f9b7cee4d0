"""Every GPU check in one command within a short, fixed budget: the tests in ``tests/gpu``, then
``benchmarks/gpu_shares.py`` with the time they left, ending with three files a person can send back.

``python benchmarks/gpu_check.py --out DIR`` on a machine with one CUDA device (``--budget``, default 240 s; the
check's own wall time stays within it). The tests run a module at a time in ``python -m pytest -v`` processes with a
timeout (pytest-timeout may be missing there); one that hangs or crashes costs its own time only: it is named from
the live output and the tests after it run one to a process. ``gpu_shares.py`` gets the rest of the budget as its
deadline and plans its repeats to fit it. A command past its time is asked to end (SIGTERM) before it is killed,
and the GPU is left as it was found: no rank process and no MPS daemon it started.

DIR then holds three files: ``summary.json`` (the verdict, every ratio, every test's status), ``report.md`` (the
tables: per workload the measured ratios, the ideal from the ranks' solo speeds with the fixed per-step costs, the
fraction of it reached, where each step's time goes, the verdict and the one-line cause) and ``artifacts.tar.gz``
(every log: ``collect.log``, ``tests/*.log``, ``gpu_shares.json``, ``gpu_shares.log``, the ranks' logs). The report
is printed as the check ends. The exit status is 0 only when every test passed and ``gpu_shares`` completed.

Without a CUDA device (or with ``--dry-run``) it is a dry run, which CI runs: it collects ``tests/gpu`` (their
modules import), checks that ``gpu_shares.py`` starts, and walks the same reporting path on a synthetic
``gpu_shares`` result (``benchmarks.gpu_shares.synthetic_result``, marked synthetic in the summary and the report),
writing the same three files; it exits 1 only if a module does not import or ``gpu_shares.py`` does not start.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script, this checkout is not on the path
    sys.path.insert(0, str(ROOT))
from benchmarks.pytest_live_report import BEGIN as LIVE_BEGIN  # noqa: E402
from benchmarks.pytest_live_report import END as LIVE_END  # noqa: E402

SHARES = ROOT / "benchmarks" / "gpu_shares.py"
BUDGET_S = 240.0  # everything: the tests, gpu_shares, the report and the archive
SHARES_RESERVE_S = 140.0  # what the tests leave to gpu_shares at least: its calibration and a pair a workload
TEST_TIMEOUT_S = 60.0  # a test's share of its module's timeout
TERM_GRACE_S = 15.0  # from SIGTERM to SIGKILL: gpu_shares ends its ranks and stops its MPS daemon in it
CLOSING_S = 10.0  # the budget's end kept for the summary, the report and the archive
FILES = ("summary.json", "report.md", "artifacts.tar.gz")
_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")
_OUTCOME = re.compile(r"^(tests/gpu/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_STATUS = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped", "XFAIL": "xfailed"}
_STATUS["XPASS"] = "passed"
_DURATION = re.compile(r"^([0-9.]+)s (?:setup|call|teardown)\s+(tests/gpu/\S+::\S+)")
_WORST = ("error", "failed", "xfailed", "skipped", "passed")  # a test's outcomes (setup, call, teardown): the worst


def _env() -> dict[str, str]:
    """This checkout first on the path: the GPU machine need not have the package installed."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def run(command: Sequence[str], log: Path, timeout: float, cwd: Path = ROOT) -> tuple[int | None, float, str]:
    """Run ``command`` in the checkout, its output in ``log``: ``(exit status or None on timeout, seconds, output)``.

    On a timeout the command's session is asked to end (SIGTERM: ``gpu_shares`` then ends the ranks it started in
    sessions of their own and stops the MPS daemon it started) and, ``TERM_GRACE_S`` later, killed with what is left
    of it (a pytest process and the ranks or workers it started)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "w") as handle:
        process = subprocess.Popen(
            command, cwd=cwd, env=_env(), stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: int | None = process.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            code = None
            for sent, grace in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, None)):
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.killpg(process.pid, sent)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=grace)
                    break
    return code, time.monotonic() - started, log.read_text(errors="replace")


def collect(out: Path, timeout: float) -> tuple[list[str], bool, float]:
    """The test ids of ``tests/gpu`` (collecting imports every module), whether collection succeeded, its seconds."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu"]
    code, seconds, output = run(command, out / "collect.log", timeout)
    ids = [line.strip() for line in output.splitlines() if line.startswith("tests/gpu/") and "::" in line]
    return ids, code == 0 and bool(ids), seconds


def status_of(code: int | None, output: str) -> str:
    """passed, failed, skipped, timeout or an error, from pytest's exit status and its closing counts."""
    if code is None:
        return "timeout"
    counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in _COUNTS.findall(output)}
    if code == 0:
        return "skipped" if counts.get("skipped") and not counts.get("passed") else "passed"
    return {1: "failed", 5: "not collected"}.get(code, f"error (exit {code})")


def outcomes(output: str) -> dict[str, str]:
    """Each test's status from ``pytest -v``'s live lines (written as each test ends: a test that hangs has none)."""
    found: dict[str, str] = {}
    for line in output.splitlines():
        match = _OUTCOME.match(line)
        if match:
            status = _STATUS[match.group(2)]
            previous = found.get(match.group(1), "passed")
            found[match.group(1)] = min(status, previous, key=_WORST.index)
    return found


def durations(output: str) -> dict[str, float]:
    """Each test's seconds (setup, call and teardown) from ``--durations=0``'s table (printed when pytest ends)."""
    seconds: dict[str, float] = {}
    for line in output.splitlines():
        match = _DURATION.match(line)
        if match:
            seconds[match.group(2)] = seconds.get(match.group(2), 0.0) + float(match.group(1))
    return seconds


def _tail(output: str, test: str) -> list[str]:
    """The test's own failure report (its assertion: written live, see ``pytest_live_report``, or in pytest's closing
    report), else the output's end."""
    lines = output.splitlines()
    begin = f"{LIVE_BEGIN}{test} "
    for index, line in enumerate(lines):
        if line.startswith(begin):
            section = list(itertools.takewhile(lambda text: text != LIVE_END, lines[index:]))
            return section if len(section) <= 40 else [*section[:15], "...", *section[-25:]]
    name = test.split("::", 1)[1]
    for index, line in enumerate(lines):
        if line.startswith("_") and f" {name} " in line:
            return lines[index : index + 40]
    return lines[-25:]


def run_tests(ids: Sequence[str], out: Path, until: float, per_test: float, cwd: Path = ROOT) -> list[dict[str, Any]]:
    """Every id, a module to a ``pytest -v`` process (one import of torch and Lightning for several tests), none
    started after ``until`` (a monotonic time). Where a process times out or crashes, the test it was in is named
    from the live output and the tests after it run one to a process."""
    modules: dict[str, list[str]] = {}
    for test in ids:
        modules.setdefault(test.split("::")[0], []).append(test)
    batches = list(modules.values())
    results: dict[str, dict[str, Any]] = {}
    while batches:
        batch = batches.pop(0)
        left = until - time.monotonic()
        if left < 10:
            for test in batch:
                results[test] = {"id": test, "status": "not run: the time budget", "seconds": 0.0}
            continue
        name = batch[0].removeprefix("tests/gpu/")
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name if len(batch) == 1 else name.split("::")[0])
        command = [sys.executable, "-m", "pytest", *batch, "-v", "-rA", "--durations=0", "-p", "no:cacheprovider"]
        command += ["-p", "benchmarks.pytest_live_report"]  # a failure's report as it happens
        code, seconds, output = run(command, out / "tests" / f"{name}.log", min(per_test * len(batch), left), cwd)
        found, timed = outcomes(output), durations(output)
        for test in batch:
            if test in found:
                results[test] = {"id": test, "status": found[test], "seconds": round(timed.get(test, 0.0), 1)}
        unfinished = [test for test in batch if test not in found]
        if unfinished:  # the first was running when the process timed out or died; the rest never started
            status = "timeout" if code is None else f"crashed (exit {code})"
            results[unfinished[0]] = {"id": unfinished[0], "status": status, "seconds": round(seconds, 1)}
            batches = [[test] for test in unfinished[1:]] + batches
        for test in batch:
            result = results.get(test)
            if result is not None and result["status"] != "passed" and "tail" not in result:
                result["tail"] = _tail(output, test)
        print(f"{seconds:6.1f} s  " + ", ".join(f"{t}: {results[t]['status']}" for t in batch if t in results))
    return [results[test] for test in ids if test in results]


def run_shares(out: Path, seconds_left: float) -> dict[str, Any]:
    """gpu_shares.py with a deadline inside the time left; its result (``gpu_shares.json``).

    An MPS daemon that was not running before and still runs after (``gpu_shares`` stops the one it starts, unless it
    was killed) is stopped here: the GPU is left as it was found."""
    from benchmarks.gpu_shares import Mps, mps_control, mps_daemon_running  # torch is imported by now

    daemon_before = mps_daemon_running()
    timeout = seconds_left - TERM_GRACE_S  # a timeout's SIGTERM and grace end within the time left
    deadline = max(timeout - 20.0, 30.0)  # no run starts that cannot end by then; the JSON is written after
    command = [sys.executable, str(SHARES), "--out", str(out), "--logs", str(out / "gpu_shares_logs")]
    code, seconds, output = run([*command, "--deadline", f"{deadline:.0f}"], out / "gpu_shares.log", timeout)
    result: dict[str, Any] = {"status": "timeout" if code is None else ("ok" if code == 0 else f"exit {code}")}
    result["seconds"] = round(seconds, 1)
    if not daemon_before and mps_daemon_running():
        Mps(control=mps_control(), started=True).stop()
        result["mps_left_running"] = "stopped by gpu_check" if not mps_daemon_running() else "still running"
    path = out / "gpu_shares.json"
    if path.is_file():
        result["result"] = _reported(json.loads(path.read_text()))
    else:
        result["tail"] = output.splitlines()[-25:]
    return result


def _reported(shares: dict[str, Any]) -> dict[str, Any]:
    """What of ``gpu_shares.json`` the summary keeps: everything but the runs' and the calibration's raw rank
    results (those stay in the archive's ``gpu_shares.json``)."""
    kept = {key: value for key, value in shares.items() if key not in ("runs", "definitions")}
    if isinstance(kept.get("calibration"), dict):
        kept["calibration"] = {k: v for k, v in kept["calibration"].items() if k != "ranks"}
    keys = ("workload", "strategy", "repeat", "status", "seconds")
    kept["runs"] = [{k: r.get(k) for k in keys} for r in shares["runs"]]
    return kept


def verdict(summary: dict[str, Any]) -> tuple[str, str | None]:
    """The verdict and the one-line cause (the compute-bound workload's, else the first with one)."""
    shares = (summary.get("gpu_shares") or {}).get("result") or {}
    workloads = shares.get("summary") or {}
    causes = [(w, s.get("cause"), s.get("fraction_of_ideal")) for w, s in workloads.items() if s.get("cause")]
    cause = None
    if causes:
        workload, line, fraction = causes[0]
        reached = "-" if fraction is None else f"{100 * fraction:.0f}%"
        cause = f"{workload}: {reached} of the ideal; {line}"
    not_passed = [t for t in summary.get("tests", []) if t["status"] != "passed"]
    if summary["dry_run"]:
        state = "collected" if summary["collected"] else "NOT collected (see collect.log in the archive)"
        starts = "" if (summary.get("gpu_shares") or {}).get("starts") else "; gpu_shares.py does NOT start"
        failed = f"; the check itself failed: {summary['error'][-1]}" if summary.get("error") else ""
        return (
            f"DRY RUN: nothing ran on a GPU; tests/gpu {state}{starts}{failed}; any numbers below are synthetic",
            cause,
        )
    parts = []
    if not summary["collected"]:
        parts.append("tests/gpu not collected")
    if not_passed:
        kinds = sorted({t["status"] for t in not_passed})
        counts = ", ".join(f"{sum(t['status'] == kind for t in not_passed)} {kind}" for kind in kinds)
        parts.append(f"{len(not_passed)} of {len(summary.get('tests', []))} tests did not pass ({counts})")
    status = (summary.get("gpu_shares") or {}).get("status")
    if status not in (None, "ok"):
        parts.append(f"gpu_shares {status}")
    unpaired = [w for w, s in workloads.items() if not s.get("pairs")]
    if unpaired:
        skipped = {r["status"] for r in shares.get("runs", []) if r.get("workload") in unpaired}
        parts.append(f"no DDP/Cannikin pair for {', '.join(unpaired)} ({', '.join(sorted(skipped))})")
    if summary.get("error"):
        parts.append(f"the check itself failed: {summary['error'][-1]}")
    return ("PASS" if summary["ok"] else "FAIL: " + "; ".join(parts or ["see the tests"])), cause


def finish(out: Path, work: Path, summary: dict[str, Any]) -> str:
    """Write ``summary.json`` and ``report.md`` into ``out``, pack ``work`` (every log) into ``artifacts.tar.gz``."""
    from benchmarks.gpu_report import archive, render

    summary["verdict"], summary["cause"] = verdict(summary)
    summary["files"] = list(FILES)
    report = render(summary)
    summary["archived"] = archive(work, out / "artifacts.tar.gz")
    (out / "report.md").write_text(report)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where summary.json, report.md and the archive go")
    parser.add_argument("--dry-run", action="store_true", help="collect, check and report synthetic numbers only")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for everything (default %(default)s)")
    parser.add_argument("--test-timeout", type=float, default=TEST_TIMEOUT_S, help="seconds a test (%(default)s)")
    parser.add_argument("--no-shares", action="store_true", help="the tests only")
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.budget < 60:
        parser.error(f"--budget {args.budget:g}: at least 60 seconds (the tests' collection alone takes some)")
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".gpu_check_", dir=out))  # packed into the archive at the end

    import torch  # here, not above: `--help` stays instant; `is_available` creates no CUDA context (MPS comes later)

    gpu = torch.cuda.is_available() and not args.dry_run
    closing = started + args.budget - CLOSING_S
    ids, collected, collect_s = collect(work, min(180.0, closing - time.monotonic()))
    summary: dict[str, Any] = {
        "dry_run": not gpu,
        "torch": torch.__version__,
        "budget": args.budget,
        "collected": collected,
        "collect_seconds": round(collect_s, 1),
    }
    try:
        if not gpu:
            why = "--dry-run" if args.dry_run else "no CUDA device"
            help_timeout = max(min(60.0, closing - time.monotonic()), 1.0)
            code, _, output = run([sys.executable, str(SHARES), "--help"], work / "gpu_shares_help.log", help_timeout)
            from benchmarks.gpu_shares import synthetic_result

            state = "collected" if collected else "NOT collected (collect.log says why)"
            summary["note"] = f"dry run ({why}): tests/gpu {state}, nothing run; gpu_shares' numbers are synthetic"
            summary["synthetic"] = True
            summary["tests"] = [{"id": test, "status": "not run (dry run)"} for test in ids]
            summary["counts"] = {"not run (dry run)": len(ids)}
            shares = synthetic_result()
            (work / "gpu_shares.json").write_text(json.dumps(shares, indent=1))
            summary["gpu_shares"] = {"starts": code == 0, "status": "synthetic", "result": _reported(shares)}
            if code != 0:
                summary["gpu_shares"]["tail"] = output.splitlines()[-25:]
            ok = collected and code == 0
        else:
            until = closing - (0.0 if args.no_shares else SHARES_RESERVE_S)
            tests = run_tests(ids, work, until, args.test_timeout)
            summary["tests"] = tests
            summary["counts"] = {
                status: sum(t["status"] == status for t in tests) for status in sorted({t["status"] for t in tests})
            }
            ok = collected and bool(tests) and all(t["status"] == "passed" for t in tests)
            if not args.no_shares:
                summary["gpu_shares"] = run_shares(work, closing - time.monotonic())
                ok = ok and summary["gpu_shares"]["status"] == "ok"
    except Exception:  # the three files are written whatever went wrong here, with what it was
        summary["error"] = traceback.format_exc().splitlines()[-25:]
        ok = False
    summary["ok"] = ok
    summary["seconds"] = round(time.monotonic() - started, 1)
    report = finish(out, work, summary)
    seconds = time.monotonic() - started
    print(report, flush=True)
    print(f"gpu_check: {summary['verdict']} ({seconds:.0f} s); {', '.join(str(out / f) for f in FILES)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
