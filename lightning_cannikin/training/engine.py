"""``BalancingEngine``: the torch side of a balancing run, behind every frontend.

Frontends (Lightning's DDP and FSDP2 strategies with their callback, Fabric's strategy) drive it through the step API
(the table is in ``docs/architecture.md``). It measures (the step timer, the noise statistics, the loss's weights),
feeds the facts to its :class:`~lightning_cannikin.core.controller.Controller`, which holds every decision and every
input to one, and carries what that decides between the ranks (:meth:`BalancingEngine._replan`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn  # Lightning's and Fabric's
from torch.utils.data import DataLoader

from lightning_cannikin.core.controller import Message
from lightning_cannikin.core.lr_scaling import check_family
from lightning_cannikin.core.plan import BatchBounds, Plan
from lightning_cannikin.core.policy import Decision
from lightning_cannikin.core.profile import PROFILE_FILENAME, save_profile
from lightning_cannikin.training.collective import Collective
from lightning_cannikin.training.data.cost_aware_sampler import SampleCosts, with_time_models
from lightning_cannikin.training.data.loader import UnevenDataLoader, loader_batch_size
from lightning_cannikin.training.data.plan_in_force import PlanInForce, RunningStep
from lightning_cannikin.training.data.rebuild import rebuild_training_loader
from lightning_cannikin.training.measurement.local_evidence import LocalEvidence
from lightning_cannikin.training.measurement.loss_weights import LossScaleCheck, WindowWeights
from lightning_cannikin.training.measurement.reductions import Reductions
from lightning_cannikin.training.optimizers import FamilyWatch, scaled_learning_rates
from lightning_cannikin.training.settings import EngineOptions

__all__ = ["ENGINE_API", "BalancingEngine", "log_messages"]

# Everything a frontend may call, read or set on the engine (``tests/test_layering.py`` checks every frontend against
# it, and that the engine has nothing else public); the table in ``docs/architecture.md`` says where each is called.
ENGINE_API = frozenset(
    {
        # the run: its options, its decisions, its reductions
        "options", "controller", "reductions", "bind", "start",
        # the plan in force and the training loader
        "data", "training_loader",
        # a step
        "begin_step", "forward_started", "backward", "optimizer_step", "end_step", "end_epoch", "running",
        # checkpoints
        "state_dict", "load_state_dict",
    }
)  # fmt: skip

AdoptHook = Callable[[Plan, "Plan | None", bool], None]


class BalancingEngine:
    """Measure a balancing run's steps, and carry its controller's decisions between the ranks.

    Args:
        options: the user's choices (:class:`~lightning_cannikin.training.settings.EngineOptions`: a Cannikin
            callback's, which the strategy builds its engine from).
        **choices: the options' fields instead (``max_batch_size=4096``, ``settings=...``).

    """

    def __init__(self, options: EngineOptions | None = None, **choices: Any) -> None:
        options = options if options is not None else EngineOptions(**choices)
        self.options = options
        self.controller = options.controller()  # every decision and every input to one: the engine measures, carries
        self.reductions = Reductions()
        self.data = PlanInForce()
        self.running = RunningStep()
        self._collective: Collective | None = None
        self._fixed_split = False  # the user fixed the split: nothing re-plans it
        self._profile_dir: str | None = None  # where rank zero writes the profile
        self._on_adopt: AdoptHook | None = None  # the frontend's side of a plan every rank adopted
        self._weights = WindowWeights()
        self._losses = LossScaleCheck()
        self._local = LocalEvidence()  # this rank's records, cost fit and change vote, for the next re-plan
        self._window: tuple[tuple[float, ...], ...] = ()  # the noise statistics' group sizes of the step's window
        self._loss_factor = 1.0
        self._position: int | None = None
        self._optimizer = FamilyWatch()
        self._restored: dict[str, Any] | None = None

    # -- the run -------------------------------------------------------------------------------------------------------

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
                (:func:`~lightning_cannikin.training.measurement.loss_weights.check_normalisation`).
            sharded: the gradients are reduce-scattered (FSDP2): the noise statistics read the reduce-scatters.
            smallest: the smallest local batch the model trains on where the user sets no lower bound
                (:func:`~lightning_cannikin.training.frontends.batch_statistics.smallest_local_batch`).

        """
        world_size, controller, reductions = collective.world_size, self.controller, self.reductions
        self._collective, self._fixed_split = collective, fixed_split
        self._weights = WindowWeights(normalisation)
        self._losses.normalisation = normalisation
        controller.configure(world_size, BatchBounds.parse(self.options.local_batch_bounds, world_size, smallest))
        if reductions.observer is None and world_size > 1 and self.options.track_noise_scale:
            every = (self.options.settings.noise_exchange_every, self.options.settings.noise_every_n_steps)
            reductions.watch_noise(collective.rank, world_size, sharded, every, controller.replanner.noise_every)
        checks = controller.replanner.check_every_n_steps
        votes = world_size > 1 and controller.policy.balance and not fixed_split and checks is not None
        self._local.watch_speed(collective if votes else None, controller.fitting.drift_tolerance, reductions.timer)

    def start(
        self,
        optimizer: Any = None,
        scaler: Any = None,
        accumulation_allowed: bool = True,
        on_adopt: AdoptHook | None = None,
        profile_dir: str | None = None,
    ) -> None:
        """Training starts: the estimator (it needs B0), the (first) ``optimizer``'s family, a checkpoint's state.

        Args:
            optimizer: the training optimizer (its family sets the AdaScale rule and the noise's preconditioning).
            scaler: the ``GradScaler`` of ``16-mixed`` (its scale is divided out of the statistics).
            accumulation_allowed: the engine may change the accumulation (the frontend accumulates for it).
            on_adopt: the frontend's side of a plan every rank adopted: ``(plan, previous, mid_epoch)``.
            profile_dir: where rank zero writes the run profile (``None``: nowhere).

        """
        plan, controller = self.data.plan, self.controller
        if plan is not None and not self._fixed_split:
            controller.policy.check_initial(plan)  # every rank sees the same plan: all raise, before any collective
        if controller.policy.accumulate and not accumulation_allowed:
            controller.policy = replace(controller.policy, accumulate=False)
        self._on_adopt, self._profile_dir = on_adopt, profile_dir
        message = controller.start(plan)
        if message is not None and self.reductions.measures_noise:  # said once, where the statistics are measured
            log_messages(message)
        self._optimizer = FamilyWatch(optimizer)
        self._identify_optimizer()
        if self.reductions.observer is not None:
            self.reductions.observer.scaler = scaler
        if self._restored is not None:
            self._restore(self._restored)
            self._restored = None

    def _identify_optimizer(self) -> None:
        """The optimizer's family, once it tells (:class:`FamilyWatch`): one that preconditions other than Adam is
        refused where AdaScale follows a measured noise scale (every rank alike)."""
        watch = self._optimizer
        if not watch.read():
            return
        if self.options.track_noise_scale:
            check_family(watch.family, self.controller.policy.lr_scaling, type(watch.inner).__name__)
        adam = self.controller.adam = watch.family == "adam"
        if self.reductions.observer is not None:  # the noise of the direction Adam steps in (AdaptDL's rule)
            self.reductions.observer.optimizer = watch.inner if adam else None

    # -- the plan and the loader ---------------------------------------------------------------------------------------

    def training_loader(
        self,
        dataloader: DataLoader,
        accumulation: int = 1,
        fixed: Sequence[int] | None = None,
        sample_costs: SampleCosts | None = None,
    ) -> UnevenDataLoader:
        """``dataloader`` rebuilt around the uneven sampler, with the plan this fit starts from
        (:meth:`~lightning_cannikin.training.data.plan_in_force.PlanInForce.first_plan`). Its steps begin with
        :meth:`begin_step`; a step's input is timed from the loop's request for it."""
        assert self._collective is not None, "bind() first"
        rank, world_size = self._collective.rank, self._collective.world_size
        bounds = self.controller.bounds or BatchBounds((1,) * world_size)
        plan = self.data.first_plan(loader_batch_size(dataloader) * world_size, accumulation, fixed, bounds)
        loader = rebuild_training_loader(dataloader, plan, rank, world_size, sample_costs)
        self.data.use_loader(plan, loader.uneven_sampler)
        loader.on_fetch = lambda: self.reductions.timer.input_starts()  # the next input span starts at the ask
        self.data.loader = loader
        return loader

    # -- a training step -----------------------------------------------------------------------------------------------

    def begin_step(
        self,
        optimizer_step: int,
        accumulation: int = 1,
        end: int = -1,
        units: tuple[float, ...] | None = None,
        batch: tuple[int, tuple[int, ...]] | None = None,
    ) -> tuple[int, tuple[int, ...]] | None:
        """A step starts on the next ``batch`` the :meth:`training_loader` handed out: time it, say whether the noise
        statistics measure it, weigh it.

        The weights are those of the exact mean over the accumulation window the step belongs to
        (:class:`~lightning_cannikin.training.measurement.loss_weights.WindowWeights`); its learning-rate factor and
        gain are those of the plan it runs (:class:`RunningStep`).

        Args:
            optimizer_step: optimizer steps taken this fit (as a resumed fit counts them): micro-steps share one.
            accumulation: micro-batches per optimizer step.
            end: where the window is closed early (the epoch's last batch, ``limit_train_batches``); ``-1``: the
                epoch's end.
            units: every rank's count (tokens) in this step, for a count mean whose counts the sampler does not know.
            batch: ``(position in the epoch, every rank's sample count)`` of the global batch, where it does not come
                from the engine's loader (``None``: the loader's next, or a step outside the uneven loader).

        Returns:
            The batch's position in the epoch and every rank's sample count in it (``None`` outside the loader).

        """
        batch = self.data.next_batch() if batch is None else batch
        position, sizes = batch if batch is not None else (None, None)
        # an epoch's first step has no input span of its own: the epoch's end and the loader's new iterator lie between
        self.reductions.start_step(optimizer_step, after_input=position is not None and position > 0)
        self._position = position
        if position is None or sizes is None:
            self.running = replace(self.running, sizes=sizes)
            return batch
        weights = self._weights.of_step(self.data.sampler, position, sizes, self._rank, accumulation, end, units)
        self._window = weights.noise_sizes
        self._loss_factor = self.reductions.weigh(weights, accumulation)
        plan = self.data.plan_at(position)
        total = plan.total_batch_size if plan is not None else sum(sizes) * accumulation
        self.running = RunningStep(plan, sizes, *self.controller.scale(total))
        return batch

    @property
    def _rank(self) -> int:
        return self._collective.rank if self._collective is not None else 0

    def forward_started(self, inner: bool = False) -> None:
        """The step's forward starts: the frontend's training step (``inner=False``: every step passes there), or the
        module itself after the wrapper's pre-forward work (``inner=True``: a collective that waits for slower ranks;
        the start moves there once)."""
        if inner:
            self.reductions.timer.inner_forward_start()
        else:
            self.reductions.timer.forward_start()

    @contextmanager
    def backward(
        self, loss: torch.Tensor, reduces: bool, parameters: Callable[[], Iterable[torch.Tensor]]
    ) -> Iterator[torch.Tensor]:
        """Around one backward of ``loss``; yields the loss to backpropagate: recorded for the check against the
        declared normalisation, times the step's factor (the rank's weight where the loss carries it, and the
        micro-batch's share of its window); ``reduces``: the gradients are reduced in it (not an accumulation
        micro-step); ``parameters``: the model's parameters (read afterwards where the noise statistics need them).

        The answer the last change check decided goes out as the backward starts (:meth:`ChangeVote.cast`): its round
        runs beside the backward, ahead of the gradient reduction queued behind it."""
        self._losses.record(self.running.sizes, loss)
        weighted = loss * self._loss_factor if self._loss_factor != 1.0 else loss
        self.reductions.timer.will_reduce(reduces)
        if self._local.vote is not None:
            self._local.vote.cast()
        yield weighted
        self.reductions.backward_done(parameters)

    @contextmanager
    def optimizer_step(self, optimizer: Any) -> Iterator[None]:
        """Around the optimizer's step: the step counts at its gain (before a scheduler that may read the progress
        after it), and the learning rates are times the step's factor for this step only, restored afterwards, so any
        LR scheduler keeps its own values (a factor of 1, most steps, touches nothing)."""
        self.controller.progress.add(self.running.gain)
        with scaled_learning_rates(optimizer, self.running.lr_factor):
            yield

    def end_step(self, resizable: bool = True, epoch_ends: bool = False, epoch: int = 0) -> Decision | None:
        """The step ended on every rank alike: time it, fold in the noise statistics that arrived, and re-plan when
        due (``resizable``: the epoch may change length; ``epoch_ends``: it was the epoch's last batch, whose end
        decides: :meth:`end_epoch`). Returns the decision of a re-plan, if one ran."""
        self._finish_step()
        if not self.reductions.timer.reduced or self._fixed_split:
            return None  # no re-plan mid-window: a window's micro-batches share one layout
        controller = self.controller
        vote = self._local.vote
        changed = vote is not None and vote.poll(controller.check_due())
        # the epoch's end decides (the vote kept for it); a stream's shares change only there
        decides = not epoch_ends and self.data.mid_epoch_plans
        due, adapt = controller.after_step(changed, resizable, decides=decides)
        return self._replan(mid_epoch=True, adapt_total=adapt, epoch=epoch) if due else None

    def end_epoch(self, epoch: int = 0, rebuilds_loader: bool = True) -> Decision | None:
        """The epoch ended on every rank alike: re-plan for the next one when due (the total too); ``rebuilds_loader``:
        the frontend builds the next epoch's loader with the plan in force (Lightning), else the plan applies to the
        running loader from its next global batch (a Fabric loop's). Returns the decision, if any."""
        if self._fixed_split:
            return None
        due, adapt = self.controller.epoch_end()
        return self._replan(mid_epoch=not rebuilds_loader, adapt_total=adapt, epoch=epoch) if due else None

    def _finish_step(self) -> None:
        timer, rank, controller = self.reductions.timer, self._rank, self.controller
        timed = self._local.timed_size(self.data.sampler, self._position, self.running.sizes, rank, controller.step)
        timer.finish(controller.step, rank, timed)
        if timer.reduced:
            self._identify_optimizer()
            observer, estimator = self.reductions.observer, controller.estimator
            # every rank folds the same exchanged numbers: the factor is identical everywhere, no collective
            if observer is not None and estimator is not None and observer.fold_into(estimator, self._window):
                log_messages(controller.noise_folded())
        controller.step_done()

    # -- re-plans ------------------------------------------------------------------------------------------------------

    def _replan(self, mid_epoch: bool, adapt_total: bool, epoch: int = 0) -> Decision | None:
        """Gather, decide on rank zero, broadcast, adopt; every rank calls it after the same step. ``mid_epoch``: the
        plan applies from the next global batch no rank has drawn yet (else from the next epoch); ``adapt_total``: the
        total batch may change now; ``epoch``: for the history. Returns the decision adopted (``None`` while some rank
        has no timing yet)."""
        collective, controller = self._collective, self.controller
        assert collective is not None
        records, cost_fit = self._local.take(self.reductions.timer)
        gathered = collective.all_gather((records, self.data.batches_yielded, self._losses.take(), cost_fit))
        from_batch = max(entry[1] for entry in gathered) if mid_epoch else 0
        current, rank_zero = self.data.plan, collective.rank == 0
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
        if took_vote and self._local.vote is not None:
            self._local.vote.reset()
        plan, probe_steps = decision.plan, controller.probe_steps
        if not mid_epoch:  # a new total waits for the rebuilt loader
            self.data.set_plan(plan, None if plan.total_batch_size != current.total_batch_size else 0)
        else:  # a probe mid-epoch alternates with the split it leaves for a warm-up
            self.data.set_plan(plan, from_batch, (current, probe_steps) if probe_steps > 0 else None)
        if self._on_adopt is not None:
            self._on_adopt(plan, current, mid_epoch)
        if rank_zero:
            profile = controller.profile() if self.options.save_profile and self._profile_dir else None
            if profile is not None:  # rank zero's run profile, where the frontend gave a folder (:meth:`start`)
                save_profile(Path(self._profile_dir) / PROFILE_FILENAME, profile)  # type: ignore[arg-type]
            log_messages(*messages)
        return decision

    # -- checkpoints ---------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs; every rank calls it, as Lightning's ``save_checkpoint`` does, and Lightning writes
        rank zero's callback state: every rank's :class:`LocalEvidence` is gathered."""
        mine = self._local.state_dict(self.reductions.timer)
        return {
            **self.controller.state_dict(),
            "plan": self.data.plan.to_dict() if self.data.plan is not None else None,
            "noise_in_flight": self.reductions.state_dict(),
            "ranks": self._collective.all_gather(mine) if self._collective is not None else [mine],
        }

    def load_state_dict(self, state: dict[str, Any]) -> Plan | None:
        """Put the saved plan in force now (the loader is built with it); the rest waits for :meth:`start` (the
        estimator needs B0). Returns the plan put in force, if any."""
        self._restored = dict(state)
        saved = state.get("plan")
        if saved is None or self._fixed_split or self._collective is None:
            return None
        plan, message = self.data.resume(saved, self._collective.world_size)
        log_messages(message)
        return plan

    def _restore(self, state: dict[str, Any]) -> None:
        """A checkpoint's ``state`` back in place (at training start: the estimator needs B0)."""
        world_size = self._collective.world_size if self._collective is not None else 1
        self.controller.load_state_dict(state, world_size)
        self.reductions.load_state_dict(state["noise_in_flight"])
        ranks = state.get("ranks")  # checkpoints older than it: every rank's check and cost fit start over
        if ranks is not None and len(ranks) == world_size:  # on other devices, each rank's own state is no evidence
            self._local.load_state_dict(ranks[self._rank])
        self._local.restarted()


def log_messages(*messages: Message | None) -> None:
    """The controller's messages in rank zero's log."""
    for message in messages:
        if message is not None:
            (rank_zero_warn if message.warn else rank_zero_info)(message.text)
