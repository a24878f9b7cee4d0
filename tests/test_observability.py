"""What a user sees: metrics in a logger, the profile file, and the CLI on a profile from a real run."""

from __future__ import annotations

import csv
import json

import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_cannikin import Cannikin, CannikinSettings, CannikinStrategy, EmulatedCluster
from lightning_cannikin.core.profile import PROFILE_FILENAME, load_profile
from lightning_cannikin.tools.cli import main as cli_main
from lightning_cannikin.training import engine as engine_module
from tests.models import CANNIKIN_METRICS, IndexedRegression, RecordingRegressor, quiet_trainer


def test_metrics_reach_a_csv_logger_and_the_profile_round_trips(tmp_path, capsys, monkeypatch):
    said = tmp_path / "info.txt"  # rank zero's info lines (the forked ranks inherit the patched module)
    monkeypatch.setattr(engine_module, "rank_zero_info", lambda text: said.open("a").write(text + "\n"))
    torch.manual_seed(0)
    # 16 steps an epoch: the warm-up's schedule is due at step 16, the epoch's last batch, which leaves it to the end
    model = RecordingRegressor(IndexedRegression(512), batch_size=16, record_dir=str(tmp_path))
    logger = CSVLogger(tmp_path, name="run")
    trainer = quiet_trainer(
        CannikinStrategy(start_method="fork"),
        2,
        [
            EmulatedCluster([1.0, 3.0], fixed_ms=2.0),
            Cannikin(
                max_batch_size=64,
                settings=CannikinSettings(min_noise_updates=3, noise_bound_sigmas=0, noise_every_n_steps=1),
            ),
        ],
        max_epochs=2,
        logger=logger,
        log_every_n_steps=2,
    )
    trainer.fit(model)
    log_dir = tmp_path / "run" / "version_0"
    with open(log_dir / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    logged = {key for row in rows for key, value in row.items() if value not in ("", None)}
    assert logged >= CANNIKIN_METRICS, CANNIKIN_METRICS - logged
    # the whole split, one scalar per rank (rank zero logs every rank's size from the plan): each step's sizes sum to
    # the total batch logged with them
    split_rows = [row for row in rows if row.get("cannikin/local_batch_size/rank_1")]
    assert split_rows
    for row in split_rows:
        sizes = [float(row[f"cannikin/local_batch_size/rank_{r}"]) for r in range(2)]
        assert min(sizes) >= 1 and sum(sizes) == float(row["cannikin/total_batch_size"]), row
    assert any(
        float(row["cannikin/local_batch_size/rank_0"]) > float(row["cannikin/local_batch_size/rank_1"])
        for row in split_rows
    )
    # each re-plan's reason: the best split's gain against the split margin; the best total's against adapt_margin
    decisions = [row for row in rows if row.get("cannikin/decision/split_gain")]
    assert decisions and all(float(row["cannikin/decision/split_margin"]) == 0.02 for row in decisions)
    totals = [row for row in rows if row.get("cannikin/decision/total_gain")]
    margin = CannikinSettings().adapt_margin
    assert totals and all(float(row["cannikin/decision/adapt_margin"]) == margin for row in totals)
    assert all(float(row["cannikin/decision/best_total_batch_size"]) >= 32 for row in totals)
    explained = [line for line in said.read_text().splitlines() if line.startswith("Cannikin: step")]
    assert any("split margin" in line for line in explained) and any("adapt margin" in line for line in explained)
    # the profile written at the last re-plan rebuilds the same models and plans the same split
    profile = load_profile(log_dir / PROFILE_FILENAME)
    balancer = profile.speed_model()
    assert profile.world_size == 2 and len(profile.history) >= 3
    steps = [h["step"] for h in profile.history]
    assert steps == sorted(set(steps)), f"one history entry per re-plan step: {steps}"
    # one decision at step 16: the epoch's end, not the last batch too (the two decided on the same records)
    assert sum("Cannikin: step 16:" in line for line in explained) == 1 and 16 in steps, (explained, steps)
    measured = [h for h in profile.history if h["measured_step_time"] is not None]
    assert measured and all(
        h["prediction_error"] == abs(h["predicted_step_time"] - h["measured_step_time"]) / h["measured_step_time"]
        for h in measured
    )
    split = balancer.plan_split(32)
    assert split.local_batch_sizes[0] > split.local_batch_sizes[1], "rank 0 is 3x faster: it gets more"
    assert cli_main(["plan", str(log_dir / PROFILE_FILENAME), "--batch-size", "32", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert tuple(printed["optimal"]["local_batch_sizes"]) == split.local_batch_sizes
    # what-if on the cluster this run measured: one more device like the 3x faster rank 0
    args = ["simulate", "--profile", str(log_dir / PROFILE_FILENAME), "--devices", "0:2", "-b", "32", "--json"]
    assert cli_main(args) == 0
    rows = {row["cluster"]: row for row in json.loads(capsys.readouterr().out)["fixed"]}
    assert tuple(rows["measured"]["local_batch_sizes"]) == split.local_batch_sizes
    sizes = rows["what-if"]["local_batch_sizes"]
    assert len(sizes) == 3 and sum(sizes) == 32 and min(sizes[0], sizes[1]) > sizes[2], sizes
    assert rows["what-if"]["predicted_step_time"] < rows["measured"]["predicted_step_time"]


def test_the_allreduce_and_its_exposed_part_are_measured(tmp_path):
    torch.manual_seed(0)
    model = RecordingRegressor(IndexedRegression(320), batch_size=16, record_dir=str(tmp_path))
    logger = CSVLogger(tmp_path, name="run")
    trainer = quiet_trainer(
        CannikinStrategy(start_method="fork"),
        2,
        [EmulatedCluster([1.0, 3.0], fixed_ms=2.0)],
        max_epochs=2,
        logger=logger,
    )
    trainer.fit(model)
    profile = json.loads((tmp_path / "run" / "version_0" / PROFILE_FILENAME).read_text())
    comm = profile["comm"]
    assert comm is not None and 0 < comm["exposed"] <= comm["allreduce"] < 0.5, comm


def test_metrics_are_logged_only_where_a_logger_or_the_progress_bar_sees_them():
    from types import SimpleNamespace

    from lightning_cannikin.training.frontends.metrics import metrics_are_seen

    assert not metrics_are_seen(SimpleNamespace(loggers=[], progress_bar_callback=None))
    assert metrics_are_seen(SimpleNamespace(loggers=[object()], progress_bar_callback=None))
    # the progress bar alone sees them only where asked for (off by default: it keeps the bar readable at 80 columns)
    assert not metrics_are_seen(SimpleNamespace(loggers=[], progress_bar_callback=object()))
    assert metrics_are_seen(SimpleNamespace(loggers=[], progress_bar_callback=object()), progress_bar=True)
    assert not metrics_are_seen(SimpleNamespace(loggers=[], progress_bar_callback=None), progress_bar=True)
