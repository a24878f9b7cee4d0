"""``CannikinSettings``: the balancing engine's tuning settings, in one frozen, documented place.

What users decide (the largest total batch, the bounds, how the learning rate follows the total, whether to balance,
where to re-plan, whether to save the profile) are arguments of :class:`~lightning_cannikin.Cannikin`; how the engine
measures and reacts lives here. The defaults are the measured ones (see ``docs/reliability.md`` and
``benchmarks/results/overhead.md``).

The keyword arguments ``Cannikin`` took for these settings before they moved here still work for one release, with a
deprecation warning naming the new spelling (:func:`split_deprecated`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = ["CannikinSettings", "split_deprecated"]


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
    | ``adapt_margin`` | 0.05 | relative goodput gain required to change the total batch (hysteresis) |
    | ``adapt_every_n_steps`` | 1 | fewest steps between mid-epoch reconsiderations of the total (``None``: never) |
    | ``accumulate`` | True | reach totals beyond the upper bounds with gradient accumulation (changed at epoch ends) |
    | ``track_noise_scale`` | None | measure the gradient noise scale (``None``: when it can change something) |
    | ``min_noise_updates`` | 20 | measured steps of noise statistics before the total batch may change |
    | ``noise_every_n_steps`` | 8 | measure the noise statistics on one optimizer step in this many |
    | ``noise_exchange_every`` | 8 | measured steps whose statistics share one all-reduce of a few floats |
    | ``max_noise_error`` | 0.25 | act on the noise scale once its parts' standard errors are within this share |
    | ``check_every_n_steps`` | 4 | steps between the ranks' speed-change comparisons, >= 0.1 s apart (``None``: off) |
    | ``progress_bar`` | False | show the total and rank zero's local batch on Lightning's progress bar |

    Args:
        warmup_steps: while some device's speed is not yet measured at two batch sizes, re-plan every this many
            steps: the first re-plan probes a second size on every rank (alternating mid-epoch), the next balances.
        half_life: recency half-life of the timing fits, in steps.
        adapt_margin: relative goodput gain required to change the total batch (hysteresis).
        adapt_every_n_steps: with ``max_batch_size``, also reconsider the total batch mid-epoch: once the noise scale
            is confident, then whenever it leaves the band of noise scales within which the last choice stays the
            goodput choice (a check on numbers every rank holds alike, no collective), but no sooner than this many
            training steps after the last reconsideration (a floor, no longer a clock; ``None``: at epoch ends only).
            The estimate itself moves only when exchanged statistics are folded in (every ``noise_every_n_steps`` x
            ``noise_exchange_every`` steps), so the default floor of 1 adds nothing to that; a larger one delays a
            total the noise scale already calls for. A mid-epoch change keeps the accumulation and every sample once;
            not under ``limit_train_batches``.
        accumulate: reach totals beyond what the upper bounds hold in one micro-step with gradient accumulation (the
            same micro-steps on every rank), changed at epoch ends. Off under manual optimization or when the Trainer
            has its own ``accumulate_grad_batches``.
        track_noise_scale: measure the gradient noise scale. ``None``: only when it can change something, i.e. with
            ``max_batch_size`` or with ``lr_scaling="adascale"`` and a ``base_batch_size``.
        min_noise_updates: measured steps of noise statistics required before the total batch may change or the
            AdaScale gain leave 1.
        noise_every_n_steps: measure the noise statistics on one optimizer step in this many; the others cost nothing
            (DDP's own all-reduce, no Python per bucket). Every measurement weighs as the steps it stands for, so the
            estimate keeps its expectation. On ``benchmarks/overhead.py`` measuring every step cost about 14% of plain
            DDP's throughput, one step in four 7% and one in eight 4-7%, about what balancing alone costs there.
        noise_exchange_every: measured steps whose statistics share one all-reduce of a few floats, never waited for
            (the same numbers, folded up to twice this many measured steps later).
        max_noise_error: the total batch and the AdaScale gain follow the noise scale only once the standard errors
            of both of its parts (``|G|^2`` and ``tr(Sigma)``, from the statistics' own spread) are within this share
            of their values, over at least ten effective steps: an estimate whose ``|G|^2`` may still be zero or
            negative (an infinite noise scale) moves nothing. ``None``: on ``min_noise_updates`` alone.
        check_every_n_steps: every rank checks its own step times for a clear change of speed (a co-tenant, a
            throttled device) at no cost; every this many steps (at least 0.1 s apart, further on steps under 25 ms)
            the ranks compare the answers in one all-reduce of a single number that nobody waits for (read the next
            step on CPU, at the next check on CUDA), and re-plan mid-epoch when some rank saw one. ``None``: changes
            are followed at the re-plans that come anyway.
        progress_bar: also show the total and rank zero's local batch on Lightning's progress bar (every logger
            receives every ``cannikin/*`` value either way; at 80 columns the bar truncates their names).

    """

    warmup_steps: int = 8
    half_life: float = 50.0
    adapt_margin: float = 0.05
    adapt_every_n_steps: int | None = 1
    accumulate: bool = True
    track_noise_scale: bool | None = None
    min_noise_updates: int = 20
    noise_every_n_steps: int = 8
    noise_exchange_every: int = 8
    progress_bar: bool = False
    max_noise_error: float | None = 0.25
    check_every_n_steps: int | None = 4

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
        if self.max_noise_error is not None and not self.max_noise_error > 0:
            raise ValueError(f"`max_noise_error` must be > 0 or None, got {self.max_noise_error}.")
        if not self.adapt_margin >= 0:
            raise ValueError(f"`adapt_margin` must be >= 0, got {self.adapt_margin}.")


SETTING_NAMES = frozenset(f.name for f in fields(CannikinSettings))
# the settings `Cannikin(...)` took as keywords before they moved here (the later ones were never keywords)
LEGACY_NAMES = SETTING_NAMES - {"progress_bar", "check_every_n_steps", "max_noise_error"}


def split_deprecated(settings: CannikinSettings | None, legacy: dict[str, Any], warn: Any) -> CannikinSettings:
    """``settings`` with the legacy keyword arguments folded in (each one warned about through ``warn``).

    Raises:
        TypeError: for a keyword that is no setting (as Python would for an unknown argument).

    """
    unknown = sorted(set(legacy) - LEGACY_NAMES)
    if unknown:
        raise TypeError(f"Cannikin() got unexpected keyword argument(s): {', '.join(unknown)}.")
    for name in legacy:
        warn(
            f"`Cannikin({name}=...)` is deprecated and will be removed in the next release: pass"
            f" `Cannikin(settings=CannikinSettings({name}=...))` instead."
        )
    return replace(settings or CannikinSettings(), **legacy)
