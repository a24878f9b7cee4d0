"""Defaults that never crash a model: a BatchNorm model's smallest local batch, and the log that names a device
slower than the step at its smallest batch (a truth computed by brute force, apart from the planner)."""

from __future__ import annotations

import itertools
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_cannikin import Cannikin, EmulatedCluster
from lightning_cannikin.core.dead_weight import dead_weight
from lightning_cannikin.core.optperf import optimal_split
from lightning_cannikin.core.plan import BatchBounds
from lightning_cannikin.training.frontends.batch_statistics import smallest_local_batch
from tests.models import IndexedRegression, RecordingRegressor, quiet_trainer


@pytest.mark.parametrize(
    ("layer", "bounds", "expected"),
    [
        (nn.BatchNorm1d(8), None, 2),
        (nn.BatchNorm2d(8), None, 2),
        (nn.LazyBatchNorm1d(), None, 2),
        (nn.BatchNorm1d(8), 64, 2),  # an upper bound alone leaves the lower to the layers
        (nn.BatchNorm1d(8), (1, 64), 1),  # a lower bound the user gives wins
        (nn.BatchNorm1d(8), ([1, 3, 1], None), 1),
        (nn.SyncBatchNorm(8), None, 1),  # pooled over the ranks: one sample is fine
        (nn.LayerNorm(8), None, 1),
        (nn.GroupNorm(2, 8), None, 1),
    ],
)
def test_smallest_local_batch_follows_batch_statistics_layers(layer, bounds, expected):
    model = nn.Sequential(nn.Linear(8, 8), layer, nn.ReLU())
    assert smallest_local_batch(model, bounds) == expected
    assert smallest_local_batch(None, bounds) == 1


def test_bounds_take_the_layers_floor_only_where_the_user_gives_no_lower_bound():
    assert BatchBounds.parse(None, 3, smallest=2) == BatchBounds((2, 2, 2))
    assert BatchBounds.parse(64, 3, smallest=2) == BatchBounds((2, 2, 2), (64, 64, 64))
    # a cap of one sample is the user's word: the floor never exceeds it
    assert BatchBounds.parse((None, [1, 64, 64]), 3, smallest=2) == BatchBounds((1, 2, 2), (1, 64, 64))
    assert BatchBounds.parse((1, None), 3, smallest=2) == BatchBounds((1, 1, 1))
    assert BatchBounds.parse(None, 3) == BatchBounds((1, 1, 1))


def _brute_step(slopes, offsets, total, lower) -> float:
    """The least ``max_i (s_i b_i + o_i)`` over every integer split of ``total`` with ``b_i >= lower_i``."""
    best = np.inf
    for split in itertools.product(*(range(lo, total + 1) for lo in lower)):
        if sum(split) == total:
            best = min(best, max(s * b + o for s, o, b in zip(slopes, offsets, split, strict=True)))
    return best


def test_dead_weight_against_brute_force():
    rng = np.random.default_rng(7)
    named = 0
    for _ in range(150):
        n = int(rng.integers(2, 4))
        slopes = rng.choice([0.0002, 0.001, 0.004, 0.02], size=n)
        offsets = rng.uniform(0.0, 0.01, size=n)
        lower = rng.integers(1, 4, size=n)
        total = int(lower.sum() + rng.integers(0, 10))
        split = optimal_split(slopes, offsets, total, lower).local_batch_sizes
        weight = dead_weight(slopes, offsets, split, lower)
        with_all = _brute_step(slopes, offsets, total, lower)
        for rank in range(n):
            others = [i for i in range(n) if i != rank]
            without = _brute_step(slopes[others], offsets[others], total, lower[others])
            times = slopes * np.array(split) + offsets
            # the truth: at its lower bound, the step's slowest, and the others alone step faster
            named_here = split[rank] == lower[rank] and times[rank] == times.max() and without < with_all
            if weight is not None and weight.rank == rank:
                assert named_here, (slopes, offsets, lower, total, split, weight)
                assert weight.step_time == pytest.approx(with_all)
                assert weight.step_time_without == pytest.approx(without)
                named += 1
            elif named_here:
                # another rank was named: only where two ranks tie as the slowest at their floors
                assert weight is not None and times[weight.rank] == times[rank], (slopes, lower, split, weight)
    assert named >= 10, "the cases must include devices not worth their place"


def test_dead_weight_of_the_issues_cluster_and_its_message():
    # 0.2, 1 and 20 ms a sample, 2 ms a step: at its floor of 2, rank 2 takes 42 ms where the others share 96 in 18
    slopes, offsets = np.array([0.0002, 0.001, 0.02]), np.full(3, 0.002)
    split = optimal_split(slopes, offsets, 96, [2, 2, 2]).local_batch_sizes
    assert split[2] == 2
    weight = dead_weight(slopes, offsets, split, [2, 2, 2])
    assert weight is not None and weight.rank == 2 and weight.local_batch_size == 2 and weight.total_batch_size == 96
    assert weight.step_time == pytest.approx(0.042)
    assert weight.step_time_without == pytest.approx(0.018)
    assert "rank 2" in weight.message() and "42.0 ms" in weight.message() and "18.0 ms" in weight.message()
    # a device that pays its way is not named; nor one the others cannot stand in for (their caps)
    assert dead_weight(slopes, offsets, (60, 30, 6), [2, 2, 2]) is None
    assert dead_weight(slopes, offsets, split, [2, 2, 2], upper=[60, 30, 64]) is None


class BatchNormRegressor(RecordingRegressor):
    """The recording regressor with a BatchNorm1d on (batch, features): one sample in training raises."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.layer = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


class KeepWarnings(Callback):
    """Rank zero writes the warnings the fit raised."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_fit_start(self, trainer, pl_module):
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always")

    def on_train_end(self, trainer, pl_module):
        self._catcher.__exit__(None, None, None)
        if trainer.is_global_zero:
            self.path.write_text(json.dumps([str(w.message) for w in self._caught]))


def test_batchnorm_model_trains_to_the_end_on_ranks_100x_apart_under_the_defaults(tmp_path):
    torch.manual_seed(0)
    dataset = IndexedRegression(960)
    model = BatchNormRegressor(dataset, batch_size=32, record_dir=str(tmp_path))
    emulated = EmulatedCluster(per_sample_ms=[0.2, 1.0, 20.0], fixed_ms=2.0)
    trainer = quiet_trainer(
        "cannikin_fork", 3, [emulated, Cannikin(), KeepWarnings(tmp_path / "warnings.json")], max_epochs=2
    )
    trainer.fit(model)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    sizes = [[len(step) for step in record["steps"]] for record in records]
    assert all(len(s) == len(sizes[0]) for s in sizes), "every rank ran every step"
    assert records[0]["epochs"][-1] == 1, "both epochs ran to the end"
    for epoch in (0, 1):  # every sample once an epoch
        seen = sorted(
            i for r in records for step, e in zip(r["steps"], r["epochs"], strict=True) if e == epoch for i in step
        )
        assert seen == list(range(960))
    assert min(min(s) for s in sizes) == 2, sizes  # never below the floor ...
    assert 2 in sizes[2], "... and the slow rank was planned down to it (it would have been 1)"
    said = json.loads((tmp_path / "warnings.json").read_text())
    assert any("rank 2 is the step's slowest even at its smallest local batch (2 samples)" in w for w in said), said
