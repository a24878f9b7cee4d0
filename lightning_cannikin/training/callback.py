"""``Cannikin``: the callback that wires the timer, the speed model and the noise scale into Lightning's hooks.

Each step every rank times itself; at each re-plan the ranks gather their records, rank zero fits and calls
:func:`lightning_cannikin.core.policy.decide`, broadcasts the :class:`~lightning_cannikin.core.policy.Decision`, and
every rank adopts it. The maths lives in :mod:`lightning_cannikin.core`; the state shared with the strategy lives in
its :class:`~lightning_cannikin.training.runtime.RuntimeState`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_cannikin.core.history import PlanHistory
from lightning_cannikin.core.lr_scaling import Progress, is_adam_family
from lightning_cannikin.core.noise_scale import NoiseScaleEstimator
from lightning_cannikin.core.plan import BatchBounds, Plan
from lightning_cannikin.core.policy import Decision, PolicySettings, decide, learning_rate_scale
from lightning_cannikin.core.schedule import ReplanSchedule
from lightning_cannikin.core.speed_model import SpeedModel, SpeedModelSettings, StepRecord
from lightning_cannikin.tools.run_profile import PROFILE_FILENAME, build_profile, save_profile
from lightning_cannikin.training.fit_loop import adopt_plan, all_gather, epoch_resizable, sync_epoch_length
from lightning_cannikin.training.grad_stats import GradientNormObserver, check_every
from lightning_cannikin.training.log_dir import run_log_dir
from lightning_cannikin.training.metrics import log_noise_scale, log_prediction_error, log_step, metrics_are_seen
from lightning_cannikin.training.runtime import RuntimeState


class Cannikin(Callback):
    """Balance a heterogeneous cluster and, optionally, adapt the total batch size for goodput.

    Args:
        max_batch_size: the largest total batch (per optimizer step) to consider. ``None`` keeps the total batch
            fixed and only balances its split.
        local_batch_bounds: bounds on any rank's local batch: an upper bound, or ``(lower, upper)`` with scalars or
            per-rank sequences. ``None``: at least one sample, no cap.
        lr_scaling: how the learning rate follows the total batch: ``"adascale"`` (the AdaScale gain; its square root
            for Adam-family optimizers), ``"sqrt"``, ``"linear"`` or ``"none"``.
        base_batch_size: the total batch the learning rate was tuned for (default: the initial total batch).
        balance: split unevenly by measured speed; ``False`` keeps an even split (an AdaptDL-like baseline when
            combined with ``max_batch_size``).
        replan_every_n_steps: also re-plan the split mid-epoch every this many training steps (``None``: at epoch
            ends only).
        adapt_every_n_steps: with ``max_batch_size``, also reconsider the total batch mid-epoch once the noise scale
            is usable, then every this many training steps (``None``: at epoch ends only). The noise-scale average
            spans about a thousand base-batch steps, so much more often buys nothing. A mid-epoch change keeps the
            accumulation, and every sample once (the epoch ends when its samples do); not under
            ``limit_train_batches``.
        accumulate: reach totals beyond what the upper bounds hold in one micro-step with gradient accumulation (the
            same micro-steps on every rank), changed at epoch ends. Off under manual optimization or when the Trainer
            has its own ``accumulate_grad_batches``.
        warmup_steps: while some device's speed is not yet measured at two batch sizes, re-plan every this many
            steps: the first re-plan probes a second size on every rank (alternating mid-epoch), the next balances.
        half_life: recency half-life of the timing fits, in steps.
        adapt_margin: relative goodput gain required to change the total batch (hysteresis).
        min_noise_updates: measured steps of noise statistics required before the total batch may change.
        track_noise_scale: measure the gradient noise scale. ``None``: only when it can change something, i.e. with
            ``max_batch_size`` or with ``lr_scaling="adascale"`` and a ``base_batch_size``.
        noise_every_n_steps: measure the noise statistics on one optimizer step in this many; the others cost nothing.
        noise_exchange_every: measured steps whose statistics share one all-reduce of a few floats, never waited for
            (the same numbers, folded up to twice this many measured steps later).
        save_profile: at each re-plan, rank zero writes ``cannikin_profile.json`` into the first logger's folder for
            this run (``version_N`` of TensorBoard and CSV, ``save_dir/name/version`` of W&B and MLflow), for
            ``cannikin plan`` and ``cannikin report``. Nothing is written without a logger.

    Example::

        trainer = Trainer(strategy="cannikin", devices=4, callbacks=[Cannikin(max_batch_size=4096)])

    """

    def __init__(
        self,
        max_batch_size: int | None = None,
        local_batch_bounds: int | tuple[int | Sequence[int], int | Sequence[int] | None] | None = None,
        lr_scaling: str = "adascale",
        base_batch_size: int | None = None,
        balance: bool = True,
        replan_every_n_steps: int | None = None,
        adapt_every_n_steps: int | None = 200,
        accumulate: bool = True,
        warmup_steps: int = 8,
        half_life: float = 50.0,
        adapt_margin: float = 0.05,
        min_noise_updates: int = 20,
        track_noise_scale: bool | None = None,
        noise_every_n_steps: int = 1,
        noise_exchange_every: int = 8,
        save_profile: bool = True,
    ) -> None:
        if base_batch_size is not None and base_batch_size < 1:
            raise ValueError(f"`base_batch_size` must be a positive integer or None, got {base_batch_size}.")
        BatchBounds.check(local_batch_bounds)
        self.policy = PolicySettings(max_batch_size, balance, adapt_margin, lr_scaling, accumulate=accumulate)
        self._length_checked: int | None = None
        self._user_accumulation: int | None = None
        self._trainer: pl.Trainer | None = None
        self.schedule = ReplanSchedule(warmup_steps, replan_every_n_steps, adapt_every_n_steps)
        self.speed_settings = SpeedModelSettings(half_life=half_life)
        self.local_batch_bounds = local_batch_bounds
        self.base_batch_size = base_batch_size
        self.min_noise_updates = min_noise_updates
        if track_noise_scale is None:
            track_noise_scale = max_batch_size is not None or (lr_scaling == "adascale" and base_batch_size is not None)
        self.track_noise_scale = track_noise_scale
        self.noise_every_n_steps = check_every("noise_every_n_steps", noise_every_n_steps)
        self.noise_exchange_every = check_every("noise_exchange_every", noise_exchange_every)
        self.save_profile = save_profile
        self.progress = Progress()
        self.lr_factor = self.gain = 1.0
        self._history = PlanHistory()
        self._speed_model: SpeedModel | None = None
        self._estimator: NoiseScaleEstimator | None = None
        self._observer: GradientNormObserver | None = None
        self._runtime: RuntimeState | None = None
        self._world_size = 1
        self._restored: dict[str, Any] | None = None
        self._step = 0
        self._adam = False
        self._log_dir: str | None = None
        self._logging = True  # whether logged values reach a logger or the progress bar
        self._identified = False  # rank zero's word, broadcast: every rank's slope has been measured

    @property
    def plan(self) -> Plan | None:
        """The split in force."""
        return self._runtime.plan if self._runtime is not None else None

    @property
    def noise_scale(self) -> float | None:
        """The gradient noise scale ``tr(Sigma) / |G|^2`` in samples (equal on every rank; ``None`` until measured)."""
        return self._estimator.noise_scale if self._estimator is not None else None

    @property
    def speed_model(self) -> SpeedModel | None:
        """The per-device timing models (``None`` before fitting starts)."""
        return self._speed_model

    @property
    def history(self) -> list[dict[str, Any]]:
        """One entry per adopted plan: sizes, predicted and measured step time, LR factor, noise scale."""
        return self._history.entries

    @property
    def max_batch_size(self) -> int | None:
        return self.policy.max_batch_size

    @property
    def replan_every_n_steps(self) -> int | None:
        return self.schedule.every_n_steps

    @property
    def lr_scaling(self) -> str:
        return self.policy.lr_scaling

    @property
    def state_key(self) -> str:
        return "Cannikin"

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        runtime = getattr(trainer.strategy, "runtime", None)
        if not isinstance(runtime, RuntimeState):
            raise ValueError(
                f"The Cannikin callback needs `strategy='cannikin'` (a CannikinStrategy), got"
                f" {type(trainer.strategy).__name__}."
            )
        self._runtime, self._world_size = runtime, trainer.world_size
        self._trainer = trainer
        if self._user_accumulation is None:  # before any change of ours (a resume restores ours afterwards)
            self._user_accumulation = trainer.accumulate_grad_batches
        if self._speed_model is None:
            bounds = BatchBounds.parse(self.local_batch_bounds, trainer.world_size)
            self._speed_model = SpeedModel(trainer.world_size, self.speed_settings, bounds)
        runtime.bounds = self._speed_model.bounds
        if self._observer is None and trainer.world_size > 1 and self.track_noise_scale:
            every = (self.noise_exchange_every, self.noise_every_n_steps)
            self._observer = GradientNormObserver(trainer.global_rank, trainer.world_size, None, *every)
            runtime.hook.observers.append(self._observer)  # through the comm hook, if there is one
        runtime.noise = self._observer

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plan = self.plan
        if plan is not None:
            self.policy.check_initial(plan)  # every rank sees the same plan: all raise, before any collective
        if self.policy.accumulate and (not pl_module.automatic_optimization or self._user_accumulation != 1):
            # Lightning accumulates under automatic optimization only; a user's own accumulation is kept as given
            self.policy = replace(self.policy, accumulate=False)
        base = self.base_batch_size or (plan.total_batch_size if plan is not None else 1)
        if self._estimator is None:
            self._estimator = NoiseScaleEstimator(base)
        self._adam = bool(trainer.optimizers) and is_adam_family(type(trainer.optimizers[0]).__name__)
        if self._observer is not None:
            self._observer.optimizer = trainer.optimizers[0] if self._adam else None
            # 16-mixed: the gradients carry the GradScaler's scale, which the statistics divide out
            self._observer.scaler = getattr(trainer.precision_plugin, "scaler", None)
        # the logger's folder for this run (W&B and MLflow included); rank zero writes the profile, and alone asks
        self._log_dir = run_log_dir(trainer) if self.save_profile and trainer.is_global_zero else None
        self._logging = metrics_are_seen(trainer)
        if self._restored is not None:
            self._load(self._restored)  # rank zero's factor and gain, the same on every rank
            self._restored = None
        elif plan is not None:  # no statistics yet: the same on every rank
            self.lr_factor, self.gain = learning_rate_scale(self.policy.lr_scaling, plan.total_batch_size, base, None)
        assert self._runtime is not None
        self._runtime.lr_factor = self.lr_factor

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self._runtime is not None
        if self._runtime.sampler is not None and self._length_checked != trainer.current_epoch:
            self._length_checked = trainer.current_epoch  # a resumed epoch's layout is restored at its first batch
            sync_epoch_length(trainer, len(self._runtime.sampler))
        self._runtime.timer.start()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._runtime is not None
        self._runtime.timer.backward_done()
        if self._observer is not None and not self._runtime.timer.reduced:
            # an accumulation micro-step (no reduction): its gradient is a noise group of its own
            self._observer.after_micro_step(pl_module.parameters(), self._runtime.hook.local_scale)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # a step counts at the gain it is taken with, before the scheduler that may read progress steps after it
        self.progress.add(self.gain)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        runtime = self._runtime
        assert runtime is not None
        sizes = runtime.step_sizes
        rank = trainer.global_rank
        runtime.timer.finish(self._step, rank, None if sizes is None else sizes[rank])
        logging = self._logging and (self._step + 1) % trainer.log_every_n_steps == 0
        if logging and (record := runtime.timer.latest) is not None:
            log_step(pl_module, record, self.plan, self.lr_factor)
            if trainer.is_global_zero and (error := self._history.prediction_error) is not None:
                log_prediction_error(pl_module, error)
        reduced = runtime.timer.reduced  # no re-plan mid-window: a window's micro-batches share one layout
        if reduced:
            self._after_optimizer_step(pl_module, logging)
        self._step += 1
        if not reduced or runtime.fixed_split:
            return
        adapt = (
            self.policy.max_batch_size is not None
            and self.schedule.adapt_due(self._step, self._adapt_ready)
            and epoch_resizable(trainer)
        )
        if adapt or self.schedule.due(self._step, self._identified, self.policy.balance):
            self._replan(trainer, mid_epoch=True, adapt_total=adapt)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._runtime is not None
        if not self._runtime.fixed_split:
            self._replan(trainer, mid_epoch=False, adapt_total=True)

    def _after_optimizer_step(self, pl_module: pl.LightningModule, logging: bool) -> None:
        """The step's noise statistics, and from them the LR factor and gain of the next step (``logging``: this
        step's values are logged)."""
        assert self._runtime is not None and self._estimator is not None
        if self._observer is None:
            return
        # every rank folds the same exchanged numbers into its own estimator: the factor follows the noise scale at
        # every step, identical on every rank, with no collective of its own
        updated = self._observer.fold_into(self._estimator, self._runtime.accumulation_window)
        if updated and self.plan is not None:
            base, total, phi = self._estimator.base_batch_size, self.plan.total_batch_size, self._usable_noise_scale()
            self.lr_factor, self.gain = learning_rate_scale(self.policy.lr_scaling, total, base, phi, self._adam)
            self._runtime.lr_factor = self.lr_factor
        phi = self._estimator.noise_scale
        if logging and updated and phi is not None:
            base = self._estimator.base_batch_size
            log_noise_scale(pl_module, phi, self.plan.total_batch_size if self.plan is not None else base, base)

    @property
    def _adapt_ready(self) -> bool:
        """The noise scale can be acted on, and the speeds are measured (or the split is even)."""
        return self._usable_noise_scale() is not None and (self._identified or not self.policy.balance)

    def _usable_noise_scale(self) -> float | None:
        """The noise scale once enough steps have been averaged to act on it (``None`` before)."""
        assert self._estimator is not None
        return self._estimator.noise_scale if self._estimator.num_updates >= self.min_noise_updates else None

    def _decide(
        self, records: list[StepRecord], current: Plan | None, mid_epoch: bool, adapt_total: bool | None = None
    ) -> Decision | None:
        """Rank zero: fold in every rank's records and decide (``None`` while some rank has no timing yet)."""
        assert self._speed_model is not None and self._estimator is not None
        self._speed_model.add(records)
        if self._speed_model.drifts:
            rank_zero_info(
                f"Cannikin: ranks {self._speed_model.drifts} changed speed; their models follow the measured change."
            )
        self._history.observe(records)
        if current is None or not self._speed_model.ready:
            return None
        # Lightning's accumulation changes at epoch ends only (as its GradientAccumulationScheduler does it): a
        # mid-epoch window must not straddle two values
        policy = replace(self.policy, accumulate=False) if mid_epoch else self.policy
        return decide(
            self._speed_model,
            current,
            policy,
            self._usable_noise_scale(),
            self._estimator.base_batch_size,
            adapt_total=not mid_epoch if adapt_total is None else adapt_total,
            adam=self._adam,
        )

    def _replan(self, trainer: pl.Trainer, mid_epoch: bool, adapt_total: bool) -> None:
        """Gather, decide on rank zero, broadcast, adopt. Every rank must call this at the same step."""
        runtime = self._runtime
        assert runtime is not None
        # the step records are read now: on CUDA the last ones wait for the device (the gather synchronises anyway)
        gathered = all_gather((runtime.timer.records(wait=True), runtime.batches_yielded))
        from_batch = max(y for _, y in gathered) if mid_epoch else 0
        current = runtime.plan
        decision = None
        if trainer.is_global_zero:
            records = [r for rank_records, _ in gathered for r in rank_records]
            decision = self._decide(records, current, mid_epoch, adapt_total)
        decision = trainer.strategy.broadcast(decision, src=0)
        if decision is None or current is None:
            self.schedule.replanned(self._step, total_changed=False, balance=self.policy.balance)
            return
        if adapt_total:
            self.schedule.adapted_at(self._step, self._adapt_ready)
        plan = decision.plan
        total_changed = plan.total_batch_size != current.total_batch_size
        self.schedule.replanned(self._step, total_changed, self.policy.balance)
        self.lr_factor = runtime.lr_factor = decision.lr_factor
        self.gain, self._identified = decision.gain, decision.identified
        adopt_plan(
            trainer, runtime, plan, mid_epoch, from_batch, 0 if decision.identified else self.schedule.warmup_steps
        )
        changed = self._speed_model.drifts if trainer.is_global_zero and self._speed_model is not None else []
        self._history.append(self._step, trainer.current_epoch, plan, decision.lr_factor, self.noise_scale, changed)
        if trainer.is_global_zero and self._log_dir and self._speed_model is not None:
            base = self._estimator.base_batch_size if self._estimator is not None else None
            profile = build_profile(self._speed_model, self.history, base_batch_size=base)
            save_profile(Path(self._log_dir) / PROFILE_FILENAME, profile)
        if trainer.is_global_zero and plan.local_batch_sizes != current.local_batch_sizes:
            rank_zero_info(
                f"Cannikin: local batch sizes {list(current.local_batch_sizes)} -> {list(plan.local_batch_sizes)}"
                f" (predicted step {1000 * (plan.predicted_step_time or 0):.1f} ms, lr factor {self.lr_factor:.3g})"
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "balancer": self._speed_model.state_dict() if self._speed_model is not None else None,
            "estimator": self._estimator.state_dict() if self._estimator is not None else None,
            "progress": self.progress.state_dict(),
            "lr_factor": self.lr_factor,
            "gain": self.gain,
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "history": self.history,
            "step": self._step,
            "identified": self._identified,
            "last_adapt_step": self.schedule.last_adapt_step,
            "adapted": self.schedule.adapted,
            "noise_in_flight": self._observer.state_dict() if self._observer is not None else None,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks after `setup` and before it builds the training loader: put the saved plan in
        # force now so the loader is built with it. The rest waits for on_train_start (the estimator needs B0).
        self._restored = dict(state_dict)
        saved = state_dict.get("plan")
        if saved is None or self._runtime is None or self._runtime.fixed_split:
            return
        plan = Plan.from_dict(saved).resized(self._world_size)
        if len(saved["local_batch_sizes"]) != self._world_size:
            rank_zero_info(
                f"Cannikin: resuming a {len(saved['local_batch_sizes'])}-rank run on {self._world_size} ranks;"
                f" keeping the global batch of {plan.global_batch_size}, split evenly until the new devices are timed."
            )
        self._runtime.adopt(plan)
        if self._trainer is not None and self._user_accumulation == 1:
            self._trainer.accumulate_grad_batches = plan.accumulation_steps  # what this callback had set

    def _load(self, state: dict[str, Any]) -> None:
        if state.get("balancer") is not None and self._speed_model is not None:
            self._speed_model.load_state_dict(state["balancer"])
            self._speed_model.restarted()
        if state.get("estimator") is not None and self._estimator is not None:
            self._estimator.load_state_dict(state["estimator"])
        self.progress.load_state_dict(state["progress"])
        self.lr_factor = state["lr_factor"]
        self.gain = state["gain"]
        self._history.entries = list(state["history"])
        self._step = self.schedule.last_replan_step = state["step"]
        self.schedule.last_adapt_step = int(state.get("last_adapt_step", self._step))
        self.schedule.adapted = bool(state.get("adapted", True))
        if state.get("noise_in_flight") is not None and self._observer is not None:
            self._observer.load_state_dict(state["noise_in_flight"])
        same_devices = state.get("balancer") is not None and state["balancer"]["world_size"] == self._world_size
        self._identified = bool(state.get("identified", False)) and same_devices
