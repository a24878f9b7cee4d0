"""``BalancingEngine``: the one object that owns a balancing run's training steps, behind every frontend.

A frontend (Lightning's DDP and FSDP2 strategies with their callback, Fabric's strategy) says where a step's pieces
happen through the step API (:meth:`~BalancingEngine.bind`, :meth:`~BalancingEngine.begin_step`,
:meth:`~BalancingEngine.backward`, :meth:`~BalancingEngine.optimizer_step`,
:meth:`~BalancingEngine.end_step`, :meth:`~BalancingEngine.end_epoch` and the reductions' seams; the table is in
``docs/architecture.md``). The step timer, the all-reduce's state, the noise observer, the loader's sampler and the
speed-change vote are its private parts (``tests/test_layering.py`` checks that no frontend reaches them). It owns
what a run learns and the one re-plan protocol (:meth:`BalancingEngine._replan`: gather, rank zero decides with
:func:`~lightning_cannikin.core.policy.decide`, broadcast, set the plan); every "when" (a re-plan, the total, a change
check, a noise measurement) is its :class:`~lightning_cannikin.core.replanner.Replanner`'s call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn  # Lightning's and Fabric's
from torch.utils.data import DataLoader, IterableDataset

from lightning_cannikin.core.change import LocalChangeCheck
from lightning_cannikin.core.change_vote import ChangeVote
from lightning_cannikin.core.controller import Controller, Message, NoiseRule
from lightning_cannikin.core.lr_scaling import check_family
from lightning_cannikin.core.plan import BatchBounds, Plan
from lightning_cannikin.core.policy import Decision
from lightning_cannikin.core.profile import PROFILE_FILENAME, build_profile, save_profile
from lightning_cannikin.core.replanner import Replanner
from lightning_cannikin.core.speed_model import SpeedModelSettings, StepRecord
from lightning_cannikin.training.collective import Collective
from lightning_cannikin.training.comm_hook import WeightedAllReduceState, weighted_allreduce_hook
from lightning_cannikin.training.cost_aware_sampler import CostTimeFit, SampleCosts, with_time_models
from lightning_cannikin.training.grad_stats import GradientNormObserver
from lightning_cannikin.training.loader import UnevenDataLoader, kept_arguments, loader_batch_size, rebuild_uneven
from lightning_cannikin.training.loss_weights import LossScaleCheck, WindowWeights
from lightning_cannikin.training.optimizers import optimizer_family_of, unwrapped
from lightning_cannikin.training.replicated_stream import rebuild_replicated
from lightning_cannikin.training.sampler import UnevenBatchSampler
from lightning_cannikin.training.settings import EngineOptions
from lightning_cannikin.training.sharded_grad_stats import NoiseReduceScatter, ShardedGradientNormObserver
from lightning_cannikin.training.step_timer import HostClock, StepTimer, step_timer_for
from lightning_cannikin.training.stream_checks import is_litdata
from lightning_cannikin.training.streaming import rebuild_streaming

__all__ = ["ENGINE_API", "BalancingEngine", "log_messages"]

# Everything a frontend may call, read or set on the engine (``tests/test_layering.py`` checks every frontend against
# it, and that the engine has nothing else public); the table in ``docs/architecture.md`` says where each is called.
ENGINE_API = frozenset(
    {
        # the frontend's facts and the loader
        "options", "bind", "use_device", "start", "training_loader", "use_loader", "set_plan",
        # a step
        "begin_next_step", "begin_step", "forward_started", "backward", "optimizer_step", "end_step", "end_epoch",
        # the reductions' seams
        "comm_hook", "reduce_with", "gradient_ready", "host_waited", "reduction_done", "reduce_scatter_for",
        # what a frontend reads (the step in progress, what the run learnt) and sets
        "plan", "collective", "step_plan", "step_sizes", "lr_factor", "epoch_length",
        "latest_record", "measures_noise", "host_clock", "controller", "on_adopt", "profile_dir",
        # checkpoints
        "state_dict", "load_state_dict",
    }
)  # fmt: skip

AdoptHook = Callable[[Plan, "Plan | None", bool], None]


class BalancingEngine:
    """Balance a heterogeneous cluster and, optionally, adapt the total batch size for goodput.

    Args:
        options: the user's choices (:class:`~lightning_cannikin.training.settings.EngineOptions`: a Cannikin
            callback's, which the strategy builds its engine from); ``save_profile`` writes where the frontend sets
            :attr:`profile_dir`. :attr:`on_adopt` is the frontend's side of a plan every rank adopted.
        **choices: the options' fields instead (``max_batch_size=4096``, ``settings=...``).

    """

    def __init__(self, options: EngineOptions | None = None, **choices: Any) -> None:
        options = options if options is not None else EngineOptions(**choices)
        self.options = options
        settings = self._settings = options.settings
        every = (settings.warmup_steps, options.replan_every_n_steps, settings.adapt_every_n_steps)
        cadence = (settings.check_every_n_steps, settings.noise_every_n_steps)
        replanner = Replanner(*every, *cadence, options.balance, options.max_batch_size is not None)
        fitting = SpeedModelSettings(half_life=settings.half_life, evidence_reach=settings.evidence_reach)
        rule = NoiseRule(settings.min_noise_updates, settings.noise_bound_sigmas, settings.noise_bound_level)
        # every decision and every input to one: this engine only measures and carries
        self.controller = Controller(options.policy, replanner, fitting, rule, options.base_batch_size)
        self.profile_dir: str | None = None  # where rank zero writes the profile (set by the frontend)
        self.on_adopt: AdoptHook | None = None  # (plan, previous, mid_epoch)
        self.collective: Collective | None = None
        self._fixed_split = False  # the user fixed the split: nothing re-plans it
        # the step in progress
        self.plan: Plan | None = None  # the newest plan (steps already prefetched may still run the one before it)
        self.step_sizes: tuple[int, ...] | None = None  # every rank's samples in the step in progress
        self.step_plan: Plan | None = None  # the plan the step in progress runs
        self.lr_factor = 1.0  # the learning-rate factor of the step in progress: that of the plan it runs
        self._gain = 1.0  # its AdaScale gain (B0-steps of progress it makes)
        # private parts: no frontend reaches them
        self._hook = WeightedAllReduceState()
        self._timer = StepTimer()
        self._hook.observers.append(self._timer)
        self._observer: GradientNormObserver | None = None
        self._observer_type: type[GradientNormObserver] = GradientNormObserver
        self._sampler: UnevenBatchSampler | None = None
        self._loader: UnevenDataLoader | None = None  # the training loader, where the engine built it
        self._weights = WindowWeights()
        self._losses = LossScaleCheck()
        self._cost_fit = CostTimeFit()  # this rank's compute time over its exact summed cost (cost-aware sampler)
        self._window: tuple[tuple[float, ...], ...] = ()  # the noise statistics' group sizes of the step's window
        self._loss_factor = 1.0
        self._position: int | None = None
        self._vote: ChangeVote | None = None  # this rank's speed-change check and the ranks' vote on it
        self._optimizer: Any = None
        self._inner: Any = None  # the optimizer that holds the state, once read
        self._family: str | None = None
        self._restored: dict[str, Any] | None = None
        self._held: list[StepRecord] = []  # this rank's records read for a checkpoint: the next re-plan's

    # -- the frontend's facts ------------------------------------------------------------------------------------------

    def bind(
        self,
        collective: Collective,
        fixed_split: bool = False,
        normalisation: str = "sample_mean",
        sharded: bool = False,
        smallest: int = 1,
    ) -> None:
        """Run over ``collective`` (at setup, before the training loader is built; again at a later fit).

        Args:
            collective: where the ranks' records, decisions and votes meet.
            fixed_split: the user fixed the split: nothing re-plans it (the steps are still weighted).
            normalisation: how the user's loss is normalised
                (:func:`~lightning_cannikin.training.loss_weights.check_normalisation`).
            sharded: the gradients are reduce-scattered (FSDP2): the noise statistics read the reduce-scatters.
            smallest: the smallest local batch the model trains on where the user sets no lower bound
                (:func:`~lightning_cannikin.training.batch_statistics.smallest_local_batch`).

        """
        world_size = collective.world_size
        self.collective, self._fixed_split = collective, fixed_split
        self._weights = WindowWeights(normalisation)
        self._losses.normalisation = normalisation
        if sharded:
            self._observer_type = ShardedGradientNormObserver
        controller = self.controller
        controller.configure(world_size, BatchBounds.parse(self.options.local_batch_bounds, world_size, smallest))
        if self._observer is None and world_size > 1 and self.options.track_noise_scale:
            every = (self._settings.noise_exchange_every, self._settings.noise_every_n_steps)
            self._observer = self._observer_type(collective.rank, world_size, None, *every)
            self._observer.cadence = controller.replanner.noise_every
            self._hook.observers.append(self._observer)
        self._vote = None
        checks = controller.replanner.check_every_n_steps
        if world_size > 1 and controller.policy.balance and not fixed_split and checks is not None:
            check = LocalChangeCheck(controller.fitting.drift_tolerance)
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
        plan, controller = self.plan, self.controller
        if plan is not None and not self._fixed_split:
            controller.policy.check_initial(plan)  # every rank sees the same plan: all raise, before any collective
        if controller.policy.accumulate and not accumulation_allowed:
            controller.policy = replace(controller.policy, accumulate=False)
        message = controller.start(plan)
        if message is not None and self.measures_noise:  # said once, where the statistics are measured
            rank_zero_warn(message.text)
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
        if self.options.track_noise_scale:
            check_family(self._family, self.controller.policy.lr_scaling, type(inner).__name__)
        self.controller.adam = self._family == "adam"
        if self._observer is not None:  # the noise of the direction Adam steps in (AdaptDL's rule)
            self._observer.optimizer = inner if self.controller.adam else None

    # -- the plan and the loader ---------------------------------------------------------------------------------------

    def use_loader(self, plan: Plan | None, sampler: UnevenBatchSampler | None) -> None:
        """The training sampler built with ``plan`` (``None``: the fit ended; the plan stays)."""
        self.plan, self._sampler = plan if plan is not None else self.plan, sampler
        self._loader = None

    def training_loader(
        self,
        dataloader: DataLoader,
        accumulation: int = 1,
        fixed: Sequence[int] | None = None,
        sample_costs: SampleCosts | None = None,
    ) -> UnevenDataLoader:
        """``dataloader`` rebuilt around the uneven sampler, with the plan this fit starts from: the ``fixed`` split,
        else the plan in force (an earlier fit's, a checkpoint's) at this ``accumulation``, else the loader's
        ``batch_size`` on every rank, moved inside the bounds (the same total). Its steps begin with
        :meth:`begin_next_step`; a step's input is timed from the loop's request for it."""
        assert self.collective is not None, "bind() first"
        world_size = self.collective.world_size
        if fixed is not None:
            plan = Plan(tuple(fixed), accumulation)
        elif self.plan is not None:
            plan = replace(self.plan, accumulation_steps=accumulation)
        else:
            bounds = self.controller.bounds or BatchBounds((1,) * world_size)
            plan = bounds.first_plan(loader_batch_size(dataloader) * world_size, accumulation)
        if is_litdata(dataloader.dataset):  # a stream: its own shares (the items left re-dealt at a mid-epoch plan)
            if sample_costs is not None:
                raise ValueError(
                    "`sample_costs` splits map-style data by each sample's cost; a streaming data set is split by"
                    " count. Drop `sample_costs` (use `batch_units` for a count mean), or use a map-style dataset."
                )
            loader = rebuild_streaming(dataloader, plan, self.collective.rank, kept_arguments(dataloader))
        elif isinstance(dataloader.dataset, IterableDataset):  # any other stream: every rank reads it whole
            if sample_costs is not None or accumulation > 1:
                raise ValueError(
                    "An IterableDataset other than LitData's is read whole by every rank, which learns each global"
                    " batch's sizes only as it reads it: it supports neither `sample_costs` nor"
                    f" `accumulate_grad_batches` > 1 (got {accumulation}). Drop them, or stream with LitData's"
                    " `StreamingDataset`."
                )
            loader = rebuild_replicated(dataloader, plan, self.collective.rank, world_size)
        else:
            loader = rebuild_uneven(dataloader, plan, self.collective.rank, sample_costs=sample_costs)
        self.use_loader(plan, loader.uneven_sampler)
        loader.on_fetch = self._input_starts
        self._loader = loader
        return loader

    @property
    def _batches_yielded(self) -> int:
        """Global batches the training sampler has handed out this epoch (a mid-epoch plan starts at or after it)."""
        return self._sampler.yielded if self._sampler is not None else 0

    @property
    def epoch_length(self) -> int | None:
        """Global batches in the running epoch (``None`` without a training loader)."""
        try:
            return len(self._sampler) if self._sampler is not None else None
        except TypeError:  # a stream read whole by every rank: its length is known at its end only
            return None

    def set_plan(self, plan: Plan, from_batch: int | None = None, interleave: tuple[Plan, int] | None = None) -> None:
        """Put ``plan`` (as many ranks as the plan in force) in force: in the running epoch from global batch
        ``from_batch`` on (``interleave``: :meth:`UnevenBatchSampler.set_plan
        <lightning_cannikin.training.sampler.UnevenBatchSampler.set_plan>`'s), or, with ``None``, when the training
        DataLoader is next built."""
        if self.plan is not None and plan.world_size != self.plan.world_size:
            raise ValueError(
                f"The plan splits across {plan.world_size} ranks, but the world size is {self.plan.world_size}."
            )
        self.plan = plan
        if from_batch is not None and self._sampler is not None:
            self._sampler.set_plan(plan, from_batch, interleave)

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
        self.lr_factor, self._gain = self.controller.scale(total)

    def begin_next_step(
        self, optimizer_step: int, accumulation: int = 1, end: int = -1, units: tuple[float, ...] | None = None
    ) -> tuple[int, tuple[int, ...]] | None:
        """:meth:`begin_step` with the next batch the :meth:`training_loader` handed out (a step outside the uneven
        loader where it handed out none). Returns the batch's position in the epoch and every rank's sample count in
        it (``None`` outside the loader)."""
        pending = self._loader.pending_steps if self._loader is not None else None
        step = pending.popleft() if pending else None
        position, sizes = step if step is not None else (None, None)
        self.begin_step(position, sizes, optimizer_step, accumulation, end, units)
        return step

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

    def _weigh(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss about to be backpropagated, recorded for the check against the declared normalisation, times the
        step's factor (the rank's weight where the loss carries it, and the micro-batch's share of its window)."""
        self._losses.record(self.step_sizes, loss)
        return loss * self._loss_factor if self._loss_factor != 1.0 else loss

    @contextmanager
    def backward(
        self, loss: torch.Tensor, reduces: bool, parameters: Callable[[], Iterable[torch.Tensor]]
    ) -> Iterator[torch.Tensor]:
        """Around one backward of ``loss``; yields the loss to backpropagate (:meth:`_weigh`); ``reduces``: the
        gradients are reduced in it (not an accumulation micro-step); ``parameters``: the model's parameters (read
        afterwards where the noise statistics need them).

        The answer the last change check decided goes out as the backward starts (:meth:`ChangeVote.cast`): its round
        runs beside the backward, ahead of the gradient reduction queued behind it. Afterwards an accumulation
        micro-step's gradient is a noise group of its own, and a sharded window's reduced shards close its block."""
        weighted = self._weigh(loss)
        self._timer.will_reduce(reduces)
        if self._vote is not None:
            self._vote.cast()
        yield weighted
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
        self.controller.progress.add(self._gain)
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
        if not self._timer.reduced or self._fixed_split:
            return None  # no re-plan mid-window: a window's micro-batches share one layout
        controller = self.controller
        changed = self._vote is not None and self._vote.poll(controller.check_due())
        # the epoch's end decides (the vote kept for it); a stream's shares change only there
        decides = not epoch_ends and getattr(self._sampler, "mid_epoch_plans", True)
        due, adapt = controller.after_step(changed, resizable, decides=decides)
        return self._replan(mid_epoch=True, adapt_total=adapt, epoch=epoch) if due else None

    def _input_starts(self) -> None:
        """The loop asks the training loader for its next batch (the loader calls it): the next step's input span
        starts here, after whatever else ran between the steps (a re-plan, logging, validation, a checkpoint)."""
        self._timer.input_starts()

    def end_epoch(self, epoch: int = 0, rebuilds_loader: bool = True) -> Decision | None:
        """The epoch ended on every rank alike: re-plan for the next one when due (the total too); ``rebuilds_loader``:
        the frontend builds the next epoch's loader with the plan in force (Lightning), else the plan applies to the
        running loader from its next global batch (a Fabric loop's). Returns the decision, if any."""
        if self._fixed_split:
            return None
        due, adapt = self.controller.epoch_end()
        return self._replan(mid_epoch=not rebuilds_loader, adapt_total=adapt, epoch=epoch) if due else None

    def _finish_step(self) -> None:
        timer, rank, controller = self._timer, self._rank, self.controller
        timer.finish(controller.step, rank, None if self.step_sizes is None else self._timed_size(rank))
        if timer.reduced:
            self._identify_optimizer()
            observer, estimator = self._observer, controller.estimator
            # every rank folds the same exchanged numbers: the factor is identical everywhere, no collective
            if observer is not None and estimator is not None and observer.fold_into(estimator, self._window):
                log_messages(controller.noise_folded())
        controller.step_done()

    def _timed_size(self, rank: int) -> int | None:
        """The size this step is timed at: its samples, or with a cost-aware sampler its summed cost in samples of
        average cost (the speed model then fits the time over the cost; the exact cost goes to the cost fit)."""
        sizes, position, sampler = self.step_sizes, self._position, self._sampler
        load_of = getattr(sampler, "load_of", None)
        if sizes is None or load_of is None or position is None:
            return None if sizes is None else sizes[rank]
        units = sampler.units_at(position)[rank]  # type: ignore[union-attr]
        self._cost_fit.load(self.controller.step, units)
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

    # -- re-plans ------------------------------------------------------------------------------------------------------

    def _replan(self, mid_epoch: bool, adapt_total: bool, epoch: int = 0) -> Decision | None:
        """Gather, decide on rank zero, broadcast, adopt; every rank calls it after the same step. ``mid_epoch``: the
        plan applies from the next global batch no rank has drawn yet (else from the next epoch); ``adapt_total``: the
        total batch may change now; ``epoch``: for the history. Returns the decision adopted (``None`` while some rank
        has no timing yet)."""
        collective, controller = self.collective, self.controller
        assert collective is not None
        # the step records are read now (after those a checkpoint read): on CUDA the last ones wait for the device (the
        # gather synchronises anyway); with a cost-aware sampler, this rank's time over its exact cost too
        mine, self._held = self._held + self._timer.records(wait=True), []
        mine_all = (mine, self._batches_yielded, self._losses.take(), self._cost_fit.add(mine))
        gathered = collective.all_gather(mine_all)
        from_batch = max(entry[1] for entry in gathered) if mid_epoch else 0
        current, rank_zero = self.plan, collective.rank == 0
        decision = None
        if rank_zero:
            self._losses.judge([entry[2] for entry in gathered])  # the loss against its declared normalisation
            records = [record for rank_records, *_ in gathered for record in rank_records]
            decision, messages = controller.decide(records, current, mid_epoch, adapt_total)
            log_messages(*messages)
            decision = with_time_models(decision, [e[3] for e in gathered])
        decision = collective.broadcast(decision, src=0)
        took_vote, messages = controller.adopt(current, decision, adapt_total, epoch, decided=rank_zero)
        if decision is None or current is None:
            return None
        if took_vote and self._vote is not None:
            self._vote.reset()
        self._adopt(decision.plan, current, mid_epoch, from_batch, controller.probe_steps)
        if rank_zero:
            self._save_profile()
            log_messages(*messages)
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

    def _save_profile(self) -> None:
        """Rank zero's run profile, where the frontend set :attr:`profile_dir`."""
        controller = self.controller
        if not (self.options.save_profile and self.profile_dir and controller.speed_model is not None):
            return
        base = controller.estimator.base_batch_size if controller.estimator is not None else None
        trail = controller.trail.points or None  # None: from the history (no statistics measured)
        profile = build_profile(controller.speed_model, controller.history.entries, base, trail)
        save_profile(Path(self.profile_dir) / PROFILE_FILENAME, profile)

    # -- checkpoints ---------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs; every rank calls it, as Lightning's checkpoint does (each rank's own part is
        gathered)."""
        return {
            **self.controller.state_dict(),
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "noise_in_flight": self._observer.state_dict() if self._observer is not None else None,
            "ranks": self._ranks_state(),
        }

    def _ranks_state(self) -> list[dict[str, Any]]:
        """Every rank's own state, gathered (Lightning writes rank zero's callback state; every rank calls
        :meth:`state_dict`, as Lightning's ``save_checkpoint`` does): its change check and vote, its cost fit, and
        the records its timer holds for the next re-plan (read now, and still handed to it)."""
        self._held += self._timer.records(wait=True)
        mine = {
            "vote": self._vote.state_dict() if self._vote is not None else None,
            "cost_fit": self._cost_fit.state_dict(),
            "records": [record.to_dict() for record in self._held],
        }
        return self.collective.all_gather(mine) if self.collective is not None else [mine]

    def load_state_dict(self, state: dict[str, Any]) -> Plan | None:
        """Put the saved plan in force now (the loader is built with it); the rest waits for :meth:`start` (the
        estimator needs B0). Returns the plan put in force, if any."""
        self._restored = dict(state)
        saved = state.get("plan")
        if saved is None or self._fixed_split or self.collective is None:
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
        world_size = self.collective.world_size if self.collective is not None else 1
        self.controller.load_state_dict(state, world_size)
        if state["noise_in_flight"] is not None and self._observer is not None:
            self._observer.load_state_dict(state["noise_in_flight"])
        ranks = state.get("ranks")  # checkpoints older than it: every rank's check and cost fit start over
        if ranks is not None and len(ranks) == world_size:  # on other devices, each rank's own state is no evidence
            mine = ranks[self._rank]
            if self._vote is not None and mine["vote"] is not None:
                self._vote.load_state_dict(mine["vote"])
            self._cost_fit.load_state_dict(mine["cost_fit"])
            self._held = [StepRecord(**record) for record in mine["records"]]
        if self._vote is not None:
            self._vote.check.restarted()  # the device warms up again: its first times are left out


def log_messages(*messages: Message | None) -> None:
    """The controller's messages in rank zero's log."""
    for message in messages:
        if message is not None:
            (rank_zero_warn if message.warn else rank_zero_info)(message.text)
