"""``strategy="cannikin_fsdp"`` on one CUDA device: FSDP2 over NCCL with event timing, the per-rank memory cap fitted
from the measured peaks and ``mem_get_info``, and a real out-of-memory error that names the rank, its batch and the
bounds. Skipped where no CUDA device is present."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_cannikin import Cannikin, CannikinModelParallelStrategy, CannikinSettings
from lightning_cannikin.training.measurement.device_memory import LocalBatchOutOfMemoryError

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class ShardedWide(pl.LightningModule):
    """Wide layers sharded per layer; ``extra_bytes_per_sample`` allocates on top of the activations (to run out)."""

    def __init__(self, extra_bytes_per_sample: int = 0) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10)
        )
        self.extra = extra_bytes_per_sample

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.extra:
            torch.empty(len(x) * self.extra, dtype=torch.uint8, device=x.device)
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Records(Callback):
    """Every step record the engine's re-plans receive."""

    def __init__(self) -> None:
        self.records: list = []

    def on_train_start(self, trainer, pl_module):
        timer = trainer.strategy.engine.reductions.timer  # the engine's timer: the test reads its clock
        self.clock = type(timer.clock).__name__
        records = timer.records

        def recording(wait=False):
            out = records(wait)
            self.records.extend(out)
            return out

        timer.records = recording


def fit(module: pl.LightningModule, callbacks: list, batch_size: int = 256, epochs: int = 2) -> pl.Trainer:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 1024), torch.randint(0, 10, (4096,)))
    trainer = pl.Trainer(
        strategy=CannikinModelParallelStrategy(),
        accelerator="gpu",
        devices=1,
        max_epochs=epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(data, batch_size=batch_size, shuffle=True))
    return trainer


def test_fsdp_on_nccl_times_with_events_and_caps_the_batch_from_the_measured_peak():
    spy = Records()
    cannikin = Cannikin(settings=CannikinSettings(warmup_steps=4))
    trainer = fit(ShardedWide(), [cannikin, spy])
    assert trainer.strategy.process_group_backend == "nccl"
    assert spy.clock == "CudaEventClock"
    assert len(spy.records) == 32, "every step's record reached a re-plan"
    _, total = torch.cuda.mem_get_info()
    for record in spy.records:
        assert 0 < record.compute <= record.step_time
        assert 0 < record.peak_memory <= record.memory_capacity <= total
    # the memory model caps the local batch within what this rank can use
    cap = cannikin.speed_model.memory_caps[0]
    assert cap is not None and cap > 256
    assert all(torch.isfinite(p.full_tensor()).all() for p in trainer.lightning_module.net.parameters())


def test_running_out_of_memory_names_the_rank_its_batch_and_the_bounds():
    _, total = torch.cuda.mem_get_info()
    per_sample = int(total // 64)  # a local batch of 256 asks for four times the device
    message = (
        r"rank 0 \(cuda:0\) at a local batch of 256 samples.*`local_batch_bounds` is \(lower \[1\], upper \[512\]\)"
    )
    with pytest.raises(LocalBatchOutOfMemoryError, match=message):
        fit(ShardedWide(per_sample), [Cannikin(local_batch_bounds=(1, 512))], epochs=1)
