"""Every rank's local speed-change check, and the one bit that tells all ranks alike that some rank saw a change.

Each rank feeds its :class:`~lightning_cannikin.core.change.LocalChangeCheck` its own compute times as the step timer
reads them: a few floats, no collective. On the steps the schedule names
(:meth:`~lightning_cannikin.core.schedule.ReplanSchedule.check_due`, the same on every rank) the ranks share the
answers, one integer each, in a maximum that nobody waits for (:meth:`Collective.any_later`): it is issued at one
check and read at the next, so a change is acted on one check interval after some rank saw it, by every rank at the
same step, and no step ever waits for the vote.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_cannikin.core.change import LocalChangeCheck
from lightning_cannikin.training.collective import Collective

__all__ = ["ChangeVote"]


class ChangeVote:
    """One rank's change check and the vote in flight.

    Args:
        check: this rank's local check (the step timer feeds it each step's time as it reads it).
        collective: where the answers meet.

    """

    def __init__(self, check: LocalChangeCheck, collective: Collective) -> None:
        self.check = check
        self._collective = collective
        self._in_flight: Callable[[], bool] | None = None
        self._stale = False  # the vote in flight was cast before the re-plan that answered it

    def poll(self) -> bool:
        """At a check step (every rank alike): whether some rank saw a change at the previous check; this rank's
        answer now goes out for the next one."""
        changed = False
        if self._in_flight is not None:
            changed = self._in_flight() and not self._stale
        self._stale = False
        self._in_flight = self._collective.any_later(self.check.changed())
        return changed

    def reset(self) -> None:
        """A re-plan followed the change: start the check over, and drop the vote cast before it."""
        self.check.reset()
        self._stale = self._in_flight is not None
