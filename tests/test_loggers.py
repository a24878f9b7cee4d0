"""The profile lands in the logger's folder for the run, and the ``cannikin/*`` metrics reach TensorBoard's files."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from lightning_cannikin import Cannikin, CannikinSettings, CannikinStrategy, EmulatedCluster
from lightning_cannikin.core.profile import PROFILE_FILENAME, load_profile
from tests.models import CANNIKIN_METRICS, IndexedRegression, RecordingRegressor, quiet_trainer


def _event_tags(log_dir: Path) -> set[str]:
    """Every scalar tag in the TensorBoard event files of ``log_dir``, read back from the TFRecord framing."""
    event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")
    tags: set[str] = set()
    files = sorted(log_dir.glob("events.out.tfevents.*"))
    assert files, f"no event file in {log_dir}: {sorted(p.name for p in log_dir.iterdir())}"
    for path in files:
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            offset += 12  # length and its CRC
            event = event_pb2.Event.FromString(data[offset : offset + length])
            offset += length + 4  # the record and its CRC
            tags.update(value.tag for value in event.summary.value)
    return tags


def _fit(tmp_path: Path, logger: Logger, devices: int = 2) -> None:
    torch.manual_seed(0)
    model = RecordingRegressor(IndexedRegression(320), batch_size=16, record_dir=str(tmp_path))
    callbacks = [
        EmulatedCluster([1.0, 3.0][:devices], fixed_ms=2.0),
        Cannikin(max_batch_size=64, settings=CannikinSettings(min_noise_updates=3, noise_every_n_steps=1)),
    ]
    trainer = quiet_trainer(
        CannikinStrategy(start_method="fork"), devices, callbacks, max_epochs=2, logger=logger, log_every_n_steps=2
    )
    trainer.fit(model)


def test_tensorboard_gets_the_metrics_and_each_run_its_own_profile(tmp_path):
    for _ in range(2):
        _fit(tmp_path, TensorBoardLogger(tmp_path, name="tb"))
    runs = [tmp_path / "tb" / "version_0", tmp_path / "tb" / "version_1"]
    for run in runs:
        tags = _event_tags(run)
        assert tags >= CANNIKIN_METRICS, CANNIKIN_METRICS - tags
        profile = load_profile(run / PROFILE_FILENAME)
        assert profile.world_size == 2 and profile.history
    assert not (tmp_path / "tb" / PROFILE_FILENAME).exists()


class RunFolderLogger(Logger):
    """A logger shaped like W&B's and MLflow's: a shared ``save_dir``, a run known by its name and version, and no
    ``log_dir`` of its own (so Lightning's ``Trainer.log_dir`` would be the shared ``save_dir``)."""

    def __init__(self, save_dir: Path, run_id: str) -> None:
        super().__init__()
        self._save_dir, self._run_id = str(save_dir), run_id
        self.logged: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "project"

    @property
    def version(self) -> str:
        return self._run_id

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @rank_zero_only
    def log_metrics(self, metrics, step=None) -> None:
        self.logged.append(dict(metrics))

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def test_a_logger_without_a_log_dir_keeps_one_profile_per_run(tmp_path):
    for run_id in ("run-a", "run-b"):
        _fit(tmp_path, RunFolderLogger(tmp_path / "logs", run_id))
    for run_id in ("run-a", "run-b"):
        profile = load_profile(tmp_path / "logs" / "project" / run_id / PROFILE_FILENAME)
        assert profile.world_size == 2
    assert not (tmp_path / "logs" / PROFILE_FILENAME).exists(), "the shared save_dir is no run's folder"
