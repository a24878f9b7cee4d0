"""Is a device's speed changing? One rule, used by each rank on its own times and by the speed model on all of them.

A *clear change* is a run of recent step times of which at least three in four sit beyond a relative band around
what the device used to take, all on the same side. A periodic stall (every second or third step) or a one-window
glitch never fills three quarters of the window, so neither counts; a device that halves its speed fills it within
about ``window`` steps. A large change (beyond twice the band) is judged over a shorter window, ``FAST_WINDOW``
steps: longer than any one-window glitch, short enough to act within about ten steps (:func:`large_change`); a
change beyond the square of twice the band, after ``SURE_RUN`` steps in a row, longer than a glitch that large. A
smaller change is judged the same way over a longer window; the recency-weighted fits follow it at the re-plan it
asks for.

:class:`LocalChangeCheck` is the cheap, local half: each rank feeds it its own compute time every step (a few
floats, no collective) and asks it on the steps :class:`~lightning_cannikin.core.replanner.Replanner` says (the
same steps on every rank); only when some rank answers yes do the ranks need to meet and re-plan. A rank whose latest
few times are already far beyond its reference answers *suspected*: the ranks then ask again at every step until the
change counts or the run ends, so a large change is acted on at the step its window fills, not at the next scheduled
check (up to ``check_every_n_steps`` later, each step of it on the old split).

Pure Python: imports neither numpy, torch nor Lightning (a few floats per call, where numpy would cost the most).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from itertools import takewhile
from statistics import median
from typing import Any

__all__ = [
    "CHANGED",
    "CLEAR_SHARE",
    "DEFAULT_WINDOW",
    "DRIFT_TOLERANCE",
    "FAST_BAND",
    "FAST_WINDOW",
    "MAD_TO_SD",
    "RETURN_HORIZON",
    "SPREAD_FLOOR",
    "SUSPECTED",
    "ChangeWatch",
    "LocalChangeCheck",
    "clear_change",
    "large_change",
    "sure_band",
]

# the relative change of a device's step time that counts as a change of speed (the band; the speed model's default)
DRIFT_TOLERANCE = 0.25
# a median absolute deviation times this is a standard deviation for Gaussian jitter: the robust spread, everywhere
MAD_TO_SD = 1.4826
DEFAULT_WINDOW = 16  # steps of recent times judged at once: a change fills 3/4 of them within 12 steps
# the share of a window that must lie beyond the band, on one side, for a change: a stall every second step fills half
# of it, one every third step a third, a one-window glitch less than a window
CLEAR_SHARE = 3 / 4
# the large band, in multiples of the band: a change beyond it is judged over FAST_WINDOW steps, after SUSPECT_RUN of
# them is suspected, and beyond its square (``sure_band``) counts after SURE_RUN in a row
FAST_BAND = 2.0
# a band is never narrower than this many of the reference's own robust spreads: jitter alone never fills a window
SPREAD_FLOOR = 2.0
# steps judged for a change beyond twice the band: 3/4 of them (9) outlast an 8-step glitch, never filled by stalls
FAST_WINDOW = 12
# the latest steps beyond twice the band that make a change suspected: a device that is clearly slower now, but not for
# long enough to count (a stall every second or third step never runs this long)
SUSPECT_RUN = 3
# the latest steps in a row beyond the sure band (twice the band, squared: 2.25x with the default band, slower or
# faster) that count at once: the larger a change, the less of it a glitch can fake. Longer than a 4x glitch of 4
# steps, and a 2x glitch never reaches the band; a device four times slower is acted on after 6 steps, not 9
SURE_RUN = 6
# the latest records of a rescaled rank back at its old model's times (and faster than the rescaled one by the band)
# that undo the rescale: the change was a passing stall that outlasted the window
RETURN_RUN = 4
# records after a rescale during which a return to the old speed undoes it: two windows, longer than any stall the
# window took for a change (a stall that long is a change)
RETURN_HORIZON = 2 * DEFAULT_WINDOW
SUSPECTED, CHANGED = 1, 2  # :meth:`LocalChangeCheck.verdict` (0: neither)
_PARKED = 3  # other batch sizes whose watch is kept (an epoch's last batch, the sizes of a probe)
# how far beyond a rank's largest timed batch size its model is still trusted to judge a change of speed
_NEAR = 1.1


def _beyond(ratio: float, band: float, slower: bool) -> bool:
    """Whether ``ratio`` lies beyond the band on one side: above ``1 + band`` (slower), or below ``1 / (1 + band)``."""
    return ratio > 1.0 + band if slower else ratio < 1.0 / (1.0 + band)


def clear_change(ratios: Sequence[float], band: float, window: int = DEFAULT_WINDOW) -> float | None:
    """The measured ratio of a clear change in the last ``window`` ratios (measured / expected), or ``None``.

    Args:
        ratios: measured over expected times, oldest first.
        band: relative change a ratio must exceed to count (0.25: beyond 0.8 or 1.25).
        window: how many of the latest ratios are judged; fewer than this is never a change.

    Returns:
        The median of the ratios beyond the band on the side that holds at least three quarters of the window.

    """
    if len(ratios) < window:
        return None
    # plain Python: a rank asks this every few steps of a few floats, where numpy's per-call cost is most of the work
    recent = ratios[-window:]
    for slower in (True, False):
        beyond = [r for r in recent if _beyond(r, band, slower)]
        if len(beyond) >= CLEAR_SHARE * window:
            return median(beyond)
    return None


def sure_band(band: float) -> float:
    """The band beyond which a run of ``SURE_RUN`` ratios counts at once: the large band's factor, squared."""
    return (1.0 + FAST_BAND * band) ** 2 - 1.0


def large_change(ratios: Sequence[float], band: float, window: int = DEFAULT_WINDOW) -> float | None:
    """:func:`clear_change` over ``window`` ratios, or, sooner, beyond twice the band over ``FAST_WINDOW`` of them:
    a device that takes twice as long (or half) is acted on after 9 steps, a glitch of 8 steps still never counts;
    or, sooner still, the latest ``SURE_RUN`` ratios all beyond the sure band ``(1 + 2 band)^2``: a device four times
    slower is acted on after 6 steps, a glitch of 4 steps at 4x still never counts."""
    ratio = clear_change(ratios, band, window)
    if ratio is None:
        ratio = clear_change(ratios, FAST_BAND * band, min(FAST_WINDOW, window))
    run = min(SURE_RUN, window)
    if ratio is None and trailing_run(ratios, sure_band(band)) >= run:
        ratio = median(ratios[-run:])
    return ratio


def trailing_run(ratios: Sequence[float], band: float) -> int:
    """How many of the latest ratios lie beyond the band on the side of the last one (0 if the last is inside)."""
    slower = len(ratios) > 0 and ratios[-1] > 1.0 + band
    return sum(1 for _ in takewhile(lambda ratio: _beyond(ratio, band, slower), reversed(ratios)))


class LocalChangeCheck:
    """One rank's watch on its own speed: fed every step, asked on the steps the schedule chooses.

    The reference is the median of the first ``reference`` times at the batch size in force (after ``skip`` steps
    that may still carry the previous plan's warm-up); later times at the same size fill a window. Two changes
    count: a large one (beyond ``band`` in three of the last ``window`` steps in four, or beyond twice ``band`` in
    three of the last ``FAST_WINDOW``: :func:`large_change`), within about ``window`` steps (9 for twice as slow or
    more), and a small one (beyond ``small_band``, or twice the reference's own spread if that is larger, over
    ``small_window`` steps), later. The large band, too, is never narrower than ``noise_floor`` times the reference's
    spread: tiny steps on a shared host (a few milliseconds, where the scheduler's time slices move single steps by
    several times) would otherwise fill a window with jitter and ask for re-plans that keep the split; on a steady
    device (a spread of a few percent) the band is ``band``. A new batch size starts a new reference (a size seen
    lately, such as the full batch after an epoch's shorter last one, resumes its own), and :meth:`reset` starts every
    size over (call it after a re-plan this check asked for: the speed model has then seen the change).

    Args:
        band: relative change that counts at once (the speed model's ``drift_tolerance``).
        window: recent steps judged for a large change.
        reference: steps whose median is the reference.
        skip: steps left out after a change of batch size or a reset.
        small_band: the smallest relative change that counts, over ``small_window`` steps.
        small_window: recent steps judged for a small change.
        noise_floor: the narrowest large band, in multiples of the reference's relative spread (``MAD_TO_SD x`` its
            median absolute deviation, a standard deviation for Gaussian jitter); 0: ``band`` whatever the jitter.

    """

    def __init__(
        self,
        band: float = DRIFT_TOLERANCE,
        window: int = DEFAULT_WINDOW,
        reference: int = 8,
        skip: int = 2,
        small_band: float = 0.08,
        small_window: int = 48,
        noise_floor: float = SPREAD_FLOOR,
    ) -> None:
        if not (band > 0 and small_band > 0) or min(int(window), int(reference), int(small_window)) < 1 or skip < 0:
            raise ValueError(
                "`band`, `small_band` must be > 0, `window`, `small_window`, `reference` >= 1 and `skip` >= 0; got"
                f" {band}, {small_band}, {window}, {small_window}, {reference}, {skip}."
            )
        if not noise_floor >= 0:
            raise ValueError(f"`noise_floor` must be >= 0, got {noise_floor}.")
        self.noise_floor = float(noise_floor)
        self.band, self.window, self.reference, self.skip = float(band), int(window), int(reference), int(skip)
        self.small_band, self.small_window = float(small_band), int(small_window)
        self._batch_size: int | None = None
        self._seen = 0
        self._carried = 0  # SUSPECTED: the size last left suspected a change (while this one has no reference)
        self._reference: list[float] = []
        self._recent: deque[float] = self._window()
        self._restart_skip = 0  # times still left out after a restart (a device's warm-up)
        # the watch at the latest other batch sizes, resumed when a size returns: an epoch's shorter last batch
        # would otherwise start the reference over every epoch, and epochs shorter than the reference and the
        # window together would never show a change
        self._parked: dict[int, tuple[int, list[float], deque[float]]] = {}

    def reset(self) -> None:
        """Start over: a re-plan happened (the model now knows what the times showed)."""
        self._batch_size, self._seen, self._carried = None, 0, 0
        self._reference = []
        self._recent.clear()
        self._parked.clear()

    def restarted(self) -> None:
        """The device restarted (a resumed run): its next ``skip`` times are its warm-up, left out; the reference and
        the window are kept (a resume calls it after every load, so it is not saved)."""
        self._restart_skip = self.skip

    def state_dict(self) -> dict[str, Any]:
        """What decides this check's next verdicts (plain values: a checkpoint, JSON)."""
        parked = [
            [size, seen, list(reference), list(recent)] for size, (seen, reference, recent) in self._parked.items()
        ]
        return {
            "batch_size": self._batch_size,
            "seen": self._seen,
            "carried": self._carried,
            "reference": list(self._reference),
            "recent": list(self._recent),
            "parked": parked,  # oldest first, as they are dropped
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values (the settings are the constructor's)."""
        size = state["batch_size"]
        self._batch_size = None if size is None else int(size)
        self._seen, self._carried = int(state["seen"]), int(state["carried"])
        self._reference = [float(t) for t in state["reference"]]
        self._recent = self._window([float(t) for t in state["recent"]])
        self._parked = {
            int(size): (int(seen), [float(t) for t in reference], self._window([float(t) for t in recent]))
            for size, seen, reference, recent in state["parked"]
        }

    def _window(self, times: Sequence[float] = ()) -> deque[float]:
        return deque(times, maxlen=max(self.window, self.small_window))

    def observe(self, batch_size: int, seconds: float) -> None:
        """One step's compute time at ``batch_size`` (non-finite or non-positive times are ignored)."""
        if not (math.isfinite(seconds) and seconds > 0):
            return
        if self._restart_skip > 0:
            self._restart_skip -= 1
            return
        if batch_size != self._batch_size:
            if self._batch_size is not None:
                # a suspicion (or more) at the size left stands while the new one has no reference: an epoch's
                # shorter last batch (one step) must not end it, and the ranks' every-step vote with it
                self._carried = SUSPECTED if self.verdict() else 0
                self._parked[self._batch_size] = (self._seen, self._reference, self._recent)
                while len(self._parked) > _PARKED:
                    del self._parked[next(iter(self._parked))]  # the size left longest ago
            fresh = (0, [], self._window())
            self._seen, self._reference, self._recent = self._parked.pop(int(batch_size), fresh)
            self._batch_size = int(batch_size)
        self._seen += 1
        if self._seen <= self.skip:
            return
        if len(self._reference) < self.reference:
            self._reference.append(float(seconds))
        else:
            self._recent.append(float(seconds))

    def changed(self) -> bool:
        """Whether this rank's recent times show a clear change against its reference."""
        return self.verdict() == CHANGED

    def verdict(self) -> int:
        """:data:`CHANGED` (a clear change), :data:`SUSPECTED` (the latest ``SUSPECT_RUN`` or more times beyond twice
        the large band, not yet a change: worth asking again at the next step, not on the usual cadence) or 0."""
        if len(self._reference) < self.reference:
            return self._carried  # no reference at this size yet: a suspicion at the size just left
        expected = median(self._reference)
        ratios = [t / expected for t in self._recent]
        spread = MAD_TO_SD * median([abs(t / expected - 1.0) for t in self._reference])
        small = max(self.small_band, SPREAD_FLOOR * spread)
        band = max(self.band, self.noise_floor * spread)  # the large band, never inside the jitter
        large = large_change(ratios, band, self.window)
        if large is not None or clear_change(ratios, small, self.small_window) is not None:
            return CHANGED
        return SUSPECTED if trailing_run(ratios, FAST_BAND * band) >= SUSPECT_RUN else 0


class ChangeWatch:
    """The speed model's side of :func:`clear_change`, over every rank's records as they arrive at re-plans.

    Args:
        world_size: ranks.
        tolerance: the speed model's ``drift_tolerance``.

    """

    def __init__(self, world_size: int, tolerance: float) -> None:
        self.tolerance = float(tolerance)
        self._held: dict[int, list[Any]] = {}  # a suspected change of speed, kept apart until it is clear or ends
        # each rank's latest records at batch sizes inside its timed range, across re-plans: the change window
        self._recent: list[deque[Any]] = [deque(maxlen=DEFAULT_WINDOW) for _ in range(int(world_size))]
        # a rank rescaled lately: its model before, the ratio, and the records judged since (until confirmed)
        self._before: dict[int, tuple[Callable[[int], float], float, int]] = {}

    @property
    def suspected(self) -> bool:
        """Whether some rank's latest times are held apart as a suspected change of speed (not yet clear, not ended)."""
        return bool(self._held)

    @property
    def unconfirmed(self) -> bool:
        """Whether some rank was rescaled lately and may still return to its old speed (:meth:`judge`)."""
        return bool(self._before)

    def clear(self) -> None:
        """Forget what was seen (a restored state from another world)."""
        self._held, self._before = {}, {}
        for recent in self._recent:
            recent.clear()

    def state_dict(self) -> dict[str, Any]:
        """What decides the next judgements, as plain values: the records (``to_dict``) held apart and in each rank's
        window, and each lately rescaled rank's old model (``to_dict``), ratio and records judged since."""
        return {
            "held": [[rank, [r.to_dict() for r in records]] for rank, records in self._held.items()],
            "recent": [[r.to_dict() for r in recent] for recent in self._recent],
            "before": [[rank, model.to_dict(), ratio, seen] for rank, (model, ratio, seen) in self._before.items()],
        }

    def load_state_dict(
        self,
        state: dict[str, Any],
        record_of: Callable[[dict], Any],
        model_of: Callable[[dict], Callable[[int], float]],
    ) -> None:
        """Restore :meth:`state_dict`'s values; ``record_of`` and ``model_of`` rebuild a record and a model from their
        ``to_dict`` (this module stays free of the classes)."""
        if len(state["recent"]) != len(self._recent):
            raise ValueError(f"A change watch of {len(state['recent'])} ranks cannot load into {len(self._recent)}.")
        self._held = {int(rank): [record_of(r) for r in records] for rank, records in state["held"]}
        for recent, saved in zip(self._recent, state["recent"], strict=True):
            recent.clear()
            recent.extend(record_of(r) for r in saved)
        self._before = {
            int(rank): (model_of(model), float(ratio), int(seen)) for rank, model, ratio, seen in state["before"]
        }

    def judge(self, rank: int, records: list[Any], model: Callable[[int], float], sizes: Sequence[int]) -> float | None:
        """The measured ratio of a clear change of ``rank``'s speed (rescale its old samples by it), or ``None``;
        ``records`` (with ``step``, ``batch_size`` and ``compute``) is left holding what the rank's fit takes now.

        A rank's times are compared with its ``model`` only at batch sizes inside the range it has been timed at
        (``sizes``; or up to 10% beyond the largest: a re-split moves a rank a few samples): a new split or a new total
        batch that moves ranks further shows nothing but the error of an extrapolation. The latest such comparisons
        (``DEFAULT_WINDOW`` steps, across re-plans) show a change when three in four of them lie beyond the tolerance
        on one side, or three in four of the last ``FAST_WINDOW`` beyond twice it (:func:`large_change`): the samples
        from the change on join the rescaled fit at once, whatever the re-plan cadence, and those before it are
        superseded. A run of new samples beyond the tolerance that does not
        yet fill the window is held apart (the old model kept) until it does, or until samples inside the band end it:
        a one-window glitch never moves the model, and periodic stalls never fill three quarters of the window.

        A stall that outlasts the window is rescaled like a change, and the rank moved to a share it was not timed at;
        once the stall ends, its times there match its old model, and nothing else would compare them with it (the fit
        takes them in, anchored at the old size by the stall's samples). So for ``RETURN_HORIZON`` records after a
        rescale, its latest ``RETURN_RUN`` records at any size back within the tolerance of the old model and beyond it
        from the rescaled one undo the rescale (the ratio returned is its inverse).
        """
        if rank in self._before and (back := self._returned(rank, records, model)) is not None:
            return back
        tolerance, recent = self.tolerance, self._recent[rank]
        for r in records:
            if sizes and sizes[0] <= r.batch_size <= _NEAR * sizes[-1] and float(model(r.batch_size)) > 0:
                recent.append(r)
        pending = sorted(self._held.pop(rank, []) + records, key=lambda r: r.step)
        ratios = [r.cost / float(model(r.batch_size)) for r in recent]
        ratio = large_change(ratios, tolerance, recent.maxlen or DEFAULT_WINDOW)
        if ratio is not None:
            beyond = [r for r, q in zip(recent, ratios, strict=True) if _beyond(q, tolerance, ratio > 1.0)]
            first = min(r.step for r in beyond)
            records[:] = [r for r in pending if r.step >= first]
            recent.clear()
            recent.extend(r for r in records if r in beyond)
            self._before[rank] = (model, ratio, 0)
            return ratio
        run = trailing_run(ratios, tolerance)
        since = list(recent)[-run].step if run else None
        held = [r for r in pending if since is not None and r.step >= since and r in recent]
        if held:
            self._held[rank] = held  # suspected: keep the old model until it is clear, or ends
        records[:] = [r for r in pending if r not in held]
        return None

    def _returned(self, rank: int, records: list[Any], model: Callable[[int], float]) -> float | None:
        """The inverse of ``rank``'s last rescale if its latest records are back at its old speed, else ``None``."""
        old, ratio, seen = self._before[rank]
        band = 1.0 + self.tolerance
        latest = sorted(records, key=lambda r: r.step)[-RETURN_RUN:]

        def back(r: Any) -> bool:
            then, now = float(old(r.batch_size)), float(model(r.batch_size))
            if then <= 0 or now <= 0 or not then / band <= r.cost <= then * band:
                return False
            return r.cost * band < now if ratio > 1.0 else r.cost > now * band

        if len(latest) == RETURN_RUN and all(back(r) for r in latest):
            del self._before[rank]
            self._held.pop(rank, None)
            self._recent[rank].clear()
            return 1.0 / ratio
        seen += len(records)
        if seen >= RETURN_HORIZON:
            del self._before[rank]  # the change held
        else:
            self._before[rank] = (old, ratio, seen)
        return None
