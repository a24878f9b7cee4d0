"""The gradient-norm observer on its own, two ranks in one process: the exchange is read a step after it is issued and
nothing else is read from the device, every rank's estimator gets the same numbers, the GradScaler's scale is divided
out and skipped steps are left out, a resume mid-flight feeds the same numbers, and the fused norms are the
per-parameter ones."""

from __future__ import annotations

import pytest
import torch

from lightning_cannikin.core.noise_scale import NoiseScaleEstimator
from lightning_cannikin.training.measurement import grad_stats
from lightning_cannikin.training.measurement.comm_hook import WeightedAllReduceState
from lightning_cannikin.training.measurement.grad_norms import GradientNorms
from lightning_cannikin.training.measurement.grad_stats import FOLD_DELAY, GradientNormObserver

READ = torch.Tensor.tolist


class FakeBucket:
    def __init__(self, parameters, flat, last):
        self._parameters, self._flat, self._last = parameters, flat, last

    def buffer(self):
        return self._flat

    def parameters(self):
        return self._parameters

    def is_last(self):
        return self._last


class FakeGroup:
    """``dist.all_reduce`` for ranks stepped one after the other in one process: the n-th call of every rank sums."""

    def __init__(self, world_size):
        self.world_size = world_size
        self.calls: list[list[torch.Tensor]] = []
        self.counts = [0] * world_size

    def all_reduce(self, tensor, group=None, async_op=False):
        rank = next(r for r in range(self.world_size) if self.counts[r] == min(self.counts))
        index = self.counts[rank]
        self.counts[rank] += 1
        if index == len(self.calls):
            self.calls.append([])
        self.calls[index].append(tensor)
        if len(self.calls[index]) == self.world_size:
            total = sum(t.clone() for t in self.calls[index])
            for t in self.calls[index]:
                t.copy_(total)
        return None


class FakeTransfer:
    """Records when each exchange was issued and read; reading one in the step that issued it is the failure."""

    def __init__(self, clock):
        self.clock = clock
        self.reads: list[tuple[int, int]] = []
        self.checkpoint = False  # a checkpoint may wait for what it just issued

    def start(self, tensor, work):
        return tensor, self.clock[0]

    def read(self, handle):
        tensor, issued = handle
        assert issued < self.clock[0] or self.checkpoint, "an exchange was read in the step that issued it"
        self.reads.append((issued, self.clock[0]))
        return READ(tensor)


class Recorder(NoiseScaleEstimator):
    def __init__(self):
        super().__init__(base_batch_size=16)
        self.fed: list[tuple[list[float], list[int], float]] = []
        self.steps: list[int] = []

    def update(self, local, sizes, global_sqr, steps=1):
        self.fed.append((list(local), list(sizes), global_sqr))
        self.steps.append(steps)
        return super().update(local, sizes, global_sqr, steps)


def ranks(monkeypatch, world_size=2):
    group = FakeGroup(world_size)
    monkeypatch.setattr(grad_stats.dist, "all_reduce", group.all_reduce)
    clock = [0]
    observers = [GradientNormObserver(r, world_size, FakeTransfer(clock)) for r in range(world_size)]
    return observers, clock


def step(observers, estimators, local_grads, mean_grad, scale=1.0, window=((8, 8),)):
    """One optimizer step on every rank: two buckets each, then the fold."""
    state = WeightedAllReduceState()
    for observer, grads in zip(observers, local_grads, strict=True):
        params = [torch.zeros_like(g) for g in grads]
        for index in range(2):
            last = index == 1
            piece = slice(index, index + 1)
            flat = torch.cat([g.reshape(-1) for g in grads[piece]]) * scale
            observer.before_reduce(state, FakeBucket(params[piece], flat, last))
            reduced = torch.cat([g.reshape(-1) for g in mean_grad[piece]]) * scale
            observer.after_reduce(state, FakeBucket(params[piece], None, last), reduced)
    return [o.fold_into(e, window) for o, e in zip(observers, estimators, strict=True)]


def squared(tensors):
    return sum(float(t.double().pow(2).sum()) for t in tensors)


def run(observers, clock, estimators, problems, steps):
    """Optimizer steps ``steps`` of ``problems`` on every rank, the clock at each step's index."""
    for k in steps:
        clock[0] = k
        step(observers, estimators, *problems[k])


def problem(seed):
    generator = torch.Generator().manual_seed(seed)
    local = [[torch.randn(3, 4, generator=generator), torch.randn(4, generator=generator)] for _ in range(2)]
    mean = [(a + b) / 2 for a, b in zip(*local, strict=True)]
    return local, mean


def test_statistics_arrive_fold_delay_steps_later_on_every_rank_with_nothing_else_read(monkeypatch):
    observers, clock = ranks(monkeypatch)
    estimators = [Recorder(), Recorder()]
    problems = [problem(s) for s in range(6)]

    def forbidden(*args, **kwargs):
        raise AssertionError("the observer read a tensor back to the host (a sync on CUDA)")

    with monkeypatch.context() as patch:
        for name in ("tolist", "item", "__float__", "cpu", "numpy"):
            patch.setattr(torch.Tensor, name, forbidden)
        for k, (local, mean) in enumerate(problems):
            clock[0] = k
            step(observers, estimators, local, mean)
            assert len(estimators[0].fed) == max(0, k + 1 - FOLD_DELAY)
    assert estimators[0].fed == estimators[1].fed, "the ranks' estimators must be fed the very same numbers"
    for (z, sizes, y), (local, mean) in zip(estimators[0].fed, problems, strict=False):
        assert z == pytest.approx([squared(g) for g in local], rel=1e-6) and sizes == [8, 8]
        assert y == pytest.approx(squared(mean), rel=1e-6)
    assert all(read == issued + 1 for issued, read in observers[0]._transfer.reads)


class FakeScaler:
    def __init__(self, scale):
        self._scale = torch.tensor(scale)

    def _get_scale_async(self):
        return self._scale


def test_the_scale_is_divided_out_and_a_step_the_scaler_skipped_is_left_out(monkeypatch):
    observers, clock = ranks(monkeypatch)
    scaler = FakeScaler(1024.0)
    for observer in observers:
        observer.scaler = scaler
    estimators = [Recorder(), Recorder()]
    local, mean = problem(0)
    scales = [1024.0, 2048.0, 1024.0, 1024.0, 2048.0]  # grows, backs off after step 1 (skipped), grows again
    for k, scale in enumerate(scales):
        clock[0] = k
        scaler._scale = torch.tensor(scale)
        step(observers, estimators, local, mean, scale=scale)
    # steps 0-2 are complete by the end of step 4; step 1 was skipped
    assert len(estimators[0].fed) == 2 and estimators[0].fed == estimators[1].fed
    for z, _, y in estimators[0].fed:
        assert z == pytest.approx([squared(g) for g in local], rel=1e-6), "divided by the scale squared"
        assert y == pytest.approx(squared(mean), rel=1e-6)


def test_a_resume_in_flight_feeds_the_same_numbers(monkeypatch):
    problems = [problem(s) for s in range(6)]
    observers, clock = ranks(monkeypatch)
    straight = [Recorder(), Recorder()]
    run(observers, clock, straight, problems, range(6))

    observers, clock = ranks(monkeypatch)
    interrupted = [Recorder(), Recorder()]
    run(observers, clock, interrupted, problems, range(3))
    clock[0] = 3  # a checkpoint after the step: it may read what is in flight
    saved = [o.state_dict() for o in observers]
    observers, clock = ranks(monkeypatch)
    for observer, state in zip(observers, saved, strict=True):
        observer.load_state_dict(state)
    run(observers, clock, interrupted, problems, range(3, 6))
    assert interrupted[0].fed == straight[0].fed and interrupted[1].fed == straight[1].fed


def test_fused_norms_equal_per_parameter_norms_with_adam_preconditioning():
    layer = torch.nn.Linear(5, 3)
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.1)
    layer(torch.randn(7, 5)).pow(2).sum().backward()
    optimizer.step()  # second moments exist now
    norms = GradientNorms()
    norms.optimizer = optimizer
    grads = [torch.randn_like(p) for p in layer.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    fused = float(norms.bucket(flat, lambda: list(layer.parameters()), 0.5, subtract_previous=False))
    expected = 0.0
    for p, g in zip(layer.parameters(), grads, strict=True):
        state = optimizer.state[p]
        v_hat = state["exp_avg_sq"] / (1 - 0.999 ** float(state["step"]))
        expected += float((g / (v_hat.sqrt() + 1e-8)).pow(2).sum())
    assert fused == pytest.approx(expected / 0.25, rel=1e-5)
    plain = GradientNorms()
    assert float(plain.bucket(flat, lambda: [], 0.5, subtract_previous=False)) == pytest.approx(
        squared(grads) / 0.25, rel=1e-6
    )


def test_accumulated_micro_batches_are_differences_of_the_running_sum():
    norms = GradientNorms()
    params = list(torch.nn.Linear(3, 2).parameters())
    first = [torch.randn_like(p) for p in params]
    second = [torch.randn_like(p) for p in params]
    for p, g in zip(params, first, strict=True):
        p.grad = g.clone()
    assert float(norms.micro_batch(params, 0.25)) == pytest.approx(squared(first) / 0.25**2, rel=1e-5)
    flat = torch.cat([(a + b).reshape(-1) for a, b in zip(first, second, strict=True)])
    last = float(norms.bucket(flat, lambda: params, 0.75, subtract_previous=True))
    assert last == pytest.approx(squared(second) / 0.75**2, rel=1e-5)
    norms.new_window()  # the next window starts from zero
    assert float(norms.bucket(flat, lambda: params, 1.0, subtract_previous=True)) == pytest.approx(
        squared([a + b for a, b in zip(first, second, strict=True)]), rel=1e-5
    )


def batched_ranks(monkeypatch, exchange_every, world_size=2):
    observers, clock = ranks(monkeypatch, world_size)
    for observer in observers:
        observer.exchange_every = exchange_every
    return observers, clock


@pytest.mark.parametrize("every", [2, 3, 5])
def test_steps_sharing_an_exchange_feed_the_same_numbers_later_with_fewer_collectives(monkeypatch, every):
    problems = [problem(s) for s in range(12)]
    observers, clock = ranks(monkeypatch)
    one = [Recorder(), Recorder()]
    run(observers, clock, one, problems, range(12))
    observers, clock = batched_ranks(monkeypatch, every)
    grad_stats_group = grad_stats.dist.all_reduce.__self__
    batched = [Recorder(), Recorder()]
    for k in range(12):
        run(observers, clock, batched, problems, [k])
        folded = len(batched[0].fed)
        assert one[0].fed[:folded] == batched[0].fed, "the same numbers, in the same order"
        assert folded >= k + 1 - 2 * every, "a step's statistics arrive at most 2 x exchange_every steps later"
    assert batched[0].fed == batched[1].fed
    assert len(grad_stats_group.calls) == len(problems) // every, "one collective per exchange_every steps"


def test_a_checkpoint_between_exchanges_changes_nothing_and_the_resume_feeds_the_same_numbers(monkeypatch):
    problems = [problem(s) for s in range(14)]
    observers, clock = batched_ranks(monkeypatch, 4)
    straight = [Recorder(), Recorder()]
    run(observers, clock, straight, problems, range(14))

    observers, clock = batched_ranks(monkeypatch, 4)
    saver = [Recorder(), Recorder()]
    run(observers, clock, saver, problems, range(6))  # steps 4 and 5 wait for the next exchange
    clock[0] = 6
    for observer in observers:
        observer._transfer.checkpoint = True
        # every rank first, as Lightning's save_checkpoint runs: the fake collective cannot block an early reader
        observer.snapshot_waiting()
    saved = [o.state_dict() for o in observers]
    resumed = [Recorder(), Recorder()]
    new_observers, new_clock = batched_ranks(monkeypatch, 4)
    for observer, state in zip(new_observers, saved, strict=True):
        observer.load_state_dict(state)
    for observer in observers:
        observer._transfer.checkpoint = False
    run(new_observers, new_clock, resumed, problems, range(6, 14))
    run(observers, clock, saver, problems, range(6, 14))  # the run that saved goes on as if nothing happened
    assert len(straight[0].fed) == 7  # exchanges after steps 3, 7 and 11; read 4 steps later each
    assert saver[0].fed == straight[0].fed, "saving a checkpoint must not change what is folded, or when"
    assert saver[0].fed[: len(saver[0].fed) - len(resumed[0].fed)] + resumed[0].fed == straight[0].fed
    assert resumed[0].fed == resumed[1].fed


@pytest.mark.parametrize("name", ["noise_exchange_every", "noise_every_n_steps"])
def test_noise_intervals_must_be_positive_integers(name):
    from lightning_cannikin import CannikinSettings

    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=name):
            CannikinSettings(**{name: bad})


@pytest.mark.parametrize("measure_every, exchange_every", [(2, 1), (3, 1), (3, 2)])
def test_measuring_one_step_in_k_feeds_exactly_those_steps_numbers(monkeypatch, measure_every, exchange_every):
    problems = [problem(s) for s in range(16)]
    observers, clock = ranks(monkeypatch)
    every_step = [Recorder(), Recorder()]
    run(observers, clock, every_step, problems, range(16))

    observers, clock = ranks(monkeypatch)
    for observer in observers:
        observer.measure_every, observer.exchange_every = measure_every, exchange_every
    sampled = [Recorder(), Recorder()]
    for k in range(16):
        clock[0] = k
        for observer in observers:
            observer.start_step(k)
        step(observers, sampled, *problems[k])
    measured = list(range(0, 16, measure_every))
    # each measured step's Z with its own Y (not the Y of the unmeasured step after it), in order, on every rank
    expected = [every_step[0].fed[k] for k in measured if k < len(every_step[0].fed)]
    assert sampled[0].fed == expected[: len(sampled[0].fed)] and sampled[1].fed == sampled[0].fed
    assert set(sampled[0].steps) == {measure_every}, "each update stands for the steps between measurements"
    assert len(sampled[0].fed) >= len(measured) - 2 * exchange_every - 1  # all but the last ones still in flight
    assert len(grad_stats.dist.all_reduce.__self__.calls) == -(-len(measured) // exchange_every)


def test_a_measured_step_weighs_as_the_steps_since_the_last_one_when_the_cadence_changes(monkeypatch):
    # the engine measures every step while the noise bounds may move the total and one in four once they cannot:
    # each measurement stands for the steps since the one before, so every step is counted once across a change
    problems = [problem(s) for s in range(24)]
    observers, clock = ranks(monkeypatch)
    for observer in observers:
        observer.cadence = lambda: 1 if clock[0] < 6 or clock[0] >= 14 else 4
    sampled = [Recorder(), Recorder()]
    for k in range(24):
        clock[0] = k
        for observer in observers:
            observer.start_step(k)
            observer.start_step(k)  # a second micro-batch of the same step changes nothing
        step(observers, sampled, *problems[k])
    # measured: 0-5 (every step), 8 and 12 (one in four), 14-23 (every step again)
    weights = [1, 1, 1, 1, 1, 1, 3, 4, 2, *[1] * 9]
    assert sampled[0].steps == weights[: len(sampled[0].steps)] and sampled[1].steps == sampled[0].steps
    assert len(sampled[0].steps) >= len(weights) - 3  # all but the last ones still in flight
