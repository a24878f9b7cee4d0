"""The callback's re-plan protocol replayed without Lightning: emulated devices driving the engine's ``Controller``.

Each step every rank's compute is what the emulated devices cost (jitter and warm-up included); the records reach
the controller at each re-plan, and it decides the next plan. Every decision and every "when" is the controller's (its
``Replanner``: what is due after a step or at an epoch's end, when the ranks vote, what a re-plan leaves for the next
ones), and every rank's vote is the engine's ``ChangeVote``: the balancing behaviour under noise, warm-up and plan
changes is tested in milliseconds on the real decisions. This module only emulates the devices and carries the records
and the votes, as the engine carries them between ranks; it writes no decision of its own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np

from lightning_cannikin.core.change import LocalChangeCheck
from lightning_cannikin.core.change_vote import ChangeVote
from lightning_cannikin.core.controller import Controller, NoiseReading
from lightning_cannikin.core.optperf import optimal_split
from lightning_cannikin.core.plan import BatchBounds, Plan, even_split
from lightning_cannikin.core.policy import Decision, PolicySettings, noise_bounds
from lightning_cannikin.core.replanner import Replanner
from lightning_cannikin.core.speed_model import SpeedModel, SpeedModelSettings, StepRecord
from lightning_cannikin.simulation.emulated_devices import EmulatedDevices

TAIL_S = 0.002  # what a step costs beyond the slowest rank's compute (all-reduce tail, optimizer)


@dataclass
class Replay:
    """A replayed run: the plans in force step by step and the decisions taken."""

    devices: EmulatedDevices
    world_size: int
    plans: list[Plan] = field(default_factory=list)  # the plan of every step
    decisions: list[tuple[int, Decision]] = field(default_factory=list)  # (step after which it was taken, decision)
    drifts: list[tuple[int, list[int]]] = field(default_factory=list)
    changes: list[int] = field(default_factory=list)  # steps at which a rank's local check asked for a re-plan
    votes: int = 0  # the ranks' comparisons of their checks (collectives of one number)
    model: SpeedModel | None = None
    states: list[dict] = field(default_factory=list)  # the replanner's state after every step
    urgent: list[bool] = field(default_factory=list)  # after every step: whether the ranks vote at every step
    held: list[bool] = field(default_factory=list)  # after every step: whether the model holds a suspected change

    def clean_step_time(self, plan: Plan, step: int = 0) -> float:
        """The plan's step time on the devices without jitter or warm-up (seconds)."""
        return max(self.devices.clean_ms(r, b, step) for r, b in enumerate(plan.local_batch_sizes)) / 1000 + TAIL_S

    def optimum(self, total: int, step: int = 0) -> float:
        """The best step time any split of ``total`` has on the clean devices (brute-force-exact OptPerf)."""
        n = self.world_size
        slopes, offsets = _clean_pieces(self.devices, n, step)
        return optimal_split(slopes, offsets, total).step_time / 1000 + TAIL_S

    def expected_step_time(self, splits: np.ndarray, step: int = 0) -> np.ndarray:
        """The step time of each split ``(C, n)`` averaged over the devices' contention period around ``step``."""
        period = int(np.lcm.reduce([every for _, every in self.devices.contention.values()] or [1]))
        first = step - step % period
        splits = np.atleast_2d(splits)
        costs = np.array(
            [
                [[self.devices.clean_ms(r, int(b), s) for r, b in enumerate(split)] for split in splits]
                for s in range(first, first + period)
            ]
        )  # (period, C, n)
        return costs.max(axis=2).mean(axis=0) / 1000 + TAIL_S

    def expected_optimum(self, total: int, step: int = 0) -> float:
        """The least expected step time any split of ``total`` has (brute force over every split; 3 ranks)."""
        assert self.world_size == 3, "brute force over splits of three ranks"
        first = np.repeat(np.arange(1, total - 1), np.arange(total - 2, 0, -1))
        second = np.concatenate([np.arange(1, total - a) for a in range(1, total - 1)])
        splits = np.stack([first, second, total - first - second], axis=1)
        return float(self.expected_step_time(splits, step).min())

    def regret(self, step: int) -> float:
        """How much slower the plan in force at ``step`` is than the optimum for its total (0.05: 5% slower)."""
        plan = self.plans[step]
        return self.clean_step_time(plan, step) / self.optimum(plan.global_batch_size, step) - 1.0


def _clean_pieces(devices: EmulatedDevices, n: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    # devices may saturate: the clean cost is max(fixed + a * sat, fixed + a * b), two affine pieces
    big = 10**6  # far above any saturation batch
    slopes = np.array([[0.0, devices.clean_ms(r, big + 1, step) - devices.clean_ms(r, big, step)] for r in range(n)])
    flat = np.array([devices.clean_ms(r, 1, step) for r in range(n)])
    linear = np.array([devices.clean_ms(r, big, step) - big * slopes[r, 1] for r in range(n)])
    return slopes, np.stack([flat, linear], axis=1)


class _Ballot:
    """Every rank's vote in one maximum, as :class:`StrategyCollective` gives it: read only when a vote reads it."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.rounds = 0
        self._cast: list[int] = []

    def max_later(self, value: int) -> Callable[[], int]:
        if len(self._cast) == self.world_size:
            self._cast = []
        if not self._cast:
            self.rounds += 1
        cast = self._cast
        cast.append(value)
        return lambda: max(cast)


def _checkpointed(state: object) -> object:
    """``state`` as a checkpoint gives it back: plain values only (JSON is stricter than ``torch.save``)."""
    return json.loads(json.dumps(state))


def _resumed(controller: Controller, world_size: int, bounds: BatchBounds | None) -> Controller:
    """A new controller with the run's settings, loaded from ``controller``'s state as a checkpoint carries it."""
    state = _checkpointed(controller.state_dict())
    settings = ("warmup_steps", "every_n_steps", "adapt_every_n_steps", "check_every_n_steps", "noise_every_n_steps")
    old = controller.replanner
    replanner = Replanner(**{name: getattr(old, name) for name in settings}, balance=old.balance, adaptive=old.adaptive)
    fresh = Controller(
        controller.policy, replanner, controller.fitting, controller.noise_rule, controller.base_batch_size
    )
    fresh.configure(world_size, bounds)  # type: ignore[arg-type]
    fresh.load_state_dict(state, world_size, restarted=False)  # type: ignore[arg-type]
    return fresh


def _resumed_votes(votes: list[ChangeVote], build: Callable[[], ChangeVote]) -> list[ChangeVote]:
    """Every rank's new vote and check, loaded from the old ones' states as the engine's checkpoint carries them."""
    fresh = [build() for _ in votes]
    for new, old in zip(fresh, votes, strict=True):
        new.load_state_dict(_checkpointed(old.state_dict()))  # type: ignore[arg-type]
    return fresh


def replay(
    devices: EmulatedDevices,
    world_size: int,
    total: int,
    steps: int,
    epoch_steps: int | None = None,
    warmup_steps: int = 8,
    replan_every_n_steps: int | None = None,
    check_every_n_steps: int | None = Replanner.check_every_n_steps,
    totals: dict[int, int] | None = None,
    bounds: BatchBounds | None = None,
    settings: SpeedModelSettings | None = None,
    policy: PolicySettings | None = None,
    noise: Callable[[int], float | None] | None = None,
    change_check: Callable[[float], LocalChangeCheck] = LocalChangeCheck,
    read_next_step: bool = True,
    resume_at: Collection[int] = (),
) -> Replay:
    """Run ``steps`` steps from an even split of ``total``.

    Args:
        devices: the emulated devices.
        world_size: ranks.
        total: the starting global batch.
        steps: steps to run.
        epoch_steps: re-plan at every multiple of it too (an epoch end).
        warmup_steps: the callback's warm-up re-plan cadence.
        replan_every_n_steps: the callback's periodic re-plan cadence.
        check_every_n_steps: the cadence of every rank's local change check (``None``: off).
        totals: ``{step: total}``: from that step's epoch-end re-plan on, force this total (what goodput would pick),
            to test that a change of total is handled as one and not as a speed change.
        bounds: local batch bounds.
        settings: the speed model's settings.
        policy: the policy settings (default ``PolicySettings()``: the total batch is kept).
        noise: the known noise scale after each step (``None`` while there is none; both of its bounds), as every
            rank holds it: with ``policy.max_batch_size`` the total is reconsidered whenever the last choice's options
            call for a move (``Replanner.total_due``), and at epoch ends.
        change_check: each rank's local change check, from the speed model's drift tolerance.
        read_next_step: the ranks' vote (:class:`ChangeVote`) is read the step after it is cast (CPU), else at the
            next check (CUDA).
        resume_at: after each of these steps, the replanner, the speed model, every rank's vote and change check and
            the records not yet fed to the model are replaced by new ones that load the old ones' states through
            JSON, as a resumed run's are (the ballot is the transport). The emulated devices do not restart, so
            nothing calls ``restarted``: a resumed run's one deliberate difference, its devices' warm-up left out.

    """
    out = Replay(devices, world_size)
    policy = policy or PolicySettings()
    every = (warmup_steps, replan_every_n_steps, 1, check_every_n_steps)
    replanner = Replanner(*every, balance=policy.balance, adaptive=policy.max_batch_size is not None)
    controller = Controller(policy, replanner, settings or SpeedModelSettings(), base_batch_size=total)
    controller.configure(world_size, bounds)  # type: ignore[arg-type]
    out.model = controller.speed_model
    ballot = _Ballot(world_size)
    tolerance = controller.fitting.drift_tolerance

    def new_vote() -> ChangeVote:
        return ChangeVote(change_check(tolerance), ballot, read_next_step, True)

    votes = [new_vote() for _ in range(world_size)]
    checks = [vote.check for vote in votes]
    plan = Plan(even_split(total, world_size))
    pending: list[StepRecord] = []
    for step in range(steps):
        out.plans.append(plan)
        for vote in votes:
            vote.cast()  # as each rank's backward starts: the answer its last check decided goes out
        compute = [devices.delay_ms(r, b, step) / 1000 for r, b in enumerate(plan.local_batch_sizes)]
        pending += [
            StepRecord(step, r, b, compute[r], max(compute) + TAIL_S) for r, b in enumerate(plan.local_batch_sizes)
        ]
        for check, b, seconds in zip(checks, plan.local_batch_sizes, compute, strict=True):
            check.observe(b, seconds)  # each rank, on its own times
        done = controller.step_done()
        epoch_end = epoch_steps is not None and done % epoch_steps == 0
        # the known noise scale, as every rank's estimator reads it (the gain at its lower bound: no point estimate)
        controller.noise = NoiseReading(noise_bounds(noise(done) if noise is not None else None))
        # the ranks' one-bit answers are cast on the steps the controller names, and read as the engine reads them
        changed = any([vote.poll(controller.check_due()) for vote in votes])
        forced = (totals or {}).get(done) if epoch_end else None
        due, adapt = controller.after_step(changed, epoch_end=epoch_end)
        if due or forced is not None:  # a forced total is goodput's choice: always due
            if controller.replanner.changed:
                out.changes.append(done)
            current = plan if forced is None else Plan(even_split(forced, world_size))  # decide splits a forced total
            decision, _ = controller.decide(pending, current, mid_epoch=False, adapt_total=adapt)
            pending = []
            if controller.speed_model.drifts:  # type: ignore[union-attr]
                out.drifts.append((done, list(controller.speed_model.drifts)))  # type: ignore[union-attr]
            took_vote, _ = controller.adopt(plan, decision, adapt)
            if took_vote:
                for vote in votes:
                    vote.reset()
            if decision is not None:
                out.decisions.append((done, decision))
                plan = decision.plan
        out.states.append(controller.replanner.state_dict())
        out.urgent.append(any(vote.urgent for vote in votes))
        out.held.append(controller.speed_model.watch.suspected)  # type: ignore[union-attr]
        if done in resume_at:
            controller = _resumed(controller, world_size, bounds)
            out.model = controller.speed_model
            votes = _resumed_votes(votes, new_vote)
            checks = [vote.check for vote in votes]
            pending = [StepRecord(**record) for record in _checkpointed([r.to_dict() for r in pending])]  # type: ignore[union-attr]
    out.votes = ballot.rounds
    return out
