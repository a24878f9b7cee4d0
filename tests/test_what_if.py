"""``cannikin simulate --profile``: what-if on a measured cluster, against brute force and the goodput formula."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from lightning_cannikin.core.goodput import ADAPT_MARGIN, candidate_batch_sizes
from lightning_cannikin.core.profile import build_profile, save_profile
from lightning_cannikin.core.speed_model import SpeedModel
from lightning_cannikin.tools.cli import main
from tests.test_profile_cli import UPPER, _balancer, _history, _noise_history

BASE = 48


@pytest.fixture(scope="module")
def fitted() -> SpeedModel:
    return _balancer()


@pytest.fixture(scope="module")
def profile_path(fitted: SpeedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    history = _history(np.random.default_rng(1))
    profile = build_profile(fitted, history, base_batch_size=BASE, noise_scale_history=_noise_history())
    return save_profile(tmp_path_factory.mktemp("what_if") / "cannikin_profile.json", profile)


def _what_if(capsys, profile: Path, *args: str) -> dict:
    assert main(["simulate", "--profile", str(profile), *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _step_time(pieces: tuple[np.ndarray, np.ndarray], devices: list[int], sizes) -> float:
    """The slowest device's time; a device's time is the largest of its rank's pieces (not the planner's code)."""
    slopes, offsets = pieces
    return max(float(np.max(slopes[r] * b + offsets[r])) for r, b in zip(devices, sizes, strict=True))


def _brute_force(pieces, devices: list[int], total: int) -> float:
    """The best step time over every split of ``total`` with at least one sample per device."""
    best = np.inf
    for cuts in itertools.combinations(range(1, total), len(devices) - 1):
        sizes = np.diff([0, *cuts, total])
        best = min(best, _step_time(pieces, devices, sizes))
    return best


def test_fixed_totals_on_the_measured_and_a_what_if_cluster_are_optimal(fitted, profile_path, capsys):
    devices = [0, 0, 1, 2]  # one more device like the fastest rank
    result = _what_if(capsys, profile_path, "--devices", "0:2", "-b", "24", "-b", "40")
    assert result["devices"] == {"measured": [0, 1, 2], "what-if": devices}
    assert result["adaptive"] == [] and result["noise_scale"] is None
    rows = {(r["cluster"], r["total_batch_size"]): r for r in result["fixed"]}
    assert sorted(rows) == [("measured", 24), ("measured", 40), ("what-if", 24), ("what-if", 40)]
    pieces = fitted.pieces()
    for (cluster, total), row in rows.items():
        ranks = devices if cluster == "what-if" else [0, 1, 2]
        assert sum(row["local_batch_sizes"]) == total and len(row["local_batch_sizes"]) == len(ranks)
        assert row["predicted_step_time"] == pytest.approx(_step_time(pieces, ranks, row["local_batch_sizes"]))
        assert row["predicted_step_time"] == pytest.approx(_brute_force(pieces, ranks, total))
        assert row["throughput"] == pytest.approx(total / row["predicted_step_time"])
        assert row["optperf_speedup"] >= 1.0
    # the measured cluster is what `cannikin plan` says; the extra fast device makes every total faster
    for total in (24, 40):
        assert tuple(rows["measured", total]["local_batch_sizes"]) == fitted.plan_split(total).local_batch_sizes
        assert rows["what-if", total]["predicted_step_time"] < rows["measured", total]["predicted_step_time"]


def test_fewer_devices_and_the_default_total(fitted, profile_path, capsys):
    result = _what_if(capsys, profile_path, "--devices", "2:0,1:3")
    last_total = _history(np.random.default_rng(1))[-1]["total_batch_size"]
    assert result["devices"]["what-if"] == [0, 1, 1, 1]
    assert {r["total_batch_size"] for r in result["fixed"]} == {last_total}
    row = next(r for r in result["fixed"] if r["cluster"] == "what-if")
    # rank 0 is twice as fast as rank 1's copies: it takes about twice their share, and the copies share evenly
    assert row["local_batch_sizes"][0] > 1.5 * max(row["local_batch_sizes"][1:])
    assert max(row["local_batch_sizes"][1:]) - min(row["local_batch_sizes"][1:]) <= 1


def _goodput(fitted: SpeedModel, devices: list[int], total: int, noise: float) -> float:
    """B / T(B) * E(B), E(B) = (phi + B0) / (phi + B), T(B) by brute force over splits of at most ``UPPER`` each."""
    step = _brute_force(fitted.pieces(), devices, total) if total <= 40 else None
    if step is None:
        from lightning_cannikin.core.optperf import optimal_split

        slopes, offsets = fitted.pieces()
        step = optimal_split(slopes[devices], offsets[devices], total, 1, UPPER).step_time
    return total / step * (noise + BASE) / (noise + total)


@pytest.mark.parametrize("noise", [20.0, 300.0, 1e6])
def test_the_adaptive_batch_picks_the_best_goodput_on_the_what_if_cluster(fitted, profile_path, capsys, noise):
    cap = 600
    args = ("--devices", "0:2", "-b", str(BASE), "--max-batch-size", str(cap), "--noise-scale", str(noise))
    result = _what_if(capsys, profile_path, *args, "--margin", "0")
    assert result["noise_scale"] == noise and result["base_batch_size"] == BASE
    row = next(r for r in result["adaptive"] if r["cluster"] == "what-if")
    chosen = row["total_batch_size"]
    assert row["goodput"] == pytest.approx(_goodput(fitted, [0, 0, 1, 2], chosen, noise))
    # the best of the policy's candidate grid: at least as good as every candidate, computed here independently
    grid = candidate_batch_sizes(BASE, cap, 50)
    best = max(_goodput(fitted, [0, 0, 1, 2], int(b), noise) for b in grid)
    assert row["goodput"] >= best * (1 - 1e-9)
    assert row["fixed_goodput"] == pytest.approx(_goodput(fitted, [0, 0, 1, 2], BASE, noise))
    if noise == 1e6:  # no statistical cost to a larger batch: throughput decides, and it grows with the batch
        assert chosen >= grid[-3]
    if noise == 20.0:  # a large batch wastes samples: B0 is kept
        assert chosen == BASE


def test_the_adaptive_batch_uses_the_profiles_noise_scale_and_margin(profile_path, capsys):
    result = _what_if(capsys, profile_path, "-b", str(BASE), "--max-batch-size", "600")
    assert result["noise_scale"] == pytest.approx(_noise_history()[-1]["noise_scale"])
    row = result["adaptive"][0]
    # the hysteresis (the one default margin, 2%): a change of total is adopted only for more goodput than that
    assert row["total_batch_size"] == BASE or row["goodput"] > (1 + ADAPT_MARGIN) * row["fixed_goodput"]


def test_tables_without_json(profile_path, capsys):
    assert main(["simulate", "--profile", str(profile_path), "--devices", "0:3", "--max-batch-size", "600"]) == 0
    out = capsys.readouterr().out
    assert "what-if: 5 devices (rank 0 x3, rank 1, rank 2)" in out
    assert "keeps the measured step tail and all-reduce time" in out
    assert "Fixed total" in out and "Adaptive batch" in out and "noise scale" in out


def _one_error_line(capsys, args: list[str]) -> str:
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and len(lines[0]) < 500, captured.err
    return lines[0]


def test_a_wrong_input_is_one_line_of_error(profile_path, tmp_path, capsys):
    csv = tmp_path / "metrics.csv"
    csv.write_text("step,loss\n1,0.5\n")
    broken = tmp_path / "broken.json"
    broken.write_text(profile_path.read_text()[:5000])  # a profile cut short: several KB of it, no closing brace
    for path, message in [
        (csv, "not a Cannikin profile"),
        (broken, "not valid JSON"),
        (tmp_path / "missing.json", "No such file"),
    ]:
        line = _one_error_line(capsys, ["simulate", "--profile", str(path)])
        assert line.startswith("cannikin simulate: error:") and str(path) in line and message in line
    for devices, message in [
        ("0:x", "RANK:COUNT"),
        ("3:1", "rank 3 is not in the profile"),
        ("0:0,1:0,2:0", "no device"),
    ]:
        line = _one_error_line(capsys, ["simulate", "--profile", str(profile_path), "--devices", devices])
        assert message in line
    line = _one_error_line(capsys, ["simulate", "--profile", str(profile_path), "-b", "2000"])
    assert "batch size 2000 cannot be split" in line
    no_noise = save_profile(tmp_path / "p.json", build_profile(_balancer(), []))
    line = _one_error_line(capsys, ["simulate", "--profile", str(no_noise), "-b", "48", "--max-batch-size", "96"])
    assert "--noise-scale" in line


def test_a_profile_given_as_a_cluster_points_at_profile(profile_path, capsys):
    line = _one_error_line(capsys, ["simulate", "--cluster", str(profile_path)])
    assert "is a run's profile" in line and f"--profile {profile_path}" in line
