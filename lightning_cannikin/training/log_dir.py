"""Where a run's files go: the folder of the first logger's run, a folder of its own for every run.

Lightning's ``Trainer.log_dir`` is such a folder only for TensorBoard and CSV loggers; for any other logger it is the
logger's ``save_dir``, which every run shares (a second run would overwrite the first run's files there). This module
takes the rule of Lightning's ``ModelCheckpoint`` instead: the logger's own ``log_dir`` when it has one, else
``save_dir/name/version`` (W&B: ``save_dir/project/run id``; MLflow: ``save_dir/experiment id/run id``, the run's folder
in a local ``mlruns`` store).
"""

from __future__ import annotations

import os

import lightning.pytorch as pl

__all__ = ["run_log_dir"]


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
