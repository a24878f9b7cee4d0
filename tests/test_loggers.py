"""The profile lands in the logger's folder for the run, and the ``cannikin/*`` metrics reach TensorBoard's files."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace

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
        Cannikin(
            max_batch_size=64,
            settings=CannikinSettings(min_noise_updates=3, noise_bound_sigmas=0, noise_every_n_steps=1),
        ),
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


class Uploads:
    """What a fake logger's experiment received, in a file (the fit's rank zero is a forked process)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def add(self, kind: str, local_path: str, **details) -> None:
        world_size = json.loads(Path(local_path).read_text())["world_size"]  # the file as it was when uploaded
        entry = {"kind": kind, "path": local_path, "world_size": world_size, **details}
        with self.path.open("a") as handle:
            handle.write(json.dumps(entry) + "\n")

    def read(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines()]


class MlflowShapedLogger(RunFolderLogger):
    """Duck-typed as MLflow's: a ``run_id`` and an experiment client with ``log_artifact(run_id, local_path)``."""

    def __init__(self, save_dir: Path, run_id: str, uploads: Uploads) -> None:
        super().__init__(save_dir, run_id)
        client = SimpleNamespace(log_artifact=lambda run, path: uploads.add("mlflow", path, run_id=run))
        self._client = client

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def experiment(self):
        return self._client


class WandbRun:
    """Duck-typed as a W&B run: ``save(glob_str, base_path=None, policy="live")``."""

    def __init__(self, uploads: Uploads) -> None:
        self.uploads = uploads

    def save(self, glob_str, base_path=None, policy="live"):
        self.uploads.add("wandb", glob_str, base_path=base_path, policy=policy)


class WandbShapedLogger(RunFolderLogger):
    def __init__(self, save_dir: Path, run_id: str, uploads: Uploads) -> None:
        super().__init__(save_dir, run_id)
        self._run = WandbRun(uploads)

    @property
    def experiment(self):
        return self._run


def test_a_logger_without_a_log_dir_keeps_one_profile_per_run_and_gets_it_as_an_artifact(tmp_path):
    uploads = Uploads(tmp_path / "uploads.jsonl")
    _fit(tmp_path, MlflowShapedLogger(tmp_path / "logs", "run-a", uploads))
    _fit(tmp_path, WandbShapedLogger(tmp_path / "logs", "run-b", uploads))
    profiles = {run_id: tmp_path / "logs" / "project" / run_id / PROFILE_FILENAME for run_id in ("run-a", "run-b")}
    for path in profiles.values():
        assert load_profile(path).world_size == 2
    assert not (tmp_path / "logs" / PROFILE_FILENAME).exists(), "the shared save_dir is no run's folder"
    # each run's profile reached its logger's artifacts once, at the end of training, from rank zero
    mlflow, wandb = uploads.read()
    assert mlflow == {"kind": "mlflow", "path": str(profiles["run-a"]), "world_size": 2, "run_id": "run-a"}
    folder = str(profiles["run-b"].parent)
    assert wandb == {
        "kind": "wandb",
        "path": str(profiles["run-b"]),
        "world_size": 2,
        "base_path": folder,
        "policy": "now",
    }
