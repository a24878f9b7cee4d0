"""The one decision policy: from a step-time model, the plan in force and the noise scale to the next plan and LR.

:func:`decide` chooses the total batch (goodput, when allowed), its split (OptPerf, an even split, or a probe while
some device's slope is unmeasured) and the learning-rate factor and AdaScale gain that go with it. The Lightning
callback calls it on rank zero with its fitted :class:`~lightning_cannikin.core.speed_model.SpeedModel`; the
simulator calls it with its cluster model. Both answer the :class:`StepTimeModel` calls, so a projection of the
simulator is the library's own decision.

Pure: numpy and the project's maths modules only (no torch, no Lightning).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike

from lightning_cannikin.core.goodput import ADAPT_MARGIN, CANDIDATES, adascale_gain, candidate_batch_sizes
from lightning_cannikin.core.interval_choice import IntervalChoice, TotalOptions, relative_gain
from lightning_cannikin.core.lr_scaling import lr_factor, validate_rule
from lightning_cannikin.core.optperf import most_even_split
from lightning_cannikin.core.plan import Plan, even_split

# candidate micro-step globals, their accumulation steps, their predicted step times, the kept total's time
Candidates = tuple[np.ndarray, np.ndarray, np.ndarray, float]
# what is known of the noise scale: a value, the (low, high) bounds the statistics prove, or nothing yet
NoiseEvidence = float | tuple[float, float] | None

__all__ = [
    "Decision",
    "PolicySettings",
    "StepTimeModel",
    "accumulated",
    "decide",
    "gain_noise_scale",
    "learning_rate_scale",
    "margin_over_jitter",
    "noise_bounds",
]

# the relative step-time gain a re-split must promise: timing noise on identical devices must not move their split
SPLIT_MARGIN = 0.02


class StepTimeModel(Protocol):
    """What :func:`decide` asks of a model of the cluster's step time (times per micro-step, in seconds)."""

    world_size: int

    @property
    def lower(self) -> Sequence[int]: ...

    @property
    def upper(self) -> Sequence[int] | None: ...

    @property
    def identified(self) -> bool:
        """Every device's slope is measured, not assumed."""
        ...

    def optperf(self, total_batch_sizes: Sequence[int], accumulation_steps: ArrayLike = 1) -> np.ndarray:
        """Best step time of each global batch under the bounds, run ``accumulation_steps`` times per optimizer step
        (``inf`` where infeasible)."""
        ...

    def predict(self, local_batch_sizes: ArrayLike, accumulation_steps: ArrayLike = 1) -> float | np.ndarray:
        """Step time of a split (shape ``(n,)``), or of each row of a ``(C, n)`` array, times its micro-steps."""
        ...

    def plan_split(self, total_batch_size: int) -> Plan:
        """The OptPerf split of a global batch, with its predicted step time."""
        ...

    def probe(self, local_batch_sizes: Sequence[int]) -> tuple[int, ...]:
        """A perturbed split (same total) that makes every device run a new batch size."""
        ...


@dataclass(frozen=True)
class PolicySettings:
    """The user's choices that shape every decision.

    Args:
        max_batch_size: the largest total batch (per optimizer step) to consider; ``None`` keeps the total batch.
        balance: split by the model's speeds (OptPerf); ``False`` splits as evenly as the bounds allow (AdaptDL).
        margin: relative goodput gain required to change the total batch (hysteresis).
        lr_scaling: one of :data:`~lightning_cannikin.core.lr_scaling.RULES`.
        candidates: geometric candidate total batches per decision.
        accumulate: reach totals beyond what the devices hold in one micro-step with gradient accumulation (the
            fewest micro-steps that fit, the same on every rank). ``False`` keeps the accumulation in force.
        split_margin: relative step-time gain required to re-split a global batch (hysteresis): the most even split,
            or else the split in force, is kept while the model's best split is predicted faster by less than this.
            Timing noise on identical devices then leaves their split alone instead of chasing it.

    """

    max_batch_size: int | None = None
    balance: bool = True
    margin: float = ADAPT_MARGIN
    lr_scaling: str = "adascale"
    candidates: int = CANDIDATES
    accumulate: bool = False
    split_margin: float = SPLIT_MARGIN

    def __post_init__(self) -> None:
        if self.max_batch_size is not None and (isinstance(self.max_batch_size, bool) or self.max_batch_size < 1):
            raise ValueError(f"`max_batch_size` must be a positive integer or None, got {self.max_batch_size}.")
        if not self.margin >= 0:
            raise ValueError(f"`adapt_margin` must be >= 0, got {self.margin}.")
        if not self.split_margin >= 0:
            raise ValueError(f"`split_margin` must be >= 0, got {self.split_margin}.")
        object.__setattr__(self, "lr_scaling", validate_rule(self.lr_scaling))

    def check_initial(self, plan: Plan) -> None:
        """Refuse a first plan whose total already exceeds ``max_batch_size`` (it would train on, silently)."""
        cap = self.max_batch_size
        if cap is not None and plan.total_batch_size > cap:
            raise ValueError(
                f"`max_batch_size`={cap} is smaller than the initial total batch of {plan.total_batch_size}"
                f" ({list(plan.local_batch_sizes)} per rank x {plan.accumulation_steps} accumulation step(s)). Raise"
                " `max_batch_size`, or lower the DataLoader `batch_size` (or `accumulate_grad_batches`)."
            )


@dataclass(frozen=True)
class Decision:
    """What every rank adopts after a re-plan.

    Attributes:
        plan: the plan to run next, with its predicted step time.
        lr_factor: the multiplier of the base learning rate for the plan's total batch, at the noise bounds of the
            decision (for the history and the report: each step computes its own from the bounds it starts with).
        identified: whether every device's slope was measured when the decision was made.
        total_options: the candidate totals and step times the total decided here was chosen among (``None`` when
            the total was not considered). Every rank holds the same noise bounds and these options, so each can tell
            on its own, and at the same step, when the bounds call for a move
            (:meth:`~lightning_cannikin.core.replanner.Replanner.total_due`).
        untimed: the plan puts some rank beyond the sizes it was timed at lately (a walk towards a knee): re-plan
            once it has been timed there, as after a change of total (``Replanner.replanned(total_changed=)``).
        best_total: the total batch with the largest sure share of the best goodput over the noise bounds
            (:mod:`~lightning_cannikin.core.interval_choice`; ``None``: the total was not reconsidered).
        total_gain: its sure share's relative gain over keeping the total in force, against the margin
            (``PolicySettings.margin``) it had to beat to be adopted (``None``: not reconsidered).
        changing: the speed model had just followed a clear change of some rank's speed, or held a suspected one
            apart (``SpeedModel.changing``; set by the engine): a re-plan that a local change check asked for is
            followed by a settling one once the new plan is timed; without it there is nothing to settle.
        unconfirmed: some rank was rescaled lately and may yet return to its old speed (a passing stall; set by the
            engine from ``SpeedModel.watch``): once a re-plan has moved the split since, re-plan again every warm-up
            until it is confirmed or undone (``Replanner.replanned``).
        split_gain: the best split's predicted relative step-time gain over the split kept in its place (the most
            even one or the one in force; the smallest such gain when none is kept), against ``split_margin``
            (``None``: no split was weighed, e.g. a probe or an even split).
        split_margin: the margin it was weighed against: ``split_margin``, or the devices' own step-time jitter
            where that is larger (``None``: no split was weighed).

    """

    plan: Plan
    lr_factor: float
    identified: bool
    untimed: bool = False
    best_total: int | None = None
    total_gain: float | None = None
    split_gain: float | None = None
    changing: bool = False
    split_margin: float | None = None
    unconfirmed: bool = False
    total_options: TotalOptions | None = None


@lru_cache(maxsize=256)  # asked every step with the same few arguments (pure, small, immutable result)
def learning_rate_scale(
    rule: str,
    total_batch_size: int,
    base_batch_size: int,
    bounds: tuple[float, float] | None,
    adam: bool = False,
    estimate: float | None = None,
) -> tuple[float, float]:
    """``(lr factor, AdaScale gain)`` of a step at ``total_batch_size`` with the noise scale's ``bounds`` and point
    ``estimate`` (both 1 at B0 or without statistics): at the noise scale :func:`gain_noise_scale` takes. The one
    computation of both: a decision's factor (:attr:`Decision.lr_factor`) and every step's (the engine's, from the
    bounds and estimate it starts with)."""
    noise_scale = gain_noise_scale(bounds, estimate)
    factor = lr_factor(rule, total_batch_size, base_batch_size, noise_scale, adam)
    return factor, float(adascale_gain(noise_scale, total_batch_size, base_batch_size))


def noise_bounds(noise: NoiseEvidence) -> tuple[float, float] | None:
    """``(low, high)`` from what is known of the noise scale: a known value is both bounds."""
    if noise is None:
        return None
    if isinstance(noise, tuple):
        low, high = float(noise[0]), float(noise[1])
    else:
        low = high = float(noise)
    if not 0.0 <= low <= high:  # also rejects NaN
        raise ValueError(f"Noise-scale bounds must satisfy 0 <= low <= high, got {noise}.")
    return low, high


def gain_noise_scale(bounds: tuple[float, float] | None, estimate: float | None = None) -> float | None:
    """The noise scale a step's AdaScale gain (and learning-rate factor) takes: the point ``estimate`` clamped into the
    ``bounds``, as AdaScale and Pollux take the estimate, never outside what the statistics prove; ``low`` where the
    estimate is not finite (the squared mean gradient's average not yet above zero), ``None`` (a gain of 1) before
    any bounds. The lower bound alone credited 12% too little progress a step on a synthetic gpu-mix replay (a noise
    scale of 700 measured one step in eight: ``low`` about 0.72 of the truth); the gain's elasticity to the noise
    scale is well under 1, so an estimate's error moves it far less. The total's moves still rest on the bounds."""
    if bounds is None:
        return None
    low, high = bounds
    if estimate is None or not math.isfinite(estimate):
        return low
    return min(max(float(estimate), low), high)


def decide(
    model: StepTimeModel,
    current: Plan,
    settings: PolicySettings,
    noise_scale: NoiseEvidence,
    base_batch_size: int,
    adapt_total: bool = True,
    adam: bool = False,
    estimate: float | None = None,
    mid_epoch: bool = False,
) -> Decision:
    """The plan to adopt next, and the learning-rate scale that goes with it.

    Args:
        model: the step-time model (a fitted speed model, or the simulator's cluster).
        current: the plan in force.
        settings: the user's policy settings.
        noise_scale: what is known of the gradient noise scale: the ``(low, high)`` bounds the statistics prove
            (:meth:`~lightning_cannikin.core.noise_scale.NoiseScaleEstimator.bounds`), a known value, or ``None``
            (nothing yet: the total batch is kept).
        base_batch_size: B0, the total batch the learning rate was tuned for.
        adapt_total: whether the total batch may change now (the Replanner's word; ``False`` mid-epoch where the
            epoch's length cannot change).
        adam: whether the optimizer is Adam-family (the square root of the AdaScale gain).
        estimate: the noise scale's point estimate: the learning-rate factor's gain takes it within the bounds
            (:func:`gain_noise_scale`).
        mid_epoch: the plan applies within the running epoch: the accumulation in force is held (it changes at epoch
            ends only, as Lightning's GradientAccumulationScheduler changes it, so that no window straddles two
            values), and options it leaves out totals from are marked ``held`` for the epoch's end to reconsider.

    The total is chosen over the whole interval of noise scales the bounds allow
    (:class:`~lightning_cannikin.core.interval_choice.TotalOptions`): the candidate whose least share of the best
    goodput anywhere in the interval is largest (minimax regret), moved to only where that share gains more than the
    margin, and only as far as stays within the margin of the best total at the end of the interval the move goes
    away from (the lower bound for a larger total). A move thus costs at most the margin wherever the truth lies, and
    an infinite upper bound never sets how far the total grows. With both bounds equal it is the goodput choice at
    that noise scale.

    While some device's slope is not yet identified (one batch size seen), a balancing decision perturbs the current
    split instead, so that every rank runs a new batch size and the next re-plan can measure it; the total batch
    waits. An even split never probes: like AdaptDL, it chooses the total batch from the one-size prior until a
    change of total batch measures the slope.
    """
    bounds = noise_bounds(noise_scale)
    held = mid_epoch and settings.accumulate
    settings = replace(settings, accumulate=False) if held else settings
    global_batch, accumulation = current.global_batch_size, current.accumulation_steps
    choice, split_gain, split_margin = None, None, None
    adapt = adapt_total and settings.max_batch_size is not None and bounds is not None
    adapt = adapt and (model.identified or not settings.balance)  # the total waits for measured speeds
    candidates = _candidates(model, current, settings, base_batch_size) if adapt else None
    options = _options(candidates, current.total_batch_size, settings, base_batch_size)
    if adapt:
        # the largest micro-step global batch whose split keeps every rank within the model's upper bounds: for a
        # speed model its caps and ``evidence_reach`` times the largest batch each rank has run
        reachable = _held(model.upper, model.world_size, settings.balance)
        global_batch, accumulation, choice = _choose_total(options, candidates, current, bounds, reachable)  # type: ignore[arg-type]
    if settings.balance and not model.identified:
        # a slope guessed from one batch size can be far off (AdaptDL's prior puts half the time in the intercept):
        # rather than act on it, move every rank a little from where it is, so the next re-plan measures slopes
        sizes = model.probe(current.local_batch_sizes)
    elif settings.balance:
        # a gain within the devices' own jitter is not evidence: on tiny steps of a shared host the fitted slopes are
        # scheduler noise, and acting on them moves identical devices to splits such as [1, 10, 85]
        split_margin = margin_over_jitter(model, settings.split_margin)
        sizes, split_gain = _split(model, current, global_batch, split_margin)
    else:
        sizes = most_even_split(global_batch, model.world_size, model.lower, _upper(model, global_batch))
        sizes = sizes.local_batch_sizes
    plan = Plan(sizes, accumulation, predicted_step_time=float(model.predict(sizes)))
    if adapt and (plan.global_batch_size, accumulation) != (current.global_batch_size, current.accumulation_steps):
        candidates = _candidates(model, plan, settings, base_batch_size)  # the kept total's time is the new one's
        options = _options(candidates, plan.total_batch_size, settings, base_batch_size)
    if held and options is not None and (accumulation > 1 or max(options.totals) < (settings.max_batch_size or 0)):
        # the epoch's end may run these totals in fewer micro-steps, or reach larger ones by accumulating (options
        # exist only where max_batch_size does: the `or 0` is for the type checker)
        options = replace(options, held=True)
    factor, _ = learning_rate_scale(settings.lr_scaling, plan.total_batch_size, base_batch_size, bounds, adam, estimate)
    timed = getattr(model, "timed", None)  # a model that knows which sizes it timed lately
    untimed = settings.balance and model.identified and timed is not None and not timed(plan.local_batch_sizes)
    total_gain = None if choice is None else choice.gain
    best_total = None if choice is None else choice.batch_size
    return Decision(
        plan,
        factor,
        model.identified,
        bool(untimed),
        best_total,
        total_gain,
        split_gain,
        split_margin=None if split_gain is None else split_margin,
        total_options=options,
    )


def margin_over_jitter(model: StepTimeModel, margin: float) -> float:
    """``margin``, or the model's own step-time jitter where that is larger (a model without one has none): a
    difference of predicted step times within the devices' jitter is not evidence."""
    return max(margin, float(getattr(model, "jitter", 0.0)))


def _upper(model: StepTimeModel, total_batch_size: int) -> Sequence[int] | None:
    """The upper bounds a split of ``total_batch_size`` takes: a speed model's reach holds the totals its decisions
    choose, and gives way to its caps for one it did not (:meth:`SpeedModel.upper_for
    <lightning_cannikin.core.speed_model.SpeedModel.upper_for>`)."""
    upper_for = getattr(model, "upper_for", None)
    return model.upper if upper_for is None else upper_for(total_batch_size)


def _split(
    model: StepTimeModel, current: Plan, global_batch: int, margin: float
) -> tuple[tuple[int, ...], float | None]:
    """The model's best split of ``global_batch``, unless the most even one or else the split in force (same global
    batch) is predicted within ``margin`` of it: a gain that small is within the timing noise, and chasing it moves
    identical devices apart on noise alone. The even split comes first, so a probe's split is not kept for being no
    worse than the noise. A split is kept only where the model's ``supports`` (if it has one) says its prediction is
    evidence, not an extrapolation. Also returns the best split's predicted gain over the split kept (else the
    smallest gain over those weighed; ``None`` when none was inside the bounds)."""
    best = model.plan_split(global_batch).local_batch_sizes
    best_time = float(model.predict(best))
    limit = best_time * (1.0 + margin)
    upper = _upper(model, global_batch)
    kept = [most_even_split(global_batch, model.world_size, model.lower, upper).local_batch_sizes]
    if global_batch == current.global_batch_size:
        kept.append(current.local_batch_sizes)
    lower = np.asarray(model.lower)
    upper = None if upper is None else np.asarray(upper)
    supports = getattr(model, "supports", None)  # a model that knows where its predictions are evidence
    gains = []
    for sizes in kept:
        inside = bool(np.all(lower <= sizes)) and (upper is None or bool(np.all(np.asarray(sizes) <= upper)))
        if not inside or (supports is not None and not supports(sizes)):
            continue
        time = float(model.predict(sizes))
        gains.append(relative_gain(time, best_time))
        if time <= limit:
            return tuple(sizes), gains[-1]
    return tuple(best), min(gains, default=None)


def _options(
    candidates: Candidates | None, total: int, settings: PolicySettings, base_batch_size: int
) -> TotalOptions | None:
    """The interval rule's view of ``candidates`` (from :func:`_candidates`) with ``total`` in force."""
    if candidates is None:
        return None
    micro, steps, times, kept = candidates
    # Keeping the total batch means running it at its best split (re-splitting is free), not at the current split:
    # a stale split must not credit a change of total batch with the gain of re-balancing.
    totals = tuple(int(t) for t in micro * steps)
    return TotalOptions(totals, tuple(float(t) for t in times), total, kept, base_batch_size, settings.margin)


def _choose_total(
    options: TotalOptions | None,
    candidates: Candidates | None,
    current: Plan,
    bounds: tuple[float, float],
    reachable: int | None = None,
) -> tuple[int, int, IntervalChoice | None]:
    """``(global batch, accumulation steps)`` to run next among ``candidates`` (from :func:`_candidates`, as the
    interval rule sees them: ``options``), or the current ones, and the choice over the noise interval that decided it
    (``None`` when no candidate fits).

    A larger total whose micro-step global batch lies beyond ``reachable`` (``None``: no bound) is the target, not the
    move: the move goes to the largest candidate on the way that lies within it (none: the total is kept), and the
    choice's options call for the next move once that one is timed."""
    if options is None or candidates is None:
        return current.global_batch_size, current.accumulation_steps, None
    choice = options.choose(*bounds)
    if not choice.adopted:
        return current.global_batch_size, current.accumulation_steps, choice
    micro, steps, _, _ = candidates
    totals = micro * steps
    index = int(np.flatnonzero(totals == choice.batch_size)[0])
    if reachable is not None and micro[index] > reachable and totals[index] > current.total_batch_size:
        on_the_way = np.flatnonzero(
            (micro <= reachable) & (totals > current.total_batch_size) & (totals < totals[index])
        )
        if on_the_way.size == 0:
            return current.global_batch_size, current.accumulation_steps, choice
        index = int(on_the_way[np.argmax(totals[on_the_way])])
    return int(micro[index]), int(steps[index]), choice


def _held(upper: Sequence[int] | None, n: int, balance: bool) -> int | None:
    """The largest micro-step global batch per-rank ``upper`` bounds hold (``None``: no bound): their sum, or for an
    even split ``n`` times the tightest (an even split of more would overrun the smallest device)."""
    if upper is None:
        return None
    return int(sum(upper)) if balance else n * int(min(upper))


def accumulated(totals: ArrayLike, lowest: int, highest: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The fewest micro-steps that run each total with at most ``highest`` samples each (``None``: no bound), and the
    micro-step global batch, rounded up and at least ``lowest``: ``steps * micro`` exceeds a total by less than
    ``steps``."""
    totals = np.asarray(totals, dtype=np.int64)
    steps = np.ones_like(totals) if highest is None else np.maximum(1, -(-totals // highest))
    return steps, np.maximum(-(-totals // steps), lowest)


def _candidates(
    model: StepTimeModel, current: Plan, settings: PolicySettings, base_batch_size: int
) -> Candidates | None:
    """The candidate totals (micro-step globals and their accumulation), their predicted step times and the time of
    keeping the current total; ``None`` when no candidate fits.

    Candidates run from the base batch to ``max_batch_size`` (per optimizer step), within what a micro-step can
    hold: the sum of the per-rank bounds, or, for an even split, ``n`` times the tightest bound (an even split of more
    would put more than its cap on the smallest device). A step of ``s`` micro-steps costs what the model says (its
    ``accumulation_steps`` argument). A speed model's caps hold them, not the evidence's reach: the choice is the
    target, and the move toward it goes as far as the evidence reaches (:func:`_choose_total`).
    """
    n = model.world_size
    lower_bounds = list(model.lower)
    upper = getattr(model, "caps", model.upper)
    upper_bounds = None if upper is None else list(upper)
    lowest = max(sum(lower_bounds) if settings.balance else n * max(lower_bounds), n)
    highest = _held(upper_bounds, n, settings.balance)
    cap = settings.max_batch_size
    assert cap is not None
    steps_now = current.accumulation_steps
    if settings.accumulate:
        totals = candidate_batch_sizes(max(base_batch_size, lowest), max(cap, lowest), settings.candidates)
        steps, micro = accumulated(totals, lowest, highest)
    else:
        lower = max(-(-base_batch_size // steps_now), lowest)
        upper = cap // steps_now if highest is None else min(cap // steps_now, highest)
        if upper < lower:
            return None
        micro = candidate_batch_sizes(lower, upper, settings.candidates)
        steps = np.full_like(micro, steps_now)
    if settings.balance:
        times = np.asarray(model.optperf(micro, steps), dtype=np.float64)
        kept = float(model.optperf([current.global_batch_size], steps_now)[0])
    else:
        times = np.asarray(model.predict(np.array([even_split(int(g), n) for g in micro]), steps), dtype=np.float64)
        kept_split = most_even_split(
            current.global_batch_size, n, lower_bounds, _upper(model, current.global_batch_size)
        )
        kept = float(model.predict(kept_split.local_batch_sizes, steps_now))
    return micro, steps, times, kept
