"""The balancing engine in one process: the surface users hold, old checkpoints, the optimizer's family, the step's
weights and learning-rate factor (multi-process behaviour is in test_balancing, test_adaptive, test_fabric, ...)."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from lightning_cannikin import Cannikin, CannikinSettings, Plan
from lightning_cannikin.core.interval_choice import TotalOptions
from lightning_cannikin.core.plan import BatchBounds
from lightning_cannikin.training.data.sampler import UnevenBatchSampler
from lightning_cannikin.training.engine import BalancingEngine
from lightning_cannikin.training.frontends.lightning_hooks import BalancingCallback

# what a checkpoint keeps of the engine
STATE_KEYS = {"balancer", "estimator", "progress", "plan", "history", "step", "replanner", "noise_in_flight", "ranks"}


class OneRank:
    """A :class:`~lightning_cannikin.training.collective.Collective` of one process."""

    rank, world_size = 0, 1

    def all_gather(self, obj):
        return [obj]

    def broadcast(self, obj, src=0):
        return obj


class TwoRanksSecond(OneRank):
    """The second of two ranks, for what a step computes locally (no collective is called)."""

    rank, world_size, host_runs_ahead = 1, 2, False

    def max_later(self, value):
        return lambda: value


def test_the_settings_are_given_in_one_object_and_checked():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback = Cannikin(max_batch_size=64, settings=CannikinSettings(warmup_steps=4))
    assert callback.settings.warmup_steps == 4 and callback.max_batch_size == 64
    with pytest.raises(TypeError, match="warmup_steps"):
        Cannikin(max_batch_size=64, warmup_steps=4)  # a setting is no keyword of the callback
    with pytest.raises(ValueError, match="warmup_steps"):
        CannikinSettings(warmup_steps=0)


def test_the_checkpoint_keeps_the_callbacks_key_and_restores_the_replanner_exactly():
    assert BalancingCallback().state_key == Cannikin().state_key == "Cannikin"
    engine = BalancingEngine()
    engine.bind(OneRank())
    engine.data.set_plan(Plan((5, 3)))
    engine.controller.step = 9
    replanner = engine.controller.replanner
    replanner.identified, replanner.changed, replanner.settle_at, replanner.unconfirmed_moved = True, True, 12, True
    options = TotalOptions((8, 16, 32), (0.1, 0.15, 0.25), 8, 0.1, 8, 0.02)
    replanner.total_options = options
    replanner.last_adapt_step, replanner.adapted, replanner.routine_gap = 7, True, 16
    state = engine.state_dict()
    assert set(state) == STATE_KEYS
    fresh = BalancingEngine()
    fresh.bind(OneRank())
    assert fresh.load_state_dict(state) == Plan((5, 3)).resized(1)  # resumed on one rank: the global batch kept
    fresh.start()
    assert fresh.controller.step == 9 and fresh.controller.replanner.total_options == options
    assert fresh.controller.replanner.state_dict() == replanner.state_dict()
    assert fresh.controller.replanner.identified, "the same devices: their speeds were measured"


def test_a_checkpoint_from_before_the_replanner_still_resumes():
    engine = BalancingEngine()
    engine.bind(OneRank())
    engine.data.set_plan(Plan((4,)))
    state = engine.state_dict()
    del state["replanner"]
    band = [120.0, 480.0]  # a band old checkpoints saved, without the options: reconsidered at the next step
    old = {"identified": True, "last_adapt_step": 7, "adapted": True, "last_replan_step": 8, "routine_gap": 16}
    state |= old | {"noise_band": band}
    fresh = BalancingEngine()
    fresh.bind(OneRank())
    fresh.load_state_dict(state)
    fresh.start()
    replanner = fresh.controller.replanner
    assert (replanner.last_adapt_step, replanner.last_replan_step, replanner.routine_gap) == (7, 8, 16)
    assert replanner.identified and replanner.adapted
    assert replanner.total_options is None and replanner.settle_at is None


def _stepped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    parameter = optimizer.param_groups[0]["params"][0]
    parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    return optimizer


def test_the_optimizer_family_comes_from_what_it_holds():
    parameter = torch.nn.Parameter(torch.zeros(3))

    def family(optimizer, **engine_kwargs):
        engine = BalancingEngine(**engine_kwargs)
        engine.start(optimizer)
        return engine.controller.adam, engine._optimizer.family

    assert family(torch.optim.SGD([parameter], lr=0.1)) == (False, None), "nothing held before the first step"
    assert family(_stepped(torch.optim.SGD([parameter], lr=0.1, momentum=0.9))) == (False, "sgd")

    class Renamed(torch.optim.AdamW):  # the name says nothing; the second moment does
        pass

    Renamed.__name__ = "MyOptimizer"
    assert family(_stepped(Renamed([parameter], lr=0.1))) == (True, "adam")

    class Wrapper:  # as ZeroRedundancyOptimizer holds the local optimizer in `.optim`
        def __init__(self, optim):
            self.optim = optim

    assert family(Wrapper(_stepped(torch.optim.Adam([parameter], lr=0.1)))) == (True, "adam")
    rmsprop = _stepped(torch.optim.RMSprop([parameter], lr=0.1))
    with pytest.raises(ValueError, match="lr_scaling"):  # AdaScale on a measured noise scale: refused
        family(rmsprop, max_batch_size=64)
    assert family(rmsprop, max_batch_size=64, lr_scaling="sqrt") == (False, "RMSprop")
    assert family(rmsprop) == (False, "RMSprop"), "no noise scale measured: the rule cannot act, nothing to refuse"


def test_the_zero_redundancy_optimizer_is_unwrapped(tmp_path):
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        parameter = torch.nn.Parameter(torch.zeros(3))
        zero = _stepped(ZeroRedundancyOptimizer([parameter], optimizer_class=torch.optim.Adam, lr=0.1))
        engine = BalancingEngine()
        engine.start(zero)
        assert engine.controller.adam
    finally:
        dist.destroy_process_group()


def _sampler(plan: Plan) -> UnevenBatchSampler:
    return UnevenBatchSampler(200, rank=0, plan=plan, shuffle=False)


def test_each_step_runs_at_the_lr_factor_of_the_plan_it_runs_not_the_newest_one():
    # a plan decided now starts at a later batch (the loader prefetched the ones before): its factor starts with it
    engine = BalancingEngine()
    engine.controller.scale = lambda total: (total / 8, 2.0 * total)  # the learning-rate rule, known
    first, second = Plan((6, 2)), Plan((18, 6))
    sampler = _sampler(first)
    engine.data.use_loader(first, sampler)
    engine.data.set_plan(second, from_batch=3)
    factors = []
    for position in range(5):
        engine.begin_step(position, batch=(position, sampler.sizes_at(position)))
        factors.append((engine.running.lr_factor, engine.running.gain))
    assert engine.data.plan == second, "the newest plan is in force for what comes next"
    assert factors == [(1.0, 16.0)] * 3 + [(3.0, 48.0)] * 2


def _weighted(engine: BalancingEngine) -> float:
    """The loss of 1 as the engine hands it to backward (a micro-step: nothing reduced)."""
    with engine.backward(torch.tensor(1.0), reduces=False, parameters=tuple) as weighted:
        return weighted.item()


def test_the_step_weight_covers_the_accumulation_window_and_its_partial_end():
    # 3 micro-batches of (6, 2) per step over 20 samples: windows of 24 samples, then the epoch's 4 left over
    plan = Plan((6, 2), accumulation_steps=3)
    sampler = UnevenBatchSampler(28, rank=1, plan=plan, shuffle=False)
    engine = BalancingEngine()
    engine.bind(TwoRanksSecond())
    engine.data.use_loader(plan, sampler)
    engine.begin_step(0, 3, batch=(1, (6, 2)))
    hook, _ = engine.reductions.comm_hook()
    assert hook.weight == pytest.approx(6 / 24) and hook.micro_weight == pytest.approx(1 / 3)
    # the loss carries the micro share and undoes Lightning's 1/3 (the hook sums: the rank weight is on its buckets)
    assert _weighted(engine) == pytest.approx(3 * (1 / 3))
    last = sampler.sizes_at(3)
    engine.begin_step(1, 3, batch=(3, last))
    assert engine._window == (last,) and sum(last) == 4, "the noise groups: the window's one partial micro-batch"
    assert hook.weight == pytest.approx(last[1] / 4) and hook.micro_weight == 1.0
    # DDP's own all-reduce: n * b_i / B on the loss
    engine.reductions.reduce_with(loss_carries_weight=True, averaged_over=2)
    engine.begin_step(1, 3, batch=(3, last))
    assert _weighted(engine) == pytest.approx(3 * 1.0 * 2 * last[1] / 4)


def test_the_first_plan_respects_the_bounds_for_every_frontend():
    engine = BalancingEngine(local_batch_bounds=(None, [4, 40]))
    engine.bind(TwoRanksSecond())
    assert engine.controller.bounds == BatchBounds.parse((None, [4, 40]), 2)
    assert engine.controller.bounds.first_plan(24).local_batch_sizes == (4, 20)
    with pytest.raises(ValueError, match="local_batch_bounds"):
        engine.controller.bounds.first_plan(50)


def test_a_suspected_change_makes_every_rank_vote_at_every_step_until_it_counts_or_ends():
    from lightning_cannikin.core.change import CHANGED, SUSPECTED, LocalChangeCheck
    from lightning_cannikin.core.change_vote import ChangeVote

    class Ranks:  # every rank's answers in one maximum: here another rank's verdicts, played in order
        rank, world_size = 0, 2

        def __init__(self, others):
            self.others, self.cast = list(others), 0

        def max_later(self, value):
            self.cast += 1
            other = self.others.pop(0)
            return lambda: max(value, other)

    check = LocalChangeCheck()
    for _ in range(20):
        check.observe(16, 0.020)
    assert check.verdict() == 0
    for _ in range(3):
        check.observe(16, 0.080)  # four times slower for three steps: far beyond the band, too short to count
    assert check.verdict() == SUSPECTED and not check.changed()
    for read_next_step in (True, False):
        ranks = Ranks([0, SUSPECTED, SUSPECTED, CHANGED, 0])  # the other rank's verdicts; this one's stays quiet
        vote = ChangeVote(LocalChangeCheck(), ranks, read_next_step)
        assert not vote.poll(check_due=True) and ranks.cast == 1  # the scheduled check: nothing seen yet
        assert not vote.poll(check_due=True) and not vote.urgent and ranks.cast == 2  # read 0; the next vote goes out
        # read: suspected. From here every rank votes at every step and reads that vote at once
        assert not vote.poll(check_due=True) and vote.urgent and ranks.cast == 3
        assert vote.poll(check_due=False) and ranks.cast == 4, "voted off the cadence, read at once, on CUDA too"
        assert not vote.urgent
        vote.reset()  # the re-plan followed it
        assert not vote.poll(check_due=False) and ranks.cast == 4, "back on the schedule's cadence"
        assert not vote.poll(check_due=True) and ranks.cast == 5


def test_the_change_vote_is_read_one_step_later_and_not_again_after_the_replan_it_caused():
    from lightning_cannikin.core.change import LocalChangeCheck
    from lightning_cannikin.core.change_vote import ChangeVote

    class OneRank:  # a collective whose vote is read later, as the real one's is (one rank: its own answer)
        rank, world_size = 0, 1
        cast = 0

        def max_later(self, value):
            self.cast += 1
            return lambda: value

    for read_next_step in (True, False):  # CPU: the step after the check; CUDA: the next check
        collective = OneRank()
        vote = ChangeVote(LocalChangeCheck(), collective, read_next_step)
        for _ in range(20):
            vote.check.observe(16, 0.020)
        assert not vote.poll() and not vote.check.changed()
        for _ in range(16):
            vote.check.observe(16, 0.040)  # the device takes twice as long from here on
        assert vote.check.changed()
        assert not vote.poll(), "this check's answer goes out now; it is read later"
        if not read_next_step:
            assert not vote.poll(check_due=False), "between checks the vote in flight is not read"
        # the vote is read at the step after it was cast (CPU) or at the next check (CUDA); between checks none is cast
        assert vote.poll(check_due=not read_next_step), "read later, at the same step on every rank"
        assert collective.cast == (2 if read_next_step else 3)
        vote.reset()  # the re-plan followed it
        if not read_next_step:
            assert not vote.poll(), "the vote cast before the re-plan is dropped"
        assert not vote.poll(check_due=False) and not vote.poll()


def test_a_scheduled_answer_goes_out_as_the_next_backward_starts_and_is_read_at_the_same_step():
    from lightning_cannikin.core.change import CHANGED, SUSPECTED, LocalChangeCheck
    from lightning_cannikin.core.change_vote import ChangeVote

    class Ranks:  # every rank's answers in one maximum: here another rank's verdicts, played in order
        def __init__(self, others):
            self.others, self.sent = list(others), []

        def max_later(self, value):
            self.sent.append(value)
            other = self.others.pop(0)
            return lambda: max(value, other)

    # CPU: read at the step after the check, as when it was sent at the check
    ranks = Ranks([0, 0, SUSPECTED, CHANGED])
    vote = ChangeVote(LocalChangeCheck(), ranks, read_next_step=True, cast_before_backward=True)
    assert not vote.poll(check_due=True) and ranks.sent == [], "decided at the check, not sent yet"
    for seconds in [0.020] * 20 + [0.080] * 16:
        vote.check.observe(16, seconds)  # this rank's times change after the check
    assert vote.check.changed()
    vote.cast()
    vote.cast()
    assert ranks.sent == [0], "the next backward sends the answer the check decided, once"
    assert not vote.poll(check_due=False), "read at the next step"
    assert not vote.poll(check_due=True) and ranks.sent == [0]
    vote.reset()  # a re-plan between the check and the next backward: every rank drops the answer decided before it
    vote.cast()
    assert ranks.sent == [0]
    assert not vote.poll(check_due=True)
    assert not vote.poll(check_due=False) and ranks.sent == [0, 0], "no backward since: it goes out before the read"
    assert not vote.poll(check_due=True)
    vote.cast()
    # read: some rank suspects a change. From here every answer goes out at once and is read at once
    assert vote.poll(check_due=False) and ranks.sent == [0, 0, 0, 0]
    # CUDA: read at the next check
    ranks = Ranks([0, CHANGED])
    vote = ChangeVote(LocalChangeCheck(), ranks, read_next_step=False, cast_before_backward=True)
    assert not vote.poll(check_due=True) and ranks.sent == []
    vote.cast()
    assert not vote.poll(check_due=False) and ranks.sent == [0], "between checks: nothing read, nothing sent"
    assert not vote.poll(check_due=True), "the next check reads it, and decides the next answer"
    vote.cast()
    assert vote.poll(check_due=True) and ranks.sent == [0, 0], "another rank's change, read at the check after"


def test_the_engine_never_acts_on_an_infinite_estimate():
    # B = 96 against a true noise scale of 20,000: after 20 updates the averaged |G|^2 is often <= 0 (an infinite
    # noise scale, which would send the total to max_batch_size and the gain to B / B0); the lower bound is finite,
    # and the gain takes the estimate held within the bounds, the lower bound where the estimate is infinite
    from lightning_cannikin.core.goodput import adascale_gain
    from lightning_cannikin.core.policy import gain_noise_scale
    from tests.test_real_devices import _synthetic_estimator

    bounded, counted = (
        BalancingEngine(max_batch_size=4096).controller,
        BalancingEngine(max_batch_size=4096, settings=CannikinSettings(noise_bound_sigmas=0)).controller,
    )
    infinite = 0
    for estimator in _synthetic_estimator(20_000, 0):
        for controller in (bounded, counted):
            controller.estimator = estimator
            controller.noise_folded()  # the statistics read once, as after a fold
        bounds = bounded.noise.bounds
        if bounds is None:  # before min_noise_updates, and until the average spans ten effective steps
            assert estimator.num_updates <= 12 and bounded.scale(960) == (1.0, 1.0), estimator.num_updates
            continue
        infinite += counted.noise.bounds[0] == float("inf")
        assert bounds[0] <= 1.5 * 20_000, (estimator.num_updates, bounds)
        held, estimate = gain_noise_scale(bounds, estimator.noise_scale), estimator.noise_scale
        if math.isfinite(estimate):
            assert held == min(max(estimate, bounds[0]), bounds[1]), (estimate, bounds, held)
        else:
            assert held == bounds[0], (bounds, held)
        gain = adascale_gain(held, 960, 96)
        assert bounded.scale(960) == (pytest.approx(gain), pytest.approx(gain)) and gain < 10.0
    assert infinite > 0, "the check must be able to fail: the point estimate lets an infinite one through"


def test_an_epochs_last_batch_leaves_its_replan_to_the_epoch_end():
    # a re-plan due on the last batch (here the warm-up's, every 8 steps) would decide, and the epoch end right after
    # would decide again on the same records: the last batch leaves it to the epoch end, and keeps the vote for it
    from types import SimpleNamespace

    engine = BalancingEngine()
    engine.reductions.timer = SimpleNamespace(reduced=True)  # a step whose gradients were reduced
    engine._finish_step = lambda: None  # the step is counted by hand here
    replans = []
    engine._replan = lambda mid_epoch, adapt_total, epoch=0: replans.append(
        (engine.controller.step, mid_epoch, adapt_total)
    )
    engine.controller.step = engine.controller.replanner.warmup_steps
    engine.end_step(epoch_ends=True)
    assert replans == [], "the epoch end decides"
    engine.end_step()
    assert replans == [(engine.controller.step, True, False)], "mid-epoch the warm-up re-plan is due"
    engine.controller.step += 1
    engine.end_step()
    assert len(replans) == 1


def test_statistics_that_can_never_bound_the_noise_scale_are_said_once_with_the_fix():
    # two ranks measure the noise statistics (an adaptive total); a base batch 250x below the initial total leaves the
    # moving averages under ten steps of it: no bounds ever, which must not pass in silence
    for base, warned in ((2, True), (128, False)):
        engine = BalancingEngine(max_batch_size=4096, base_batch_size=base)
        engine.bind(TwoRanksSecond())
        engine.data.use_loader(Plan((256, 256)), None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.start()
        messages = [str(w.message) for w in caught if "never bounded" in str(w.message)]
        assert len(messages) == int(warned), messages
        if warned:
            assert "`base_batch_size`" in messages[0] and "at least 3" in messages[0], messages[0]


@pytest.mark.parametrize("with_callback", [True, False])
def test_a_fit_builds_one_engine_from_its_callbacks_options_and_keeps_a_plan_set_before_it(monkeypatch, with_callback):
    from lightning_cannikin.training.frontends import uneven_strategy

    built = []

    class Counted(BalancingEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(uneven_strategy, "BalancingEngine", Counted)
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "RANK"):
        monkeypatch.delenv(name, raising=False)  # what Lightning sets in this process, undone after the test
    try:
        _fit_twice(built, with_callback)
    finally:  # an in-process fit keeps its process group: later tests fork ranks from this process
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _fit_twice(built: list, with_callback: bool) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_cannikin import CannikinStrategy

    strategy = CannikinStrategy()
    strategy.set_plan(Plan((4,)))  # before the fit: the engine starts from it
    assert strategy.plan == Plan((4,)) and strategy.lr_factor == 1.0 and strategy.step_sizes is None
    callback = Cannikin(settings=CannikinSettings(warmup_steps=4))
    callbacks = [callback] if with_callback else []
    quiet = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=3, callbacks=callbacks, **quiet)
    trainer.fit(BoringModel())
    assert len(built) == 1, "one engine per fit"
    (engine,) = built
    assert strategy.engine is engine and engine.data.plan is not None and engine.data.plan.local_batch_sizes == (4,)
    if with_callback:
        assert callback.engine is engine and engine.options is callback.options
    trainer.fit_loop.epoch_loop.max_steps = 6
    trainer.fit(BoringModel())
    assert built == [engine], "a later fit with the same options keeps the engine"


def test_every_ranks_check_vote_cost_fit_and_unfed_records_round_trip_through_rank_zeros_checkpoint():
    from lightning_cannikin.core.change import SUSPECTED
    from lightning_cannikin.core.speed_model import StepRecord

    class Gathered(TwoRanksSecond):  # rank 1 of two: rank zero's part of a gather is another's
        def all_gather(self, obj):
            return [{"vote": None, "cost_fit": {"pairs": [], "loads": []}, "records": []}, obj]

    engine = BalancingEngine()
    engine.bind(Gathered())
    engine.data.set_plan(Plan((8, 8)))
    engine.controller.step = 40
    vote, cost_fit = engine._local.vote, engine._local.cost_fit
    for step in range(40):  # this rank's times: a reference, then a slowdown far beyond the band, too short to count
        vote.check.observe(8, 0.020 if step < 37 else 0.080)
        cost_fit.load(step, 8.0 + step % 3)
    cost_fit.add([StepRecord(step, 1, 8, 0.01 * (1 + step % 3), 0.05) for step in range(30)])
    assert vote.check.verdict() == SUSPECTED
    assert not vote.poll(check_due=True)  # a check step: the answer waits for the next backward
    vote.cast()  # it starts: the answer is in flight, read at the next step
    engine._local.held = [StepRecord(39, 1, 8, 0.08, 0.1)]  # read for a checkpoint, not yet fed to a re-plan
    state = json.loads(json.dumps(engine.state_dict()))  # plain values
    saved = state["ranks"][1]
    assert len(state["ranks"]) == 2 and saved["vote"]["in_flight"] == SUSPECTED and not saved["vote"]["urgent"]
    fresh = BalancingEngine()
    fresh.bind(Gathered())
    fresh.load_state_dict(state)
    fresh.start()
    assert json.loads(json.dumps(fresh.state_dict()))["ranks"] == state["ranks"], "each rank's own state, exactly"
    assert fresh._local.cost_fit.fit() == cost_fit.fit() and fresh._local.held == engine._local.held
    # the vote in flight is read at the next step, as the uninterrupted run reads it: suspected, every rank votes on
    assert fresh._local.vote.poll(check_due=False) == vote.poll(check_due=False) is False
    assert fresh._local.vote.urgent and vote.urgent
    # the device restarted: its next `skip` times are its warm-up, left out; the reference and the window stay
    reference = fresh._local.vote.check.state_dict()
    for _ in range(fresh._local.vote.check.skip):
        fresh._local.vote.check.observe(8, 1.0)
    assert fresh._local.vote.check.state_dict() == reference
    fresh._local.vote.check.observe(8, 0.080)
    assert fresh._local.vote.check.state_dict()["recent"][-1] == 0.080
    # on other devices (another world size) each rank's own state is no evidence: it starts over
    other = BalancingEngine()
    other.bind(OneRank())
    other.load_state_dict(state)
    other.start()
    assert other._local.cost_fit.fit() is None and other._local.held == []
