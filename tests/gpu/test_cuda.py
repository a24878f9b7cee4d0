"""On one CUDA device: the event timer against synchronised truth, the weighted hook on NCCL (world size 1), the full
strategy in 32-bit, 16-mixed and bf16-mixed, and the memory model against a measured peak and ``mem_get_info``.

Run with ``python -m pytest tests/gpu -q``; every test here is skipped where no CUDA device is present.
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from lightning_cannikin import Cannikin, CannikinStrategy
from lightning_cannikin.core.memory import MemoryFitter
from lightning_cannikin.training.measurement.comm_hook import WeightedAllReduceState, weighted_allreduce_hook
from lightning_cannikin.training.measurement.device_memory import DeviceMemory
from lightning_cannikin.training.measurement.step_timer import CudaEventClock, StepTimer

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = torch.device("cuda", 0)


def gpu_work(x: torch.Tensor, weight: torch.Tensor, repeats: int) -> torch.Tensor:
    """Matrix products whose GPU time (tens of ms) is far above their launch time (microseconds each)."""
    for _ in range(repeats):
        x = torch.tanh(x @ weight)
    return x


def test_event_timer_matches_synchronised_truth_and_reads_lazily():
    x = torch.randn(4096, 4096, device=DEVICE)
    weight = torch.randn(4096, 4096, device=DEVICE) / 64
    gpu_work(x, weight, 3)  # warm up the kernels
    torch.cuda.synchronize()
    truths, timed, launches = [], [], []
    timer = StepTimer(CudaEventClock(), DeviceMemory(DEVICE))
    for step in range(5):
        torch.cuda.synchronize()
        started = time.perf_counter()
        gpu_work(x, weight, 30)
        launches.append(time.perf_counter() - started)  # what a host clock would call the compute
        torch.cuda.synchronize()
        truths.append(time.perf_counter() - started)

        torch.cuda.synchronize()
        timer.start()
        timer.forward_start()
        gpu_work(x, weight, 30)
        timer.before_reduce(None, None)
        timer.after_reduce(None, None, None)
        timer.finish(step, 0, 8)
        if step == 0:
            assert timer.records() == [], "read before the device ran the step: the timer must not wait"
        timed.extend(record.compute for record in timer.records(wait=True))
    truth = statistics.median(truths)
    assert len(timed) == 5 and all(t > 0 for t in timed)
    assert statistics.median(timed) == pytest.approx(truth, rel=0.10)
    assert statistics.median(launches) < 0.5 * truth, "the work must be GPU-bound for this check to mean anything"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bucketed_net() -> nn.Sequential:
    """10 MiB in three layers of 2-4 MiB: with a 1 MiB cap, DDP's rebuilt buckets (filled in the order gradients become
    ready, closed once over the cap) close at each of them. One 4 MiB layer behind 88 KiB of others stays one bucket
    even after the rebuild (the big layer's gradient is the last ready and closes the only bucket)."""
    return nn.Sequential(
        nn.Linear(512, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 10),
    ).to(DEVICE)


def test_weighted_hook_on_nccl_scales_every_step_and_times_the_rebuilt_buckets():
    created = not dist.is_initialized()
    if created:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model, reference = _bucketed_net(), _bucketed_net()
        reference.load_state_dict(model.state_dict())
        ddp = DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=1)
        timer = StepTimer(CudaEventClock(), DeviceMemory(DEVICE))
        state = WeightedAllReduceState(weight=0.25, observers=[timer])
        ddp.register_comm_hook(state, weighted_allreduce_hook)
        buckets = []
        for step in range(4):
            x, y = torch.randn(64, 512, device=DEVICE), torch.randint(0, 10, (64,), device=DEVICE)
            for p in (*model.parameters(), *reference.parameters()):
                p.grad = None
            calls = state.calls
            timer.start()
            timer.forward_start()
            nn.functional.cross_entropy(ddp(x), y).backward()
            timer.backward_done()
            timer.finish(step, 0, 64)
            buckets.append(state.calls - calls)
            nn.functional.cross_entropy(reference(x), y).backward()
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                # one rank: sum of (b_i / B) g_i with weight 1/4, on the first step's single bucket as on the later ones
                torch.testing.assert_close(p.grad, 0.25 * q.grad, msg=lambda m, step=step: f"step {step}: {m}")
        # torch's DDP puts every parameter in one bucket for the first iteration (neither find_unused_parameters nor a
        # static graph: the order gradients become ready is unknown yet) and rebuilds the buckets by size before the
        # second forward, in the order it saw
        assert buckets[0] == 1, buckets
        assert buckets[1] > 1 and len(set(buckets[1:])) == 1, f"the rebuilt buckets went through the hook: {buckets}"
        records = timer.records(wait=True)
        assert [record.step for record in records] == [0, 1, 2, 3]
        steady = records[-1]
        assert 0 < steady.compute <= steady.step_time
        assert steady.allreduce is not None and 0 <= steady.exposed <= steady.allreduce
        # every bucket came back through the hook: the reductions' own time is measured, the last one's within it
        assert steady.comm_busy is not None and steady.last_bucket is not None
        assert 0 <= steady.last_bucket <= steady.comm_busy
        assert steady.peak_memory > 0 and steady.memory_capacity > 0
    finally:
        if created:
            dist.destroy_process_group()


class Wide(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Records(pl.Callback):
    """Every step record the timer hands out, and the clock in use."""

    def __init__(self) -> None:
        self.records: list = []
        self.clock = None

    def on_train_start(self, trainer, pl_module):
        timer = trainer.strategy.engine.reductions.timer  # the engine's timer: the test reads its clock
        self.clock = type(timer.clock).__name__
        handout = timer.records

        def recording(wait: bool = False):
            out = handout(wait)
            self.records.extend(out)
            return out

        timer.records = recording


@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed"])
def test_the_strategy_trains_on_one_gpu_with_event_timing(precision):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 1024), torch.randint(0, 10, (4096,)))
    spy = Records()
    trainer = pl.Trainer(
        strategy=CannikinStrategy(),
        accelerator="gpu",
        devices=1,
        precision=precision,
        max_epochs=2,
        callbacks=[Cannikin(), spy],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Wide(), DataLoader(data, batch_size=128, shuffle=True))
    assert spy.clock == "CudaEventClock"
    assert len(spy.records) == 64, "every step's record reached a re-plan"
    _, total = torch.cuda.mem_get_info(DEVICE)
    for record in spy.records:
        assert 0 < record.compute <= record.step_time
        assert record.allreduce is not None and record.peak_memory > 0
        # free memory plus what this process holds: at least its own allocations, at most the device
        assert record.peak_memory <= record.memory_capacity <= total
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())


def test_memory_model_predicts_a_measured_peak_and_caps_within_the_capacity():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 8192), nn.ReLU(), nn.Linear(8192, 8192), nn.ReLU(), nn.Linear(8192, 10))
    model = model.to(DEVICE)
    # plain SGD updates in place; Adam's temporaries (parameter-sized, independent of the batch) would put a flat
    # floor under the peak at small batches, which a linear model does not describe
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    memory = DeviceMemory(DEVICE)
    fitter = MemoryFitter()
    peaks = {}
    for batch in (256, 512, 1024, 2048):
        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            x = torch.randn(batch, 1024, device=DEVICE)
            nn.functional.cross_entropy(model(x), torch.randint(0, 10, (batch,), device=DEVICE)).backward()
            optimizer.step()
            peaks[batch] = memory.peak()
        if batch < 2048:
            fitter.add(batch, peaks[batch])
    m0, m1 = fitter.fit()
    assert m0 + m1 * 2048 == pytest.approx(peaks[2048], rel=0.10), "the linear peak model extrapolates"
    free, total = torch.cuda.mem_get_info(DEVICE)
    capacity = memory.capacity()
    assert capacity == pytest.approx(free + torch.cuda.memory_reserved(DEVICE), rel=0.01)
    assert capacity <= total
    cap = fitter.max_batch_size(capacity)
    assert cap > 2048 and m0 + m1 * cap <= 0.9 * capacity
