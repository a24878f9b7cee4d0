"""What a balancing run is configured with: the user's choices (:class:`EngineOptions`, the arguments of
:class:`~lightning_cannikin.Cannikin`) and the engine's tuning settings (:class:`CannikinSettings`), each frozen and
checked when given.

What users decide (the largest total batch, the bounds, how the learning rate follows the total, whether to balance,
where to re-plan, whether to save the profile) are arguments of :class:`~lightning_cannikin.Cannikin`; how the engine
measures and reacts lives in the settings. The defaults are the measured ones (see ``docs/reliability.md`` and
``benchmarks/results/overhead.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from lightning_cannikin.core.controller import MIN_NOISE_UPDATES, Controller, NoiseRule
from lightning_cannikin.core.noise_scale import NOISE_BOUND_LEVEL
from lightning_cannikin.core.plan import BatchBounds
from lightning_cannikin.core.policy import PolicySettings
from lightning_cannikin.core.replanner import Replanner
from lightning_cannikin.core.speed_model import SpeedModelSettings
from lightning_cannikin.core.timing import HALF_LIFE

__all__ = ["CannikinSettings", "EngineOptions"]


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")


@dataclass(frozen=True)
class CannikinSettings:
    """How the balancing engine measures and reacts.

    | setting | default | what it does |
    |---|---|---|
    | ``warmup_steps`` | 8 | while some device is timed at one batch size, re-plan every this many steps |
    | ``half_life`` | 50.0 | recency half-life of the timing fits, in steps |
    | ``adapt_margin`` | 0.02 | relative goodput gain required to change the total batch (hysteresis) |
    | ``adapt_every_n_steps`` | 1 | fewest steps between mid-epoch reconsiderations of the total (``None``: never) |
    | ``accumulate`` | True | reach totals beyond the upper bounds with gradient accumulation (changed at epoch ends) |
    | ``track_noise_scale`` | None | measure the gradient noise scale (``None``: when it can change something) |
    | ``min_noise_updates`` | 10 | measured steps of noise statistics before the total batch may change |
    | ``noise_every_n_steps`` | 8 | a fixed total measures one optimizer step in this many (an adaptive one, every) |
    | ``noise_exchange_every`` | 4 | measured steps whose statistics share one all-reduce of a few floats |
    | ``noise_bound_level`` | 0.05 | share of runs whose noise bounds may ever miss the truth, however often looked at |
    | ``noise_bound_sigmas`` | None | a fixed width per look instead, in standard errors (``0``: the point estimate) |
    | ``check_every_n_steps`` | 4 | steps between the ranks' speed-change comparisons (``None``: off) |
    | ``evidence_reach`` | 2.0 | no plan gives a rank more than this many times the largest batch it has run |
    | ``progress_bar`` | False | show the total and rank zero's local batch on Lightning's progress bar |

    Args:
        warmup_steps: while some device's speed is not yet measured at two batch sizes, re-plan every this many
            steps: the first re-plan probes a second size on every rank (alternating mid-epoch), the next balances.
        half_life: recency half-life of the timing fits, in steps.
        adapt_margin: relative goodput gain required to change the total batch (hysteresis against the step-time
            model's error). The noise scale's own uncertainty is already in the bounds a move must clear, so this is
            smaller than AdaptDL's 5% on a point estimate: on the gpu-mix time-to-accuracy run a 5% margin held the
            total at 480 for 170,000 samples while each larger one was predicted to gain 2-5%.
        adapt_every_n_steps: with ``max_batch_size``, also reconsider the total batch mid-epoch: once the noise scale
            has bounds, then whenever they call for a move under the last choice's candidates (a check on numbers
            every rank holds alike, no collective), but no sooner than
            this many training steps after the last reconsideration (a floor, not a clock; ``None``: at epoch ends
            only). The bounds move only when exchanged statistics are folded in (every ``noise_exchange_every``
            measured steps), so the default floor of 1 adds nothing to that; a larger one delays a total the
            statistics already call for. A mid-epoch change keeps the accumulation and every sample once;
            not under ``limit_train_batches``.
        accumulate: reach totals beyond what the upper bounds hold in one micro-step with gradient accumulation (the
            same micro-steps on every rank), changed at epoch ends. Off under manual optimization or when the Trainer
            has its own ``accumulate_grad_batches``.
        track_noise_scale: measure the gradient noise scale. ``None``: only when it can change something, i.e. with
            ``max_batch_size`` or with ``lr_scaling="adascale"`` and a ``base_batch_size``.
        min_noise_updates: measured steps of noise statistics required before the total batch may change or the
            AdaScale gain leave 1 (the bounds themselves wait for ten effective steps of spread).
        noise_every_n_steps: where the total batch is fixed (no ``max_batch_size``: the AdaScale gain alone reads the
            noise scale), the statistics are measured on one optimizer step in this many; where it follows the noise
            scale, on every step (a skipped step is evidence lost, and the bounds that prove a move widen). Every
            measurement weighs as the steps it stands for, so the estimate keeps its expectation. A measured step costs
            a few hundred microseconds of host time (``benchmarks/results/README.md``): a large share of a 3 ms CPU
            step, under 1% of a 50 ms one.
        noise_exchange_every: measured steps whose statistics share one all-reduce of a few floats, never waited for
            (the same numbers, folded up to twice this many measured steps later).
        noise_bound_level: the total batch and the AdaScale gain act on bounds ``(low, high)`` of the noise scale
            that, over a whole run, however long and however often they are looked at, exclude the truth in at most
            about this share of runs (:meth:`~lightning_cannikin.core.noise_scale.NoiseScaleEstimator.run_bounds`:
            a Student-t width on the statistics' own spread, spent over the run's windows). The total is chosen over
            the whole interval (:mod:`~lightning_cannikin.core.interval_choice`) and the gain takes the point estimate
            held within the bounds. ``low``
            is finite even while ``|G|^2`` may still be zero, so a larger total that pays is taken early.
        noise_bound_sigmas: instead of ``noise_bound_level``, bounds a fixed number of standard errors wide at each
            look (:meth:`~lightning_cannikin.core.noise_scale.NoiseScaleEstimator.bounds`): each look holds the truth
            with the normal confidence, but a run that looks at every step acts on a bound that misses it in a third
            of runs or more. ``0``: act on the point estimate (which may be infinite) from ``min_noise_updates`` on.
        check_every_n_steps: every rank checks its own step times for a clear change of speed (a co-tenant, a
            throttled device) at no cost; every this many steps the ranks compare the answers in one all-reduce of
            a single number that nobody waits for (read the next step on CPU, at the next check on CUDA), and
            re-plan mid-epoch when some rank saw one. ``None``: changes are followed at the re-plans that come
            anyway.
        evidence_reach: no plan (a new total, a re-split, a probe) gives a rank more than this many times the largest
            local batch it has run: its timing line says little far beyond the sizes it was fitted on, so a move of
            the total goes as far as that, and the next, once timed, goes on toward the goodput choice (a total can
            double at each re-plan). ``None``: no such bound.
        progress_bar: also show the total and rank zero's local batch on Lightning's progress bar (every logger
            receives every ``cannikin/*`` value either way; at 80 columns the bar truncates their names).

    """

    # the core's defaults, defined once there
    warmup_steps: int = Replanner.warmup_steps
    half_life: float = HALF_LIFE
    adapt_margin: float = PolicySettings.margin
    adapt_every_n_steps: int | None = Replanner.adapt_every_n_steps
    accumulate: bool = True
    track_noise_scale: bool | None = None
    min_noise_updates: int = MIN_NOISE_UPDATES
    noise_every_n_steps: int = Replanner.noise_every_n_steps
    noise_exchange_every: int = 4
    progress_bar: bool = False
    noise_bound_level: float = NOISE_BOUND_LEVEL
    noise_bound_sigmas: float | None = None
    check_every_n_steps: int | None = Replanner.check_every_n_steps
    evidence_reach: float | None = SpeedModelSettings.evidence_reach

    def __post_init__(self) -> None:
        _positive("warmup_steps", self.warmup_steps)
        _positive("noise_every_n_steps", self.noise_every_n_steps)
        _positive("noise_exchange_every", self.noise_exchange_every)
        for name in ("adapt_every_n_steps", "check_every_n_steps"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if isinstance(self.min_noise_updates, bool) or not isinstance(self.min_noise_updates, int):
            raise ValueError(f"`min_noise_updates` must be an integer, got {self.min_noise_updates!r}.")
        if not self.half_life > 0:
            raise ValueError(f"`half_life` must be > 0, got {self.half_life}.")
        sigmas = self.noise_bound_sigmas
        if sigmas is not None and not (isinstance(sigmas, (int, float)) and 0 <= sigmas < float("inf")):
            raise ValueError(f"`noise_bound_sigmas` must be None or a finite number >= 0, got {sigmas!r}.")
        if not (isinstance(self.noise_bound_level, (int, float)) and 0 < self.noise_bound_level < 1):
            raise ValueError(f"`noise_bound_level` must lie in (0, 1), got {self.noise_bound_level!r}.")
        SpeedModelSettings(evidence_reach=self.evidence_reach)  # its own check, with its message
        if not self.adapt_margin >= 0:
            raise ValueError(f"`adapt_margin` must be >= 0, got {self.adapt_margin}.")


@dataclass(frozen=True)
class EngineOptions:
    """The user's choices for a balancing run: the :class:`~lightning_cannikin.Cannikin` callback's arguments (see
    there), checked when given, before any process is launched. The strategy builds its engine from them."""

    max_batch_size: int | None = None
    local_batch_bounds: Any = None
    lr_scaling: str = "adascale"
    base_batch_size: int | None = None
    balance: bool = True
    replan_every_n_steps: int | None = None
    save_profile: bool = True
    settings: CannikinSettings = field(default_factory=CannikinSettings)

    def __post_init__(self) -> None:
        if self.settings is None:  # as the callback's argument: the defaults
            object.__setattr__(self, "settings", CannikinSettings())
        if self.base_batch_size is not None and self.base_batch_size < 1:
            raise ValueError(f"`base_batch_size` must be a positive integer or None, got {self.base_batch_size}.")
        every = self.replan_every_n_steps
        if every is not None and int(every) < 1:
            raise ValueError(f"`replan_every_n_steps` must be a positive integer or None, got {every}.")
        BatchBounds.check(self.local_batch_bounds)
        self.policy  # noqa: B018 (the policy's own checks: max_batch_size, lr_scaling)

    @cached_property  # a frozen value: built once (a cached_property writes the instance's dict, not a field)
    def policy(self) -> PolicySettings:
        """The decision policy these choices make (the margin is the settings' ``adapt_margin``)."""
        settings = self.settings
        return PolicySettings(
            self.max_batch_size, self.balance, settings.adapt_margin, self.lr_scaling, accumulate=settings.accumulate
        )

    def controller(self) -> Controller:
        """A new decision controller for a run with these choices (every "when" its replanner's)."""
        settings = self.settings
        every = (settings.warmup_steps, self.replan_every_n_steps, settings.adapt_every_n_steps)
        cadence = (settings.check_every_n_steps, settings.noise_every_n_steps)
        replanner = Replanner(*every, *cadence, self.balance, self.max_batch_size is not None)
        fitting = SpeedModelSettings(half_life=settings.half_life, evidence_reach=settings.evidence_reach)
        rule = NoiseRule(settings.min_noise_updates, settings.noise_bound_sigmas, settings.noise_bound_level)
        return Controller(self.policy, replanner, fitting, rule, self.base_batch_size)

    @property
    def track_noise_scale(self) -> bool:
        """Whether the noise statistics are measured: the settings say so, else where the total adapts or AdaScale
        scales from a given base batch."""
        track = self.settings.track_noise_scale
        if track is not None:
            return track
        adascale_from_base = self.policy.lr_scaling == "adascale" and self.base_batch_size is not None
        return self.max_batch_size is not None or adascale_from_base
