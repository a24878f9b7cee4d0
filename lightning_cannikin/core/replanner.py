"""Every "when" of a balancing run, owned by one object: the :class:`Replanner`.

It says when to re-plan mid-epoch (every few steps while some device's speed is unmeasured, on a fixed cadence, when a
rank's local check sees its speed change, while a new plan waits to be timed), when to ask the ranks' change checks,
when to reconsider the total batch (when the noise scale's bounds call for a move under the rule the last choice was
made by, not on a clock), how often to measure the noise statistics, and whether an epoch's end re-plans when nothing
asks for it (less often while re-plans keep finding the plan in force). Its :meth:`Replanner.state_dict` is complete:
a resumed run makes the same calls as one that was not interrupted. The engine, the replays in ``benchmarks/replay.py``
and ``benchmarks/replan_rules.py`` all drive this one object.

Pure Python: imports neither torch nor Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_cannikin.core.interval_choice import TotalOptions

__all__ = ["BACKOFF", "CHANGE_SETTLE_SHARE", "ROUTINE_GAP_CAP", "Replanner"]

# the most steps an epoch end waits between re-plans nothing asked for: the fits still take in a slow drift that no
# change check sees at least this often
ROUTINE_GAP_CAP = 1024
# the routine gap's growth at each re-plan that keeps the plan: one geometric back-off
BACKOFF = 2
# the share of the warm-up after which a change of speed's re-split comes: the rescaled model's split is near the new
# optimum already, so few steps run its guess
CHANGE_SETTLE_SHARE = 0.5

Bounds = tuple[float, float] | None


@dataclass
class Replanner:
    """When a balancing run re-plans, reconsiders its total, asks the change checks and measures the noise.

    Every rank holds one and feeds it the same facts (the step count, the noise bounds every estimator shares, the
    ranks' one-bit change vote, the decisions rank zero broadcast), so every rank answers alike with no collective.

    Args:
        warmup_steps: while some rank's slope is not measured (:attr:`identified` false), re-plan every this many
            steps: the first re-plan probes a second batch size on every rank, the next one balances. Not used when
            the split is even (an even split probes nothing, so it would re-plan forever for no change).
        every_n_steps: also re-plan every this many steps (``None``: never on a cadence).
        adapt_every_n_steps: mid-epoch, reconsider the total batch when the noise scale's bounds call for a move
            (:meth:`total_due`), but no sooner than this many steps after the last
            reconsideration (a floor, not a clock; ``None``: at epoch ends only).
        check_every_n_steps: ask every rank's :class:`~lightning_cannikin.core.change.LocalChangeCheck` after every
            this many steps (:meth:`check_due`, the same steps on every rank); a yes from any rank re-plans at that
            step (``None``: never). The check itself is local; only its one-bit answer must reach every rank.
        noise_every_n_steps: measure the noise statistics one optimizer step in this many once only a drift of the
            noise scale could move the total (:meth:`noise_every`).
        balance: the split follows the devices' speeds (else it stays even: nothing to identify or settle).
        adaptive: the total batch follows the noise scale (a ``max_batch_size`` is set).

    """

    warmup_steps: int = 8
    every_n_steps: int | None = None
    adapt_every_n_steps: int | None = 1
    check_every_n_steps: int | None = 4
    noise_every_n_steps: int = 8
    balance: bool = True
    adaptive: bool = False
    # the state (all of it in state_dict)
    identified: bool = False  # rank zero's word, broadcast: every rank's slope has been measured
    changed: bool = False  # the ranks' vote at the latest check step said a speed changed, and no re-plan took it yet
    last_replan_step: int = 0
    last_adapt_step: int = 0
    adapted: bool = False  # a total batch was chosen with statistics that allow it
    settle_at: int | None = None  # a re-plan due once a new total batch has been timed at its new sizes
    total_options: TotalOptions | None = None  # the candidates it was chosen among, and the rule's margin
    # steps an epoch end waits after the last re-plan when nothing asks for one: doubled by every re-plan that keeps
    # the plan in force (up to ROUTINE_GAP_CAP), none after one that changes it
    routine_gap: int = 0
    # a rescale not confirmed yet (a passing stall may have been taken for a change) moved the split: re-plan every
    # warm-up until it is confirmed or undone, so that a rank is not left at the share a stall gave it
    unconfirmed_moved: bool = False
    # the last reconsideration, on evidence, found no total the accumulation in force reaches (a mid-epoch one, whose
    # accumulation is fixed): the next waits for an epoch's end, instead of one re-plan at every step until then
    unreachable: bool = False

    def __post_init__(self) -> None:
        if int(self.warmup_steps) < 1:
            raise ValueError(f"`warmup_steps` must be >= 1, got {self.warmup_steps}.")
        if self.every_n_steps is not None and int(self.every_n_steps) < 1:
            raise ValueError(f"`replan_every_n_steps` must be a positive integer or None, got {self.every_n_steps}.")
        for name in ("adapt_every_n_steps", "check_every_n_steps"):
            every = getattr(self, name)
            if every is not None and (isinstance(every, bool) or int(every) < 1):
                raise ValueError(f"`{name}` must be a positive integer or None, got {every}.")

    # -- what is due after a step ----------------------------------------------------------------------------------

    def after_step(
        self, step: int, bounds: Bounds, resizable: bool = True, epoch_end: bool = False
    ) -> tuple[bool, bool]:
        """``(re-plan now, reconsider the total too)`` after ``step`` steps, every rank alike, at the noise ``bounds``
        every rank holds (``None``: none yet); ``resizable``: the epoch may change length mid-epoch; ``epoch_end``:
        the epoch ended, and its end decides (:meth:`epoch_end_due`; the total may change there). Mid-epoch the total
        is reconsidered where :attr:`adaptive`, ``resizable``, the speeds are measured and :meth:`total_due` says so;
        a re-plan is also due as :meth:`due` says."""
        if epoch_end:
            return self.epoch_end_due(step, bounds), True
        adapt = self.adaptive and resizable and self.speeds_known and self.total_due(bounds, step)
        return adapt or self.due(step), adapt

    @property
    def speeds_known(self) -> bool:
        """Every rank's speed is measured, or the split is even (nothing to measure)."""
        return self.identified or not self.balance

    def voted(self, changed: bool) -> None:
        """The ranks' change vote after this step (read on every step, true only at a :meth:`check_due` step): a yes
        is kept until a re-plan takes it (an epoch's last step hands it to the epoch's end)."""
        self.changed = changed

    def noise_every(self) -> int:
        """Optimizer steps per noise measurement: every step where the total batch follows the noise scale (a move may
        be proven, or a drift caught, at any step, and a measurement skipped is evidence lost: one step in ``k``
        leaves about ``k`` times fewer effective steps in the average, and its bounds that much wider), one in
        ``noise_every_n_steps`` where the total is fixed (the AdaScale gain alone reads it)."""
        return 1 if self.adaptive else self.noise_every_n_steps

    def check_due(self, step: int) -> bool:
        """Whether every rank asks its local change check after ``step`` steps (the same answer on every rank)."""
        every = self.check_every_n_steps
        return every is not None and step % every == 0

    def total_due(self, bounds: tuple[float, float] | None, step: int, epoch_end: bool = False) -> bool:
        """Whether to reconsider the total batch mid-epoch after ``step`` steps: the noise scale has bounds (``None``
        until the statistics have a spread, :meth:`~lightning_cannikin.core.noise_scale.NoiseScaleEstimator.bounds`),
        at least ``adapt_every_n_steps`` steps passed since the last reconsideration, and either no options are held
        (no total was chosen with bounds yet, or a resume or a change of speed dropped them) or the last choice's
        options call for a move at these bounds (:meth:`TotalOptions.moves
        <lightning_cannikin.core.interval_choice.TotalOptions.moves>`, kept here by :meth:`adapted_at`). Not while a
        re-plan waits for new sizes to be timed (:attr:`settle_at`): their times would be the model's guesses. Every
        rank holds the same bounds and options, so every rank answers alike at the same step, with no collective. At
        an ``epoch_end`` the floor does not apply (the epoch's end may change the total whatever
        ``adapt_every_n_steps`` says), and options chosen with the accumulation held do not speak for it."""
        floor = 0 if epoch_end else self.adapt_every_n_steps
        if bounds is None or floor is None or step - self.last_adapt_step < floor:
            return False
        if self.settle_at is not None and step < self.settle_at:
            return False  # some rank runs sizes its model has not timed yet: the settling re-plan reconsiders
        if self.unreachable and not epoch_end:
            return False  # no total within reach until the accumulation may change
        if self.total_options is None or (epoch_end and self.total_options.held):
            return True
        return self.total_options.moves(bounds)

    def adapted_at(self, step: int, ready: bool, options: TotalOptions | None = None) -> None:
        """The total batch was reconsidered after ``step`` steps (at an epoch end too); ``options``: the decision's
        (:attr:`~lightning_cannikin.core.policy.Decision.total_options`, for :meth:`total_due`)."""
        self.last_adapt_step = step
        self.adapted = self.adapted or ready
        self.unreachable = ready and options is None
        if options is not None:
            self.total_options = options

    def followed(self, step: int, previous: Any, decision: Any, adapted: bool = False, bounds: Bounds = None) -> None:
        """A re-plan after ``step`` steps adopted ``decision`` (a :class:`~lightning_cannikin.core.policy.Decision`)
        in place of the plan ``previous``; ``adapted``: the total was reconsidered, at the noise ``bounds``. Keeps
        the options the total was chosen among (:meth:`adapted_at`), what the next re-plans wait for
        (:meth:`replanned`) and whether the speeds are measured; the change vote it answered is spent."""
        plan = decision.plan
        if adapted:  # chosen on evidence where the noise scale has bounds and the speeds are known
            self.adapted_at(step, bounds is not None and self.speeds_known, decision.total_options)
        total_changed = plan.total_batch_size != previous.total_batch_size
        # a new total, a walk to a device's knee, a split moved by a rescale that may be a passing stall, or a change of
        # speed the model followed: re-split once timed (a check fired by what the model does not see settles nothing)
        kept = plan.local_batch_sizes == previous.local_batch_sizes and not total_changed
        timing = total_changed or decision.untimed
        changed = self.changed and decision.changing
        self.replanned(step, timing, changed, kept, decision.unconfirmed)
        self.changed = False
        self.identified = decision.identified

    def due(self, step: int) -> bool:
        """Whether the ranks re-plan after ``step`` steps whatever the total does: the vote said a device's speed moved
        clearly (:attr:`changed`), a warm-up step while some speed is unmeasured, the cadence, or a plan to settle."""
        balance = self.balance
        if self.changed and balance:
            return True
        warming_up = balance and not self.identified and step % self.warmup_steps == 0
        periodic = self.every_n_steps is not None and step - self.last_replan_step >= self.every_n_steps
        settling = self.settle_at is not None and step >= self.settle_at
        return warming_up or periodic or settling

    def epoch_end_due(self, step: int, bounds: Bounds) -> bool:
        """Whether an epoch's end re-plans: something asks for it (a speed not yet measured, :attr:`changed`: some
        rank's check saw a change, a re-plan waiting to settle, the total batch: :meth:`total_due` at ``bounds``,
        where :attr:`adaptive`), or :attr:`routine_gap` steps ran since the last re-plan. While re-plans keep finding
        the plan in force, they come at every other epoch end, then every fourth, up to ``ROUTINE_GAP_CAP`` steps
        apart (:meth:`replanned`): each is rank zero's fit and decision while the other ranks wait."""
        total = self.adaptive and self.total_due(bounds, step, epoch_end=True)
        pending = not self.speeds_known or self.changed or total or self.settle_at is not None
        return pending or step - self.last_replan_step >= self.routine_gap

    def replanned(
        self, step: int, total_changed: bool, changed: bool = False, kept: bool = False, unconfirmed: bool = False
    ) -> None:
        """A re-plan happened after ``step`` steps. A new total (or a split beyond the sizes a rank was timed at:
        ``total_changed``) puts ranks at sizes their models extrapolated to: re-split once ``warmup_steps`` steps have
        timed the new plan. After a change of speed (``changed``: the re-plan a local check asked for) the model is
        rescaled from a few steps at one size and the split already near the new optimum: re-split after half as
        many, so that few steps run the rescaled model's guess, and drop the options the total was chosen among (they
        were for the old speeds). An even split has nothing to re-split. ``kept``: the plan in force was kept (the
        routine gap doubles; a new plan resets it; after a change, no rank runs a size it was not timed at, so there
        is nothing to settle). ``unconfirmed``: some rank was rescaled lately and may return to its old speed; once a
        re-plan moved the split since, re-plan every ``warmup_steps`` until it is confirmed or undone. While the split
        stays the one before the rescale, no rank runs a share the rescale gave it: the next re-plan judges it, and
        re-plans that would each keep the split (rank zero's fit while the others wait) are not run."""
        # one geometric back-off: the gap doubles (from the steps since the last re-plan, if more) while re-plans keep
        # the plan, and starts over at the first one that moves it
        gap = max(BACKOFF * self.routine_gap, step - self.last_replan_step)
        self.routine_gap = min(gap, ROUTINE_GAP_CAP) if kept else 0
        self.last_replan_step = step
        if changed and self.last_adapt_step != step:
            # the options held the step times of the old speeds: reconsider the total at the next step the
            # floor allows (as after a resume), not when the noise scale happens to move
            self.total_options = None
        settle = max(int(CHANGE_SETTLE_SHARE * self.warmup_steps), 1) if changed else self.warmup_steps
        self.unconfirmed_moved = unconfirmed and (self.unconfirmed_moved or not kept)
        # a change re-plan that kept the split left every rank at sizes it was timed at: nothing to settle
        follow = total_changed or self.unconfirmed_moved or (changed and not kept)
        self.settle_at = step + settle if follow and self.balance else None

    # -- checkpoints ---------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything that decides what is due next (the settings are the run's, not the state's)."""
        options = self.total_options
        return {
            "identified": self.identified,
            "changed": self.changed,
            "last_replan_step": self.last_replan_step,
            "last_adapt_step": self.last_adapt_step,
            "adapted": self.adapted,
            "settle_at": self.settle_at,
            "total_options": None if options is None else options.to_dict(),
            "routine_gap": self.routine_gap,
            "unconfirmed_moved": self.unconfirmed_moved,
            "unreachable": self.unreachable,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put a :meth:`state_dict` back. Older checkpoints lack some keys: a missing ``settle_at`` or vote is none, and
        without options the total is reconsidered at the next step (a saved noise band is no longer used)."""
        self.identified = bool(state.get("identified", False))
        self.changed = bool(state.get("changed", False))
        self.last_replan_step = int(state["last_replan_step"])
        self.last_adapt_step = int(state["last_adapt_step"])
        self.adapted = bool(state["adapted"])
        settle_at = state.get("settle_at")
        self.settle_at = None if settle_at is None else int(settle_at)
        options = state.get("total_options")
        self.total_options = None if options is None else TotalOptions.from_dict(options)
        self.routine_gap = int(state["routine_gap"])
        self.unconfirmed_moved = bool(state.get("unconfirmed_moved", False))
        self.unreachable = bool(state.get("unreachable", False))
