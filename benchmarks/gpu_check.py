"""Every GPU check in one command: the tests in ``tests/gpu``, then ``benchmarks/gpu_shares.py``, within 8 minutes.

``python benchmarks/gpu_check.py --out DIR`` on a machine with one CUDA device. Each test id runs in its own
``python -m pytest`` process with a timeout (pytest-timeout may be missing there), so a failure, a crash or a hung
collective ends that test only and every other test still runs. ``gpu_shares.py`` gets the time the tests left. Every
log and JSON goes into DIR (``collect.log``, ``tests/*.log``, ``gpu_shares.json``, ``gpu_shares.log``,
``gpu_shares_logs/``), and a summary (per test: passed, failed, skipped or timeout, with its seconds and, where it did
not pass, the end of its log; ``gpu_shares``' headline numbers) is written to ``summary.json`` and printed. The exit
status is 0 only when every test passed and ``gpu_shares`` completed. A command past its time is asked to end
(SIGTERM) before it is killed, and the GPU is left as it was found: no rank process and no MPS daemon it started.

Without a CUDA device (or with ``--dry-run``) it is a dry run: it still collects ``tests/gpu`` (their modules import),
checks that ``gpu_shares.py`` starts, writes ``summary.json`` with ``"dry_run": true``, says so and exits 0 (1 only if
a module does not import). CI runs it so: ``python benchmarks/gpu_check.py --dry-run --out "$(mktemp -d)"``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SHARES = ROOT / "benchmarks" / "gpu_shares.py"
BUDGET_S = 470.0  # of the 8 minutes: the rest is this script's own start and the last writes
SHARES_RESERVE_S = 240.0  # what the tests leave to gpu_shares at least (it plans for about 4 minutes)
TEST_TIMEOUT_S = 120.0
TERM_GRACE_S = 15.0  # from SIGTERM to SIGKILL: gpu_shares ends its ranks and stops its MPS daemon in it
_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")


def _env() -> dict[str, str]:
    """This checkout first on the path: the GPU machine need not have the package installed."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def run(command: Sequence[str], log: Path, timeout: float) -> tuple[int | None, float, str]:
    """Run ``command`` in the checkout, its output in ``log``: ``(exit status or None on timeout, seconds, output)``.

    On a timeout the command's session is asked to end (SIGTERM: ``gpu_shares`` then ends the ranks it started in
    sessions of their own and stops the MPS daemon it started) and, ``TERM_GRACE_S`` later, killed with what is left
    of it (a pytest process and the ranks or workers it started)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "w") as handle:
        process = subprocess.Popen(
            command, cwd=ROOT, env=_env(), stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
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


def collect(out: Path) -> tuple[list[str], bool, float]:
    """The test ids of ``tests/gpu`` (collecting imports every module), whether collection succeeded, its seconds."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu"]
    code, seconds, output = run(command, out / "collect.log", 180.0)
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


def run_each_test(ids: Sequence[str], out: Path, until: float, per_test: float) -> list[dict[str, Any]]:
    """Each id in its own pytest process, none after ``until`` (a monotonic time)."""
    results = []
    for test in ids:
        left = until - time.monotonic()
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", test.removeprefix("tests/gpu/"))
        if left < 10:
            results.append({"id": test, "status": "not run: the time budget", "seconds": 0.0})
            continue
        command = [sys.executable, "-m", "pytest", test, "-q", "-rA", "-p", "no:cacheprovider"]
        code, seconds, output = run(command, out / "tests" / f"{name}.log", min(per_test, left))
        result: dict[str, Any] = {"id": test, "status": status_of(code, output), "seconds": round(seconds, 1)}
        if result["status"] != "passed":
            result["tail"] = output.splitlines()[-25:]  # the assertion and pytest's short summary
        results.append(result)
        print(f"{result['status']:>8}  {seconds:6.1f} s  {test}", flush=True)
    return results


def run_shares(out: Path, seconds_left: float) -> dict[str, Any]:
    """gpu_shares.py with a deadline inside the time left; its headline numbers.

    An MPS daemon that was not running before and still runs after (``gpu_shares`` stops the one it starts, unless it
    was killed) is stopped here: the GPU is left as it was found."""
    if str(ROOT) not in sys.path:  # run as a script, this checkout is not on the path
        sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_shares import Mps, mps_control, mps_daemon_running  # torch is imported by now

    daemon_before = mps_daemon_running()
    timeout = seconds_left - TERM_GRACE_S  # a timeout's SIGTERM and grace end within the time left
    deadline = max(timeout - 20.0, 30.0)  # no run starts that cannot end by then; the JSON is written after
    command = [sys.executable, str(SHARES), "--out", str(out), "--logs", str(out / "gpu_shares_logs")]
    code, seconds, output = run([*command, "--deadline", str(deadline)], out / "gpu_shares.log", timeout)
    result: dict[str, Any] = {"status": "timeout" if code is None else ("ok" if code == 0 else f"exit {code}")}
    result["seconds"] = round(seconds, 1)
    if not daemon_before and mps_daemon_running():
        Mps(control=mps_control(), started=True).stop()
        result["mps_left_running"] = "stopped by gpu_check" if not mps_daemon_running() else "still running"
    path = out / "gpu_shares.json"
    if path.is_file():
        result["headline"] = json.loads(path.read_text()).get("headline")
    else:
        result["tail"] = output.splitlines()[-25:]
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where every log, JSON and summary.json go")
    parser.add_argument("--dry-run", action="store_true", help="collect and check only, even where a GPU is present")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for everything (default %(default)s)")
    parser.add_argument("--test-timeout", type=float, default=TEST_TIMEOUT_S, help="seconds a test (%(default)s)")
    parser.add_argument("--no-shares", action="store_true", help="the tests only")
    args = parser.parse_args(argv)
    started = time.monotonic()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)

    import torch  # here, not above: `--help` stays instant; `is_available` creates no CUDA context (MPS comes later)

    gpu = torch.cuda.is_available() and not args.dry_run
    ids, collected, collect_s = collect(out)
    summary: dict[str, Any] = {
        "dry_run": not gpu,
        "torch": torch.__version__,
        "collected": collected,
        "collect_seconds": round(collect_s, 1),
    }
    if not gpu:
        why = "--dry-run" if args.dry_run else "no CUDA device"
        code, _, output = run([sys.executable, str(SHARES), "--help"], out / "gpu_shares_help.log", 120.0)
        summary["note"] = f"dry run ({why}): tests/gpu collected, nothing run"
        summary["tests"] = [{"id": test, "status": "not run (dry run)"} for test in ids]
        summary["gpu_shares"] = {"starts": code == 0, **({} if code == 0 else {"tail": output.splitlines()[-25:]})}
        ok = collected and code == 0
    else:
        until = started + args.budget - (0.0 if args.no_shares else SHARES_RESERVE_S)
        tests = run_each_test(ids, out, until, args.test_timeout)
        summary["tests"] = tests
        summary["counts"] = {
            status: sum(t["status"] == status for t in tests) for status in sorted({t["status"] for t in tests})
        }
        ok = collected and all(t["status"] == "passed" for t in tests)
        if not args.no_shares:
            summary["gpu_shares"] = run_shares(out, args.budget - (time.monotonic() - started))
            ok = ok and summary["gpu_shares"]["status"] == "ok"
    summary["seconds"] = round(time.monotonic() - started, 1)
    summary["ok"] = ok
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    if not gpu:
        print(f"gpu_check: dry run ({'--dry-run' if args.dry_run else 'no CUDA device'}); nothing ran on a GPU")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
