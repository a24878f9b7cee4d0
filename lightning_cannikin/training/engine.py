"""``BalancingEngine``: the one object that owns a balancing run's training steps, behind every frontend.

A frontend (Lightning's DDP and FSDP2 strategies with their callback, Fabric's strategy) says where a step's pieces
happen through the step API (:meth:`~BalancingEngine.bind`, :meth:`~BalancingEngine.begin_step`,
:meth:`~BalancingEngine.weigh`, :meth:`~BalancingEngine.backward`, :meth:`~BalancingEngine.optimizer_step`,
:meth:`~BalancingEngine.end_step`, :meth:`~BalancingEngine.end_epoch` and the reductions' seams; the table is in
``docs/architecture.md``). The step timer, the all-reduce's state, the noise observer, the loader's sampler and the
speed-change vote are its private parts (``tests/test_layering.py`` checks that no frontend reaches them). It owns
what a run learns and the one re-plan protocol (:meth:`BalancingEngine.replan`: gather, rank zero decides with
:func:`~lightning_cannikin.core.policy.decide`, broadcast, set the plan); when one is due is
:class:`~lightning_cannikin.core.schedule.ReplanSchedule`'s call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn  # Lightning's and Fabric's

from lightning_cannikin.core.change import LocalChangeCheck
from lightning_cannikin.core.change_vote import ChangeVote
from lightning_cannikin.core.history import NoiseTrail, PlanHistory
from lightning_cannikin.core.interval_choice import TotalOptions
from lightning_cannikin.core.lr_scaling import Progress, check_family
from lightning_cannikin.core.noise_scale import NoiseScaleEstimator
from lightning_cannikin.core.plan import BatchBounds, Plan
from lightning_cannikin.core.policy import Decision, PolicySettings, decide, gain_noise_scale, learning_rate_scale
from lightning_cannikin.core.profile import PROFILE_FILENAME, build_profile, save_profile
from lightning_cannikin.core.schedule import ReplanSchedule
from lightning_cannikin.core.speed_model import SpeedModel, SpeedModelSettings, StepRecord
from lightning_cannikin.training.collective import Collective
from lightning_cannikin.training.comm_hook import WeightedAllReduceState, weighted_allreduce_hook
from lightning_cannikin.training.cost_aware_sampler import CostTimeFit, with_time_models
from lightning_cannikin.training.explain import explain
from lightning_cannikin.training.grad_stats import GradientNormObserver
from lightning_cannikin.training.loss_weights import LossScaleCheck, WindowWeights
from lightning_cannikin.training.optimizers import optimizer_family_of, unwrapped
from lightning_cannikin.training.sampler import UnevenBatchSampler
from lightning_cannikin.training.settings import CannikinSettings
from lightning_cannikin.training.sharded_grad_stats import NoiseReduceScatter, ShardedGradientNormObserver
from lightning_cannikin.training.step_timer import HostClock, StepTimer, step_timer_for

__all__ = ["BalancingEngine"]

AdoptHook = Callable[[Plan, "Plan | None", bool], None]


class BalancingEngine:
    """Balance a heterogeneous cluster and, optionally, adapt the total batch size for goodput.

    The arguments are :class:`~lightning_cannikin.Cannikin`'s (``save_profile`` writes where the frontend sets
    :attr:`profile_dir`); ``settings`` are the tuning settings. :attr:`on_adopt` is the frontend's side of a plan every
    rank adopted (``(plan, previous, mid_epoch)``).
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
        self.on_adopt: AdoptHook | None = None
        self.progress = Progress()
        self.history = PlanHistory()
        self.noise_trail = NoiseTrail()  # the estimate and its bounds over the fit, for the run profile
        self.speed_model: SpeedModel | None = None
        self.estimator: NoiseScaleEstimator | None = None
        self.collective: Collective | None = None
        self.step = 0  # optimizer steps and micro-steps run this fit (as the schedule counts them)
        self.identified = False  # rank zero's word, broadcast: every rank's slope has been measured
        self.adam = False
        self.fixed_split = False  # the user fixed the split: nothing re-plans it
        # the step in progress
        self.plan: Plan | None = None  # the newest plan (steps already prefetched may still run the one before it)
        self.step_sizes: tuple[int, ...] | None = None  # every rank's samples in the step in progress
        self.step_plan: Plan | None = None  # the plan the step in progress runs
        self.lr_factor = 1.0  # the learning-rate factor of the step in progress: that of the plan it runs
        self.gain = 1.0  # its AdaScale gain (B0-steps of progress it makes)
        # private parts: no frontend reaches them
        self._hook = WeightedAllReduceState()
        self._timer = StepTimer()
        self._hook.observers.append(self._timer)
        self._observer: GradientNormObserver | None = None
        self._observer_type: type[GradientNormObserver] = GradientNormObserver
        self._sampler: UnevenBatchSampler | None = None
        self._weights = WindowWeights()
        self._losses = LossScaleCheck()
        self._cost_fit = CostTimeFit()  # this rank's compute time over its exact summed cost (cost-aware sampler)
        self._window: tuple[tuple[float, ...], ...] = ()  # the noise statistics' group sizes of the step's window
        self._loss_factor = 1.0
        self._position: int | None = None
        self._vote: ChangeVote | None = None  # this rank's speed-change check and the ranks' vote on it
        self._changed = False  # the vote of this step: some rank's speed changed clearly
        self._optimizer: Any = None
        self._inner: Any = None  # the optimizer that holds the state, once read
        self._family: str | None = None
        self._restored: dict[str, Any] | None = None

    # -- the frontend's facts ------------------------------------------------------------------------------------------

    def bind(
        self,
        collective: Collective,
        fixed_split: bool = False,
        normalisation: str = "sample_mean",
        sharded: bool = False,
    ) -> None:
        """Run over ``collective`` (at setup, before the training loader is built; again at a later fit).

        Args:
            collective: where the ranks' records, decisions and votes meet.
            fixed_split: the user fixed the split: nothing re-plans it (the steps are still weighted).
            normalisation: how the user's loss is normalised
                (:func:`~lightning_cannikin.training.loss_weights.check_normalisation`).
            sharded: the gradients are reduce-scattered (FSDP2): the noise statistics read the reduce-scatters.

        """
        world_size = collective.world_size
        self.collective, self.fixed_split = collective, fixed_split
        self._weights = WindowWeights(normalisation)
        self._losses.normalisation = normalisation
        if sharded:
            self._observer_type = ShardedGradientNormObserver
        if self.speed_model is None:
            bounds = BatchBounds.parse(self.local_batch_bounds, world_size)
            self.speed_model = SpeedModel(world_size, SpeedModelSettings(half_life=self.settings.half_life), bounds)
        if self._observer is None and world_size > 1 and self.track_noise_scale:
            every = (self.settings.noise_exchange_every, self.settings.noise_every_n_steps)
            self._observer = self._observer_type(collective.rank, world_size, None, *every)
            self._observer.cadence = self.noise_every
            self._hook.observers.append(self._observer)
        self._vote = None
        if world_size > 1 and self.policy.balance and not fixed_split and self.schedule.check_every_n_steps is not None:
            check = LocalChangeCheck(self.speed_model.settings.drift_tolerance)
            self._vote = ChangeVote(check, collective, not collective.host_runs_ahead, cast_before_backward=True)
            self._timer.listeners[:] = [self._vote.check.observe]  # its own times, as the timer reads them

    def use_device(self, device: torch.device) -> None:
        """Time on ``device`` from now on: CUDA events on a GPU, the host clock elsewhere."""
        timer = step_timer_for(device)
        observers = self._hook.observers
        observers[observers.index(self._timer)] = timer
        timer.listeners = self._timer.listeners
        self._timer = timer

    @property
    def bounds(self) -> BatchBounds | None:
        """Every rank's local batch bounds (``None`` before :meth:`bind`)."""
        return self.speed_model.bounds if self.speed_model is not None else None

    @property
    def measures_noise(self) -> bool:
        """Whether the noise statistics are measured: they must see every gradient bucket (DDP's comm hook)."""
        return self._observer is not None

    @property
    def host_clock(self) -> bool:
        """Whether steps are timed on the host clock (on CPU the host waits inside collectives)."""
        return isinstance(self._timer.clock, HostClock)

    def start(self, optimizer: Any = None, scaler: Any = None, accumulation_allowed: bool = True) -> None:
        """Training starts: the estimator (it needs B0), the (first) ``optimizer``'s family, a checkpoint's state;
        ``scaler``: the ``GradScaler`` of ``16-mixed`` (its scale is divided out of the statistics);
        ``accumulation_allowed``: the engine may change the accumulation (the frontend accumulates for it)."""
        plan = self.plan
        if plan is not None and not self.fixed_split:
            self.policy.check_initial(plan)  # every rank sees the same plan: all raise, before any collective
        if self.policy.accumulate and not accumulation_allowed:
            self.policy = replace(self.policy, accumulate=False)
        base = self.base_batch_size or (plan.total_batch_size if plan is not None else 1)
        if self.estimator is None:
            self.estimator = NoiseScaleEstimator(base)
            if self.measures_noise and plan is not None:  # said once, where the statistics are measured
                message = self.estimator.never_bounded_at(plan.total_batch_size)
                if message is not None:
                    rank_zero_warn(message)
        self._optimizer, self._family, self._inner = optimizer, None, None
        self._identify_optimizer()
        if self._observer is not None:
            self._observer.scaler = scaler
        if self._restored is not None:
            self._restore(self._restored)
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
        if self._observer is not None:  # the noise of the direction Adam steps in (AdaptDL's rule)
            self._observer.optimizer = inner if self.adam else None

    # -- the plan and the loader ---------------------------------------------------------------------------------------

    def first_plan(self, global_batch_size: int, world_size: int, accumulation: int = 1) -> Plan:
        """The plan a fit starts from: ``global_batch_size`` as even as the bounds allow (the same total)."""
        bounds = self.bounds or BatchBounds((1,) * world_size)
        return bounds.first_plan(global_batch_size, accumulation)

    def use_loader(self, plan: Plan | None, sampler: UnevenBatchSampler | None) -> None:
        """The training loader the frontend built with ``plan`` (``None``: the fit ended; the plan stays)."""
        self.plan, self._sampler = plan if plan is not None else self.plan, sampler

    @property
    def batches_yielded(self) -> int:
        """Global batches the training sampler has handed out this epoch (a mid-epoch plan starts at or after it)."""
        return self._sampler.yielded if self._sampler is not None else 0

    @property
    def epoch_length(self) -> int | None:
        """Global batches in the running epoch (``None`` without a training loader)."""
        return len(self._sampler) if self._sampler is not None else None

    def set_plan(self, plan: Plan, from_batch: int | None = None, interleave: tuple[Plan, int] | None = None) -> None:
        """Put ``plan`` in force.

        Args:
            plan: the new split; it must split across as many ranks as the plan in force.
            from_batch: apply it to the current epoch from this global batch on. ``None`` leaves the running epoch
                alone: the plan takes effect when the training DataLoader is next built.
            interleave: ``(other, steps)``: for ``steps`` global batches from ``from_batch`` alternate ``plan`` and
                ``other`` (same global batch), then keep ``plan``. A probe interleaved with the split it left is
                timed beside it, so a trend in the device's speed (its first steps) cannot read as a slope.

        """
        if self.plan is not None and plan.world_size != self.plan.world_size:
            raise ValueError(
                f"The plan splits across {plan.world_size} ranks, but the world size is {self.plan.world_size}."
            )
        self.plan = plan
        sampler = self._sampler
        if from_batch is None or sampler is None:
            return
        other, steps = interleave if interleave is not None else (plan, 0)
        if other.global_batch_size != plan.global_batch_size:
            steps = 0  # the epoch's layout would change length: never for a probe, which keeps the total
        for offset in range(steps):  # increasing batches: each entry keeps the ones before it
            sampler.set_plan(plan if offset % 2 == 0 else other, from_batch + offset)
        sampler.set_plan(plan, from_batch + steps)

    # -- a training step -----------------------------------------------------------------------------------------------

    def begin_step(
        self,
        position: int | None,
        sizes: tuple[int, ...] | None,
        optimizer_step: int,
        accumulation: int = 1,
        end: int = -1,
        units: tuple[float, ...] | None = None,
    ) -> None:
        """Global batch ``position`` of the epoch starts, with every rank's ``sizes``: time it, say whether the noise
        statistics measure it, weigh it.

        The weights are those of the exact mean over the accumulation window the step belongs to
        (:class:`~lightning_cannikin.training.loss_weights.WindowWeights`); its learning-rate factor and gain are
        those of the plan it runs (a plan decided mid-epoch starts at a later batch than the decision, because the
        loader prefetches; its factor starts with it).

        Args:
            position: the global batch's index in the epoch (``None``: outside the uneven loader).
            sizes: every rank's sample count in it.
            optimizer_step: optimizer steps taken this fit (as a resumed fit counts them): micro-steps share one.
            accumulation: micro-batches per optimizer step.
            end: where the window is closed early (the epoch's last batch, ``limit_train_batches``); ``-1``: the
                epoch's end.
            units: every rank's count (tokens) in this step, for a count mean whose counts the sampler does not know.

        """
        # an epoch's first step has no input span of its own: the epoch's end and the loader's new iterator lie between
        self._timer.start(after_input=position is not None and position > 0)
        if self._observer is not None:  # before the step's first backward: is this optimizer step measured?
            self._observer.start_step(optimizer_step)
        self.step_sizes, self._position = sizes, position
        if position is None or sizes is None:
            return
        weights = self._weights.of_step(self._sampler, position, sizes, self._rank, accumulation, end, units)
        self._window = weights.noise_sizes
        hook = self._hook
        hook.weight, hook.micro_weight, hook.unit_scale = weights.rank, weights.micro, weights.unit_scale
        hook.global_scale = weights.global_scale
        # the weight on the loss (where the loss carries it), times n where the reduction averages
        weight = hook.weight * hook.mean_over if hook.weight_in_loss else 1.0
        self._loss_factor = accumulation * hook.micro_weight * weight
        plan = self._sampler.plan_at(position) if self._sampler is not None else self.plan
        total = plan.total_batch_size if plan is not None else sum(sizes) * accumulation
        self.step_plan = plan
        self.lr_factor, self.gain = self.scale(total)

    @property
    def _rank(self) -> int:
        return self.collective.rank if self.collective is not None else 0

    def forward_started(self, inner: bool = False) -> None:
        """The step's forward starts: the frontend's training step (``inner=False``: every step passes there), or the
        module itself after the wrapper's pre-forward work (``inner=True``: a collective that waits for slower ranks;
        the start moves there once)."""
        if inner:
            self._timer.inner_forward_start()
        else:
            self._timer.forward_start()

    def weigh(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss about to be backpropagated, recorded for the check against the declared normalisation, times the
        step's factor (the rank's weight where the loss carries it, and the micro-batch's share of its window)."""
        self._losses.record(self.step_sizes, loss)
        return loss * self._loss_factor if self._loss_factor != 1.0 else loss

    @contextmanager
    def backward(self, reduces: bool, parameters: Callable[[], Iterable[torch.Tensor]]) -> Iterator[None]:
        """Around one backward; ``reduces``: the gradients are reduced in it (not an accumulation micro-step);
        ``parameters``: the model's parameters (read afterwards where the noise statistics need them).

        The answer the last change check decided goes out as the backward starts (:meth:`ChangeVote.cast`): its round
        runs beside the backward, ahead of the gradient reduction queued behind it. Afterwards an accumulation
        micro-step's gradient is a noise group of its own, and a sharded window's reduced shards close its block."""
        self._timer.will_reduce(reduces)
        if self._vote is not None:
            self._vote.cast()
        yield
        timer, observer = self._timer, self._observer
        timer.backward_done()
        if observer is None:
            return
        if not timer.reduced:
            observer.after_micro_step(parameters(), self._hook.local_scale)
        elif isinstance(observer, ShardedGradientNormObserver):
            observer.reduced(self._hook, parameters())

    @contextmanager
    def optimizer_step(self, optimizer: Any) -> Iterator[None]:
        """Around the optimizer's step: the step counts at its gain (before a scheduler that may read the progress
        after it), and the learning rates are times the step's factor for this step only, restored afterwards, so any
        LR scheduler keeps its own values (a factor of 1, most steps, touches nothing)."""
        self.progress.add(self.gain)
        factor = self.lr_factor
        if factor == 1.0:
            yield
            return
        saved = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
        try:
            yield
        finally:
            for group, lr in zip(optimizer.param_groups, saved, strict=True):
                group["lr"] = lr

    def end_step(self, resizable: bool = True, epoch_ends: bool = False, epoch: int = 0) -> Decision | None:
        """The step ended on every rank alike: time it, fold in the noise statistics that arrived, and re-plan when
        due (``resizable``: the epoch may change length; ``epoch_ends``: it was the epoch's last batch, whose end
        decides: :meth:`end_epoch`). Returns the decision of a re-plan, if one ran."""
        self._finish_step()
        due, adapt = self.replan_due(resizable, epoch_ends)
        return self.replan(mid_epoch=True, adapt_total=adapt, epoch=epoch) if due else None

    def input_starts(self) -> None:
        """The loop asks the training loader for its next batch (the loader calls it): the next step's input span
        starts here, after whatever else ran between the steps (a re-plan, logging, validation, a checkpoint)."""
        self._timer.input_starts()

    def end_epoch(self, epoch: int = 0, rebuilds_loader: bool = True) -> Decision | None:
        """The epoch ended on every rank alike: re-plan for the next one when due (the total too); ``rebuilds_loader``:
        the frontend builds the next epoch's loader with the plan in force (Lightning), else the plan applies to the
        running loader from its next global batch (a Fabric loop's). Returns the decision, if any."""
        if self.fixed_split or not self.epoch_end_due():
            return None
        return self.replan(mid_epoch=not rebuilds_loader, adapt_total=True, epoch=epoch)

    def _finish_step(self) -> None:
        timer, rank = self._timer, self._rank
        timer.finish(self.step, rank, None if self.step_sizes is None else self._timed_size(rank))
        if timer.reduced:
            self._identify_optimizer()
            observer, estimator = self._observer, self.estimator
            # every rank folds the same exchanged numbers: the factor is identical everywhere, no collective
            if observer is not None and estimator is not None and observer.fold_into(estimator, self._window):
                self.noise_trail.add(self.step, estimator.noise_scale, self.noise_bounds())
        self.step += 1

    def _timed_size(self, rank: int) -> int | None:
        """The size this step is timed at: its samples, or with a cost-aware sampler its summed cost in samples of
        average cost (the speed model then fits the time over the cost; the exact cost goes to the cost fit)."""
        sizes, position, sampler = self.step_sizes, self._position, self._sampler
        load_of = getattr(sampler, "load_of", None)
        if sizes is None or load_of is None or position is None:
            return None if sizes is None else sizes[rank]
        units = sampler.units_at(position)[rank]  # type: ignore[union-attr]
        self._cost_fit.load(self.step, units)
        return load_of(units)

    @property
    def latest_record(self) -> StepRecord | None:
        """This rank's newest step record the timer has read (for logging)."""
        return self._timer.latest

    # -- the framework's seams -----------------------------------------------------------------------------------------

    def comm_hook(self) -> tuple[WeightedAllReduceState, Callable[..., Any]]:
        """``(state, hook)`` to register as DDP's comm hook: the weighted all-reduce its observers see."""
        return self._hook, weighted_allreduce_hook

    def reduce_with(self, loss_carries_weight: bool, averaged_over: int = 1) -> None:
        """How the frontend reduces: whether the loss carries the rank's weight (one scalar product instead of a pass
        over every bucket) and over how many ranks its reduction averages (DDP's own all-reduce, FSDP2's
        reduce-scatter: ``n * b_i / B`` on the loss makes their mean the weighted mean; 1 where the comm hook sums)."""
        self._hook.weight_in_loss, self._hook.mean_over = loss_carries_weight, averaged_over

    def gradient_ready(self) -> None:
        """A gradient (bucket) is ready for its reduction: the first of a step marks where gradients start, every one
        the latest."""
        self._timer.gradient_ready()

    def host_waited(self, seconds: float) -> None:
        """The host waited ``seconds`` for other ranks inside a collective of this step (FSDP2 on CPU): not compute."""
        self._timer.blocked(seconds)

    def reduction_done(self, reduced: torch.Tensor) -> None:
        """A reduction the comm hook does not see (FSDP2's reduce-scatter) returned ``reduced``."""
        self._timer.after_reduce(None, None, reduced)  # type: ignore[arg-type]

    def reduce_scatter_for(self, module: Any, reduce_scatter: Any) -> Any:
        """FSDP2's reduce-scatter of one sharded ``module``: ``reduce_scatter``, seen first by the noise statistics
        where they are measured (an object FSDP2's ``set_custom_reduce_scatter`` accepts)."""
        observer = self._observer
        if not isinstance(observer, ShardedGradientNormObserver):
            return reduce_scatter
        # Adam's preconditioner is all-gathered on measured steps: a wait, not compute
        observer.blocked = self._timer.blocked if self.host_clock else None
        return NoiseReduceScatter(reduce_scatter, observer, module)

    # -- the noise scale and the learning rate -------------------------------------------------------------------------

    @property
    def noise_scale(self) -> float | None:
        """The gradient noise scale in samples (equal on every rank; ``None`` until measured)."""
        return self.estimator.noise_scale if self.estimator is not None else None

    def noise_bounds(self) -> tuple[float, float] | None:
        """The noise scales the statistics cannot yet tell apart, ``(low, high)``: at ``noise_bound_level`` over the
        run (:meth:`~lightning_cannikin.core.noise_scale.NoiseScaleEstimator.run_bounds`), or ``noise_bound_sigmas``
        wide at each look where that is set; ``None`` before ``min_noise_updates`` measured steps or before the
        statistics have a spread. The same on every rank: every estimator receives the same numbers."""
        estimator, settings = self.estimator, self.settings
        if estimator is None or estimator.num_updates < settings.min_noise_updates:
            return None
        if settings.noise_bound_sigmas is not None:
            return estimator.bounds(settings.noise_bound_sigmas)
        return estimator.run_bounds(settings.noise_bound_level)

    def noise_every(self) -> int:
        """Optimizer steps per noise measurement now: every step while the bounds may still prove a move of the total,
        one in ``noise_every_n_steps`` once they lie inside the band of the total in force and only a drift of the
        noise scale could move it, or where the total is fixed (alike on every rank: the same bounds and band)."""
        if self.policy.max_batch_size is None or self.schedule.settled(self.noise_bounds()):
            return self.settings.noise_every_n_steps
        return 1

    def scale(self, total_batch_size: int) -> tuple[float, float]:
        """``(lr factor, AdaScale gain)`` of a step at ``total_batch_size`` with what is known now (the same on every
        rank): the gain the noise scale's lower bound supports, never more
        (:func:`~lightning_cannikin.core.policy.gain_noise_scale`)."""
        if self.estimator is None:
            return 1.0, 1.0
        base = self.estimator.base_batch_size
        phi = gain_noise_scale(self.noise_bounds())
        return learning_rate_scale(self.policy.lr_scaling, total_batch_size, base, phi, self.adam)

    @property
    def adapt_ready(self) -> bool:
        """The noise scale has bounds, and the speeds are measured (or the split is even)."""
        return self.noise_bounds() is not None and (self.identified or not self.policy.balance)

    # -- re-plans ------------------------------------------------------------------------------------------------------

    def replan_due(self, resizable: bool = True, epoch_ends: bool = False) -> tuple[bool, bool]:
        """``(re-plan now, reconsider the total too)`` after the step; ``resizable``: the epoch may change length;
        ``epoch_ends``: it was the epoch's last batch, whose end decides (:meth:`epoch_end_due`; the vote kept)."""
        if not self._timer.reduced or self.fixed_split:
            return False, False  # no re-plan mid-window: a window's micro-batches share one layout
        vote = self._vote
        self._changed = vote is not None and vote.poll(self.schedule.check_due(self.step))
        if epoch_ends:
            return False, False
        # the total moves where the noise bounds prove it out of the band rank zero broadcast: alike on every rank
        ready = self.policy.max_batch_size is not None and resizable and (self.identified or not self.policy.balance)
        balance, bounds = self.policy.balance, self.noise_bounds()
        return self.schedule.after_step(self.step, self.identified, balance, self._changed, bounds, ready)

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
        collective = self.collective
        assert collective is not None
        # the step records are read now: on CUDA the last ones wait for the device (the gather synchronises anyway)
        mine = self._timer.records(wait=True)  # with a cost-aware sampler, this rank's time over its exact cost too
        mine_all = (mine, self.batches_yielded, self._losses.take(), self._cost_fit.add(mine))
        gathered = collective.all_gather(mine_all)
        from_batch = max(entry[1] for entry in gathered) if mid_epoch else 0
        current = self.plan
        decision = None
        if collective.rank == 0:
            self._losses.judge([entry[2] for entry in gathered])  # the loss against its declared normalisation
            records = [record for rank_records, *_ in gathered for record in rank_records]
            decision = with_time_models(self.decide(records, current, mid_epoch, adapt_total), [e[3] for e in gathered])
        decision = collective.broadcast(decision, src=0)
        if decision is None or current is None:
            self.schedule.replanned(self.step, total_changed=False, balance=self.policy.balance)
            return None
        plan, balance = decision.plan, self.policy.balance
        self.schedule.followed(self.step, current, decision, balance, self._changed, adapt_total, self.adapt_ready)
        if self._changed and self._vote is not None:
            self._vote.reset()
        self._changed = False
        self.identified = decision.identified
        probe_steps = 0 if decision.identified else self.schedule.warmup_steps
        self._adopt(plan, current, mid_epoch, from_batch, probe_steps)
        self._record(plan, current, decision, epoch, collective.rank == 0)
        return decision

    def _adopt(self, plan: Plan, current: Plan, mid_epoch: bool, from_batch: int, probe_steps: int) -> None:
        """Put the plan in force; a probe mid-epoch alternates with the split it leaves for ``probe_steps`` batches."""
        if not mid_epoch:
            total_changed = plan.total_batch_size != current.total_batch_size
            self.set_plan(plan, None if total_changed else 0)  # a new total waits for the rebuilt loader
        else:
            interleave = (current, probe_steps) if probe_steps > 0 else None
            self.set_plan(plan, from_batch=from_batch, interleave=interleave)
        if self.on_adopt is not None:
            self.on_adopt(plan, current, mid_epoch)

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

    # -- checkpoints ---------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs."""
        schedule = self.schedule
        return {
            "balancer": self.speed_model.state_dict() if self.speed_model is not None else None,
            "estimator": self.estimator.state_dict() if self.estimator is not None else None,
            "progress": self.progress.state_dict(),
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "history": self.history.entries,
            "step": self.step,
            "identified": self.identified,
            "last_adapt_step": schedule.last_adapt_step,
            "adapted": schedule.adapted,
            "last_replan_step": schedule.last_replan_step,
            "routine_gap": schedule.routine_gap,
            "noise_band": schedule.noise_band,
            "total_options": None if schedule.total_options is None else schedule.total_options.to_dict(),
            "noise_in_flight": self._observer.state_dict() if self._observer is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> Plan | None:
        """Put the saved plan in force now (the loader is built with it); the rest waits for :meth:`start` (the
        estimator needs B0). Returns the plan put in force, if any."""
        self._restored = dict(state)
        saved = state.get("plan")
        if saved is None or self.fixed_split or self.collective is None:
            return None
        world_size = self.collective.world_size
        plan = Plan.from_dict(saved).resized(world_size)
        if len(saved["local_batch_sizes"]) != world_size:
            rank_zero_info(
                f"Cannikin: resuming a {len(saved['local_batch_sizes'])}-rank run on {world_size} ranks;"
                f" keeping the global batch of {plan.global_batch_size}, split evenly until the new devices are timed."
            )
        self.set_plan(plan)
        return plan

    def _restore(self, state: dict[str, Any]) -> None:
        """A checkpoint's ``state`` back in place (at training start: the estimator needs B0)."""
        if state["balancer"] is not None and self.speed_model is not None:
            self.speed_model.load_state_dict(state["balancer"])
            self.speed_model.restarted()
        if state["estimator"] is not None and self.estimator is not None:
            self.estimator.load_state_dict(state["estimator"])
        self.progress.load_state_dict(state["progress"])
        self.history.entries = list(state["history"])
        self.step = int(state["step"])
        schedule = self.schedule
        schedule.last_adapt_step = int(state["last_adapt_step"])
        schedule.adapted = bool(state["adapted"])
        schedule.last_replan_step = int(state["last_replan_step"])
        schedule.routine_gap = int(state["routine_gap"])
        band = state["noise_band"]
        options = state.get("total_options")  # absent from checkpoints older than the interval rule: reconsider
        schedule.noise_band = None if band is None or options is None else (float(band[0]), float(band[1]))
        schedule.total_options = None if options is None else TotalOptions.from_dict(options)
        if state["noise_in_flight"] is not None and self._observer is not None:
            self._observer.load_state_dict(state["noise_in_flight"])
        world_size = self.collective.world_size if self.collective is not None else 1
        same_devices = state["balancer"] is not None and state["balancer"]["world_size"] == world_size
        self.identified = bool(state["identified"]) and same_devices
