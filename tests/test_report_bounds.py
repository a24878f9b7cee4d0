"""The noise scale's confidence bounds in a profile and on ``cannikin report``'s training plot (pure: no torch)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from lightning_cannikin.core.plan import BatchBounds
from lightning_cannikin.core.profile import Profile, build_profile, load_profile, save_profile
from lightning_cannikin.core.speed_model import SpeedModel, SpeedModelSettings
from lightning_cannikin.tools.cli import main
from lightning_cannikin.tools.report import TRAINING_PNG, _noise_bounds, plot_training

# A lower bound only while the upper one is infinite (stored as null), then a band; one gap at step 40.
BOUNDED = [
    {"step": 10, "noise_scale": None, "noise_low": 20.0, "noise_high": math.inf},
    {"step": 20, "noise_scale": 60.0, "noise_low": 25.0, "noise_high": math.inf},
    {"step": 30, "noise_scale": 90.0, "noise_low": 40.0, "noise_high": 400.0},
    {"step": 40, "noise_scale": 150.0, "noise_low": 80.0, "noise_high": None},
    {"step": 50, "noise_scale": 240.0, "noise_low": 150.0, "noise_high": 900.0},
    {"step": 60, "noise_scale": 400.0, "noise_low": 260.0, "noise_high": 1200.0},
]
# What profiles wrote before the bounds existed.
OLD = [{"step": 10 * k, "noise_scale": 30.0 * 1.8**k} for k in range(1, 7)]


def _profile(tmp_path: Path, noise_scale_history: list[dict]) -> Profile:
    balancer = SpeedModel(2, SpeedModelSettings(), BatchBounds.parse((1, 512), 2))
    history = [{"step": 10 * j, "total_batch_size": 32 * 2**j, "lr_factor": 2.0**j} for j in range(7)]
    profile = build_profile(balancer, history, base_batch_size=32, noise_scale_history=noise_scale_history)
    return load_profile(save_profile(tmp_path / "cannikin_profile.json", profile))


def _legend(profile: Profile) -> list[str]:
    noise_ax = plot_training(profile).axes[2]
    return [text.get_text() for text in noise_ax.get_legend().get_texts()]


def test_bounds_are_the_finite_lower_bounds_with_the_upper_ones_or_inf() -> None:
    entries = [
        {"step": 30, "noise_low": 5.0, "noise_high": 50.0},
        {"step": 10, "noise_low": 1, "noise_high": None},  # null: how a profile stores an infinite bound
        {"step": 20, "noise_low": 2.5, "noise_high": math.inf},
        {"step": 40, "noise_low": 0.0},  # no upper bound recorded
        {"step": 45, "noise_low": 3.0, "noise_high": math.nan},
        {"step": 50, "noise_low": None, "noise_high": 90.0},  # no lower bound: nothing to draw
        {"step": 60, "noise_low": math.inf, "noise_high": math.inf},
        {"step": 70, "noise_low": math.nan, "noise_high": 9.0},
        {"step": None, "noise_low": 1.0, "noise_high": 2.0},
        {"step": 80, "noise_scale": 12.0},  # an old entry
    ]
    steps, low, high = _noise_bounds(entries)
    np.testing.assert_array_equal(steps, [10, 20, 30, 40, 45])
    np.testing.assert_array_equal(low, [1.0, 2.5, 5.0, 0.0, 3.0])
    np.testing.assert_array_equal(high, [math.inf, math.inf, 50.0, math.inf, math.inf])
    for none in ([], OLD):
        assert all(column.size == 0 for column in _noise_bounds(none))


def test_infinite_bounds_round_trip_as_null(tmp_path: Path) -> None:
    profile = _profile(tmp_path, [*BOUNDED, {"step": 70, "noise_scale": 500.0, "noise_low": math.nan}])
    raw = json.loads(profile.path.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert [e.get("noise_high") for e in raw["noise_scale_history"]] == [None, None, 400.0, None, 900.0, 1200.0, None]
    assert raw["noise_scale_history"][-1]["noise_low"] is None
    steps, low, high = _noise_bounds(profile.noise_scale_history)  # the entry whose lower bound was NaN left out
    np.testing.assert_array_equal(steps, [10, 20, 30, 40, 50, 60])
    np.testing.assert_array_equal(low, [e["noise_low"] for e in BOUNDED])
    np.testing.assert_array_equal(high, [math.inf, math.inf, 400.0, math.inf, 900.0, 1200.0])


def test_report_draws_the_band_the_lower_bounds_and_the_total(tmp_path: Path, capsys) -> None:
    from matplotlib.image import imread
    from matplotlib.patches import StepPatch

    profile = _profile(tmp_path, BOUNDED)
    assert main(["report", str(profile.path), "-o", str(tmp_path / "report")]) == 0
    png = tmp_path / "report" / TRAINING_PNG
    assert png.stat().st_size > 8_000 and imread(png)[..., :3].std() > 0.05
    noise_ax = plot_training(profile).axes[2]
    assert _legend(profile) == ["confidence band", "lower bound only", "noise scale", "total batch"]
    (band,) = [p for p in noise_ax.patches if isinstance(p, StepPatch)]
    values, edges, baseline = band.get_data()
    # Each bound holds until the next measurement, as the estimate's step line does; unbounded steps have no band.
    np.testing.assert_array_equal(edges, [10, 20, 30, 40, 50, 60, 60])
    np.testing.assert_array_equal(values, [np.nan, np.nan, 400.0, np.nan, 900.0, 1200.0])
    np.testing.assert_array_equal(baseline, [20.0, 25.0, 40.0, 80.0, 150.0, 260.0])
    lower_only = next(line for line in noise_ax.lines if line.get_label() == "lower bound only")
    np.testing.assert_array_equal(lower_only.get_ydata(), [20.0, 25.0, np.nan, 80.0, np.nan, np.nan])
    assert noise_ax.get_yscale() == "log"  # 20 to 2048 samples with the bounds and the total
    # A few measurements: each is marked, each band with a bar.
    (bars,) = noise_ax.collections
    assert [segment[:, 1].tolist() for segment in bars.get_segments()] == [[40, 400], [150, 900], [260, 1200]]
    assert {line.get_label(): line.get_marker() for line in noise_ax.lines if line.get_label() != "total batch"} == {
        "lower bound only": "^",
        "noise scale": "o",
    }


def test_a_dense_trail_is_drawn_without_markers(tmp_path: Path) -> None:
    trail = [{"step": k, "noise_scale": 50.0 + k, "noise_low": 40.0 + k, "noise_high": 70.0 + k} for k in range(300)]
    noise_ax = plot_training(_profile(tmp_path, trail)).axes[2]
    assert not noise_ax.collections  # no bar per measurement
    assert {line.get_marker() for line in noise_ax.lines} == {"None"}
    (band,) = noise_ax.patches
    assert band.get_data().edges.size == 301


def test_the_log_scale_counts_the_bounds_and_the_total_but_not_a_zero_lower_bound(tmp_path: Path) -> None:
    tight = {"step": 10, "noise_scale": 1000.0, "noise_low": 900.0, "noise_high": 1100.0}
    with_totals = _profile(tmp_path, [tight])
    alone = replace(with_totals, history=())  # the estimate and its bounds only

    def scale(profile: Profile, *entries: dict) -> str:
        return plot_training(replace(profile, noise_scale_history=entries)).axes[2].get_yscale()

    assert scale(alone, tight) == "linear"
    assert scale(alone, {**tight, "noise_high": 30_000.0}) == "log"  # the band spans more than a factor 20
    assert scale(alone, {**tight, "noise_low": 40.0}) == "log"
    assert scale(alone, {**tight, "noise_low": 0.0}) == "linear"  # a lower bound of 0 bounds nothing
    assert scale(alone, {**tight, "noise_high": None}) == "linear"
    assert scale(with_totals, tight) == "log"  # the totals, 32 to 2048 samples, share the axis


def test_bounds_without_an_estimate_still_fill_the_panel(tmp_path: Path) -> None:
    profile = _profile(tmp_path, [{**e, "noise_scale": None} for e in BOUNDED])
    texts = [t.get_text() for t in plot_training(profile).axes[2].texts]
    assert not any("not measured" in t for t in texts)
    assert _legend(profile) == ["confidence band", "lower bound only", "total batch"]


def test_an_old_profile_draws_the_estimate_and_the_total(tmp_path: Path) -> None:
    profile = _profile(tmp_path, OLD)
    assert main(["report", str(profile.path), "-o", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / TRAINING_PNG).stat().st_size > 8_000
    noise_ax = plot_training(profile).axes[2]
    assert _legend(profile) == ["noise scale", "total batch"]
    assert not noise_ax.patches and noise_ax.get_yscale() == "log"
