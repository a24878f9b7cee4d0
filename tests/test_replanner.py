"""The :class:`Replanner`: every "when" of a run, and its exact resume."""

from __future__ import annotations

import itertools

import pytest

from benchmarks.replay import replay
from lightning_cannikin.core.policy import PolicySettings
from lightning_cannikin.core.replanner import ROUTINE_GAP_CAP, Replanner
from lightning_cannikin.simulation.emulated_devices import EmulatedDevices


class BandRule:
    """A stand-in for the decision's ``TotalOptions`` in the replanner's tests: a move wherever the bounds lie wholly
    outside a band (the rule itself is tested in tests/test_interval_choice.py; here, when the replanner asks it)."""

    held = False  # chosen with the accumulation free to change: the options speak for an epoch's end too

    def __init__(self, low: float, high: float) -> None:
        self.low, self.high = low, high

    def moves(self, bounds: tuple[float, float]) -> bool:
        return bounds[0] > self.high or bounds[1] < self.low


def _adapted(replanner: Replanner, step: int, band: tuple[float, float]) -> None:
    replanner.adapted_at(step, True, BandRule(*band))  # type: ignore[arg-type]


def _end_due(
    replanner: Replanner, step: int, identified: bool, changed: bool, bounds: tuple[float, float] | None
) -> bool:
    replanner.identified, replanner.changed = identified, changed
    return replanner.epoch_end_due(step, bounds)


def _due(replanner: Replanner, step: int, changed: bool = False) -> bool:
    replanner.changed = changed
    return replanner.due(step)


def test_epoch_ends_replan_less_often_while_replans_keep_the_plan():
    replanner = Replanner(8, identified=True, adaptive=True)
    replanner.replanned(16, total_changed=False)  # the balancing re-plan: a new split
    assert _end_due(replanner, 128, True, False, None)
    replanner.replanned(128, total_changed=False, kept=True)
    ends = []
    for end in range(256, 128 * 40, 128):  # 128-step epochs whose re-plans keep the plan
        if _end_due(replanner, end, True, False, None):
            ends.append(end)
            replanner.replanned(end, total_changed=False, kept=True)
    assert ends[:4] == [256, 512, 1024, 1920], ends  # the gap doubles from the 112 steps since the last re-plan
    assert all(b - a == ROUTINE_GAP_CAP for a, b in itertools.pairwise(ends[3:])), ends
    # whatever the gap, an epoch end re-plans when something asks for it
    skipped = ends[-1] + 128
    assert not _end_due(replanner, skipped, True, False, None)
    assert _end_due(replanner, skipped, True, True, None), "a rank's check saw a change"
    assert _end_due(replanner, skipped, False, False, None), "a device is not timed at two sizes yet"
    assert _end_due(replanner, skipped, True, False, (500.0, 500.0)), "noise bounds and no band: the total"
    _adapted(replanner, skipped, (400.0, 600.0))
    assert not _end_due(replanner, skipped + 128, True, False, (500.0, 500.0)), "inside the band the total stays"
    assert _end_due(replanner, skipped + 128, True, False, (700.0, 700.0)), "out of it"
    replanner.replanned(skipped + 128, total_changed=False)  # a re-plan that moved the split
    assert _end_due(replanner, skipped + 256, True, False, None), "the next epoch end re-plans again"


def test_the_replanner_replans_when_a_check_says_so_and_settles_after():
    replanner = Replanner(8, identified=True, adaptive=True)
    assert replanner.check_due(16) and replanner.check_due(12) and not replanner.check_due(14)  # every 4 steps
    assert _due(replanner, 16, changed=True) and not _due(replanner, 16)
    replanner.replanned(16, total_changed=False, changed=True)
    # after a change of speed the rescaled model's split is re-split once half the warm-up has timed it
    assert _due(replanner, 20) and not _due(replanner, 19)
    replanner.replanned(20, total_changed=True)  # a new total (or untimed sizes): the whole warm-up
    assert _due(replanner, 28) and not _due(replanner, 27)
    replanner.replanned(28, total_changed=False, changed=True, kept=True)
    assert replanner.settle_at is None and not _due(replanner, 32), "a kept split has nothing to settle"
    with pytest.raises(ValueError, match="check_every_n_steps"):
        Replanner(8, identified=True, adaptive=True, check_every_n_steps=0)


def test_an_unconfirmed_rescale_is_rejudged_every_warmup_only_while_the_split_it_moved_is_in_force():
    replanner = Replanner(8, identified=True, adaptive=True)
    # a rescale (perhaps a passing stall) that left the split as it was: no rank runs a share the rescale gave it,
    # so no re-plan is run just to judge it (on identical CPU ranks each kept re-plan was rank zero's fit, in vain)
    replanner.replanned(16, total_changed=False, changed=True, kept=True, unconfirmed=True)
    assert replanner.settle_at is None and not any(_due(replanner, step) for step in range(17, 64))
    # a later re-plan moved the split while it is unconfirmed: re-judged every warm-up from then, kept splits too
    replanner.replanned(64, total_changed=False, unconfirmed=True)
    assert _due(replanner, 72) and not _due(replanner, 71)
    replanner.replanned(72, total_changed=False, kept=True, unconfirmed=True)
    assert _due(replanner, 80) and not _due(replanner, 79)
    # confirmed (or undone): nothing more to judge
    replanner.replanned(80, total_changed=False, kept=True, unconfirmed=False)
    assert replanner.settle_at is None and not replanner.unconfirmed_moved
    # a change re-plan that moved the split: settled after half the warm-up, then every warm-up while unconfirmed
    replanner.replanned(96, total_changed=False, changed=True, unconfirmed=True)
    assert replanner.settle_at == 100
    replanner.replanned(100, total_changed=False, kept=True, unconfirmed=True)
    assert replanner.settle_at == 108


def test_a_change_of_speed_drops_the_total_options_and_the_settling_replan_reconsiders_the_total():
    # the options held the step times of the old speeds; after a change they say nothing
    replanner = Replanner(8, identified=True, adaptive=True, adapt_every_n_steps=1)
    _adapted(replanner, 40, (200.0, 800.0))
    assert not replanner.total_due((500.0, 500.0), 60)
    replanner.replanned(60, total_changed=False, changed=True)  # a device's speed changed
    assert replanner.total_options is None
    assert not replanner.total_due((500.0, 500.0), 63), "not while the new split is untimed"
    assert replanner.total_due((500.0, 500.0), 64) and _due(replanner, 64), "the settling re-plan reconsiders it"
    # a re-plan that reconsidered the total at the change keeps the options it just chose among
    _adapted(replanner, 64, (300.0, 900.0))
    replanner.replanned(64, total_changed=False, changed=True)
    assert (replanner.total_options.low, replanner.total_options.high) == (300.0, 900.0)  # type: ignore[union-attr]


def test_the_replanner_reconsiders_the_total_when_the_noise_scale_leaves_its_band():
    replanner = Replanner(8, identified=True, adaptive=True, adapt_every_n_steps=8)
    assert not replanner.total_due(None, 30) and replanner.total_due((300.0, 300.0), 30)  # the first bounds
    _adapted(replanner, 40, (200.0, 800.0))
    assert not replanner.total_due((500.0, 500.0), 60) and not replanner.total_due(None, 60)
    assert replanner.total_due((900.0, 900.0), 60) and replanner.total_due((150.0, 150.0), 60)
    assert not replanner.total_due((900.0, 900.0), 47), "no sooner than the floor after the last reconsideration"
    assert not Replanner(8, identified=True, adaptive=True, adapt_every_n_steps=None).total_due((900.0, 900.0), 60), (
        "adapt_every_n_steps=None: at epoch ends only"
    )
    replanner.total_options = None  # a change of speed dropped the options: the total is reconsidered once
    assert replanner.total_due((500.0, 500.0), 60)
    _adapted(replanner, 60, (200.0, 800.0))
    assert not replanner.total_due((500.0, 500.0), 70) and replanner.total_due((850.0, float("inf")), 70)


def _noise(step: int) -> tuple[float, float] | None:
    """Noise bounds every rank holds: none at first, then narrowing around a noise scale that rises, then falls."""
    if step < 24:
        return None
    truth = 300.0 if step < 200 else 3000.0 if step < 330 else 600.0
    width = 1.0 + 8.0 / (step - 20) ** 0.5
    return truth / width, truth * width


def _decisions(run) -> list[tuple]:
    """Every decision: when, the split, the accumulation, the learning-rate factor and whether the speeds were known."""
    return [
        (step, d.plan.local_batch_sizes, d.plan.accumulation_steps, d.lr_factor, d.identified)
        for step, d in run.decisions
    ]


def test_a_run_resumed_in_a_backoff_a_suspicion_or_a_settling_decides_as_the_uninterrupted_run():
    # three ranks, jitter, a device that slows at step 150 and comes back at 260 (a long stall: a rescale that is
    # undone), another twice as slow for 8 steps from 353 (a glitch: suspected by its rank's check, held apart by the
    # model, never a change), epoch ends every 40 steps (the routine back-off) and a noise scale that moves the total
    # (settlings)
    fast, glitch = [0.5, 1.0, 2.0], [0.5, 1.0, 4.0]
    changes = {150: [0.5, 3.0, 2.0], 260: fast, 353: glitch, 361: fast}
    devices = EmulatedDevices(fast, 10.0, jitter_ms=0.5, seed=3, speed_changes=changes)
    options = {"epoch_steps": 40, "policy": PolicySettings(max_batch_size=768), "noise": _noise}
    steps = 420
    whole = replay(devices, 3, 96, steps, **options)
    states = whole.states

    def first(condition, after: int = 0) -> int:
        step = next((i + 1 for i, state in enumerate(states) if i + 1 > after and condition(state)), None)
        assert step is not None, "the run must pass through every kind of interruption point"
        return step

    # (a vote kept for the epoch's end never outlasts its step here: the epoch end follows at once; the engine's
    # checkpoint test carries it)
    def during(flags: list[bool], after: int = 0) -> int:
        step = next((i + 1 for i, flag in enumerate(flags) if i + 1 > after and flag), None)
        assert step is not None, "the run must pass through every kind of interruption point"
        return step

    unconfirmed = first(lambda s: s["unconfirmed_moved"])
    points = {
        "settling in the warm-up": first(lambda s: s["settle_at"] is not None),
        "settling a new total": first(lambda s: s["settle_at"] is not None, after=200),
        "back-off": first(lambda s: s["routine_gap"] > 0, after=100),
        "unconfirmed rescale moved the split": unconfirmed,
        # its undoing needs the speed model's change watch (the old model, the ratio) across the checkpoint
        "unconfirmed rescale, a re-plan later": first(lambda s: s["unconfirmed_moved"], after=unconfirmed),
        "total options held": first(lambda s: s["total_options"] is not None),
        # every rank's check and vote: a suspected change votes at every step; the model holds a suspicion apart
        "a change suspected: every rank votes each step": during(whole.urgent),
        "a glitch suspected": during(whole.urgent, after=300),
        "a suspected change held apart by the model": during(whole.held),
        # a check step's vote is in flight (read at the next step) and each check holds its reference and window
        "a vote in flight after a check": Replanner.check_every_n_steps * 17,
    }
    assert len(set(points.values())) == len(points), points
    for name, step in points.items():
        resumed = replay(devices, 3, 96, steps, resume_at={step}, **options)
        assert _decisions(resumed) == _decisions(whole), f"resumed after step {step} ({name})"
        assert resumed.states == states, f"resumed after step {step} ({name})"
        assert (resumed.changes, resumed.drifts) == (whole.changes, whole.drifts), f"votes, after step {step} ({name})"
        assert resumed.plans == whole.plans and resumed.urgent == whole.urgent, f"after step {step} ({name})"


def test_the_noise_is_measured_on_every_step_where_the_total_follows_it():
    # a skipped measurement is evidence lost (the bounds widen about sqrt(k)-fold at one step in k): where the total
    # may move, it may move at any step; where it is fixed only the gain reads the statistics
    assert Replanner(8, adaptive=True, noise_every_n_steps=8).noise_every() == 1
    assert Replanner(8, adaptive=False, noise_every_n_steps=8).noise_every() == 8
