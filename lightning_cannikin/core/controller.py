"""The :class:`Controller`: every decision of a balancing run, and every input to one, in one pure object.

It owns what a run learns (the speed model, the noise-scale estimator, the plan history, the progress made) and every
"when" (its :class:`~lightning_cannikin.core.replanner.Replanner`). A frontend's engine feeds it a step's facts and
carries what it decides between the ranks; the replays in ``benchmarks/replay.py`` feed it emulated facts the same way.
One loop, written once::

    due, adapt = controller.after_step(changed, resizable)        # every rank, every step
    decision = controller.decide(records, current, mid_epoch, adapt)  # rank zero, when due
    controller.adopt(current, decision, adapt)                    # every rank, the broadcast decision

The noise scale travels as a value (:class:`NoiseReading`), read once whenever new statistics are folded in. What the
controller has to say goes out as :class:`Message` values, which the engine logs on rank zero. Its
:meth:`Controller.state_dict` is complete: a controller restored from it decides as the one that saved it.

Pure Python: imports neither torch nor Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from lightning_cannikin.core.dead_weight import dead_weight
from lightning_cannikin.core.explain import explain, missed_prediction
from lightning_cannikin.core.history import NoiseTrail, PlanHistory
from lightning_cannikin.core.lr_scaling import Progress
from lightning_cannikin.core.noise_scale import NOISE_BOUND_LEVEL, NoiseScaleEstimator
from lightning_cannikin.core.plan import BatchBounds, Plan
from lightning_cannikin.core.policy import Decision, PolicySettings, decide, learning_rate_scale
from lightning_cannikin.core.profile import build_profile
from lightning_cannikin.core.replanner import Replanner
from lightning_cannikin.core.speed_model import SpeedModel, SpeedModelSettings, StepRecord

__all__ = ["MIN_NOISE_UPDATES", "Controller", "Message", "NoiseReading", "NoiseRule"]

# measured steps of noise statistics before the total batch may change or the AdaScale gain leave 1: the first
# exchanges' spread says little (the bounds themselves also wait for ten effective steps of spread)
MIN_NOISE_UPDATES = 10

Bounds = tuple[float, float] | None


@dataclass(frozen=True)
class NoiseReading:
    """What is known of the noise scale after a step, the same on every rank: its ``bounds`` (``None``: none yet)
    and its point ``estimate`` (``None``: unmeasured; it may be infinite)."""

    bounds: Bounds = None
    estimate: float | None = None


@dataclass(frozen=True)
class NoiseRule:
    """How the estimator's statistics become bounds a decision may act on.

    Args:
        min_updates: measured steps before there are any bounds.
        sigmas: a fixed width per look, in standard errors (``None``: ``level`` over the whole run).
        level: the share of runs whose bounds may ever miss the truth, however often looked at.

    """

    min_updates: int = MIN_NOISE_UPDATES
    sigmas: float | None = None
    level: float = NOISE_BOUND_LEVEL

    def read(self, estimator: NoiseScaleEstimator | None) -> NoiseReading:
        """The reading of ``estimator`` now: no bounds before ``min_updates`` measured steps or a spread."""
        if estimator is None:
            return NoiseReading()
        estimate = estimator.noise_scale
        if estimator.num_updates < self.min_updates:
            return NoiseReading(None, estimate)
        if self.sigmas is not None:
            return NoiseReading(estimator.bounds(self.sigmas), estimate)
        return NoiseReading(estimator.run_bounds(self.level), estimate)


@dataclass(frozen=True)
class Message:
    """A line for rank zero's log: ``warn`` for what a user should act on, else information."""

    text: str
    warn: bool = False


@dataclass
class Controller:
    """Decide a balancing run's plans, totals and learning-rate factors from the facts its steps give.

    Every rank holds one and feeds it the same facts (its step count, the noise statistics every estimator shares, the
    ranks' one-bit change vote, the decisions rank zero broadcast), so every rank's "when" agrees with no collective;
    rank zero alone folds in the step records and decides.

    Args:
        policy: what a decision may do (the largest total, balancing, the margins, the learning-rate rule).
        replanner: when to re-plan, reconsider the total, ask the change checks and measure the noise.
        fitting: the speed model's settings.
        noise_rule: how the noise statistics become bounds.
        base_batch_size: B0, the total the learning rate was tuned for (``None``: the first plan's total).

    """

    policy: PolicySettings = field(default_factory=PolicySettings)
    replanner: Replanner = field(default_factory=Replanner)
    fitting: SpeedModelSettings = field(default_factory=SpeedModelSettings)
    noise_rule: NoiseRule = field(default_factory=NoiseRule)
    base_batch_size: int | None = None
    # what the run learns (all of it in state_dict)
    speed_model: SpeedModel | None = None
    estimator: NoiseScaleEstimator | None = None
    history: PlanHistory = field(default_factory=PlanHistory)
    progress: Progress = field(default_factory=Progress)
    step: int = 0  # optimizer steps and micro-steps run this fit
    noise: NoiseReading = NoiseReading()  # read once whenever new statistics arrive
    adam: bool = False  # the optimizer preconditions (the square root of the AdaScale gain)
    trail: NoiseTrail = field(default_factory=NoiseTrail)  # the estimate and its bounds over the fit, for the profile
    # the estimator's restarts (changes of the statistics) a message has told of
    _restarts_told: int = field(default=0, init=False, repr=False)
    # the ranks a message said are slowest at their smallest batch
    _dead_weights: set[int] = field(default_factory=set, init=False, repr=False)

    # -- the run's facts -------------------------------------------------------------------------------------------

    def configure(self, world_size: int, bounds: BatchBounds) -> None:
        """The ranks and their local batch bounds (at the first fit; a later fit keeps what the first learnt)."""
        if self.speed_model is None:
            self.speed_model = SpeedModel(world_size, self.fitting, bounds)

    def start(self, plan: Plan | None) -> Message | None:
        """Training starts from ``plan``: the estimator, with B0 (``base_batch_size`` or the plan's total). Returns a
        warning where the noise statistics at this total can never bound the noise scale."""
        if self.estimator is not None:
            return None
        self.estimator = NoiseScaleEstimator(self.base_batch_size or (plan.total_batch_size if plan is not None else 1))
        message = self.estimator.never_bounded_at(plan.total_batch_size) if plan is not None else None
        return None if message is None else Message(message, warn=True)

    @property
    def base(self) -> int | None:
        """B0: the estimator's (a checkpoint's, on a resume), else ``base_batch_size`` (``None``: not started)."""
        return self.estimator.base_batch_size if self.estimator is not None else self.base_batch_size

    @property
    def bounds(self) -> BatchBounds | None:
        """Every rank's local batch bounds (``None`` before :meth:`configure`)."""
        return self.speed_model.bounds if self.speed_model is not None else None

    # -- a step ------------------------------------------------------------------------------------------------------

    def scale(self, total_batch_size: int) -> tuple[float, float]:
        """``(lr factor, AdaScale gain)`` of a step at ``total_batch_size`` at the noise reading now: the gain at the
        point estimate held within the bounds (:func:`~lightning_cannikin.core.policy.gain_noise_scale`)."""
        if self.estimator is None:
            return 1.0, 1.0
        base, noise, rule = self.estimator.base_batch_size, self.noise, self.policy.lr_scaling
        return learning_rate_scale(rule, total_batch_size, base, noise.bounds, self.adam, noise.estimate)

    def noise_folded(self) -> Message | None:
        """The estimator took in new statistics after this step: read the noise once (every decision until the next
        fold reads this reading) and keep it on the trail. Returns a message where the statistics changed."""
        self.noise = self.noise_rule.read(self.estimator)
        self.trail.add(self.step, self.noise.estimate, self.noise.bounds)
        restarts = self.estimator.restarts if self.estimator is not None else 0
        if restarts <= self._restarts_told:
            return None
        self._restarts_told = restarts
        return Message(
            f"Cannikin: step {self.step}: the noise statistics changed (the recent window's bounds left the run's);"
            " the noise-scale averages restart from the recent window"
        )

    def step_done(self) -> int:
        """A step (or micro-step) ran on every rank. Returns the steps run."""
        self.step += 1
        return self.step

    def check_due(self) -> bool:
        """Whether every rank asks its local change check now (the same answer on every rank)."""
        return self.replanner.check_due(self.step)

    def after_step(
        self, changed: bool, resizable: bool = True, epoch_end: bool = False, decides: bool = True
    ) -> tuple[bool, bool]:
        """``(re-plan now, reconsider the total too)`` after the step just done, every rank alike.

        Args:
            changed: the ranks' vote after this step: some rank's check saw its speed change (kept until a re-plan
                takes it).
            resizable: the epoch may change length mid-epoch.
            epoch_end: the epoch ended (its end decides; the total may change there).
            decides: this step may re-plan (``False``: the epoch's end or a stream's next epoch decides; the vote is
                kept for it).

        """
        self.replanner.voted(changed)
        if not decides:
            return False, False
        return self.replanner.after_step(self.step, self.noise.bounds, resizable, epoch_end)

    def epoch_end(self) -> tuple[bool, bool]:
        """``(re-plan now, reconsider the total too)`` at an epoch's end (the vote of its last step kept)."""
        return self.replanner.after_step(self.step, self.noise.bounds, epoch_end=True)

    # -- a re-plan ---------------------------------------------------------------------------------------------------

    def decide(
        self, records: list[StepRecord], current: Plan | None, mid_epoch: bool, adapt_total: bool
    ) -> tuple[Decision | None, list[Message]]:
        """Rank zero: fold in every rank's ``records`` and decide the plan after ``current`` (``None`` while some
        rank has no timing yet), with what it has to say. ``mid_epoch``: the plan applies within the running epoch
        (the accumulation waits for an epoch's end); ``adapt_total``: the total may change now."""
        model, base = self.speed_model, self.base
        assert model is not None and base is not None, "configure() and start() first"
        messages: list[Message] = []
        model.add(records)
        if model.drifts:
            messages.append(Message(f"Cannikin: ranks {model.drifts} changed speed; their models follow the change."))
        self.history.observe(records)
        if current is None or not model.ready:
            return None, messages
        settle_at = self.replanner.settle_at
        if settle_at is not None and self.step >= settle_at:  # after a move, its sizes timed: was it as predicted?
            miss = missed_prediction(self.step, current, model, self.policy.split_margin)
            if miss is not None:
                messages.append(Message(miss))
        noise, policy = self.noise, self.policy
        decision = decide(model, current, policy, noise.bounds, base, adapt_total, self.adam, noise.estimate, mid_epoch)
        decision = replace(decision, changing=model.changing, unconfirmed=model.watch.unconfirmed)
        return decision, messages

    def adopt(
        self, current: Plan | None, decision: Decision | None, adapt_total: bool, epoch: int = 0, decided: bool = True
    ) -> tuple[bool, list[Message]]:
        """Every rank: the broadcast ``decision`` (``None``: nothing decided) replaces ``current``. Returns whether
        the ranks' change votes start over (the re-plan took a vote's yes) and, where this controller ``decided`` it
        (rank zero: its speed model holds the fits), what was decided and why."""
        replanner = self.replanner
        if decision is None or current is None:  # some rank has no timing yet: the next re-plan waits as after any
            replanner.replanned(self.step, total_changed=False)
            return False, []
        took_vote = replanner.changed
        replanner.followed(self.step, current, decision, adapt_total, self.noise.bounds)
        model, plan = self.speed_model, decision.plan
        changed = list(model.drifts) if decided and model is not None else []
        self.history.append(self.step, epoch, plan, decision.lr_factor, self.noise.estimate, changed)
        if not decided:
            return took_vote, []
        messages = [Message(explain(self.step, decision, current, self.policy))]
        if decision.identified and model is not None:
            weight = dead_weight(*model.pieces(), plan.local_batch_sizes, model.lower, model.upper)
            if weight is not None and weight.rank not in self._dead_weights:  # said once a rank
                self._dead_weights.add(weight.rank)
                messages.append(Message(weight.message(), warn=True))
        return took_vote, messages

    @property
    def probe_steps(self) -> int:
        """Steps a probe alternates with the split it leaves (mid-epoch) while the speeds are not all measured."""
        return 0 if self.replanner.identified else self.replanner.warmup_steps

    def profile(self) -> dict[str, Any] | None:
        """The run profile (:func:`~lightning_cannikin.core.profile.build_profile`; ``None`` before any fit)."""
        if self.speed_model is None:
            return None
        base = self.estimator.base_batch_size if self.estimator is not None else None
        trail = self.trail.points or None  # None: from the history (no statistics measured)
        return build_profile(self.speed_model, self.history.entries, base, trail)

    # -- checkpoints -------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything that decides what comes next (the settings are the run's, not the state's)."""
        return {
            "balancer": self.speed_model.state_dict() if self.speed_model is not None else None,
            "estimator": self.estimator.state_dict() if self.estimator is not None else None,
            "progress": self.progress.state_dict(),
            "history": self.history.entries,
            "step": self.step,
            "replanner": self.replanner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], world_size: int, restarted: bool = True) -> None:
        """Put a :meth:`state_dict` back (after :meth:`configure` and :meth:`start`). ``restarted``: the devices
        start again (their warm-up is left out of the speed model's change watch); on another number of ranks the
        speeds are measured again."""
        if state["balancer"] is not None and self.speed_model is not None:
            self.speed_model.load_state_dict(state["balancer"])
            if restarted:
                self.speed_model.restarted(int(state["step"]))
        if state["estimator"] is not None and self.estimator is not None:
            self.estimator.load_state_dict(state["estimator"])
            self._restarts_told = self.estimator.restarts  # told by the run that saved it
        self.progress.load_state_dict(state["progress"])
        self.history.entries = list(state["history"])
        self.step = int(state["step"])
        # checkpoints older than the Replanner kept some of its state at the top level
        self.replanner.load_state_dict(state.get("replanner", state))
        same_devices = state["balancer"] is not None and state["balancer"]["world_size"] == world_size
        self.replanner.identified = self.replanner.identified and same_devices
        self.noise = self.noise_rule.read(self.estimator)
