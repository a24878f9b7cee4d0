"""``BalancingCallback``: Lightning's hooks wired to a :class:`~lightning_cannikin.training.engine.BalancingEngine`.

Hook wiring only: where a step ends, when an epoch ends, what the checkpoint holds, what is logged, and what adopting
a plan means on Lightning's side (the accumulation set on the Trainer at epoch ends, the loader rebuilt for a new total,
the running epoch's length). The strategy owns the engine (built from this callback's options) and drives the step's
other pieces (its start, loss, backward and optimizer step); the protocol and its state are the engine's.
:class:`~lightning_cannikin.Cannikin` is this callback with the user's arguments; ``strategy="cannikin"`` without one
adds this callback with the defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_cannikin.core.explain import decision_values
from lightning_cannikin.core.lr_scaling import Progress
from lightning_cannikin.core.plan import Plan
from lightning_cannikin.core.policy import Decision
from lightning_cannikin.core.profile import PROFILE_FILENAME
from lightning_cannikin.core.speed_model import SpeedModel
from lightning_cannikin.training._lightning_compat import epoch_resizable, sync_epoch_length
from lightning_cannikin.training.engine import BalancingEngine
from lightning_cannikin.training.frontends.log_dir import log_artifact, run_log_dir
from lightning_cannikin.training.frontends.metrics import (
    log_decision,
    log_noise_scale,
    log_prediction_error,
    log_step,
    metrics_are_seen,
)
from lightning_cannikin.training.frontends.strategy_checks import wrong_strategy_error
from lightning_cannikin.training.settings import EngineOptions

__all__ = ["BalancingCallback"]


class BalancingCallback(Callback):
    """Drive the strategy's balancing engine from a Lightning fit (``strategy="cannikin"``).

    Args:
        options: what the strategy builds its engine from (default: the defaults).

    """

    def __init__(self, options: EngineOptions | None = None) -> None:
        self.options = options if options is not None else EngineOptions()
        self._engine: BalancingEngine | None = None
        self._trainer: pl.Trainer | None = None
        self._user_accumulation: int | None = None
        self._length_checked: int | None = None
        self._logging = True  # whether logged values reach a logger or the progress bar
        self._profile_dir: str | None = None  # where rank zero writes the run profile (set at training start)

    @property
    def engine(self) -> BalancingEngine:
        """The engine of the strategy this callback drives (once the fit is set up)."""
        if self._engine is None:
            raise RuntimeError("The Cannikin callback has no engine before a fit with `strategy='cannikin'` sets up.")
        return self._engine

    def use_engine(self, engine: BalancingEngine) -> None:
        """The strategy built its ``engine`` from :attr:`options`: this callback drives and reads it from now on."""
        self._engine = engine

    @property
    def plan(self) -> Plan | None:
        """The split in force (``None`` before a fit)."""
        return self._engine.data.plan if self._engine is not None else None

    @property
    def noise_scale(self) -> float | None:
        """The gradient noise scale ``tr(Sigma) / |G|^2`` in samples (equal on every rank; ``None`` until measured)."""
        return self._engine.controller.noise.estimate if self._engine is not None else None

    @property
    def speed_model(self) -> SpeedModel | None:
        """The per-device timing models (``None`` before fitting starts)."""
        return self._engine.controller.speed_model if self._engine is not None else None

    @property
    def history(self) -> list[dict[str, Any]]:
        """One entry per adopted plan: sizes, predicted and measured step time, LR factor, noise scale."""
        return self._engine.controller.history.entries if self._engine is not None else []

    @property
    def progress(self) -> Progress:
        """Training progress in base-batch steps (the sum of the AdaScale gains; none before a fit)."""
        return self._engine.controller.progress if self._engine is not None else Progress()

    @property
    def lr_factor(self) -> float:
        """The learning-rate factor of the step in progress (or the last one; 1 before a fit)."""
        return self._engine.running.lr_factor if self._engine is not None else 1.0

    @property
    def state_key(self) -> str:
        return "Cannikin"  # what checkpoints written by every version hold this callback's state under

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # the strategy built its engine from this callback's options and bound it at its `setup_environment`
        if self._engine is None or getattr(trainer.strategy, "engine", None) is not self._engine:
            raise ValueError(wrong_strategy_error(trainer.strategy))
        self._trainer = trainer
        if self._user_accumulation is None:  # before any change of ours (a resume restores ours afterwards)
            self._user_accumulation = trainer.accumulate_grad_batches

    def _adopted(self, plan: Plan, previous: Plan | None, mid_epoch: bool) -> None:
        """Lightning's side of a plan every rank adopted."""
        trainer, length = self._trainer, self.engine.data.epoch_length
        assert trainer is not None
        total_changed = previous is not None and plan.total_batch_size != previous.total_batch_size
        if total_changed:
            # the next epoch's length changes with the total batch: Lightning must rebuild the loader to see it
            trainer.reload_dataloaders_every_n_epochs = max(trainer.reload_dataloaders_every_n_epochs, 1)
        if not mid_epoch:
            trainer.accumulate_grad_batches = plan.accumulation_steps
        elif total_changed and length is not None:
            sync_epoch_length(trainer, length)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning accumulates under automatic optimization only; a user's own accumulation is kept as given
        accumulation = pl_module.automatic_optimization and self._user_accumulation == 1
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        # 16-mixed: the gradients carry the GradScaler's scale, which the statistics divide out
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        # the logger's folder for this run (W&B and MLflow included); rank zero writes the profile, and alone asks
        self._profile_dir = run_log_dir(trainer) if self.options.save_profile and trainer.is_global_zero else None
        self.engine.start(optimizer, scaler, accumulation, on_adopt=self._adopted, profile_dir=self._profile_dir)
        self._logging = metrics_are_seen(trainer, self.options.settings.progress_bar)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the profile as an artifact of the run where the logger keeps artifacts (MLflow, W&B); rank zero wrote it
        profile = Path(self._profile_dir or "", PROFILE_FILENAME)
        if self._profile_dir is None or not trainer.is_global_zero or not profile.is_file():
            return
        for logger in trainer.loggers:
            try:
                log_artifact(logger, str(profile))
            except Exception as error:  # an upload that fails must not fail a finished fit
                rank_zero_warn(f"Cannikin could not log {profile} as an artifact of {type(logger).__name__}: {error}")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        length = self.engine.data.epoch_length
        if length is not None and self._length_checked != trainer.current_epoch:
            self._length_checked = trainer.current_epoch  # a resumed epoch's layout is restored at its first batch
            sync_epoch_length(trainer, length)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        engine = self.engine
        # the epoch's last batch: its end re-plans next (a mid-epoch re-plan too would decide twice in a row)
        last = batch_idx + 1 >= trainer.num_training_batches
        decision = engine.end_step(epoch_resizable(trainer), last, trainer.current_epoch)
        if self._logging and engine.controller.step % trainer.log_every_n_steps == 0:
            if (record := engine.reductions.latest_record) is not None:
                bar = self.options.settings.progress_bar
                running = engine.running
                log_step(pl_module, record, running.plan, running.lr_factor, running.sizes, bar)
                if trainer.is_global_zero and (error := engine.controller.history.prediction_error) is not None:
                    log_prediction_error(pl_module, error)
            phi, estimator = engine.controller.noise.estimate, engine.controller.estimator
            if phi is not None and estimator is not None:  # the latest estimate at every logging step
                base = estimator.base_batch_size
                plan = engine.running.plan
                total = plan.total_batch_size if plan is not None else base
                log_noise_scale(pl_module, phi, engine.controller.noise.bounds, total, base)
        self._log(trainer, decision)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(trainer, self.engine.end_epoch(trainer.current_epoch))

    def _log(self, trainer: pl.Trainer, decision: Decision | None) -> None:
        """Rank zero: what a re-plan decided, and why, to the loggers."""
        if decision is not None and self._logging:
            log_decision(trainer, decision_values(decision, self.options.policy))

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks after `setup` and before it builds the training loader: the saved plan is put
        # in force now so the loader is built with it
        plan = self.engine.load_state_dict(state_dict)
        if plan is not None and self._trainer is not None and self._user_accumulation == 1:
            self._trainer.accumulate_grad_batches = plan.accumulation_steps  # what this callback had set
