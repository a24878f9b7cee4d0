"""``BalancingEngine``: the one balancing protocol, the same behind every frontend (Lightning, Fabric, ...).

It owns the speed model, the noise estimator and its observer, the plan history, the schedule's state, the progress,
and a re-plan's protocol (:meth:`BalancingEngine.replan`): gather every rank's step records, rank zero fits them and
decides (:meth:`BalancingEngine.decide`, through :func:`~lightning_cannikin.core.policy.decide`), broadcast the
decision, adopt it everywhere (at a step every rank chose alike: :meth:`BalancingEngine.replan_due` mid-epoch,
:meth:`BalancingEngine.epoch_end_due`). A frontend is hook wiring: where steps start and end, a :class:`Collective`,
and what adopting a plan means on its framework's side. The maths lives in :mod:`lightning_cannikin.core`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info  # Lightning's and Fabric's (no Trainer, no Fabric)

from lightning_cannikin.core.change import LocalChangeCheck
from lightning_cannikin.core.history import NoiseTrail, PlanHistory
from lightning_cannikin.core.lr_scaling import Progress, check_family
from lightning_cannikin.core.noise_scale import NoiseScaleEstimator
from lightning_cannikin.core.plan import BatchBounds, Plan
from lightning_cannikin.core.policy import Decision, PolicySettings, decide, gain_noise_scale, learning_rate_scale
from lightning_cannikin.core.profile import PROFILE_FILENAME, build_profile, save_profile
from lightning_cannikin.core.schedule import ReplanSchedule
from lightning_cannikin.core.speed_model import SpeedModel, SpeedModelSettings, StepRecord
from lightning_cannikin.training.change_vote import ChangeVote
from lightning_cannikin.training.collective import Collective
from lightning_cannikin.training.cost_aware_sampler import with_time_models
from lightning_cannikin.training.engine_state import engine_state, restore_engine
from lightning_cannikin.training.explain import explain
from lightning_cannikin.training.grad_stats import GradientNormObserver
from lightning_cannikin.training.optimizers import optimizer_family_of, unwrapped
from lightning_cannikin.training.runtime import RuntimeState
from lightning_cannikin.training.settings import CannikinSettings

__all__ = ["BalancingEngine"]

AdoptHook = Callable[[Plan, "Plan | None", bool], None]


class BalancingEngine:
    """Balance a heterogeneous cluster and, optionally, adapt the total batch size for goodput.

    The arguments are :class:`~lightning_cannikin.Cannikin`'s (``save_profile`` writes where the frontend sets
    :attr:`profile_dir`); ``settings`` are the tuning settings.
    """

    def __init__(
        self,
        max_batch_size: int | None = None,
        local_batch_bounds: Any = None,
        lr_scaling: str = "adascale",
        base_batch_size: int | None = None,
        balance: bool = True,
        replan_every_n_steps: int | None = None,
        save_profile: bool = True,
        settings: CannikinSettings | None = None,
    ) -> None:
        if base_batch_size is not None and base_batch_size < 1:
            raise ValueError(f"`base_batch_size` must be a positive integer or None, got {base_batch_size}.")
        BatchBounds.check(local_batch_bounds)
        settings = settings or CannikinSettings()
        self.settings = settings
        margin, checks = settings.adapt_margin, settings.check_every_n_steps
        self.policy = PolicySettings(max_batch_size, balance, margin, lr_scaling, accumulate=settings.accumulate)
        every = (settings.warmup_steps, replan_every_n_steps, settings.adapt_every_n_steps)
        self.schedule = ReplanSchedule(*every, check_every_n_steps=checks)
        self.local_batch_bounds = local_batch_bounds
        self.base_batch_size = base_batch_size
        track = settings.track_noise_scale
        if track is None:
            track = max_batch_size is not None or (self.policy.lr_scaling == "adascale" and base_batch_size is not None)
        self.track_noise_scale = track
        self.save_profile = save_profile
        self.profile_dir: str | None = None  # where rank zero writes the profile (set by the frontend)
        self.progress = Progress()
        self.history = PlanHistory()
        self.speed_model: SpeedModel | None = None
        self.estimator: NoiseScaleEstimator | None = None
        self.observer: GradientNormObserver | None = None
        self.runtime: RuntimeState | None = None
        self.collective: Collective | None = None
        self.vote: ChangeVote | None = None  # this rank's speed-change check and the ranks' vote on it
        self._changed = False  # the vote of this step: some rank's speed changed clearly
        self.step = 0  # optimizer steps and micro-steps run this fit (as the schedule counts them)
        self.identified = False  # rank zero's word, broadcast: every rank's slope has been measured
        self.adam = False
        self._optimizer: Any = None
        self._inner: Any = None  # the optimizer that holds the state, once read
        self._family: str | None = None
        self._on_adopt: AdoptHook | None = None
        self._restored: dict[str, Any] | None = None
        self.noise_trail = NoiseTrail()  # the estimate and its bounds over the fit, for the run profile

    def attach(self, runtime: RuntimeState, collective: Collective, on_adopt: AdoptHook | None = None) -> None:
        """Drive ``runtime`` over ``collective`` (at setup, before the training loader is built)."""
        world_size = collective.world_size
        if self.speed_model is None:
            bounds = BatchBounds.parse(self.local_batch_bounds, world_size)
            self.speed_model = SpeedModel(world_size, SpeedModelSettings(half_life=self.settings.half_life), bounds)
        if self.observer is None and world_size > 1 and self.track_noise_scale:
            every = (self.settings.noise_exchange_every, self.settings.noise_every_n_steps)
            self.observer = runtime.noise_observer_type(collective.rank, world_size, None, *every)
            self.observer.cadence = self.noise_every
        runtime.attach(self.speed_model.bounds, self.observer, self.scale)
        self.vote = None
        if world_size > 1 and self.policy.balance and self.schedule.check_every_n_steps is not None:
            check = LocalChangeCheck(self.speed_model.settings.drift_tolerance)
            self.vote = ChangeVote(check, collective, not collective.host_runs_ahead, cast_before_backward=True)
            runtime.timer.listeners[:] = [self.vote.check.observe]  # its own times, as the timer reads them
        self.runtime, self.collective, self._on_adopt = runtime, collective, on_adopt

    def start(self, optimizer: Any = None, scaler: Any = None, accumulation_allowed: bool = True) -> None:
        """Training starts: the estimator (it needs B0), the (first) ``optimizer``'s family, a checkpoint's state;
        ``scaler``: the ``GradScaler`` of ``16-mixed`` (its scale is divided out of the statistics);
        ``accumulation_allowed``: the engine may change the accumulation (the frontend accumulates for it)."""
        plan = self.plan
        if plan is not None:
            self.policy.check_initial(plan)  # every rank sees the same plan: all raise, before any collective
        if self.policy.accumulate and not accumulation_allowed:
            self.policy = replace(self.policy, accumulate=False)
        base = self.base_batch_size or (plan.total_batch_size if plan is not None else 1)
        if self.estimator is None:
            self.estimator = NoiseScaleEstimator(base)
        self._optimizer, self._family, self._inner = optimizer, None, None
        self._identify_optimizer()
        if self.observer is not None:
            self.observer.scaler = scaler
        if self._restored is not None:
            restore_engine(self, self._restored)
            self._restored = None

    def _identify_optimizer(self) -> None:
        """Adam-family once the optimizer holds a second moment (at once on a resume, else after its first step); one
        that preconditions otherwise is refused where AdaScale follows a measured noise scale (every rank alike)."""
        if self._optimizer is None or self._family is not None:
            return
        if self._inner is not None and not getattr(self._inner, "state", None):
            return  # it still holds nothing (plain SGD never does): as read last time, at no cost each step
        inner = self._inner = unwrapped(self._optimizer)
        self._family = optimizer_family_of(inner)
        if self.track_noise_scale:
            check_family(self._family, self.policy.lr_scaling, type(inner).__name__)
        self.adam = self._family == "adam"
        if self.observer is not None:  # the noise of the direction Adam steps in (AdaptDL's rule)
            self.observer.optimizer = inner if self.adam else None

    @property
    def plan(self) -> Plan | None:
        """The newest plan (steps already prefetched may still run the one before it)."""
        return self.runtime.plan if self.runtime is not None else None

    @property
    def noise_scale(self) -> float | None:
        """The gradient noise scale in samples (equal on every rank; ``None`` until measured)."""
        return self.estimator.noise_scale if self.estimator is not None else None

    def noise_bounds(self) -> tuple[float, float] | None:
        """The noise scales the statistics cannot yet tell apart, ``(low, high)``
        (:meth:`~lightning_cannikin.core.noise_scale.NoiseScaleEstimator.bounds`, ``noise_bound_sigmas`` wide);
        ``None`` before ``min_noise_updates`` measured steps or before the statistics have a spread. The same on every
        rank: every estimator receives the same numbers."""
        estimator = self.estimator
        if estimator is None or estimator.num_updates < self.settings.min_noise_updates:
            return None
        return estimator.bounds(self.settings.noise_bound_sigmas)

    def noise_every(self) -> int:
        """Optimizer steps per noise measurement now: every step while the bounds may still prove a move of the total,
        one in ``noise_every_n_steps`` once they lie inside the band of the total in force and only a drift of the
        noise scale could move it, or where the total is fixed (alike on every rank: the same bounds and band)."""
        if self.policy.max_batch_size is None or self.schedule.settled(self.noise_bounds()):
            return self.settings.noise_every_n_steps
        return 1

    def scale(self, total_batch_size: int) -> tuple[float, float]:
        """``(lr factor, AdaScale gain)`` of a step at ``total_batch_size`` with what is known now (the same on every
        rank): the gain the noise scale's lower bound supports, and while a grown total is kept at least that of its
        band's lower edge (:func:`~lightning_cannikin.core.policy.gain_noise_scale`): the total and its gain come from
        the same evidence."""
        if self.estimator is None:
            return 1.0, 1.0
        base = self.estimator.base_batch_size
        phi = gain_noise_scale(self.noise_bounds(), total_batch_size, base, self.schedule.band_of(total_batch_size))
        return learning_rate_scale(self.policy.lr_scaling, total_batch_size, base, phi, self.adam)

    @property
    def adapt_ready(self) -> bool:
        """The noise scale has bounds, and the speeds are measured (or the split is even)."""
        return self.noise_bounds() is not None and (self.identified or not self.policy.balance)

    def step_started(self) -> None:
        """A training step (or accumulation micro-step) starts on this rank."""
        assert self.runtime is not None
        self.runtime.timer.start()

    def backward_started(self) -> None:
        """A backward starts: the answer the last change check decided goes out now (:meth:`ChangeVote.cast`)."""
        if self.vote is not None:
            self.vote.cast()

    def backward_done(self, parameters: Any) -> None:
        """Its backward ended; an accumulation micro-step's gradient is a noise group of its own."""
        runtime = self.runtime
        assert runtime is not None
        runtime.timer.backward_done()
        if self.observer is not None and not runtime.timer.reduced:
            self.observer.after_micro_step(parameters, runtime.hook.local_scale)

    def before_optimizer_step(self) -> None:
        """A step counts at the gain it is taken with, before a scheduler that may read the progress after it."""
        assert self.runtime is not None
        self.progress.add(self.runtime.gain)

    def step_finished(self) -> bool:
        """The step ended: time it, fold in the noise statistics that arrived; whether the noise scale changed."""
        runtime = self.runtime
        assert runtime is not None and self.collective is not None
        rank, sizes = self.collective.rank, runtime.step_sizes
        runtime.timer.finish(self.step, rank, None if sizes is None else runtime.timed_size(rank, self.step))
        updated = False
        if runtime.timer.reduced:
            self._identify_optimizer()
            if self.observer is not None and self.estimator is not None:
                # every rank folds the same exchanged numbers: the factor is identical everywhere, no collective
                updated = self.observer.fold_into(self.estimator, runtime.accumulation_window)
                if updated:
                    self.noise_trail.add(self.step, self.estimator.noise_scale, self.noise_bounds())
        self.step += 1
        return updated

    def replan_due(self, resizable: bool = True, epoch_ends: bool = False) -> tuple[bool, bool]:
        """``(re-plan now, reconsider the total too)`` after the step; ``resizable``: the epoch may change length;
        ``epoch_ends``: it was the epoch's last batch, whose end decides (:meth:`epoch_end_due`; the vote kept)."""
        runtime = self.runtime
        assert runtime is not None
        if not runtime.timer.reduced or runtime.fixed_split:
            return False, False  # no re-plan mid-window: a window's micro-batches share one layout
        vote = self.vote
        plan = runtime.plan if vote is not None else None  # its predicted step spaces the checks (alike everywhere)
        seconds = plan.predicted_step_time if plan is not None else None
        self._changed = vote is not None and vote.poll(self.schedule.check_due(self.step, seconds))
        if epoch_ends:
            return False, False
        # the total moves where the noise bounds prove it out of the band rank zero broadcast: alike on every rank
        ready = self.policy.max_batch_size is not None and resizable and (self.identified or not self.policy.balance)
        adapt = ready and self.schedule.total_due(self.noise_bounds(), self.step)
        return adapt or self.schedule.due(self.step, self.identified, self.policy.balance, self._changed), adapt

    def epoch_end_due(self) -> bool:
        """Whether the epoch's end re-plans (:meth:`ReplanSchedule.epoch_end_due`; every rank alike)."""
        noise = self.noise_bounds() if self.policy.max_batch_size is not None else None  # None: no total due
        return self.schedule.epoch_end_due(self.step, self.identified or not self.policy.balance, self._changed, noise)

    def decide(
        self, records: list[StepRecord], current: Plan | None, mid_epoch: bool, adapt_total: bool | None = None
    ) -> Decision | None:
        """Rank zero: fold in every rank's records and decide (``None`` while some rank has no timing yet)."""
        assert self.speed_model is not None and self.estimator is not None
        self.speed_model.add(records)
        if self.speed_model.drifts:
            rank_zero_info(
                f"Cannikin: ranks {self.speed_model.drifts} changed speed; their models follow the measured change."
            )
        self.history.observe(records)
        if current is None or not self.speed_model.ready:
            return None
        # the accumulation changes at epoch ends only (as Lightning's GradientAccumulationScheduler does it): a
        # mid-epoch window must not straddle two values
        policy = replace(self.policy, accumulate=False) if mid_epoch else self.policy
        adapt_total = not mid_epoch if adapt_total is None else adapt_total
        noise, base = self.noise_bounds(), self.estimator.base_batch_size
        decision = decide(self.speed_model, current, policy, noise, base, adapt_total=adapt_total, adam=self.adam)
        return replace(decision, changing=self.speed_model.changing, unconfirmed=self.speed_model.watch.unconfirmed)

    def replan(self, mid_epoch: bool, adapt_total: bool, epoch: int = 0) -> Decision | None:
        """Gather, decide on rank zero, broadcast, adopt; every rank calls it after the same step. ``mid_epoch``: the
        plan applies from the next global batch no rank has drawn yet (else from the next epoch); ``adapt_total``: the
        total batch may change now; ``epoch``: for the history. Returns the decision adopted (``None`` while some rank
        has no timing yet)."""
        runtime, collective = self.runtime, self.collective
        assert runtime is not None and collective is not None
        # the step records are read now: on CUDA the last ones wait for the device (the gather synchronises anyway)
        mine = runtime.timer.records(wait=True)  # with a cost-aware sampler, this rank's time over its exact cost too
        mine_all = (mine, runtime.batches_yielded, runtime.losses.take(), runtime.cost_fit.add(mine))
        gathered = collective.all_gather(mine_all)
        from_batch = max(entry[1] for entry in gathered) if mid_epoch else 0
        current = runtime.plan
        decision = None
        if collective.rank == 0:
            runtime.losses.judge([entry[2] for entry in gathered])  # the loss against its declared normalisation
            records = [record for rank_records, *_ in gathered for record in rank_records]
            decision = with_time_models(self.decide(records, current, mid_epoch, adapt_total), [e[3] for e in gathered])
        decision = collective.broadcast(decision, src=0)
        if decision is None or current is None:
            self.schedule.replanned(self.step, total_changed=False, balance=self.policy.balance)
            return None
        plan = decision.plan
        if adapt_total:
            self.schedule.adapted_at(self.step, self.adapt_ready, decision.noise_band, plan.total_batch_size)
        total_changed = plan.total_batch_size != current.total_batch_size
        # a new total, a walk to a device's knee, a split moved by a rescale that may be a passing stall, or a change of
        # speed the model followed: re-split once timed (a check fired by what the model does not see settles nothing)
        changed = self._changed and decision.changing
        kept = plan.local_batch_sizes == current.local_batch_sizes and not total_changed
        timing = total_changed or decision.untimed
        unconfirmed, at_optimum = decision.unconfirmed, decision.at_optimum
        self.schedule.replanned(self.step, timing, self.policy.balance, changed, kept, unconfirmed, at_optimum)
        if self._changed and self.vote is not None:
            self.vote.reset()
        self._changed = False
        self.identified = decision.identified
        probe_steps = 0 if decision.identified else self.schedule.warmup_steps
        self._adopt(plan, current, mid_epoch, from_batch, probe_steps)
        self._record(plan, current, decision, epoch, collective.rank == 0)
        return decision

    def _adopt(self, plan: Plan, current: Plan, mid_epoch: bool, from_batch: int, probe_steps: int) -> None:
        """Put the plan in force; a probe mid-epoch alternates with the split it leaves for ``probe_steps`` batches."""
        runtime = self.runtime
        assert runtime is not None
        if not mid_epoch:
            total_changed = plan.total_batch_size != current.total_batch_size
            runtime.adopt(plan, None if total_changed else 0)  # a new total waits for the rebuilt loader
        else:
            interleave = (current, probe_steps) if probe_steps > 0 else None
            runtime.adopt(plan, from_batch=from_batch, interleave=interleave)
        if self._on_adopt is not None:
            self._on_adopt(plan, current, mid_epoch)

    def _record(self, plan: Plan, current: Plan, decision: Decision, epoch: int, rank_zero: bool) -> None:
        """The history entry, rank zero's profile and message."""
        changed = self.speed_model.drifts if rank_zero and self.speed_model is not None else []
        self.history.append(self.step, epoch, plan, decision.lr_factor, self.noise_scale, changed)
        if not rank_zero:
            return
        if self.save_profile and self.profile_dir and self.speed_model is not None:
            base = self.estimator.base_batch_size if self.estimator is not None else None
            trail = self.noise_trail.points or None  # None: from the history (no statistics measured)
            profile = build_profile(self.speed_model, self.history.entries, base, trail)
            save_profile(Path(self.profile_dir) / PROFILE_FILENAME, profile)
        rank_zero_info(explain(self.step, decision, current, self.policy))  # what was decided, and why

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs (the keys of the checkpoints the callback wrote before the engine existed)."""
        return engine_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> Plan | None:
        """Put the saved plan in force now (the loader is built with it); the rest waits for :meth:`start` (the
        estimator needs B0). Returns the plan put in force, if any."""
        self._restored = dict(state)
        saved = state.get("plan")
        runtime = self.runtime
        if saved is None or runtime is None or runtime.fixed_split or self.collective is None:
            return None
        world_size = self.collective.world_size
        plan = Plan.from_dict(saved).resized(world_size)
        if len(saved["local_batch_sizes"]) != world_size:
            rank_zero_info(
                f"Cannikin: resuming a {len(saved['local_batch_sizes'])}-rank run on {world_size} ranks;"
                f" keeping the global batch of {plan.global_batch_size}, split evenly until the new devices are timed."
            )
        runtime.adopt(plan)
        return plan
