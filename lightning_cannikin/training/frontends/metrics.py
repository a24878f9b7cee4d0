"""The ``cannikin/*`` metrics, logged through the LightningModule so that every Lightning logger receives them.

Per step and unsynchronised: a synced per-step log would add a collective per key and distort the timing it reports.
Values are plain floats (numpy scalars break the fork/spawn launchers' transfer of ``callback_metrics``).
"""

from __future__ import annotations

import math

import lightning.pytorch as pl

from lightning_cannikin.core.goodput import efficiency
from lightning_cannikin.core.plan import Plan
from lightning_cannikin.core.speed_model import StepRecord

__all__ = ["log_decision", "log_noise_scale", "log_prediction_error", "log_step", "metrics_are_seen"]

# shown on the progress bar only where asked for (`CannikinSettings(progress_bar=True)`): at 80 columns the bar
# truncates `cannikin/...` names; every logger receives every value either way
_PROGRESS_BAR = ("cannikin/total_batch_size", "cannikin/local_batch_size")


def metrics_are_seen(trainer: pl.Trainer, progress_bar: bool = False) -> bool:
    """Whether a logged value reaches anyone: a logger or (with ``progress_bar``) the progress bar. Once logged, a key
    costs Lightning some work at every step for the rest of the fit, so a run with neither logs nothing."""
    return bool(trainer.loggers) or (progress_bar and trainer.progress_bar_callback is not None)


def log_step(
    pl_module: pl.LightningModule,
    record: StepRecord,
    plan: Plan | None,
    lr_factor: float,
    sizes: tuple[int, ...] | None = None,
    progress_bar: bool = False,
) -> None:
    """This rank's step time and local batch, the total batch, the plan's prediction and the LR factor; ``sizes``:
    every rank's local batch in the step, which rank zero logs as ``cannikin/local_batch_size/rank_<r>`` (known on
    every rank from the plan: no collective)."""
    values = {
        "cannikin/step_time": record.step_time,
        "cannikin/local_batch_size": float(record.batch_size),
        "cannikin/lr_factor": float(lr_factor),
    }
    if plan is not None:
        values["cannikin/total_batch_size"] = float(plan.total_batch_size)
        if plan.predicted_step_time is not None:
            values["cannikin/predicted_step_time"] = float(plan.predicted_step_time)
    for name, value in values.items():
        bar = progress_bar and name in _PROGRESS_BAR
        pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=bar, batch_size=record.batch_size)
    for rank, size in enumerate(sizes or ()):
        name = f"cannikin/local_batch_size/rank_{rank}"
        pl_module.log(
            name, float(size), on_step=True, on_epoch=False, rank_zero_only=True, batch_size=record.batch_size
        )


def log_decision(trainer: pl.Trainer, values: dict[str, float]) -> None:
    """Rank zero: a re-plan's ``cannikin/decision/*`` values, straight to every logger at the current step (a re-plan
    is an event, and the epoch's end, where most re-plans happen, allows no per-step ``self.log``)."""
    if not values or not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        logger.log_metrics(values, step=trainer.global_step)


def log_prediction_error(pl_module: pl.LightningModule, error: float) -> None:
    """Rank zero's relative error of the latest plan's predicted step time, once measured."""
    pl_module.log("cannikin/prediction_error", float(error), on_step=True, on_epoch=False, rank_zero_only=True)


def log_noise_scale(
    pl_module: pl.LightningModule, noise_scale: float, bounds: tuple[float, float] | None, total: int, base: int
) -> None:
    """Rank zero's noise scale, its bounds (``cannikin/noise_scale_low``, ``_high``) and the statistical efficiency of
    the total batch in force (``total``, against the ``base`` the learning rate was tuned for); a value that is not
    finite (no detectable signal yet) is left out."""
    values = {"cannikin/noise_scale": noise_scale}
    if bounds is not None:
        values["cannikin/noise_scale_low"], values["cannikin/noise_scale_high"] = bounds
    if math.isfinite(noise_scale):
        values["cannikin/efficiency"] = efficiency(noise_scale, total, base)
    for name, value in values.items():
        if math.isfinite(value):
            pl_module.log(name, float(value), on_step=True, on_epoch=False, rank_zero_only=True)
