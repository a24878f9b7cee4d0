"""The GPU check's dry run (what CI can run without a GPU: its three files on synthetic numbers) and gpu_shares'
ideal and summary arithmetic.

The GPU paths themselves (tests/gpu, MPS, the ranks' fits) need a device; ``python benchmarks/gpu_shares.py --smoke``
runs the benchmark's whole code path on CPU in about a minute and is left to CI's explicit command.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from benchmarks import gpu_check, gpu_shares
from benchmarks.gpu_check import status_of
from benchmarks.gpu_shares import Config, summarise_calibration, summarise_workload
from benchmarks.shortfall import PARTS, fit_line, fraction_of_ideal, water_fill

ROOT = Path(__file__).resolve().parent.parent


def test_the_dry_run_collects_every_gpu_test_and_ends_with_three_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out), "--budget", "120"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["artifacts.tar.gz", "report.md", "summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] is True and summary["collected"] is True and summary["ok"] is True
    assert summary["synthetic"] is True and "tests/gpu collected" in summary["note"]
    assert summary["seconds"] <= summary["budget"] == 120 and seconds < 120
    ids = [test["id"] for test in summary["tests"]]
    assert len(ids) >= 8 and all(test["status"] == "not run (dry run)" for test in summary["tests"])
    names = {test_id.split("::")[1].split("[")[0] for test_id in ids}
    assert {
        "test_weighted_hook_on_nccl_scales_every_step_and_times_the_rebuilt_buckets",
        "test_fsdp_on_nccl_times_with_events_and_caps_the_batch_from_the_measured_peak",
    } <= names
    shares = summary["gpu_shares"]
    assert shares["starts"] is True and shares["result"]["synthetic"] is True
    compute = shares["result"]["summary"]["compute"]
    assert 0 < compute["ideal_ratio_lines"] < compute["ideal_ratio"] < 1 and compute["shortfall"]["cause"] in PARTS
    # the report walks the real path on the synthetic numbers, says they are synthetic, and is printed as it ends
    report = (out / "report.md").read_text()
    assert "Synthetic numbers" in report and summary["verdict"].startswith("DRY RUN")
    assert f"| compute | {compute['measured_ratio_steady']:.3f}x |" in report and "ratio points of the gap" in report
    assert "| compute | DDP |" in report and "| compute | Cannikin |" in report
    assert "## Where a step goes" in done.stdout and summary["cause"] in done.stdout
    with tarfile.open(out / "artifacts.tar.gz") as tar:
        members = set(tar.getnames())
    assert {"artifacts/collect.log", "artifacts/gpu_shares.json", "artifacts/gpu_shares_help.log"} <= members


def test_a_dry_run_whose_collection_fails_says_so(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(gpu_check, "collect", lambda out, timeout: ([], False, 0.5))  # pytest missing, say
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["collected"] is False and summary["ok"] is False
    assert "NOT collected" in summary["note"] and "tests/gpu collected" not in summary["note"]
    assert "NOT collected" in summary["verdict"] and "NOT collected" in capsys.readouterr().out


def test_the_three_files_are_written_whatever_fails_in_the_check(tmp_path: Path, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("the synthetic result broke")

    monkeypatch.setattr(gpu_check, "collect", lambda out, timeout: (["tests/gpu/test_x.py::test_y"], True, 0.5))
    monkeypatch.setattr(gpu_shares, "synthetic_result", broken)
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifacts.tar.gz", "report.md", "summary.json"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] is False and "RuntimeError: the synthetic result broke" in summary["verdict"]
    assert "the synthetic result broke" in (tmp_path / "report.md").read_text()


def test_status_comes_from_the_exit_status_and_the_closing_counts() -> None:
    assert status_of(0, "1 passed in 3.1s") == "passed"
    assert status_of(0, "1 skipped in 3.1s") == "skipped"
    assert status_of(1, "1 failed in 3.1s") == "failed"
    assert status_of(None, "") == "timeout"
    assert status_of(4, "ERROR: not found") == "error (exit 4)"


def test_each_tests_status_comes_from_pytests_live_lines_and_a_hung_test_has_none() -> None:
    output = "\n".join(
        [
            "tests/gpu/test_cuda.py::test_a PASSED                                     [ 25%]",
            "tests/gpu/test_cuda.py::test_b[16-mixed] FAILED                           [ 50%]",
            "tests/gpu/test_cuda.py::test_c PASSED                                     [ 75%]",
            "tests/gpu/test_cuda.py::test_c ERROR                                      [ 75%]",  # at its teardown
            "tests/gpu/test_cuda.py::test_d ",  # started, never ended
        ]
    )
    assert gpu_check.outcomes(output) == {
        "tests/gpu/test_cuda.py::test_a": "passed",
        "tests/gpu/test_cuda.py::test_b[16-mixed]": "failed",
        "tests/gpu/test_cuda.py::test_c": "error",
    }


def test_a_hung_test_costs_its_own_time_only_and_the_tests_after_it_still_run(tmp_path: Path) -> None:
    # a module as tests/gpu holds them, under a rootdir of its own: one passes, one fails, one hangs, one passes after
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "tests" / "gpu").mkdir(parents=True)
    (tmp_path / "tests" / "gpu" / "test_fake.py").write_text(
        "import time\n"
        "def test_a():\n    pass\n"
        "def test_b():\n    assert 1 == 2, 'the assertion'\n"
        "def test_c():\n    time.sleep(120)\n"
        "def test_d():\n    pass\n"
    )
    ids = [f"tests/gpu/test_fake.py::test_{name}" for name in "abcd"]
    started = time.monotonic()
    results = gpu_check.run_tests(ids, tmp_path / "out", time.monotonic() + 100, per_test=4.0, cwd=tmp_path)
    assert time.monotonic() - started < 60
    assert [r["status"] for r in results] == ["passed", "failed", "timeout", "passed"]
    assert any("the assertion" in line for line in results[1]["tail"])
    assert results[2]["seconds"] >= 4 * 4 - 1  # the module's timeout: four tests' worth


def test_water_filling_ends_every_busy_rank_together_and_leaves_out_a_rank_too_slow_to_help() -> None:
    # no intercepts: T* = B / sum(1 / a_i), split in proportion to speed
    best, split = water_fill([(1.0, 0.0), (2.0, 0.0), (4.0, 0.0)], 7)
    assert best == pytest.approx(4.0) and split == pytest.approx([4.0, 2.0, 1.0])
    # intercepts: the closed form T* = (B + sum a0_i / a_i) / sum(1 / a_i) while every rank has work
    lines = [(0.001, 0.010), (0.002, 0.020), (0.004, 0.005)]
    closed = (600 + sum(a0 / a for a, a0 in lines)) / sum(1 / a for a, _ in lines)
    best, split = water_fill(lines, 600)
    assert best == pytest.approx(closed) and sum(split) == pytest.approx(600)
    best, split = water_fill([(1.0, 0.0), (1.0, 100.0)], 10)  # the second rank's fixed cost alone exceeds T*
    assert best == pytest.approx(10.0) and split == pytest.approx([10.0, 0.0])
    assert fit_line([1, 2, 4], [3.0, 5.0, 9.0]) == pytest.approx((2.0, 1.0))


def test_the_ideal_comes_from_the_solo_lines_with_the_fixed_costs_and_the_gap_adds_up() -> None:
    assert fraction_of_ideal(0.7, 0.4) == pytest.approx(0.5)
    assert fraction_of_ideal(0.99, 0.995) is None  # an ideal that saves nothing: no fraction of it
    config = Config(total=60, repeats=1)
    # solo compute lines t_i(b) = a_i b (ms): 1, 2 and 4 ms a sample; the even split (20 each) takes 80 ms, the best
    # 60 / 1.75 = 34.3 ms
    slopes = (1e-3, 2e-3, 4e-3)
    ranks = [
        {
            "ok": True,
            "device": "fake",
            "torch": "x",
            "sizes": list(config.calib_sizes),
            "solo_step_s": [1.25 * a * b for b in config.calib_sizes],
            "solo_compute_s": [a * b for b in config.calib_sizes],
            "concurrent_step_s": 1.1 * 1.25 * a * config.even,
            "loader_samples_per_s": 1e4,
        }
        for a in slopes
    ]
    calibration = summarise_calibration(config, ranks)
    assert calibration is not None
    assert calibration["ideal_ratio_lines"] == pytest.approx((60 / 1750) / 0.080)
    assert calibration["interference"] == pytest.approx([1.1] * 3)
    assert calibration["speed_vs_share"][1] == pytest.approx((1 / 2) / (25 / 60))

    def fit(strategy: str, batches: list[int], epochs: list[float], exposed: list[float]) -> dict:
        rows = []
        for b, a, wait in zip(batches, slopes, exposed, strict=True):
            compute = 1.1 * a * b * 1e3
            steady = {"batch": b, "compute_ms": compute, "host_ms": 1.0, "exposed_ms": wait, "after_ms": 0.5}
            steady |= {"gap_ms": 3.0, "step_ms": compute + wait + 0.5}
            steady["cycle_ms"] = steady["step_ms"] + 4.0
            rank = {"ok": True, "epoch_s": epochs, "train_s": sum(epochs), "loss_sum": 2.0, "loss_samples": 20}
            rows.append(rank | {"steady": steady, "split": batches})
        return {"strategy": strategy, "repeat": 0, "workload": "compute", "status": "ok", "ranks": rows}

    runs = [
        fit("ddp", [20] * 3, [3.0, 2.0, 2.0], [68.0, 46.0, 2.0]),
        fit("cannikin", [35, 17, 8], [3.0, 1.2, 1.2], [2, 4, 3]),
    ]
    summary = summarise_workload(config, calibration, runs)
    assert summary["measured_ratio_steady"] == pytest.approx(0.6)
    assert summary["loss"] == {"ddp": pytest.approx(0.1), "cannikin": pytest.approx(0.1)}
    shortfall = summary["shortfall"]
    # DDP's critical rank is the slowest (rank 2: least wait at the all-reduce); its all-reduce, broadcast wait and
    # optimizer step are the fixed costs: 2 + 3 + 0.5 ms
    assert shortfall["fixed_ms"] == {"allreduce": 2.0, "broadcast": 3.0, "optimizer": 0.5}
    assert summary["ideal_ratio"] == pytest.approx((60 / 1.75 + 5.5) / (80 + 5.5))
    assert summary["fraction_of_ideal"] == pytest.approx(0.4 / (1 - summary["ideal_ratio"]))
    # the parts lead from the ideal to the measured ratio of the critical path's cycles, exactly
    assert summary["ideal_ratio"] + sum(shortfall["contributions"].values()) == pytest.approx(
        shortfall["measured_ratio"]
    )
    assert shortfall["critical_ranks"]["cannikin"]["allreduce"] == 0  # 35 samples at 1 ms: the last to arrive
    assert shortfall["path_ms"]["cannikin"]["interference"] == pytest.approx(0.1 * 35)
    assert summary["ranks"]["cannikin"][0]["compute_vs_solo"] == pytest.approx(1.1)
    assert summary["ranks"]["ddp"][2]["after_ms"] == pytest.approx(0.5), "the optimizer's span is reported per rank"


def test_a_timed_out_command_is_asked_to_end_and_killed_only_if_it_does_not(tmp_path: Path, monkeypatch) -> None:
    ended = tmp_path / "ended"
    polite = f"trap 'echo yes > {ended}; exit 3' TERM; sleep 60 & wait"
    code, seconds, _ = gpu_check.run(["bash", "-c", polite], tmp_path / "polite.log", timeout=1.0)
    assert code is None and ended.read_text().strip() == "yes" and seconds < 10
    monkeypatch.setattr(gpu_check, "TERM_GRACE_S", 0.5)
    deaf = "trap '' TERM; sleep 60 & wait"  # SIGTERM ignored, by the shell and by its sleep
    code, seconds, _ = gpu_check.run(["bash", "-c", deaf], tmp_path / "deaf.log", timeout=1.0)
    assert code is None and seconds < 10


def _workers_of(logs: Path) -> list[int]:
    """The rank processes gpu_shares started for runs under ``logs`` (their command line names a job there)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--worker" in args and any(arg.startswith(str(logs).encode()) for arg in args):
            pids.append(int(cmdline.parent.name))
    return pids


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads the processes from /proc")
def test_gpu_shares_ended_from_outside_leaves_no_rank_running(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_shares.py"), "--smoke", "--out", str(tmp_path)]
    # its own session, as gpu_check starts it; the ranks it starts have sessions of their own
    shares = subprocess.Popen(
        [*command, "--logs", str(logs)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        waited = time.monotonic()
        while len(_workers_of(logs)) < 3 and time.monotonic() - waited < 120 and shares.poll() is None:
            time.sleep(0.1)
        assert len(_workers_of(logs)) == 3, "the calibration's three ranks never started"
        os.killpg(shares.pid, signal.SIGTERM)
        assert shares.wait(timeout=60) == 128 + signal.SIGTERM
        assert _workers_of(logs) == [], "a rank outlived the benchmark that started it"
    finally:
        if shares.poll() is None:
            os.killpg(shares.pid, signal.SIGKILL)
        for pid in _workers_of(logs):
            os.killpg(pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads the processes from /proc")
def test_a_timed_out_run_reports_where_every_rank_waits(tmp_path: Path, monkeypatch, capsys) -> None:
    # every rank is told of one rank more than are started: each waits in the rendezvous for one that never comes
    real_env = gpu_shares.rank_env

    def one_rank_missing(config: Config, rank: int, port: int, run_id: str) -> dict[str, str]:
        return {**real_env(config, rank, port, run_id), "WORLD_SIZE": str(config.world_size + 1)}

    monkeypatch.setattr(gpu_shares, "rank_env", one_rank_missing)
    config = gpu_shares.SMOKE
    run = gpu_shares.launch(config, {"kind": "calibrate"}, tmp_path / "hung", timeout=30.0)
    report = capsys.readouterr().out
    assert run["status"] == "timeout"
    for rank in range(config.world_size):
        printed = report.split(f"hung: rank {rank} exited with")[1].split("hung: rank")[0]
        assert "init_process_group" in printed, f"rank {rank}'s stack is not in the report:\n{printed}"
    assert _workers_of(tmp_path) == [], "a rank outlived its timed-out run"


class _PausedClock:
    """``time`` for gpu_shares whose monotonic clock jumps ``pause`` seconds at the first poll: the launcher and its
    ranks stopped together for that long (a VM paused, the job suspended) right after the ranks started."""

    def __init__(self, pause: float) -> None:
        self.offset, self.pause = 0.0, pause

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
        self.offset, self.pause = self.offset + self.pause, 0.0


def test_time_the_launcher_did_not_run_does_not_time_out_its_ranks(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(gpu_shares, "time", _PausedClock(pause=1000.0))
    run = gpu_shares.launch(gpu_shares.SMOKE, {"kind": "calibrate"}, tmp_path / "paused", timeout=90.0)
    assert run["status"] == "ok", "a pause of the whole job was taken for the ranks' own time"
    assert run["paused_s"] >= 1000.0 and run["seconds"] < 90.0
    assert [rank["ok"] for rank in run["ranks"]] == [True] * gpu_shares.SMOKE.world_size, "every rank finished"
