"""The profile file, ``cannikin plan`` and ``cannikin report`` (pure: no training, no torch in the tested code)."""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest

from lightning_cannikin.core import optperf as planner
from lightning_cannikin.core.plan import BatchBounds, even_split, proportional_sizes
from lightning_cannikin.core.profile import FORMAT, VERSION, Profile, build_profile, load_profile, save_profile
from lightning_cannikin.core.speed_model import SpeedModel, SpeedModelSettings, StepRecord
from lightning_cannikin.tools.cli import main
from lightning_cannikin.tools.report import COMPUTE_TIME_PNG, STEP_TIME_PNG, TRAINING_PNG, plot_training

SLOPES = (0.0005, 0.001, 0.002)  # seconds per sample: 0.5, 1 and 2 ms
INTERCEPT = 0.005
TAIL = 0.003
UPPER = 256
# The splits a warm-up with probing and a growing total batch would run, each for a few steps.
SPLITS = ((16, 16, 16), (18, 14, 16), (28, 14, 6), (30, 12, 8), (44, 22, 12), (46, 20, 14))
STEPS_PER_SPLIT = 6


def _records(rng: np.random.Generator, ranks: tuple[int, ...] = (0, 1, 2)) -> list[StepRecord]:
    records = []
    for j, split in enumerate(SPLITS):
        for k in range(STEPS_PER_SPLIT):
            step = j * STEPS_PER_SPLIT + k
            compute = [a * b + INTERCEPT + rng.normal(0.0, 1e-4) for a, b in zip(SLOPES, split, strict=True)]
            for rank in ranks:
                step_time = max(compute) + TAIL + rng.normal(0.0, 5e-5)
                records.append(StepRecord(step, rank, split[rank], compute[rank], step_time))
    return records


def _history(rng: np.random.Generator) -> list[dict]:
    history = []
    for j, split in enumerate(SPLITS):
        true_time = max(a * b + INTERCEPT for a, b in zip(SLOPES, split, strict=True)) + TAIL
        history.append(
            {
                "step": j * STEPS_PER_SPLIT,
                "epoch": j // 2,
                "local_batch_sizes": list(split),
                "total_batch_size": sum(split),
                "predicted_step_time": None if j == 0 else true_time * 1.02,
                # the newest plan has not run long enough to be measured, as in the callback
                "measured_step_time": None if j == len(SPLITS) - 1 else true_time + rng.normal(0.0, 2e-4),
                "lr_factor": sum(split) / 48,
                "noise_scale": None if j < 2 else 40.0 * j,
            }
        )
    return history


def _noise_history() -> list[dict]:
    return [{"step": 6 * k, "noise_scale": 30.0 * 1.3**k, "total_batch_size": 48} for k in range(1, 8)]


def _balancer(ranks: tuple[int, ...] = (0, 1, 2), lower=1, upper=UPPER, **settings) -> SpeedModel:
    settings.setdefault("warmup_samples", 0)  # synthetic timings: no warm-up to leave out
    # a profile is a what-if: its model plans any total on the fitted lines, with no reach beyond the sizes run
    # (test_a_profile_plans_beyond_the_runs_reach); built so here, the round trip is exact
    settings.setdefault("evidence_reach", None)
    balancer = SpeedModel(3, SpeedModelSettings(**settings), BatchBounds.parse((lower, upper), 3))
    balancer.add(_records(np.random.default_rng(0), ranks))
    return balancer


@pytest.fixture(scope="module")
def fitted() -> SpeedModel:
    return _balancer()


@pytest.fixture(scope="module")
def profile_path(fitted: SpeedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    profile = build_profile(
        fitted, _history(np.random.default_rng(1)), base_batch_size=48, noise_scale_history=_noise_history()
    )
    return save_profile(tmp_path_factory.mktemp("profile") / "run" / "cannikin_profile.json", profile)


def _ready(profile: Profile) -> bool:
    """Every rank has a fitted model."""
    return all(d.model is not None for d in profile.devices)


def _optimal(balancer: SpeedModel, total: int) -> tuple[int, ...]:
    """The planner's own answer, from the balancer's pieces (independent of the CLI's code path)."""
    slopes, offsets = balancer.pieces()
    return planner.optimal_split(slopes, offsets, total, balancer.lower, balancer.upper).local_batch_sizes


# ---------------------------------------------------------------------------------------------------- the profile


def test_build_profile_holds_models_samples_tail_bounds_and_histories(fitted: SpeedModel) -> None:
    history = _history(np.random.default_rng(1))
    profile = build_profile(fitted, history, base_batch_size=48, noise_scale_history=_noise_history())
    json.dumps(profile, allow_nan=False)  # strict JSON as built
    assert profile["format"] == FORMAT and profile["version"] == VERSION == 1
    assert profile["world_size"] == 3 and profile["base_batch_size"] == 48
    assert len(profile["devices"]) == 3
    for rank, (device, slope) in enumerate(zip(profile["devices"], SLOPES, strict=True)):
        assert device["rank"] == rank
        assert device["model"]["slope"] == pytest.approx(slope, rel=0.03)
        assert device["model"]["intercept"] == pytest.approx(INTERCEPT, rel=0.1)
        samples = device["samples"]
        assert len(samples["batch_sizes"]) == len(samples["seconds"]) == len(SPLITS) * STEPS_PER_SPLIT
        assert samples["batch_sizes"][:STEPS_PER_SPLIT] == [SPLITS[0][rank]] * STEPS_PER_SPLIT
        assert samples["batch_sizes"][-1] == SPLITS[-1][rank]
    assert profile["tail"]["seconds"] == pytest.approx(TAIL, abs=3e-4)
    assert len(profile["tail"]["samples"]) == len(SPLITS) * STEPS_PER_SPLIT
    assert profile["bounds"] == {"lower": [1, 1, 1], "upper": [UPPER] * 3}
    assert profile["history"] == history
    assert profile["noise_scale_history"] == _noise_history()
    assert profile["balancer_state"] == fitted.state_dict()


def test_profile_round_trip_rebuilds_the_same_balancer(fitted: SpeedModel, profile_path: Path) -> None:
    profile = load_profile(profile_path)
    assert profile.path == profile_path and profile.world_size == 3 and _ready(profile)
    assert profile.base_batch_size == 48
    assert list(profile.history) == _history(np.random.default_rng(1))
    assert list(profile.noise_scale_history) == _noise_history()
    assert [d.model for d in profile.devices] == fitted.models()
    assert profile.devices[1].batch_sizes == tuple(b for b, _ in fitted.fitters[1].samples())
    assert profile.devices[1].seconds == tuple(t for _, t in fitted.fitters[1].samples())
    rebuilt = profile.speed_model()
    assert rebuilt.models() == fitted.models()  # floats survive JSON exactly (repr round trip)
    assert rebuilt.tail() == fitted.tail()
    assert (rebuilt.lower, rebuilt.upper, rebuilt.settings) == (fitted.lower, fitted.upper, fitted.settings)
    for total in (3, 48, 97, 300, 768):
        assert rebuilt.plan_split(total) == fitted.plan_split(total)
    totals = np.arange(3, 769, 7)
    np.testing.assert_array_equal(rebuilt.optperf(totals), fitted.optperf(totals))
    # The rebuilt balancer keeps learning like the original one: same window, same recency weights.
    more = [StepRecord(100 + k, r, 64, 0.2, 0.25) for k in range(3) for r in range(3)]
    rebuilt.add(more)
    original = _balancer()
    original.add(more)
    assert rebuilt.models() == original.models() and rebuilt.tail() == original.tail()


def test_a_profile_plans_beyond_the_runs_reach(tmp_path: Path) -> None:
    trained = _balancer(evidence_reach=2.0)  # as in training: no plan past twice the largest batch a rank ran
    assert trained.plan_split(700).local_batch_sizes == _balancer().plan_split(700).local_batch_sizes, (
        "a total beyond the reach is planned within the caps alone"
    )
    # 165 samples: the fitted lines give (95, 47, 23), past twice what ranks 0 and 1 ran (46 and 22 samples)
    reach = [2 * max(split[rank] for split in SPLITS) for rank in range(3)]
    assert trained.upper == reach
    unreached = _balancer().plan_split(165).local_batch_sizes
    reached = trained.plan_split(165).local_batch_sizes
    assert any(b > r for b, r in zip(unreached, reach, strict=True)), unreached
    assert sum(reached) == 165 and all(b <= r for b, r in zip(reached, reach, strict=True)), reached
    rebuilt = load_profile(save_profile(tmp_path / "p.json", build_profile(trained, []))).speed_model()
    assert rebuilt.settings.evidence_reach is None and rebuilt.models() == trained.models()
    assert rebuilt.plan_split(165).local_batch_sizes == unreached


def test_round_trip_keeps_non_default_settings(tmp_path: Path) -> None:
    balancer = _balancer(half_life=math.inf, tail_window=5, lower=(2, 3, 4), upper=None)
    path = save_profile(tmp_path / "p.json", build_profile(balancer, []))
    raw = json.loads(path.read_text())
    assert raw["settings"] == {
        "half_life": None,
        "tail_window": 5,
        "max_samples": 512,
        "drift_tolerance": 0.25,
        "warmup_samples": 0,
        "probe_lever": 0.25,
    }
    assert raw["bounds"] == {"lower": [2, 3, 4], "upper": None}
    rebuilt = load_profile(path).speed_model()
    assert rebuilt.settings.half_life == math.inf and rebuilt.tails.maxlen == 5 and rebuilt.upper is None
    assert list(rebuilt.tails) == list(balancer.tails) and len(rebuilt.tails) == 5
    assert rebuilt.models() == balancer.models()
    for total in (9, 50, 1000):
        assert rebuilt.plan_split(total) == balancer.plan_split(total)


def test_save_is_atomic_strict_json_and_overwrites(fitted: SpeedModel, tmp_path: Path) -> None:
    history = [
        {
            "step": np.int64(4),
            "epoch": 0,
            "local_batch_sizes": (np.int64(20), 16, 12),
            "total_batch_size": 48,
            "predicted_step_time": np.float64(0.031),
            "measured_step_time": float("nan"),
            "lr_factor": np.float32(1.5),
            "noise_scale": math.inf,  # no detectable signal; strict JSON has no Infinity
        },
        {"step": 10, "total_batch_size": 48, "lr_factor": 1.0, "noise_scale": 12.5},
    ]
    path = tmp_path / "cannikin_profile.json"
    save_profile(path, build_profile(fitted, history))
    first = path.read_text()
    json.loads(first, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    profile = load_profile(path)
    assert profile.history[0]["local_batch_sizes"] == [20, 16, 12]
    assert profile.history[0]["measured_step_time"] is None and profile.history[0]["noise_scale"] is None
    assert profile.history[0]["lr_factor"] == pytest.approx(1.5)
    # Without an explicit noise history, the history's known (finite) noise scales are taken.
    assert [(e["step"], e["noise_scale"]) for e in profile.noise_scale_history] == [(10, 12.5)]
    save_profile(path, build_profile(fitted, history[1:]))
    assert path.read_text() != first and len(load_profile(path).history) == 1
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind
    with pytest.raises(ValueError, match="not a Cannikin profile"):
        save_profile(tmp_path / "other.json", {"world_size": 3})
    assert not (tmp_path / "other.json").exists()


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_save_gives_the_mode_of_any_log_file(fitted: SpeedModel, tmp_path: Path, umask: int, mode: int) -> None:
    # a teammate on a shared cluster reads it like the run's other logs: 0666 less the umask, as open() creates files
    previous = os.umask(umask)
    try:
        path = save_profile(tmp_path / "run" / "cannikin_profile.json", build_profile(fitted, []))
        path = save_profile(path, build_profile(fitted, []))  # the overwrite (a later re-plan) keeps it
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def _profile_text(profile_path: Path, change: str) -> str:
    data = json.loads(profile_path.read_text())
    if change == "version":
        data["version"] = 2
    elif change == "format":
        data["format"] = "something-else"
    elif change == "missing":
        del data["devices"]
    elif change == "world_size":
        data["world_size"] = 4
    elif change == "samples":
        data["devices"][0]["samples"]["seconds"].pop()
    return json.dumps(data)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json {", "not valid JSON"),
        ("[1, 2, 3]", "not a Cannikin profile"),
        ("format", "not a Cannikin profile"),
        ("version", "version 2 is not supported"),
        ("missing", "missing devices"),
        ("world_size", "do not match world_size"),
        ("samples", "malformed"),
    ],
)
def test_load_rejects_what_is_not_a_profile(profile_path: Path, tmp_path: Path, content: str, message: str) -> None:
    bad = tmp_path / "bad.json"
    is_change = content in ("format", "version", "missing", "world_size", "samples")
    bad.write_text(_profile_text(profile_path, content) if is_change else content)
    with pytest.raises(ValueError, match=message) as info:
        load_profile(bad)
    assert str(bad) in str(info.value)


# ---------------------------------------------------------------------------------------------------- cannikin plan


def test_plan_prints_the_planners_split(fitted: SpeedModel, profile_path: Path, capsys) -> None:
    total = 300
    assert main(["plan", str(profile_path), "--batch-size", str(total)]) == 0
    out = capsys.readouterr().out
    expected = fitted.plan_split(total)
    assert expected.local_batch_sizes == _optimal(fitted, total)
    line = next(line for line in out.splitlines() if line.startswith("optimal split:"))
    assert line.startswith(f"optimal split: {list(expected.local_batch_sizes)}  ")
    assert f"predicted step {1000 * expected.predicted_step_time:.2f} ms" in line
    for label in ("Optimal (OptPerf)", "Even (DDP)", "Speed-proportional", "optimal is faster by"):
        assert label in out
    even_time = fitted.predict(even_split(total, 3))
    assert f"{even_time / expected.predicted_step_time:.3f}x" in out


@pytest.mark.parametrize("total", [3, 48, 301, 700])
def test_plan_json_matches_planner_and_alternatives(fitted: SpeedModel, profile_path: Path, capsys, total) -> None:
    assert main(["plan", str(profile_path), "-b", str(total), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["total_batch_size"] == total and data["world_size"] == 3
    optimal = fitted.plan_split(total)
    assert tuple(data["optimal"]["local_batch_sizes"]) == optimal.local_batch_sizes == _optimal(fitted, total)
    assert data["optimal"]["predicted_step_time"] == optimal.predicted_step_time
    assert data["optimal"]["throughput"] == pytest.approx(total / optimal.predicted_step_time)
    slopes = [m.slope for m in fitted.models()]
    alternatives = {"even": even_split(total, 3), "proportional": proportional_sizes(total, [1 / a for a in slopes])}
    for name, sizes in alternatives.items():
        row = data[name]
        assert tuple(row["local_batch_sizes"]) == sizes
        assert row["predicted_step_time"] == fitted.predict(sizes)
        assert row["optimal_speedup"] == pytest.approx(row["predicted_step_time"] / optimal.predicted_step_time)
        within = all(1 <= b <= UPPER for b in sizes)
        assert row["within_bounds"] is within
        if within:
            assert row["optimal_speedup"] >= 1.0  # nothing within the bounds beats the optimum
    if 48 <= total <= 400:
        # The even split waits for the 4x slower device (at 700 the caps force near-even splits anyway).
        assert data["even"]["optimal_speedup"] > 1.5
    if total == 700:
        # 400 samples on the fastest device would break its cap of 256: faster on paper, flagged as not allowed.
        assert data["proportional"]["local_batch_sizes"][0] > UPPER and not data["proportional"]["within_bounds"]
    assert [d["slope"] for d in data["devices"]] == slopes


@pytest.mark.parametrize(
    ("total", "reason"), [(3 * UPPER + 1, "exceeds sum"), (2, "smaller than sum"), (0, "positive")]
)
def test_plan_infeasible_batch_exits_2(profile_path: Path, capsys, total: int, reason: str) -> None:
    assert main(["plan", str(profile_path), "--batch-size", str(total)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "cannikin plan: error:" in captured.err and reason in captured.err


def test_plan_bad_or_missing_file_names_the_path(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "metrics.csv"
    bad.write_text("step,loss\n1,0.5\n")
    assert main(["plan", str(bad), "--batch-size", "64"]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "not a Cannikin profile" in err
    missing = tmp_path / "nope.json"
    assert main(["plan", str(missing), "--batch-size", "64"]) == 2
    assert str(missing) in capsys.readouterr().err


def test_plan_refuses_a_profile_without_samples_for_every_rank(tmp_path: Path, capsys) -> None:
    path = save_profile(tmp_path / "p.json", build_profile(_balancer(ranks=(0, 1)), []))
    assert load_profile(path).devices[2].model is None
    assert main(["plan", str(path), "--batch-size", "64"]) == 2
    assert "no timing samples for rank(s) [2]" in capsys.readouterr().err


def test_usage_errors_and_help(profile_path: Path, capsys) -> None:
    assert main(["plan", "--help"]) == 0
    assert "--batch-size" in capsys.readouterr().out
    assert main(["plan", str(profile_path)]) == 2  # --batch-size is required
    assert main(["report", str(profile_path)]) == 2  # -o is required
    assert main(["frobnicate"]) == 2
    capsys.readouterr()
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "plan" in out and "report" in out and "simulate" in out


# -------------------------------------------------------------------------------------------------- cannikin report


def _check_png(path: Path) -> np.ndarray:
    from matplotlib.image import imread

    assert path.stat().st_size > 8_000
    image = imread(path)
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    assert image.shape[0] >= 300 and image.shape[1] >= 500
    assert image[..., :3].std() > 0.05  # something is drawn on the white background
    return image


def test_report_writes_readable_pngs(profile_path: Path, tmp_path: Path, capsys) -> None:
    out_dir = tmp_path / "report"
    assert main(["report", str(profile_path), "-o", str(out_dir)]) == 0
    printed = capsys.readouterr().out
    names = (COMPUTE_TIME_PNG, STEP_TIME_PNG, TRAINING_PNG)
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(names)
    for name in names:
        _check_png(out_dir / name)
        assert name in printed
    # Two panels side by side: the step-time figure is wider than tall.
    height, width = _check_png(out_dir / STEP_TIME_PNG).shape[:2]
    assert width > 2 * height * 0.9


def test_report_panels_without_data_say_so(fitted: SpeedModel, tmp_path: Path, capsys) -> None:
    path = save_profile(tmp_path / "p.json", build_profile(fitted, []))
    assert main(["report", str(path), "-o", str(tmp_path / "r")]) == 0
    for name in (COMPUTE_TIME_PNG, STEP_TIME_PNG, TRAINING_PNG):
        _check_png(tmp_path / "r" / name)
    texts = [t.get_text() for ax in plot_training(load_profile(path)).axes for t in ax.texts]
    assert any("no plan history" in t for t in texts)
    assert any("noise scale not measured" in t for t in texts)


def test_report_bad_file_exits_2(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "lightning-cannikin/profile", "version": 99}')
    assert main(["report", str(bad), "-o", str(tmp_path / "r")]) == 2
    assert str(bad) in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------------------------------------- the console script


@pytest.mark.skipif(shutil.which("cannikin") is None, reason="the `cannikin` console script is not installed")
def test_console_script_plan(fitted: SpeedModel, profile_path: Path) -> None:
    done = subprocess.run(
        ["cannikin", "plan", str(profile_path), "--batch-size", "120", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert tuple(json.loads(done.stdout)["optimal"]["local_batch_sizes"]) == _optimal(fitted, 120)
