"""The GPU check's dry run (what CI can run without a GPU) and gpu_shares' ideal and summary arithmetic.

The GPU paths themselves (tests/gpu, MPS, the ranks' fits) need a device; ``python benchmarks/gpu_shares.py --smoke``
runs the benchmark's whole code path on CPU in about a minute and is left to CI's explicit command.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu_check, gpu_shares
from benchmarks.gpu_check import status_of
from benchmarks.gpu_shares import (
    Config,
    fit_line,
    fraction_of_ideal,
    summarise_calibration,
    summarise_workload,
    water_fill,
)

ROOT = Path(__file__).resolve().parent.parent


def test_the_dry_run_collects_every_gpu_test_and_exits_cleanly(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "dry run" in done.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dry_run"] is True and summary["collected"] is True and summary["ok"] is True
    ids = [test["id"] for test in summary["tests"]]
    assert len(ids) >= 8 and all(test["status"] == "not run (dry run)" for test in summary["tests"])
    names = {test_id.split("::")[1].split("[")[0] for test_id in ids}
    assert {
        "test_weighted_hook_on_nccl_scales_every_step_and_times_the_rebuilt_buckets",
        "test_fsdp_on_nccl_times_with_events_and_caps_the_batch_from_the_measured_peak",
    } <= names
    assert summary["gpu_shares"] == {"starts": True}
    assert (tmp_path / "collect.log").is_file()


def test_status_comes_from_the_exit_status_and_the_closing_counts() -> None:
    assert status_of(0, "1 passed in 3.1s") == "passed"
    assert status_of(0, "1 skipped in 3.1s") == "skipped"
    assert status_of(1, "1 failed in 3.1s") == "failed"
    assert status_of(None, "") == "timeout"
    assert status_of(4, "ERROR: not found") == "error (exit 4)"


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


def test_the_fraction_of_the_ideal_and_the_gap_add_up() -> None:
    assert fraction_of_ideal(0.7, 0.4) == pytest.approx(0.5)
    assert fraction_of_ideal(0.99, 0.995) is None  # an ideal that saves nothing: no fraction of it
    config = Config(total=60, repeats=1)
    # solo steps of t_i(b) = a_i b (ms): 1, 2 and 4 ms a sample; the even split (20 each) takes 80 ms, the best 34.3
    slopes = (1e-3, 2e-3, 4e-3)
    ranks = [
        {
            "ok": True,
            "device": "fake",
            "torch": "x",
            "sizes": list(config.calib_sizes),
            "solo_step_s": [a * b for b in config.calib_sizes],
            "solo_compute_s": [0.8 * a * b for b in config.calib_sizes],
            "concurrent_step_s": 1.1 * a * config.even,
            "loader_samples_per_s": 1e4,
        }
        for a in slopes
    ]
    calibration = summarise_calibration(config, ranks)
    assert calibration is not None
    assert calibration["ideal_ratio"] == pytest.approx((60 / 1750) / 0.080)
    assert calibration["interference"] == pytest.approx([1.1] * 3)
    assert calibration["speed_vs_share"][1] == pytest.approx((1 / 2) / (25 / 60))

    def fit(strategy: str, step_ms: float, epochs: list[float], split: list[int]) -> dict:
        steady = {"batch": 20, "compute_ms": 10.0, "host_ms": 1.0, "exposed_ms": 2.0, "after_ms": 0.5, "gap_ms": 0.2}
        steady["step_ms"] = 9.0
        rank = {"ok": True, "epoch_s": epochs, "train_s": sum(epochs), "loss_sum": 2.0, "loss_samples": 20}
        rank |= {"steady": {**steady, "cycle_ms": step_ms}, "split": split}
        return {"strategy": strategy, "repeat": 0, "workload": "compute", "status": "ok", "ranks": [rank] * 3}

    runs = [fit("ddp", 100.0, [3.0, 2.0, 2.0], [20, 20, 20]), fit("cannikin", 60.0, [3.0, 1.2, 1.2], [35, 17, 8])]
    summary = summarise_workload(config, calibration, runs)
    assert summary["measured_ratio_steady"] == pytest.approx(0.6)
    assert summary["measured_ratio_step"] == pytest.approx(0.6)
    assert summary["loss"] == {"ddp": pytest.approx(0.1), "cannikin": pytest.approx(0.1)}
    # DDP's measured 100 ms less the 80 - 34.3 ms the best split saves on the lines
    assert summary["ideal_ratio_vs_measured_ddp"] == pytest.approx(1 - (0.080 - 0.060 / 1.75) / 0.100)
    # the gap's parts lead from the ideal to the measured step ratio
    assert calibration["ideal_ratio"] + sum(summary["gap"].values()) == pytest.approx(summary["measured_ratio_step"])
    assert summary["ranks"]["cannikin"][0]["compute_vs_solo"] == pytest.approx(10.0 / (0.8 * 1e-3 * 20 * 1e3))
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
