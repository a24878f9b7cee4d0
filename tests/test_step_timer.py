"""The step timer's logic on CPU: fake CUDA events (lazy reads, no sync, the right intervals and step indices), the
host clock with a scripted ``perf_counter``, the device-memory readings, and the choice of clock by device."""

from __future__ import annotations

import pytest
import torch

from lightning_cannikin.training.measurement import step_timer
from lightning_cannikin.training.measurement.device_memory import DeviceMemory
from lightning_cannikin.training.measurement.step_timer import CudaEventClock, HostClock, StepTimer, step_timer_for


def unread(timer: StepTimer) -> int:
    """Finished steps whose marks have not been read yet."""
    return len(timer._pending)


class FakeDevice:
    """A GPU timeline: an event recorded now gets timestamp ``at`` (ms); the device has run everything up to ``now``."""

    def __init__(self) -> None:
        self.at = 0.0
        self.now = 0.0
        self.syncs = 0
        self.created = 0


class FakeEvent:
    """Behaves like ``torch.cuda.Event(enable_timing=True)``: ``elapsed_time`` fails on an event not yet reached."""

    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.time: float | None = None
        device.created += 1

    def record(self) -> None:
        self.time = self.device.at

    def query(self) -> bool:
        return self.time is not None and self.time <= self.device.now

    def synchronize(self) -> None:
        self.device.syncs += 1
        self.device.now = max(self.device.now, self.time)

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.query() and end.query()):
            raise RuntimeError("cudaErrorNotReady: an event has not completed")
        return end.time - self.time


def cuda_timer() -> tuple[StepTimer, FakeDevice]:
    device = FakeDevice()
    return StepTimer(CudaEventClock(lambda: FakeEvent(device))), device


def run_step(timer: StepTimer, device: FakeDevice, step: int, t0: float, buckets: int = 2, reduce: bool = True) -> None:
    """One step whose GPU timeline starts at ``t0`` ms: forward at +2, buckets at +10 and +30, reduced at +45."""
    device.at = t0
    timer.start()
    device.at = t0 + 1
    timer.forward_start()  # the strategy's training_step
    device.at = t0 + 2
    timer.inner_forward_start()  # DDP hands the batch to the module
    device.at = t0 + 3
    timer.inner_forward_start()  # the module calls itself again: the start must not move
    if reduce:
        for k in range(buckets):
            device.at = t0 + 10 + 20 * k
            timer.before_reduce(None, None)
        device.at = t0 + 45
        timer.after_reduce(None, None, None)
    device.at = t0 + 40
    timer.backward_done()
    device.at = t0 + 50
    timer.finish(step, 1, 32)


def test_cuda_records_are_read_lazily_with_their_own_step_index():
    timer, device = cuda_timer()
    device.now = 5.0  # the GPU is still in step 0's forward
    run_step(timer, device, step=7, t0=0.0)
    assert timer.records() == [] and unread(timer) == 1
    device.now = 60.0  # step 0 done on the device, step 1 being queued
    run_step(timer, device, step=8, t0=100.0)
    (record,) = timer.records()
    assert device.syncs == 0, "the hot path must never wait for the device"
    assert record.step == 7 and record.rank == 1 and record.batch_size == 32
    # forward start after DDP's pre-forward (+2) to the last bucket (+30); all-reduce first bucket (+10) to +45
    assert record.compute == pytest.approx(0.028)
    assert record.allreduce == pytest.approx(0.035)
    assert record.exposed == pytest.approx(0.015)
    assert record.step_time == pytest.approx(0.050)
    assert unread(timer) == 1
    # the re-plan waits for what is left: nothing is lost, and the late record keeps its step
    (late,) = timer.records(wait=True)
    assert device.syncs > 0 and late.step == 8 and late.compute == pytest.approx(0.028)
    assert timer.records(wait=True) == []


def test_cuda_hot_path_never_syncs_and_reuses_its_events():
    timer, device = cuda_timer()
    for step in range(200):
        device.now = 100.0 * step - 50.0  # the device runs half a step behind the host
        run_step(timer, device, step=step, t0=100.0 * step)
    assert device.syncs == 0
    records = timer.records()
    assert [r.step for r in records] == list(range(199)), "every step but the one still on the device, in order"
    assert all(r.compute == pytest.approx(0.028) for r in records)
    # events come from a pool: a couple of steps' worth, not one set per step
    assert device.created <= 3 * 7


def test_the_input_span_is_what_the_device_waited_for_and_none_after_an_epoch_end():
    timer, device = cuda_timer()
    run_step(timer, device, step=0, t0=0.0)  # the fit's first step: no request for its input was seen
    # step 1: the loop asks for the batch as the device finishes step 0 (at 50) and the batch reaches it at 62
    device.at = 50.0
    timer.input_starts()
    device.at = 51.0
    timer.input_starts()  # a second request (the first was a prefetch): the span starts at the latest
    run_step(timer, device, step=1, t0=62.0)
    # step 2: the host ran ahead (workers kept up): its request and the step start meet on the device's queue
    device.at = 112.0
    timer.input_starts()
    run_step(timer, device, step=2, t0=112.0)
    # step 3: the first of a new epoch
    device.at = 170.0
    timer.input_starts()
    device.at = 200.0
    timer.start(after_input=False)
    device.at = 240.0
    timer.backward_done()
    timer.finish(3, 1, 32)
    device.now = 1e9
    records = {r.step: r for r in timer.records()}
    assert records[0].host is None and records[3].host is None
    assert records[1].host == pytest.approx(0.011) and records[2].host == pytest.approx(0.0)
    assert records[1].compute == pytest.approx(0.028), "the device's own span is unchanged"
    # after the reduction (45 on its timeline) to the step's end (50): the optimizer, in series with the next step
    assert records[1].after == pytest.approx(0.005) and records[3].after == pytest.approx(0.0)
    assert records[1].cost == pytest.approx(0.039) and records[1].cycle == pytest.approx(0.061)
    assert records[1].own == pytest.approx(0.044), "input, compute and after: all of the rank's own step"
    # from the previous step's end to the input request: 50 to 51, then none (the host ran ahead); none at an epoch
    assert records[1].gap == pytest.approx(0.001) and records[2].gap == pytest.approx(0.0)
    assert records[0].gap is None and records[3].gap is None
    assert records[0].cost == records[0].compute and records[0].cycle == records[0].step_time
    assert device.syncs == 0


def test_host_clock_times_the_input_between_the_request_and_the_step(monkeypatch):
    clock = iter([0.0, 1.0, 1.5, 2.0, 2.0, 5.0, 5.25, 5.5, 6.0, 6.0])
    monkeypatch.setattr(step_timer.time, "perf_counter", lambda: next(clock))
    timer, seen = StepTimer(HostClock()), []
    timer.listeners.append(lambda b, seconds: seen.append((b, seconds)))
    timer.input_starts()  # 0.0: ignored below, the epoch's first step
    timer.start(after_input=False)  # 1.0
    timer.backward_done()  # 1.5
    timer.finish(0, 0, 8)  # 2.0: the step's end, and the next one's previous end
    timer.input_starts()  # 5.0
    timer.start()  # 5.25
    timer.backward_done()  # 5.5
    timer.finish(1, 0, 8)  # 6.0
    first, second = timer.records()
    assert first.host is None and second.host == pytest.approx(0.25)
    assert second.compute == pytest.approx(0.25) and second.step_time == pytest.approx(0.75)
    assert first.after == pytest.approx(0.5) and second.after == pytest.approx(0.5)  # backward's end to the step's
    assert first.gap is None and second.gap == pytest.approx(3.0), "the previous step's end to the input request"
    # the change check sees what the speed model's lines fit: compute and input
    assert seen == [(8, pytest.approx(0.5)), (8, pytest.approx(0.5))]


def test_a_micro_step_ends_its_compute_at_backward_and_has_no_allreduce():
    timer, device = cuda_timer()
    device.now = 1e9
    run_step(timer, device, step=0, t0=0.0, reduce=False)
    assert not timer.reduced
    (record,) = timer.records()
    assert record.compute == pytest.approx(0.038) and record.allreduce is None and record.exposed is None


def test_without_a_forward_mark_compute_starts_at_the_batch():
    timer, device = cuda_timer()
    device.now = 1e9
    device.at = 0.0
    timer.start()
    timer.inner_forward_start()  # not armed by training_step: ignored
    device.at = 30.0
    timer.before_reduce(None, None)
    device.at = 35.0
    timer.after_reduce(None, None, None)
    device.at = 40.0
    timer.finish(0, 0, 8)
    (record,) = timer.records()
    assert record.compute == pytest.approx(0.030)


def test_an_unfinished_step_is_dropped_and_a_step_without_a_batch_gives_no_record():
    timer, device = cuda_timer()
    device.now = 1e9
    timer.start()
    timer.forward_start()
    timer.before_reduce(None, None)  # an exception ends the step here: no finish
    run_step(timer, device, step=1, t0=100.0)
    assert [r.step for r in timer.records()] == [1]
    timer.start()
    timer.before_reduce(None, None)
    timer.finish(2, 0, None)
    assert timer.records(wait=True) == []


def test_host_clock_gives_exact_intervals(monkeypatch):
    ticks = iter([0.0, 0.001, 0.002, 0.010, 0.010, 0.030, 0.045, 0.050, 0.050])
    monkeypatch.setattr(step_timer.time, "perf_counter", lambda: next(ticks))
    timer = StepTimer(HostClock())
    timer.start()  # 0
    timer.forward_start()  # 1 ms
    timer.inner_forward_start()  # 2 ms
    timer.before_reduce(None, None)  # 10 ms: the first bucket and, for now, the latest
    timer.before_reduce(None, None)  # 30 ms
    timer.after_reduce(None, None, None)  # 45 ms
    timer.backward_done()  # reduced: not marked
    timer.finish(3, 0, 16)  # 50 ms
    (record,) = timer.records()
    assert (record.step, record.batch_size) == (3, 16)
    assert record.compute == pytest.approx(0.028) and record.allreduce == pytest.approx(0.035)
    assert record.exposed == pytest.approx(0.015) and record.step_time == pytest.approx(0.050)
    assert record.after == pytest.approx(0.005), "the reduction's end to the step's end"
    assert record.peak_memory is None and record.memory_capacity is None


class FakeCudaMemory:
    def __init__(self) -> None:
        self.peak = 5e9
        self.calls = {"mem_get_info": 0, "reset": 0}

    def max_memory_allocated(self, device):
        return self.peak

    def reset_peak_memory_stats(self, device):
        self.calls["reset"] += 1

    def mem_get_info(self, device):
        self.calls["mem_get_info"] += 1
        return 30e9, 80e9  # another process holds most of the rest of the device

    def memory_reserved(self, device):
        return 6e9


def test_memory_capacity_is_free_plus_held_and_read_once_per_handout():
    backend = FakeCudaMemory()
    memory = DeviceMemory(torch.device("cuda", 0), backend)
    timer = StepTimer(HostClock(), memory)
    for step in range(5):
        backend.peak = 1e9 * (step + 1)
        timer.start()
        timer.before_reduce(None, None)
        timer.finish(step, 0, 8)
    assert backend.calls == {"mem_get_info": 0, "reset": 5}, "the capacity is not read per step"
    records = timer.records(wait=True)
    assert backend.calls["mem_get_info"] == 1
    assert [r.peak_memory for r in records] == [1e9, 2e9, 3e9, 4e9, 5e9]
    assert {r.memory_capacity for r in records} == {36e9}, "free + reserved, not the device's 80 GB"


def test_cpu_memory_reads_nothing():
    memory = DeviceMemory(torch.device("cpu"))
    assert memory.peak() is None and memory.capacity() is None


def test_the_clock_follows_the_device_and_replaces_the_hook_observer():
    from lightning_cannikin.training.engine import BalancingEngine

    assert isinstance(step_timer_for(torch.device("cpu")).clock, HostClock)
    cuda = step_timer_for(torch.device("cuda", 0))  # builds no event and touches no device yet
    assert isinstance(cuda.clock, CudaEventClock) and cuda.memory._backend is not None
    engine = BalancingEngine()
    old = engine.reductions.timer
    engine.reductions.use_device(torch.device("cuda", 0))
    hook, _ = engine.reductions.comm_hook()
    assert isinstance(engine.reductions.timer.clock, CudaEventClock) and not engine.reductions.host_clock
    assert engine.reductions.timer in hook.observers and old not in hook.observers


def test_buckets_outside_a_timed_step_are_not_marked():
    timer, device = cuda_timer()
    timer.before_reduce(None, None)  # a fit without the callback: nobody starts steps
    timer.after_reduce(None, None, None)
    assert not timer.reduced and device.created == 0


def bucket_step(timer: StepTimer, device: FakeDevice, ready: list[float], reduce_ms: float, t0: float = 0.0) -> float:
    """One step whose buckets are ready at ``ready`` ms after ``t0`` and reduced in order, each in ``reduce_ms``: the
    hook sees every bucket ready and every reduction return, in the order they happen. Returns the step's end."""
    device.at = t0
    timer.start()
    device.at = t0 + 1
    timer.forward_start()
    moments, end = [], 0.0
    for at in ready:
        end = max(at, end) + reduce_ms
        moments += [(at, 1, timer.before_reduce), (end, 0, timer.after_reduce)]
    for at, _, call in sorted(moments, key=lambda moment: moment[:2]):  # a return before a bucket ready with it
        device.at = t0 + at
        call(None, None) if call == timer.before_reduce else call(None, None, None)
    device.at = t0 + end
    timer.backward_done()
    device.at = t0 + end + 1
    return t0 + end + 1


@pytest.mark.parametrize(
    "ready, reduce_ms, busy, last, exposed",
    [
        ([10, 20, 30], 4, 12, 4, 4),  # backward hides the reductions: the exposed part is the last bucket's
        ([10, 12, 14], 8, 24, 8, 20),  # the reductions are the bottleneck: the exposed part waits on the earlier ones
        ([10], 5, 5, 5, 5),
        ([10, 11, 30, 31, 32], 6, 30, 6, 16),  # a gap: the third bucket waits for its gradients, not the second
    ],
)
def test_the_hook_gives_the_reductions_own_time_in_either_regime(ready, reduce_ms, busy, last, exposed):
    timer, device = cuda_timer()
    device.now = 1e9
    bucket_step(timer, device, ready, reduce_ms)
    timer.finish(0, 0, 32)
    (record,) = timer.records()
    assert record.comm_busy == pytest.approx(busy / 1000) and record.last_bucket == pytest.approx(last / 1000)
    assert record.exposed == pytest.approx(exposed / 1000), "the spans are what they were"
    assert record.compute == pytest.approx((ready[-1] - 1) / 1000)


def test_bucket_marks_come_from_the_pool_and_a_reduction_not_seen_gives_none():
    timer, device = cuda_timer()
    for step in range(100):
        device.now = 100.0 * step - 50.0  # the device runs half a step behind the host
        bucket_step(timer, device, [10, 20, 30, 40, 50], 4, t0=100.0 * step)
        timer.finish(step, 0, 32)
    records = timer.records()
    assert [r.step for r in records] == list(range(98)) and device.syncs == 0
    assert all(r.comm_busy == pytest.approx(0.020) and r.last_bucket == pytest.approx(0.004) for r in records)
    assert device.created <= 3 * (7 + 2 * 5 - 3), "a couple of steps' worth of events, not a set per step"
    # a bucket whose reduction never came back through the hook (an exception), or DDP's own all-reduce: no guess
    timer, device = cuda_timer()
    device.now = 1e9
    run_step(timer, device, step=0, t0=0.0)  # two buckets ready, one return seen
    timer.start()
    timer.will_reduce(True)
    timer.gradient_ready()  # DDP's own all-reduce: parameters ready, no bucket seen
    timer.backward_done()
    timer.finish(1, 0, 8)
    assert [(r.comm_busy, r.last_bucket) for r in timer.records()] == [(None, None), (None, None)]
    assert timer.latest is None


def test_the_comm_hook_fills_the_reductions_time_on_gloo(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lightning_cannikin.training.measurement.comm_hook import WeightedAllReduceState, weighted_allreduce_hook

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.1)  # about a bucket per parameter
        buckets = []
        state, timer = WeightedAllReduceState(), StepTimer()
        state.observers.append(timer)
        ddp.register_comm_hook(state, weighted_allreduce_hook)
        for step in range(3):
            before = state.calls
            timer.start()
            timer.forward_start()
            ddp(torch.randn(8, 256)).sum().backward()
            timer.backward_done()
            timer.finish(step, 0, 8)
            buckets.append(state.calls - before)
        records = timer.records(wait=True)
    finally:
        dist.destroy_process_group()
    assert min(buckets[1:]) >= 3, f"several buckets per step (after DDP's first, which builds them): {buckets}"
    for record in records:
        assert record.comm_busy is not None and record.last_bucket is not None
        assert 0 < record.last_bucket <= record.comm_busy <= record.allreduce + 1e-9


def test_step_records_pickle_as_their_values_and_stay_frozen():
    import dataclasses
    import pickle

    from lightning_cannikin.core.step_record import StepRecord

    made = StepRecord(3, 1, 32, 0.01, 0.02, 0.005, 0.001, None, None, 0.004, 0.002, 0.003, 0.001, 0.0005)
    built = StepRecord.of(3, 1, 32, 0.01, 0.02, 0.005, 0.001, None, None, 0.004, 0.002, 0.003, 0.001, 0.0005)
    assert built == made and hash(built) == hash(made) and pickle.loads(pickle.dumps([made, built])) == [made, made]
    assert len(pickle.dumps(made)) < len(pickle.dumps(made.to_dict()))  # the values alone, not a dict of them
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.compute = 1.0
    with pytest.raises(ValueError):
        StepRecord.of(3, 1, 32)  # every field's value, in order
