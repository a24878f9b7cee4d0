"""Every rank's local speed-change check, and the one bit that tells all ranks alike that some rank saw a change.

Each rank feeds its :class:`~lightning_cannikin.core.change.LocalChangeCheck` its own compute times as the step timer
reads them: a few floats, no collective. On the steps the schedule names
(:meth:`~lightning_cannikin.core.replanner.Replanner.check_due`, the same on every rank) the ranks share the
answers, one integer each, in a maximum that nobody waits for (a :class:`Ballot`: the training side's
``Collective.max_later``), read by every rank at the same later step: on CPU at the next step (every rank issued the
vote before that step's gradient all-reduce on the same process group, which runs collectives in order, so the vote is
done when the step is), on CUDA at the next check (the host may run a step or more ahead of the device: reading its
pinned copy a step later could wait for the device). Where the frontend says when a backward starts, a scheduled answer
is cast there (:meth:`ChangeVote.cast`), not at the end of the step that decided it: its rounds run beside the backward,
ahead of the gradient all-reduce queued behind it (measured in alternate blocks of one run on ranks sharing cores: 0.5%
faster, within the spread). The answer is the same, read at the same step. No step waits for the vote, and a change is
acted on by every rank at the same step. When the maximum says some rank *suspects* a change (its latest times far
beyond its reference, not yet for long enough to count), every rank votes again at every step, and reads that vote at
once, until the answer is a change or nothing: what every rank read is the same, so every rank votes at the same steps,
and a large change is acted on at the step its window fills instead of up to a check interval later. Off those spells
the cadence is the schedule's and nobody waits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from lightning_cannikin.core.change import CHANGED, SUSPECTED, LocalChangeCheck

__all__ = ["Ballot", "ChangeVote"]


class Ballot(Protocol):
    """Where the ranks' answers meet: every rank's integer in one maximum, read later (the training side's
    :meth:`~lightning_cannikin.training.collective.Collective.max_later`)."""

    def max_later(self, value: int) -> Callable[[], int]: ...


class ChangeVote:
    """One rank's change check and the vote in flight.

    Args:
        check: this rank's local check (the step timer feeds it each step's time as it reads it).
        collective: where the answers meet.
        read_next_step: read the vote at the step after it was cast (CPU); otherwise at the next check (CUDA).
        cast_before_backward: a scheduled answer waits for :meth:`cast`, which the frontend calls when the next
            backward starts (every rank at the same backward); otherwise it goes out when :meth:`poll` decides it.

    """

    def __init__(
        self,
        check: LocalChangeCheck,
        collective: Ballot,
        read_next_step: bool = True,
        cast_before_backward: bool = False,
    ) -> None:
        self.check = check
        self.read_next_step = read_next_step
        self.cast_before_backward = cast_before_backward
        self._collective = collective
        self._ballot: int | None = None  # an answer decided at a check, waiting for the next backward
        self._in_flight: Callable[[], int] | None = None
        self._stale = False  # the vote in flight was cast before the re-plan that answered it
        self.urgent = False  # some rank suspects a change: vote at every step until it counts or ends

    def poll(self, check_due: bool = True) -> bool:
        """After every step (every rank alike; ``check_due``: the schedule's check step): whether some rank saw a
        change at the vote now read; at a check step, or every step while a change is suspected, this rank's answer
        goes out. While suspected, the answer is read at once: every rank casts it at the same step, so the wait is
        the ranks meeting a moment earlier than at the next step's all-reduce (on CUDA, the host waiting for the
        device), for a few steps, and a change counts one step sooner."""
        self.cast()  # an answer no backward sent since (a step without one) goes now, before anything is read
        changed = False
        if self._in_flight is not None and (self.read_next_step or check_due or self.urgent):
            changed = self._read()
        if check_due or self.urgent:
            self._ballot = self.check.verdict()
            if self.urgent or not self.cast_before_backward:
                self.cast()
            if self.urgent:
                changed = self._read() or changed
        return changed

    def cast(self) -> None:
        """Send the answer a check decided, if one waits (the frontend, as a backward starts: every rank alike)."""
        if self._ballot is not None:
            self._stale = False
            self._in_flight, self._ballot = self._collective.max_later(self._ballot), None

    def _read(self) -> bool:
        verdict = 0 if self._stale else self._in_flight()  # type: ignore[misc]
        self.urgent = verdict == SUSPECTED
        self._in_flight, self._stale = None, False
        return verdict >= CHANGED

    def state_dict(self) -> dict[str, object]:
        """What decides this rank's next votes and reads: its check's state, the answer waiting for a backward, the
        vote in flight (read now: every rank cast it, so its maximum is there, and it is read later from the value,
        the same answer at the same step: saving changes nothing), whether it is stale, and whether a change is
        suspected."""
        if self._in_flight is not None:
            answer = self._in_flight()
            self._in_flight = lambda: answer
        return {
            "check": self.check.state_dict(),
            "ballot": self._ballot,
            "in_flight": None if self._in_flight is None else self._in_flight(),
            "stale": self._stale,
            "urgent": self.urgent,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s values (a vote saved in flight is read from its saved answer)."""
        self.check.load_state_dict(state["check"])
        ballot, answer = state["ballot"], state["in_flight"]
        self._ballot = None if ballot is None else int(ballot)
        self._in_flight = None if answer is None else (lambda: int(answer))
        self._stale, self.urgent = bool(state["stale"]), bool(state["urgent"])

    def reset(self) -> None:
        """A re-plan followed the change: start the check over, and drop the vote cast before it."""
        self.check.reset()
        self._stale = self._in_flight is not None
        self._ballot = None  # decided before the re-plan, on every rank alike: its answer would be dropped anyway
        self.urgent = False
