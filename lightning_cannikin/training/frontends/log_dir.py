"""Where a run's files go: the folder of the first logger's run, a folder of its own for every run.

Lightning's ``Trainer.log_dir`` is such a folder only for TensorBoard and CSV loggers; for any other logger it is the
logger's ``save_dir``, which every run shares (a second run would overwrite the first run's files there). This module
takes the rule of Lightning's ``ModelCheckpoint`` instead: the logger's own ``log_dir`` when it has one, else
``save_dir/name/version`` (W&B: ``save_dir/project/run id``; MLflow: ``save_dir/experiment id/run id``, the run's folder
in a local ``mlruns`` store).

A file in that folder is part of the run for TensorBoard and CSV; MLflow and W&B keep their runs' files as artifacts,
which :func:`log_artifact` uploads it to.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import lightning.pytorch as pl

__all__ = ["log_artifact", "run_log_dir"]


def run_log_dir(trainer: pl.Trainer) -> str | None:
    """The first logger's folder for this run, or ``None`` without a logger.

    Reads the logger only (no collective), so it may be called on rank zero alone; on the other ranks a logger may
    not know its run (W&B and MLflow start it on rank zero).
    """
    if not trainer.loggers:
        return None
    logger = trainer.loggers[0]
    log_dir = getattr(logger, "log_dir", None)
    if log_dir:
        return str(log_dir)
    save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
    version = logger.version
    version = version if isinstance(version, str) else f"version_{version}"
    return os.path.join(save_dir, str(logger.name), version)


def log_artifact(logger: Any, path: str) -> str | None:
    """Upload the file ``path`` as an artifact of ``logger``'s run, where the logger keeps artifacts; which kind.

    Duck-typed, so no logger's package is imported: MLflow's (a ``run_id``, an experiment client with
    ``log_artifact(run_id, path)``) and W&B's (a run with ``save(path, base_path=...)``). ``None`` for the others
    (TensorBoard, CSV: the file is in the run's folder already). Call it on rank zero (the run lives there).
    """
    run_id = getattr(logger, "run_id", None)
    experiment = getattr(logger, "experiment", None)
    if run_id is not None and callable(getattr(experiment, "log_artifact", None)):
        experiment.log_artifact(run_id, path)
        return "mlflow"
    save = getattr(experiment, "save", None)
    if callable(save) and "base_path" in inspect.signature(save).parameters:
        save(path, base_path=os.path.dirname(path), policy="now")
        return "wandb"
    return None
