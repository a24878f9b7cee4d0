"""Parameter hooks, on CPU without DDP: gradient readiness (the timing source with DDP's own all-reduce) and the
capture of the local gradient for the noise statistics."""

from __future__ import annotations

import torch
from torch import nn

from lightning_cannikin.training.measurement.grad_ready import GradientReadiness
from lightning_cannikin.training.measurement.step_timer import StepTimer


def hooked(readiness: GradientReadiness) -> int:
    """How many parameters carry a hook now (all of them until the first backward ends, then two at most)."""
    return len(readiness._handles)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))


def test_the_first_backward_learns_the_order_and_two_hooks_stay():
    model = mlp()
    frozen = nn.Linear(1, 1)
    frozen.weight.requires_grad_(False)
    calls: list[int] = []
    readiness = GradientReadiness([*model.parameters(), frozen.weight], lambda: calls.append(1))
    assert hooked(readiness) == 6, "every parameter that needs a gradient, and only those"
    model(torch.randn(4, 8)).sum().backward()
    assert len(calls) == 6
    readiness.backward_done()
    assert readiness.discovered and hooked(readiness) == 2
    calls.clear()
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        readiness.backward_done()
    assert len(calls) == 2 * 3, "two Python calls a step, whatever the model's size"
    readiness.remove()
    model(torch.randn(4, 8)).sum().backward()
    assert len(calls) == 6 and hooked(readiness) == 0


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
    monkeypatch.setattr("lightning_cannikin.training.measurement.step_timer.time.perf_counter", lambda: next(ticks))
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
