"""``Cannikin``: the callback that measures every rank, models it, re-plans the split and adapts the total batch."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_cannikin.balancer import SplitBalancer, StepRecord, median_step_time
from lightning_cannikin.goodput import adascale_gain, efficiency
from lightning_cannikin.grad_stats import GradientNormObserver
from lightning_cannikin.lr_scaling import Progress, is_adam_family, lr_factor, validate_rule
from lightning_cannikin.noise_scale import NoiseScaleEstimator
from lightning_cannikin.plan import Plan
from lightning_cannikin.planner import even_split
from lightning_cannikin.profile import PROFILE_FILENAME, build_profile, save_profile
from lightning_cannikin.replanner import next_plan
from lightning_cannikin.strategy import CannikinStrategy


class Cannikin(Callback):
    """Balance a heterogeneous cluster and, optionally, adapt the total batch size for goodput.

    Every rank times its own forward and backward each step (until its gradients are ready, so waiting for slower
    ranks is not counted). At each re-plan the ranks share their samples in one collective, rank zero fits a linear
    compute-time model per device and solves OptPerf (the split of the total batch that minimises the step time), and
    all ranks adopt the same :class:`~lightning_cannikin.Plan`. With ``max_batch_size`` set, rank zero also tracks the
    gradient noise scale and, at epoch ends, moves to the total batch with the best predicted goodput
    (throughput x statistical efficiency), scaling the learning rate to match.

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
            ends only). The total batch changes only at epoch ends.
        warmup_steps: while some device's speed is not yet measured at two batch sizes (at the start, after a
            restart on other devices, after a speed change), re-plan every this many steps: the first re-plan probes
            a second batch size on every rank, the next one balances. Not used with ``balance=False``.
        half_life: recency half-life of the timing fits, in steps.
        adapt_margin: relative goodput gain required to change the total batch (hysteresis).
        min_noise_updates: optimizer steps of noise statistics required before the total batch may change.
        track_noise_scale: measure the gradient noise scale (one extra all-reduce of ``world_size`` floats per
            optimizer step). ``None``: only when it can change something, i.e. with ``max_batch_size`` or with
            ``lr_scaling="adascale"`` and a ``base_batch_size``.
        save_profile: at each re-plan, rank zero writes ``cannikin_profile.json`` (fitted models, raw timing
            samples, plan history) into the trainer's log dir, for ``cannikin plan`` and ``cannikin report``.
            Nothing is written when the trainer has no log dir (``logger=False``).

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
        warmup_steps: int = 8,
        half_life: float = 50.0,
        adapt_margin: float = 0.05,
        min_noise_updates: int = 20,
        track_noise_scale: bool | None = None,
        save_profile: bool = True,
    ) -> None:
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"`max_batch_size` must be a positive integer or None, got {max_batch_size}.")
        if base_batch_size is not None and base_batch_size < 1:
            raise ValueError(f"`base_batch_size` must be a positive integer or None, got {base_batch_size}.")
        if replan_every_n_steps is not None and replan_every_n_steps < 1:
            raise ValueError(f"`replan_every_n_steps` must be a positive integer or None, got {replan_every_n_steps}.")
        if warmup_steps < 1:
            raise ValueError(f"`warmup_steps` must be >= 1, got {warmup_steps}.")
        if half_life <= 0:
            raise ValueError(f"`half_life` must be positive, got {half_life}.")
        if adapt_margin < 0:
            raise ValueError(f"`adapt_margin` must be >= 0, got {adapt_margin}.")
        self.max_batch_size = max_batch_size
        self.local_batch_bounds = local_batch_bounds
        self.lr_scaling = validate_rule(lr_scaling)
        self.base_batch_size = base_batch_size
        self.balance = balance
        self.replan_every_n_steps = replan_every_n_steps
        self.warmup_steps = warmup_steps
        self.half_life = half_life
        self.adapt_margin = adapt_margin
        self.min_noise_updates = min_noise_updates
        if track_noise_scale is None:
            track_noise_scale = max_batch_size is not None or (lr_scaling == "adascale" and base_batch_size is not None)
        self.track_noise_scale = track_noise_scale
        self.save_profile = save_profile
        self.history: list[dict[str, Any]] = []
        self.progress = Progress()
        self.lr_factor = 1.0
        self.gain = 1.0
        self._lower, self._upper = _split_bounds(local_batch_bounds)
        self._balancer: SplitBalancer | None = None
        self._estimator: NoiseScaleEstimator | None = None
        self._observer: GradientNormObserver | None = None
        self._strategy: CannikinStrategy | None = None
        self._restored: dict[str, Any] | None = None
        self._records: list[StepRecord] = []
        self._since_replan: list[StepRecord] = []
        self._step = 0
        self._steps_at_replan = 0
        self._batch_start = 0.0
        self._forward_start: float | None = None
        self._backward_end: float | None = None
        self._in_train_batch = False
        self._hook_handle: Any = None
        self._log_dir: str | None = None
        self._identified = False  # rank zero's word, broadcast: every rank's slope has been measured

    @property
    def plan(self) -> Plan | None:
        """The split in force."""
        return self._strategy.plan if self._strategy is not None else None

    @property
    def noise_scale(self) -> float | None:
        """The gradient noise scale ``tr(Sigma) / |G|^2`` in samples (rank zero; ``None`` until measured)."""
        return self._estimator.noise_scale if self._estimator is not None else None

    @property
    def balancer(self) -> SplitBalancer | None:
        """The timing models (``None`` before fitting starts)."""
        return self._balancer

    @property
    def state_key(self) -> str:
        return "Cannikin"

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(trainer.strategy, CannikinStrategy):
            raise ValueError(
                f"The Cannikin callback needs `strategy='cannikin'` (a CannikinStrategy), got"
                f" {type(trainer.strategy).__name__}."
            )
        self._strategy = trainer.strategy
        if self._balancer is None:
            self._balancer = SplitBalancer(trainer.world_size, self.half_life, lower=self._lower, upper=self._upper)
        self._strategy.batch_bounds = (self._balancer.lower, self._balancer.upper)
        if self._observer is None and trainer.world_size > 1 and self.track_noise_scale:
            self._observer = GradientNormObserver(trainer.global_rank, trainer.world_size)
            self._strategy.hook_state.observers.append(self._observer)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # start the compute clock when the module's forward begins: after DDP's own pre-forward work (buffer
        # broadcast), which can wait on other ranks and is not this device's compute
        self._hook_handle = pl_module.register_forward_pre_hook(self._on_forward_start)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plan = self._strategy.plan if self._strategy is not None else None
        base = self.base_batch_size or (plan.total_batch_size if plan is not None else 1)
        if self._estimator is None:
            self._estimator = NoiseScaleEstimator(base)
        self._adam = bool(trainer.optimizers) and is_adam_family(type(trainer.optimizers[0]).__name__)
        if self._observer is not None and self._adam:
            self._observer.optimizer = trainer.optimizers[0]
        # `trainer.log_dir` broadcasts from rank zero: ask on every rank here, never from rank zero alone later
        self._log_dir = trainer.log_dir if self.save_profile and trainer.loggers else None
        if self._restored is not None:
            # the checkpoint holds rank zero's factor and gain; every rank loads the same ones
            self._load(self._restored)
            self._restored = None
            if self._strategy is not None:
                self._strategy.lr_factor = self.lr_factor
        elif plan is not None:
            self._set_lr_factor(plan.total_batch_size)  # no statistics yet: the same on every rank

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._hook_handle is not None:
            self._hook_handle.remove()
            self._hook_handle = None

    def _on_forward_start(self, module: torch.nn.Module, args: Any) -> None:
        if self._in_train_batch and self._forward_start is None:
            self._forward_start = time.perf_counter()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self._strategy is not None
        self._strategy.hook_state.reset_step()
        self._forward_start = self._backward_end = None
        self._in_train_batch = True
        self._batch_start = time.perf_counter()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._backward_end = time.perf_counter()
        assert self._strategy is not None
        if self._observer is not None and self._strategy.hook_state.last_entry is None:
            # an accumulation micro-step (no reduction): its gradient is a noise group of its own
            self._observer.after_micro_step(pl_module.parameters(), self._strategy.hook_state.micro_weight)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        assert self._strategy is not None
        self._in_train_batch = False
        sizes = self._strategy.step_sizes
        hook = self._strategy.hook_state
        stepped = hook.last_entry is not None  # gradients were reduced: an optimizer step, not an accumulation one
        # gradients are ready when the last bucket reaches the comm hook; without a reduction (accumulation
        # micro-step) backward's end is the end of compute
        compute_end = hook.last_entry if stepped else self._backward_end
        if sizes is not None and compute_end is not None:
            start = self._forward_start if self._forward_start is not None else self._batch_start
            rank = trainer.global_rank
            allreduce = exposed = None
            if stepped and hook.first_entry is not None and hook.last_done is not None:
                allreduce, exposed = hook.last_done - hook.first_entry, hook.last_done - hook.last_entry
            peak, capacity = self._memory_peak(pl_module.device)
            record = StepRecord(
                self._step,
                rank,
                sizes[rank],
                compute_end - start,
                now - self._batch_start,
                allreduce,
                exposed,
                peak,
                capacity,
            )
            self._records.append(record)
            if (self._step + 1) % trainer.log_every_n_steps == 0:
                # only on steps whose metrics reach the loggers: each log call costs time on the hot path
                self._log_step(pl_module, record)
        if stepped:
            self._after_optimizer_step(trainer, pl_module)
        self._step += 1
        if self._strategy.fixed_split:
            return
        # until every rank's slope is measured, re-plan every `warmup_steps`: probe first, then balance (an even split
        # probes nothing, so it would re-plan every few steps forever for no change)
        due_warmup = self.balance and not self._identified and self._step % self.warmup_steps == 0
        due_periodic = (
            self.replan_every_n_steps is not None and self._step - self._steps_at_replan >= self.replan_every_n_steps
        )
        if due_warmup or due_periodic:
            self._replan(trainer, mid_epoch=True)

    @staticmethod
    def _memory_peak(device: torch.device) -> tuple[float | None, float | None]:
        """This step's peak allocated bytes and the device's capacity, on CUDA; the peak counter restarts."""
        if device.type != "cuda":
            return None, None
        peak = float(torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
        return peak, float(torch.cuda.get_device_properties(device).total_memory)

    def _after_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Progress, and on rank zero the noise-scale statistics of the step's gradients."""
        assert self._strategy is not None and self._estimator is not None
        plan = self._strategy.plan
        total = plan.total_batch_size if plan is not None else self._estimator.base_batch_size
        # the gain comes from rank zero's last decision, so progress (and schedules driven by it) agree on all ranks
        self.progress.add(self.gain)
        statistics = self._observer.collect() if self._observer is not None else None
        window = self._strategy.window
        if trainer.is_global_zero and statistics is not None and window:
            local, global_sqr = statistics
            # groups are rank-major, as the observer exchanged them: rank 0's micro-batches first
            sizes = [micro[rank] for rank in range(trainer.world_size) for micro in window]
            self._estimator.update(local, sizes, global_sqr)
            phi = self._estimator.noise_scale
            if phi is not None and np.isfinite(phi) and (self._step + 1) % trainer.log_every_n_steps == 0:
                base = self._estimator.base_batch_size
                pl_module.log("cannikin/noise_scale", phi, on_step=True, on_epoch=False, rank_zero_only=True)
                pl_module.log(
                    "cannikin/efficiency",
                    float(efficiency(phi, total, base)),
                    on_step=True,
                    on_epoch=False,
                    rank_zero_only=True,
                )

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._strategy is not None
        if not self._strategy.fixed_split:
            self._replan(trainer, mid_epoch=False)

    def _log_step(self, pl_module: pl.LightningModule, record: StepRecord) -> None:
        assert self._strategy is not None
        plan = self._strategy.plan
        values = {
            "cannikin/step_time": record.step_time,
            "cannikin/local_batch_size": float(record.batch_size),
            "cannikin/lr_factor": self.lr_factor,
        }
        if plan is not None:
            values["cannikin/total_batch_size"] = float(plan.total_batch_size)
            if plan.predicted_step_time is not None:
                values["cannikin/predicted_step_time"] = plan.predicted_step_time
        for name, value in values.items():
            prog_bar = name in ("cannikin/total_batch_size", "cannikin/local_batch_size")
            # per step, no sync: a synced per-step log would add a collective and distort the timing it reports
            pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=prog_bar, batch_size=record.batch_size)

    def _current_noise_scale(self) -> float | None:
        """The noise scale once enough statistics exist to act on (rank zero only)."""
        if self._estimator is None or self._estimator.num_updates < self.min_noise_updates:
            return None
        return self._estimator.noise_scale

    def _set_lr_factor(self, total_batch_size: int) -> None:
        assert self._strategy is not None and self._estimator is not None
        base, phi = self._estimator.base_batch_size, self._current_noise_scale()
        self.lr_factor = lr_factor(self.lr_scaling, total_batch_size, base, phi, self._adam)
        self.gain = float(adascale_gain(phi, total_batch_size, base))
        self._strategy.lr_factor = self.lr_factor

    def _replan(self, trainer: pl.Trainer, mid_epoch: bool) -> None:
        """Share timings, fit, decide on rank zero, adopt everywhere. Every rank must call this at the same step."""
        strategy = self._strategy
        assert strategy is not None and self._balancer is not None
        loader = strategy.train_loader
        yielded = loader.uneven_sampler.yielded if loader is not None else 0
        gathered = _all_gather((self._records, yielded))
        from_batch = max(y for _, y in gathered) if mid_epoch else 0
        self._records = []
        self._steps_at_replan = self._step
        current = strategy.plan
        decision: tuple[Plan, float, float, bool] | None = None
        if trainer.is_global_zero:
            records = [r for rank_records, _ in gathered for r in rank_records]
            self._balancer.add(records)
            if self._balancer.drifts:
                rank_zero_info(f"Cannikin: ranks {self._balancer.drifts} changed speed; their timing starts afresh.")
            self._since_replan.extend(records)
            if self.history and self.history[-1]["measured_step_time"] is None:
                self.history[-1]["measured_step_time"] = median_step_time(
                    self._since_replan, self.history[-1]["local_batch_sizes"]
                )
            if current is not None and self._balancer.ready:
                # the total batch changes only at epoch ends: mid-epoch, the epoch's length must not change
                plan = next_plan(
                    self._balancer,
                    current,
                    noise_scale=self._current_noise_scale(),
                    base_batch_size=self._estimator.base_batch_size if self._estimator is not None else None,
                    max_batch_size=None if mid_epoch else self.max_batch_size,
                    balance=self.balance,
                    margin=self.adapt_margin,
                )
                # the factor is decided once, here, and broadcast, so every rank steps with the identical LR
                self._set_lr_factor(plan.total_batch_size)
                decision = (plan, self.lr_factor, self.gain, self._balancer.identified)
        # rank zero models and decides; every rank adopts what it broadcasts
        decision = strategy.broadcast(decision, src=0)
        if decision is None:
            return
        plan, factor, self.gain, self._identified = decision
        self.lr_factor = strategy.lr_factor = factor
        self._since_replan = []
        if plan.global_batch_size != current.global_batch_size:
            # the epoch's length changes with the total batch: Lightning must rebuild the loader to see it
            trainer.reload_dataloaders_every_n_epochs = max(trainer.reload_dataloaders_every_n_epochs, 1)
            strategy.set_plan(plan)
        else:
            strategy.set_plan(plan, from_batch=from_batch)
        self.history.append(_history_entry(self._step, trainer.current_epoch, plan, factor, self.noise_scale))
        if trainer.is_global_zero and self.save_profile and self._log_dir:
            base = self._estimator.base_batch_size if self._estimator is not None else None
            profile = build_profile(self._balancer, self.history, base_batch_size=base)
            save_profile(Path(self._log_dir) / PROFILE_FILENAME, profile)
        if trainer.is_global_zero and plan.local_batch_sizes != current.local_batch_sizes:
            rank_zero_info(
                f"Cannikin: local batch sizes {list(current.local_batch_sizes)} -> {list(plan.local_batch_sizes)}"
                f" (predicted step {1000 * (plan.predicted_step_time or 0):.1f} ms, lr factor {factor:.3g})"
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "balancer": self._balancer.state_dict() if self._balancer is not None else None,
            "estimator": self._estimator.state_dict() if self._estimator is not None else None,
            "progress": self.progress.state_dict(),
            "lr_factor": self.lr_factor,
            "gain": self.gain,
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "history": self.history,
            "step": self._step,
            "identified": self._identified,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks after `setup` and before it builds the training loader: put the saved plan in
        # force now so the loader is built with it. The rest waits for on_train_start (the estimator needs B0).
        self._restored = dict(state_dict)
        saved = state_dict.get("plan")
        if saved is None or self._strategy is None or self._strategy.fixed_split:
            return
        plan = Plan.from_dict(saved)
        if plan.world_size != self._strategy.world_size:
            # elastic restart: keep the total batch where the new cluster can hold it, split evenly until timed
            global_batch = max(plan.global_batch_size, self._strategy.world_size)
            plan = Plan(even_split(global_batch, self._strategy.world_size), plan.accumulation_steps)
            rank_zero_info(
                f"Cannikin: resuming a {len(saved['local_batch_sizes'])}-rank run on {self._strategy.world_size} ranks;"
                f" keeping the global batch of {global_batch}, split evenly until the new devices are timed."
            )
        self._strategy.set_plan(plan)

    def _load(self, state: dict[str, Any]) -> None:
        if state.get("balancer") is not None and self._balancer is not None:
            self._balancer.load_state_dict(state["balancer"])
        if state.get("estimator") is not None and self._estimator is not None:
            self._estimator.load_state_dict(state["estimator"])
        self.progress.load_state_dict(state["progress"])
        self.lr_factor = state["lr_factor"]
        self.gain = state["gain"]
        self.history = list(state["history"])
        self._step = self._steps_at_replan = state["step"]
        same_devices = (
            state.get("balancer") is not None and state["balancer"]["world_size"] == self._strategy.world_size
        )
        self._identified = bool(state.get("identified", False)) and same_devices


def _history_entry(step: int, epoch: int, plan: Plan, lr_factor: float, noise_scale: float | None) -> dict[str, Any]:
    return {
        "step": step,
        "epoch": epoch,
        "local_batch_sizes": list(plan.local_batch_sizes),
        "total_batch_size": plan.total_batch_size,
        "predicted_step_time": plan.predicted_step_time,
        "measured_step_time": None,
        "lr_factor": lr_factor,
        "noise_scale": noise_scale,
    }


def _split_bounds(bounds: Any) -> tuple[Any, Any]:
    if bounds is None:
        return None, None
    if isinstance(bounds, int):
        return None, bounds
    if isinstance(bounds, tuple) and len(bounds) == 2:
        return bounds
    raise ValueError(
        f"`local_batch_bounds` must be an upper bound, a (lower, upper) tuple of scalars or per-rank sequences, or"
        f" None; got {bounds!r}."
    )


def _all_gather(obj: Any) -> list[Any]:
    """One object per rank (a single-process run returns ``[obj]``)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
