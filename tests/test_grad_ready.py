"""Parameter hooks, on CPU without DDP: gradient readiness (the timing source with DDP's own all-reduce) and the
capture of the local gradient for the noise statistics."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_cannikin.training.grad_capture import GradientCapture
from lightning_cannikin.training.grad_norms import GradientNorms
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


@pytest.mark.parametrize("in_place_buckets", [False, True], ids=["final-callback", "parameter-hooks"])
def test_the_capture_measures_each_local_gradient_during_an_armed_backward_only(in_place_buckets):
    model = mlp()
    unused = nn.Linear(2, 2)  # never in the graph
    capture = GradientCapture([*model.parameters(), *unused.parameters()], GradientNorms(), in_place_buckets)

    def reduce_all():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(3.0)

    queued = []

    def reduce_later(parameter):
        if not queued:  # as DDP's reducer: at the first gradient, a final callback that overwrites them all
            queued.append(True)
            torch.autograd.Variable._execution_engine.queue_callback(reduce_all)

    def triple(parameter):  # as DDP's reducer with gradient_as_bucket_view: each bucket reduced in place
        parameter.grad.mul_(3.0)

    def backward(module, armed):
        """A backward whose gradients are overwritten after the capture ran, as DDP's all-reduce does."""
        queued.clear()
        loss = module(torch.randn(4, 8)).sum()
        if armed:
            capture.arm(loss)
        overwrite = triple if in_place_buckets else reduce_later
        after = [p.register_post_accumulate_grad_hook(overwrite) for p in model.parameters()]  # after the capture's
        loss.backward()
        for handle in after:
            handle.remove()
        if armed:
            capture.disarm()
        return sum(float((p.grad / 3.0).pow(2).sum()) for p in module.parameters())

    local = backward(model, armed=True)
    assert not capture.armed and all(not p._post_accumulate_grad_hooks for p in model.parameters()), "none is left"
    assert float(capture.local_squared()) == pytest.approx(local, rel=1e-6), "before the reduction, all of them"
    backward(model, armed=False)  # not armed: nothing is measured
    assert float(capture.local_squared()) == pytest.approx(local, rel=1e-6)
    model.zero_grad()
    first = backward(model[0], armed=True)  # only the first layer gets gradients: only they count
    assert float(capture.local_squared()) == pytest.approx(first, rel=1e-6)
    capture.arm(torch.zeros((), requires_grad=True))
    capture.disarm()
    assert capture.local_squared() is None, "no backward, no measurement"
    capture.arm(torch.zeros(()))  # a loss without a gradient: backward will raise its own error, arming none
    assert not capture.armed
    model.zero_grad()  # a backward that gives none of them a gradient measures zero (the exchange needs it)
    loss = (2 * torch.ones(2, requires_grad=True)).sum()
    capture.arm(loss)
    loss.backward()
    capture.disarm()
    assert float(capture.local_squared()) == 0.0


def reduced_by_ddp_after_the_capture(device: torch.device, in_place_buckets: bool) -> tuple[float, float, float]:
    """One backward of a real DDP model (world size 1) whose comm hook triples every bucket, captured: the capture's
    squared norm, the local gradient's, and the squared norm DDP left in the gradients (9x the local one).

    One rank's all-reduce changes nothing, so the hook's factor makes "after the reduction" visible: DDP copies each
    gradient into its bucket, reduces (here: triples) it, and copies the result back when backward ends, or, with
    ``gradient_as_bucket_view``, reduces the gradients in place. Shared with the CUDA test (NCCL).
    """
    created = not dist.is_initialized()
    if created:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert dist.get_world_size() == 1
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
        model = model.to(device)
        reference = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
        reference.to(device).load_state_dict(model.state_dict())
        ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=0.1,  # several buckets
            gradient_as_bucket_view=in_place_buckets,
        )

        def tripled(state, bucket):
            future = torch.futures.Future()
            future.set_result(bucket.buffer().mul_(3.0))
            return future

        ddp.register_comm_hook(None, tripled)
        capture = GradientCapture(model.parameters(), GradientNorms(), in_place_buckets)
        x = torch.randn(16, 64, device=device)
        loss = ddp(x).square().mean()
        capture.arm(loss)
        loss.backward()
        capture.disarm()
        reference(x).square().mean().backward()
        local = sum(float(p.grad.double().pow(2).sum()) for p in reference.parameters())
        after = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters())
        return float(capture.local_squared()), local, after
    finally:
        if created:
            dist.destroy_process_group()


@pytest.mark.parametrize("in_place_buckets", [False, True], ids=["final-callback", "bucket-view"])
def test_the_capture_reads_real_ddp_gradients_before_the_reduction_replaces_them(in_place_buckets):
    captured, local, after = reduced_by_ddp_after_the_capture(torch.device("cpu"), in_place_buckets)
    assert after == pytest.approx(9 * local, rel=1e-5), "DDP did replace the gradients"
    assert captured == pytest.approx(local, rel=1e-5)
