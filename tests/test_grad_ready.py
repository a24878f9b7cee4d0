"""Parameter hooks, on CPU without DDP: gradient readiness (the timing source with DDP's own all-reduce) and the
capture of the local gradient for the noise statistics."""

from __future__ import annotations

import torch
from torch import nn

from lightning_cannikin.training.comm_hook import WeightedAllReduceState
from lightning_cannikin.training.grad_capture import GradientCapture
from lightning_cannikin.training.grad_ready import GradientReadiness
from lightning_cannikin.training.step_timer import StepTimer


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))


def test_the_first_backward_learns_the_order_and_two_hooks_stay():
    model = mlp()
    frozen = nn.Linear(1, 1)
    frozen.weight.requires_grad_(False)
    calls: list[int] = []
    readiness = GradientReadiness([*model.parameters(), frozen.weight], lambda: calls.append(1))
    assert readiness.hooked == 6, "every parameter that needs a gradient, and only those"
    model(torch.randn(4, 8)).sum().backward()
    assert len(calls) == 6
    readiness.backward_done()
    assert readiness.discovered and readiness.hooked == 2
    calls.clear()
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        readiness.backward_done()
    assert len(calls) == 2 * 3, "two Python calls a step, whatever the model's size"
    readiness.remove()
    model(torch.randn(4, 8)).sum().backward()
    assert len(calls) == 6 and readiness.hooked == 0


def test_the_kept_hooks_are_the_first_and_the_last_gradient_ready():
    model = mlp()
    order: list[str] = []
    names = {id(p): name for name, p in model.named_parameters()}
    for p in model.parameters():  # the truth: every parameter's own hook, in the order autograd runs them
        p.register_post_accumulate_grad_hook(lambda q: order.append(names[id(q)]))
    seen: list[str] = []
    readiness = GradientReadiness(model.parameters(), lambda: seen.append(order[-1]))
    model(torch.randn(4, 8)).sum().backward()
    readiness.backward_done()
    first, last = order[0], order[-1]
    order.clear()
    seen.clear()
    model(torch.randn(4, 8)).sum().backward()
    assert seen == [first, last] and first.startswith("4.") and last.startswith("0.")


def test_the_timer_marks_gradients_and_the_reduction_from_readiness(monkeypatch):
    ticks = iter(float(t) for t in range(100))
    monkeypatch.setattr("lightning_cannikin.training.step_timer.time.perf_counter", lambda: next(ticks))
    timer = StepTimer()
    model = mlp()
    readiness = GradientReadiness(model.parameters(), timer.gradient_ready)
    timer.start()  # 0
    timer.forward_start()  # 1
    timer.inner_forward_start()  # 2
    timer.will_reduce(True)
    model(torch.randn(4, 8)).sum().backward()  # six gradients: the first marks 3 and 4, the others 5 to 9
    readiness.backward_done()
    timer.backward_done()  # 10: the all-reduce is done when DDP's backward returns
    timer.finish(0, 0, 4)  # 11
    (record,) = timer.records()
    assert (record.compute, record.allreduce, record.exposed, record.step_time) == (9 - 2, 10 - 3, 10 - 9, 11)
    # a micro-step (no sync): the hooks fire, but compute ends at backward and no all-reduce is recorded
    timer.start()
    timer.will_reduce(False)
    model(torch.randn(4, 8)).sum().backward()
    timer.backward_done()
    timer.finish(1, 0, 4)
    (micro,) = timer.records()
    assert micro.allreduce is None and micro.compute == 13 - 12 and not timer.reduced


class SeenBuckets:
    """A bucket observer that keeps copies of what it is shown."""

    def __init__(self) -> None:
        self.before: list[tuple[torch.Tensor, list]] = []
        self.after: list[torch.Tensor] = []

    def before_reduce(self, state, bucket) -> None:
        assert bucket.is_last()
        self.before.append((bucket.buffer().clone(), bucket.parameters()))

    def after_reduce(self, state, bucket, reduced) -> None:
        self.after.append(reduced.clone())


def test_the_capture_copies_each_local_gradient_during_an_armed_backward_only():
    model = mlp()
    unused = nn.Linear(2, 2)  # never in the graph: reads as zeros
    parameters = [*model.parameters(), *unused.parameters()]
    capture = GradientCapture(parameters)
    flat = lambda tensors: torch.cat([t.reshape(-1) for t in tensors])  # noqa: E731

    capture.arm()
    assert capture.armed
    model(torch.randn(4, 8)).sum().backward()
    local = [p.grad.clone() for p in model.parameters()]
    capture.disarm()
    assert not capture.armed and all(not p._post_accumulate_grad_hooks for p in parameters), "no hook is left"
    for p in model.parameters():
        p.grad.mul_(3.0)  # what the all-reduce does to the gradients after the capture
    seen = SeenBuckets()
    capture.report(seen, WeightedAllReduceState(), reduced=True)
    ((before, listed),), (after,) = seen.before, seen.after
    zeros = torch.zeros(sum(p.numel() for p in unused.parameters()))
    assert torch.equal(before, torch.cat([flat(local), zeros])), "the local gradients, in parameter order"
    assert listed == parameters
    assert torch.equal(after, torch.cat([flat(local) * 3.0, zeros])), "the gradients as they are after backward"

    model.zero_grad()
    model(torch.randn(4, 8)).sum().backward()  # not armed: nothing is copied
    capture.report(seen, WeightedAllReduceState(), reduced=False)
    assert torch.equal(seen.before[1][0], seen.after[0]) and len(seen.after) == 1

    capture.arm()  # armed again: what an earlier backward left is cleared
    model.zero_grad()
    model[0](torch.randn(4, 8)).sum().backward()  # only the first layer gets gradients
    capture.disarm()
    capture.report(seen, WeightedAllReduceState(), reduced=False)
    first = flat([p.grad for p in model[0].parameters()])
    assert torch.equal(seen.before[2][0][: first.numel()], first)
    assert not seen.before[2][0][first.numel() :].any()
