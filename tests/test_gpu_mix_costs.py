"""The gpu-mix benchmark's device costs: shipped as numbers, so a clean clone runs without the unlicensed Sia files."""

import pytest

import lightning_cannikin.simulation.models as models
from benchmarks.gpu_mix import FITTED_COSTS, GPUS, JOB, check_fitted_costs, gpu_costs
from lightning_cannikin.simulation.gpu_profiles import ProfileStore


def test_gpu_costs_are_the_shipped_fits_without_reading_any_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable(*args: object, **kwargs: object) -> None:
        raise AssertionError("gpu_costs read the GPU profiles")

    # patched on the class and the module, so no spelling of the import can reach the files
    monkeypatch.setattr(models, "load_job", unavailable)
    monkeypatch.setattr(ProfileStore, "__init__", unavailable)
    per_sample, fixed, description = gpu_costs(1.0)
    assert per_sample == [1000.0 * FITTED_COSTS[g][0] for g in GPUS]
    assert fixed == [1000.0 * FITTED_COSTS[g][1] for g in GPUS]
    assert description == {
        "job": JOB,
        "gpus": ["A100", "2080Ti", "T4"],
        "sources": {"A100": "sia", "2080Ti": "sia", "T4": "pollux"},
        "scale": 1.0,
    }
    assert gpu_costs(2.0)[0] == pytest.approx([2.0 * ms for ms in per_sample])


def test_the_shipped_t4_fit_matches_the_shipped_pollux_trace() -> None:
    assert check_fitted_costs(ProfileStore(use_sia=False)) == ["T4"]


def test_the_shipped_fits_match_the_local_sia_traces() -> None:
    store = ProfileStore()
    if not store.sia_available:
        pytest.skip("the Sia profiles are not shipped; no local copy (../shared or CANNIKIN_GPU_PROFILES) found")
    assert check_fitted_costs(store) == list(GPUS)


def test_a_drifted_fit_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    slope, intercept, source = FITTED_COSTS["T4"]
    monkeypatch.setitem(FITTED_COSTS, "T4", (slope * (1 + 1e-4), intercept, source))
    with pytest.raises(AssertionError, match="T4 slope"):
        check_fitted_costs(ProfileStore(use_sia=False))
