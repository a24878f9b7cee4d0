"""Real heterogeneous devices on one GPU: three ranks held to 60 / 25 / 15% of its SMs by MPS, Lightning DDP against
Cannikin, and the ideal those shares allow.

``python benchmarks/gpu_shares.py --out DIR`` on a machine with one CUDA GPU (``--deadline``, default 180 s, plans
the repeats). As root it starts the MPS daemon, ``nvidia-cuda-mps-control -d`` (without pipes, under a 10 s bound),
probes it with one CUDA client (25 s), and stops it at the end, also when ended by SIGTERM, which ends every rank it
started too (SIGTERM, then SIGKILL); a daemon already running is used and left alone. A daemon that does not start or
answer is stopped and skipped within seconds, and the run goes on time-sliced, labelled so (``sharing``).
Every run starts three rank processes as torchelastic would (``devices=1, num_nodes=3``; ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK=0``, ``GROUP_RANK``, ``NODE_RANK``, ``LOCAL_WORLD_SIZE=1``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_RUN_ID``; the rendezvous store is held by this script, as torchrun's agent holds it), each with its
own ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``; the process group is gloo, since
NCCL refuses two ranks on one GPU. ``--smoke`` runs the same code path on CPU (no MPS, tiny sizes, 2 short epochs, one
repeat: under a minute on 2 cores once Lightning's import is cached) to check the launch, the environment, the
collection and the JSON.

What runs, in this order:

1. Calibration (torch only): each rank alone at its share, the others waiting at a barrier, times full training steps
   (forward, backward, SGD step) at three batch sizes with CUDA events and fits ``t_i(b) = a_i * b + a0_i``; then all
   ranks together at the even split (MPS splits the SMs but not the memory bandwidth: this is the interference); and
   each rank's host loader alone (samples a second its workers deliver to the device).
2. Lightning DDP and Cannikin (``CannikinStrategy``, default balancing, fixed total) interleaved, in as many pairs as
   the deadline leaves time for (at most ``--repeats``),
   on two workloads with the same model, initial weights and global batch: ``compute`` (uint8 images resident on the
   device, fetched as one gather a batch: no host cost) and ``loader`` (host tensors, a DataLoader with 2 workers and
   pinned memory, per-sample indexing and collation, as most training reads data).

Every rank records every step with the package's own step timer (``step_timer_for``: CUDA events read lazily, no
synchronisation per step), in both strategies alike: the device span (forward start to its last gradient ready), the
input (the loader's fetch, marked by a hook on the training loader, to the batch's start), the wait before it (the
step's end to the fetch: Lightning's per-step broadcast), the step (batch start to end), the all-reduce's exposed part
and what follows it (the optimizer step). Epochs are timed on the wall clock, synchronised at epoch starts and at the
end only.

The JSON (``gpu_shares.json``; ``definitions`` in it says the same) gives per workload the measured Cannikin / DDP
time ratios, the ideal ``(T* + fixed) / (T_even + fixed)`` from the solo compute lines and DDP's fixed per-step costs,
the fraction of it reached, and ``shortfall`` (:mod:`benchmarks.shortfall`): every rank's step split into solo
compute, interference, input, broadcast wait, all-reduce and optimizer, each part's ratio points of the gap, and the
one that holds Cannikin back most, in one line. ``synthetic_result`` builds the same JSON from a loop whose every part
is known (the GPU check's dry run).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from typing_extensions import override

if __package__ in (None, ""):  # run as a script: this checkout's benchmarks, not an installed copy
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.shortfall import decompose, fit_line, fraction_of_ideal, line_time, water_fill

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results"
MPS_CONTROL = "nvidia-cuda-mps-control"
MPS_CONTROL_PATH = "/usr/local/nvidia/bin/nvidia-cuda-mps-control"
MPS_CONTROL_ENV = "GPU_SHARES_MPS_CONTROL"  # another control program (a test's stand-in)
# the daemon's start, a client's probe and its quit are bounded: an MPS that does not answer costs seconds, not a run
MPS_START_TIMEOUT_S, MPS_PROBE_TIMEOUT_S, MPS_QUIT_TIMEOUT_S = 10.0, 25.0, 5.0
MPS_PROBE = "import torch; x = torch.ones(1 << 20, device='cuda'); torch.cuda.synchronize(); print(float(x.sum()))"
# a rank or a probe that must end gets SIGTERM, then this long, then SIGKILL (a SIGKILLed MPS client can wedge the
# server: pytorch#32575)
CLIENT_TERM_GRACE_S = 3.0
STRATEGIES = ("ddp", "cannikin")
WORKLOADS = ("compute", "loader")
LR, MOMENTUM = 0.02, 0.9
# a timed-out run's ranks (and their loader workers) write every thread's stack into their logs on this signal, and
# get this long to do so before they are killed; the run's report then prints this many lines of each rank's log
STACKS_SIGNAL, STACKS_GRACE_S, TIMEOUT_TAIL = signal.SIGUSR1, 2.0, 60
# a pause this long between two of the launcher's 0.2 s polls is time the launcher (and its ranks) did not run
PAUSE_GAP_S = 5.0
# launcher variables a parent may carry that would make Lightning pick another cluster environment than torchelastic's
_FOREIGN_PREFIXES = ("SLURM_", "TORCHELASTIC_", "LSB_", "PL_", "OMPI_", "PMI_", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")

DEFINITIONS = {
    "sharing": "how the ranks shared the GPU: MPS shares (each held to its SM share), time-sliced (MPS absent, failed"
    " or skipped: no SM limits), CPU (smoke) or synthetic (the GPU check's dry run: every number made up)",
    "measured_ratio_steady": "Cannikin / DDP wall time of the steady epochs (every epoch but the first, which holds"
    " Cannikin's probing), rank 0's clock synchronised at epoch starts; median over the repeats' pairs",
    "measured_ratio_fit": "the same over the whole training loop (on_train_start to on_train_end, every epoch)",
    "measured_ratio_step": "Cannikin / DDP median steady cycle on rank 0 (the previous step's end to this one's)",
    "ideal_ratio_lines": "T* / T_even on the calibrated solo compute lines t_i(b) = a_i b + a0_i (each rank alone at"
    " its share, forward and backward): T* the optimal continuous split of the total, T_even = max_i t_i(total / n)",
    "ideal_ratio": "(T* + fixed) / (T_even + fixed), fixed = DDP's all-reduce, broadcast wait and optimizer step on"
    " its critical path (costs no split shrinks); see shortfall",
    "fraction_of_ideal": "(1 - measured_ratio_steady) / (1 - ideal_ratio); null where the ideal saves under 2%",
    "fraction_of_ideal_step": "the same on the critical path's cycles (shortfall.measured_ratio)",
    "shortfall": "benchmarks/shortfall.py: every rank's steady cycle split into lines (its solo compute line at its"
    " batch), interference (measured compute less that), input (the loader's fetch to the batch's start), broadcast"
    " (the step's end to the loader's fetch: the loop's work and its wait at Lightning's broadcast), allreduce (last"
    " gradient ready to the reduction's end), optimizer (the reduction's end to the step's end) and other; the"
    " critical path (the last rank at the all-reduce up to it, the last at the broadcast after it); contributions:"
    " each part's ratio points of measured_ratio - ideal_ratio, which they add up to; cause: the largest",
    "ranks": "per strategy, per rank, medians over the steady steps (then over repeats): batch, compute_ms (device"
    " span: forward start to the last gradient ready), solo_compute_ms (the calibrated compute line at that batch),"
    " host_ms (the loader's fetch to the batch's start: on CUDA, device idle for its input), exposed_ms (last"
    " gradient ready to the all-reduce's end: waiting for slower ranks plus the reduction), after_ms (the all-reduce's"
    " end to the step's end: the optimizer step and Lightning's closing work), gap_ms (the step's end to the loader's"
    " fetch for the next: Lightning's loop, whose broadcast at each step's start, from 2.5.2, waits for the other ranks"
    " and, on CUDA, for the device), step_ms (batch start to end), cycle_ms (gap_ms + host_ms + step_ms)",
}


@dataclass(frozen=True)
class Config:
    """One invocation's sizes; ``smoke`` runs on CPU (gloo, no MPS)."""

    smoke: bool = False
    shares: tuple[int, ...] = (60, 25, 15)
    total: int = 768  # global batch: 256 a rank under DDP
    steps: int = 30  # a epoch's global batches
    epochs: int = 3  # the first holds Cannikin's probing; the other two are the steady ones
    width: int = 64  # channels of the first convolution
    image: int = 64  # side of the 3 x image x image inputs
    classes: int = 10
    workers: int = 2  # the loader workload's DataLoader workers a rank
    calib_warmup: int = 3
    calib_steps: int = 8
    concurrent_seconds: float = 2.0
    threads: int = 4  # torch's CPU threads a rank (16 cores for 3 ranks and their workers)
    repeats: int = 3  # at most: a (DDP, Cannikin) pair starts only where the deadline leaves time for both
    workloads: tuple[str, ...] = WORKLOADS
    run_timeout: float = 120.0
    deadline: float = 180.0  # no run starts that the longest run so far says cannot end before it

    @property
    def world_size(self) -> int:
        return len(self.shares)

    @property
    def even(self) -> int:
        return self.total // self.world_size

    @property
    def calib_sizes(self) -> tuple[int, int, int]:
        """Batch sizes of the calibrated lines: half the even split, the even split, twice it (past what the fastest
        rank runs at 60 / 25 / 15)."""
        return max(self.even // 2, 1), self.even, 2 * self.even


SMOKE = Config(
    smoke=True,
    shares=(34, 33, 33),
    total=24,
    steps=8,  # two epochs of 8: Cannikin's warm-up re-plans (every 8 steps) run too
    epochs=2,
    width=4,
    image=16,
    workers=1,
    calib_warmup=1,
    calib_steps=3,
    concurrent_seconds=0.3,
    threads=1,
    repeats=1,
    run_timeout=120.0,  # a run takes 7-20 s on 2 busy cores: a hang costs CI two minutes, not five
    deadline=900.0,
)


# -- the model and the data (both sides) ------------------------------------------------------------------------------


class ConvNet(nn.Module):
    """Five 3x3 convolutions with ReLU, global average pooling and a linear head.

    No normalisation layers: the step's time is the convolutions' arithmetic, which MPS divides by SMs, rather than
    memory traffic, which it does not. Few parameters (1.1 M at width 64), so gloo's all-reduce stays small beside it.
    """

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        c = width
        shapes = ((3, c, 1), (c, 2 * c, 2), (2 * c, 2 * c, 1), (2 * c, 4 * c, 2), (4 * c, 4 * c, 1))
        layers: list[nn.Module] = []
        for inputs, outputs, stride in shapes:
            layers += [nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1), nn.ReLU(inplace=True)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(4 * c, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float().div_(255)  # uint8 wherever the images live: the conversion is part of every step
        return self.head(self.features(x).mean(dim=(2, 3)))


def synthetic_images(count: int, config: Config, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` uint8 images and labels: each class's fixed pattern plus as much noise (learnable, not trivial)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    shape = (3, config.image, config.image)
    labels = torch.randint(0, config.classes, (count,), generator=generator, device=device)
    patterns = torch.randint(0, 128, (config.classes, *shape), generator=generator, device=device, dtype=torch.uint8)
    images = torch.randint(0, 128, (count, *shape), generator=generator, device=device, dtype=torch.uint8)
    images += patterns[labels]  # at most 254: no overflow
    return images, labels


class DeviceBatches(Dataset):
    """Images and labels resident on the device, fetched a batch at a time: one gather on the device, no per-sample
    indexing or collation on the host (the DataLoader uses ``__getitems__`` where a dataset has it)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor(indices, dtype=torch.long)
        if self.images.is_cuda:  # a pinned copy is queued on the stream; a pageable one would wait for the device
            index = index.pin_memory().to(self.images.device, non_blocking=True)
        return self.images.index_select(0, index), self.labels.index_select(0, index)


def whole_batch(batch: Any) -> Any:
    """The collate function of :class:`DeviceBatches`: its ``__getitems__`` already returns the batch."""
    return batch


class FetchTimedLoader(DataLoader):
    """A DataLoader that calls ``on_fetch`` where the loop asks it for a batch after an iteration's first: where the
    fetch really starts (after the loop's broadcast at the step's start; Lightning's loop keeps one batch ahead, so the
    batch fetched there is the next step's, as the package's own loader times it). Lightning rebuilds a DataLoader
    with its sampler as the same class; the Cannikin strategy rebuilds it as its own loader, which has the same hook.
    """

    on_fetch: Callable[[], None] | None = None

    @override
    def __iter__(self) -> Iterator[Any]:
        return _calling_on_fetch(super().__iter__(), self)


def _calling_on_fetch(batches: Iterator[Any], loader: Any) -> Iterator[Any]:
    for batch in batches:
        yield batch
        if loader.on_fetch is not None:  # resumed: the loop asks for the next batch, which the loop below fetches
            loader.on_fetch()


def hook_fetch(loader: Any, callback: Callable[[], None]) -> bool:
    """Have ``loader`` call ``callback`` (too) where it starts a fetch; ``False`` where it has no such hook."""
    if not hasattr(loader, "on_fetch"):
        return False
    previous = loader.on_fetch
    if previous is None or previous == callback or getattr(previous, "chained", None) == callback:
        loader.on_fetch = callback if previous is None else previous
        return True

    def both() -> None:
        previous()  # the Cannikin engine's own input mark
        callback()

    both.chained = callback  # type: ignore[attr-defined]
    loader.on_fetch = both
    return True


def training_loader(config: Config, workload: str, device: torch.device, strategy: str = "ddp") -> DataLoader:
    """The even split's per-rank loader (Lightning adds DDP's sampler; Cannikin rebuilds it around its own, as its
    own loader class, which calls the same ``on_fetch``: it is given a plain DataLoader, as it asks for)."""
    cls = FetchTimedLoader if strategy == "ddp" else DataLoader
    count = config.steps * config.total
    if workload == "compute":
        images, labels = synthetic_images(count, config, device, seed=1)
        return cls(DeviceBatches(images, labels), batch_size=config.even, shuffle=True, collate_fn=whole_batch)
    images, labels = synthetic_images(count, config, torch.device("cpu"), seed=1)
    return cls(
        TensorDataset(images, labels),
        batch_size=config.even,
        shuffle=True,
        num_workers=config.workers,
        pin_memory=device.type == "cuda",
        persistent_workers=config.workers > 0,  # the workers start once, not at every epoch
    )


def rank_device(config: Config) -> torch.device:
    return torch.device("cpu") if config.smoke else torch.device("cuda", 0)  # LOCAL_RANK is 0 on every rank


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the calibration (a rank process, torch only) ---------------------------------------------------------------------


class Marks:
    """Points in a step: CUDA events on a GPU (read after a synchronisation), the host clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0 if self.cuda else end - start


def calibrate_rank(config: Config) -> dict[str, Any]:
    """This rank's training steps alone at its share (three sizes), with the others at once (the even split), and its
    host loader alone. The ranks take turns at gloo barriers."""
    import torch.distributed as dist

    dist.init_process_group("gloo")  # env://: the parent's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device(config)
    torch.manual_seed(0)
    net = ConvNet(config.width, config.classes).to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    images, labels = synthetic_images(max(config.calib_sizes), config, device, seed=2)
    marks = Marks(device)

    def steps(batch: int, count: int) -> list[tuple[float, float]]:
        """(compute, step) seconds of ``count`` training steps, queued back to back and read at the end."""
        spans = []
        for _ in range(count):
            optimizer.zero_grad(set_to_none=True)
            start = marks.mark()
            nn.functional.cross_entropy(net(images[:batch]), labels[:batch]).backward()
            backward = marks.mark()
            optimizer.step()
            spans.append((start, backward, marks.mark()))
        synchronize(device)
        return [(marks.seconds(start, backward), marks.seconds(start, end)) for start, backward, end in spans]

    solo: dict[int, tuple[float, float]] = {}
    loader = None
    for turn in range(world):
        dist.barrier()
        if rank == turn:
            for batch in config.calib_sizes:
                steps(batch, config.calib_warmup)
                timed = steps(batch, config.calib_steps)
                solo[batch] = (statistics.median(c for c, _ in timed), statistics.median(s for _, s in timed))
            loader = loader_rate(config, device)
        dist.barrier()
    # all at once: each rank steps (synchronised, so that its window is its own) until the same wall time has passed
    steps(config.even, config.calib_warmup)
    dist.barrier()
    together: list[tuple[float, float]] = []
    until = time.perf_counter() + config.concurrent_seconds
    while time.perf_counter() < until or len(together) < 3:
        together += steps(config.even, 1)
    dist.barrier()
    dist.destroy_process_group()
    sizes = list(config.calib_sizes)
    return {
        "ok": True,
        "rank": rank,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "sizes": sizes,
        "solo_compute_s": [solo[b][0] for b in sizes],
        "solo_step_s": [solo[b][1] for b in sizes],
        "concurrent_step_s": statistics.median(s for _, s in together),
        "concurrent_compute_s": statistics.median(c for c, _ in together),
        "loader_samples_per_s": loader,
    }


def loader_rate(config: Config, device: torch.device) -> float:
    """Samples a second the loader workload's DataLoader (its workers, pinned memory, the copy) delivers at the even
    split, alone: after as many batches as the workers prefetch, so that their head start is not counted."""
    skip, timed = 1 + 2 * max(config.workers, 1), 8
    images, labels = synthetic_images(config.even * (skip + timed), config, torch.device("cpu"), seed=3)
    loader = DataLoader(
        TensorDataset(images, labels),
        batch_size=config.even,
        shuffle=True,
        num_workers=config.workers,
        pin_memory=device.type == "cuda",
    )
    samples, start = 0, 0.0
    for index, (x, y) in enumerate(loader):
        x.to(device, non_blocking=True)
        y.to(device, non_blocking=True)
        if index + 1 == skip:
            synchronize(device)
            start = time.perf_counter()
        elif index >= skip:
            samples += len(y)
    synchronize(device)
    return samples / (time.perf_counter() - start)


# -- a training run (a rank process) ----------------------------------------------------------------------------------


def fit_rank(config: Config, workload: str, strategy_name: str, run_dir: Path) -> dict[str, Any]:
    """One rank of one Lightning fit; returns its steps' medians, its epochs' times and (rank 0) Cannikin's split."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_cannikin import Cannikin, CannikinStrategy

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = rank_device(config)
    loader = training_loader(config, workload, device, strategy_name)

    class Classifier(pl.LightningModule):
        """The model; sums its loss over each epoch's samples on the device (read once, after the fit)."""

        def __init__(self) -> None:
            super().__init__()
            self.net = ConvNet(config.width, config.classes)
            self.loss_sum = torch.zeros(())
            self.samples = 0

        def on_train_epoch_start(self) -> None:
            self.loss_sum, self.samples = torch.zeros((), device=self.device), 0

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            images, labels = batch
            loss = nn.functional.cross_entropy(self.net(images), labels)
            self.loss_sum += loss.detach() * len(labels)  # no .item(): that would wait for the device every step
            self.samples += len(labels)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

    torch.manual_seed(0)  # the same initial weights in every rank and run (DDP broadcasts rank 0's anyway)
    model = Classifier()
    spans = spans_callback(device, world)
    if strategy_name == "ddp":
        strategy: Any = DDPStrategy(process_group_backend="gloo")
        callbacks: list[Callback] = [spans]
    else:
        strategy = CannikinStrategy(process_group_backend="gloo")
        cannikin = Cannikin(save_profile=False)
        callbacks = [cannikin, spans]
    trainer = pl.Trainer(
        accelerator="cpu" if config.smoke else "gpu",
        devices=1,
        num_nodes=world,
        strategy=strategy,
        max_epochs=config.epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(run_dir),
    )
    started = time.perf_counter()
    trainer.fit(model, loader)
    fit_s = time.perf_counter() - started
    # Lightning leaves a gloo group to the interpreter's exit, where torch (2.13) aborts a rank now and then
    # ("terminate called without an active exception"): a fit that ended well ends its group here
    dist.destroy_process_group()
    clock = spans.clock
    result: dict[str, Any] = {
        "ok": True,
        "rank": rank,
        "fit_s": fit_s,
        "train_s": clock[-1] - clock[0],
        "epoch_s": [end - start for start, end in itertools.pairwise(clock)],
        "loss_sum": float(model.loss_sum),  # the last epoch's
        "loss_samples": model.samples,
        "input_from": "the loader's fetch" if spans.fetch_hooked else "the batch's end (no fetch hook)",
        **step_medians(spans.records, spans.epoch_of, spans.sizes_of),
    }
    if strategy_name == "cannikin" and rank == 0:
        result["cannikin"] = cannikin_view(cannikin)
    return result


def spans_callback(device: torch.device, world: int) -> Any:
    """The callback that times every step of this rank on the package's step timer, whichever strategy trains, and
    the epochs on the wall clock: its ``records``, ``epoch_of``, ``sizes_of`` and ``clock`` after the fit."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from lightning_cannikin.training.measurement.grad_ready import GradientReadiness
    from lightning_cannikin.training.measurement.step_timer import step_timer_for

    class Spans(Callback):
        """Every step of this rank on the package's step timer, whichever strategy trains, and the epochs' clock."""

        def __init__(self) -> None:
            self.rank, self.world = int(os.environ.get("RANK", "0")), world
            self.timer = step_timer_for(device)
            self.readiness: Any = None
            self.step = self.epoch = 0
            self.first = True
            self.epoch_of: dict[int, int] = {}
            self.sizes_of: dict[int, tuple[int, ...]] = {}
            self.clock: list[float] = []  # every epoch's start, then the end of training
            self.records: list[Any] = []
            self.fetch_hooked = False

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            # no Python comm hook under DDP's own all-reduce: the last gradient ready ends the device span, as the
            # Cannikin strategy times it too
            self.readiness = GradientReadiness(pl_module.parameters(), self.timer.gradient_ready)

        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            # the next input is timed from the loader's fetch (a loader built for this epoch gets the hook too): the
            # loop's broadcast at a step's start lies before it, in `gap`, not in `host`
            self.fetch_hooked = hook_fetch(trainer.train_dataloader, self.timer.input_starts)
            synchronize(device)  # epochs end on the device, not where the host queued them
            self.clock.append(time.perf_counter())
            self.epoch, self.first = trainer.current_epoch, True

        def on_train_batch_start(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int
        ) -> None:
            self.timer.start(after_input=not self.first)  # an epoch's first step has no input span
            self.timer.forward_start()
            self.first = False

        def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
            self.timer.will_reduce(True)  # no accumulation: every backward reduces

        def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.timer.backward_done()
            self.readiness.backward_done()

        def on_train_batch_end(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
        ) -> None:
            # after Cannikin's callback (listed first): its re-plan is inside this step, not in the next one's input
            sizes = getattr(trainer.strategy, "step_sizes", None)
            self.sizes_of[self.step] = tuple(sizes) if sizes else (len(batch[1]),) * self.world
            self.epoch_of[self.step] = self.epoch
            self.timer.finish(self.step, self.rank, len(batch[1]))
            if not self.fetch_hooked:  # a loader without the hook: the next input is timed from here (gap about 0)
                self.timer.input_starts()
            self.step += 1

        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.records += self.timer.records()  # those the device has finished; the rest stay queued

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            synchronize(device)
            self.clock.append(time.perf_counter())
            self.records += self.timer.records(wait=True)
            self.readiness.remove()

    return Spans()


def step_medians(records: Sequence[Any], epoch_of: dict[int, int], sizes_of: dict[int, tuple[int, ...]]) -> dict:
    """Medians of this rank's steady steps (every epoch but the first) and of each epoch, and the splits run."""

    def medians(rows: Sequence[Any]) -> dict[str, float | None]:
        host = [r.host for r in rows if r.host is not None]
        exposed = [r.exposed for r in rows if r.exposed is not None]
        after = [r.after for r in rows if r.after is not None]
        gap = [r.gap for r in rows if r.gap is not None]
        return {
            "steps": len(rows),
            "batch": _median([r.batch_size for r in rows]),
            "compute_ms": _ms(_median([r.compute for r in rows])),
            "host_ms": _ms(_median(host)),
            "exposed_ms": _ms(_median(exposed)),
            "after_ms": _ms(_median(after)),
            "gap_ms": _ms(_median(gap)),
            "step_ms": _ms(_median([r.step_time for r in rows])),
            # previous step's end to this one's: the loop between the steps, the input, the step
            "cycle_ms": _ms(_median([r.step_time + (r.host or 0.0) + (r.gap or 0.0) for r in rows])),
        }

    epochs = sorted(set(epoch_of.values()))
    steady = [r for r in records if epoch_of.get(r.step, 0) > 0]
    steady_sizes = [sizes for step, sizes in sizes_of.items() if epoch_of[step] > 0]
    return {
        "steady": medians(steady),
        "per_epoch": [medians([r for r in records if epoch_of.get(r.step) == e]) for e in epochs],
        "split": list(Counter(steady_sizes).most_common(1)[0][0]) if steady_sizes else None,
        "splits_per_epoch": [
            list(Counter(s for step, s in sizes_of.items() if epoch_of[step] == e).most_common(1)[0][0]) for e in epochs
        ],
    }


def cannikin_view(cannikin: Any) -> dict[str, Any]:
    """What Cannikin believed at the end: its plan and the lines it fitted to each rank (rank 0's speed model)."""
    plan = cannikin.plan
    view: dict[str, Any] = {
        "plan": None if plan is None else list(plan.local_batch_sizes),
        "predicted_step_ms": _ms(plan.predicted_step_time) if plan is not None else None,
        "history": len(cannikin.history),
    }
    model = cannikin.speed_model
    try:
        view["lines_ms"] = [[m.slope * 1e3, m.intercept * 1e3] for m in model.models()] if model is not None else None
    except RuntimeError:  # some rank never timed
        view["lines_ms"] = None
    return view


def worker_main(job_path: Path) -> int:
    """A rank process: run the job the parent wrote, and write this rank's JSON beside it."""
    job = json.loads(job_path.read_text())
    config = Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in job["config"].items()})
    rank = int(os.environ["RANK"])
    # a run that times out is asked for every thread's stack before it is ended (its loader workers inherit this)
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    # asked to end (a run past its time, the launcher ended): unwind, so that a CUDA client leaves MPS cleanly
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    torch.set_num_threads(config.threads)
    out = job_path.parent / f"rank{rank}.json"
    try:
        if job["kind"] == "calibrate":
            result = calibrate_rank(config)
        else:
            result = fit_rank(config, job["workload"], job["strategy"], job_path.parent)
    except Exception:
        out.write_text(json.dumps({"ok": False, "rank": rank, "error": traceback.format_exc()}))
        traceback.print_exc()
        return 1
    out.write_text(json.dumps(result, indent=1))
    return 0


# -- the ideal and the summary (the parent; pure) ---------------------------------------------------------------------


def summarise_calibration(config: Config, ranks: Sequence[dict | None]) -> dict[str, Any] | None:
    """Each rank's solo lines (compute, and full steps with the optimizer), its speed and interference."""
    if not ranks or any(r is None or not r.get("ok") for r in ranks):
        return None
    step_lines = [fit_line(r["sizes"], r["solo_step_s"]) for r in ranks]
    compute_lines = [fit_line(r["sizes"], r["solo_compute_s"]) for r in ranks]
    best, split = water_fill(compute_lines, config.total)
    even = max(line_time(line, config.even) for line in compute_lines)
    # each rank's measured solo step at the even split (one of the calibrated sizes): its speed at its share
    solo_even = [r["solo_step_s"][r["sizes"].index(config.even)] for r in ranks]
    speeds = [config.even / t for t in solo_even]
    return {
        "device": ranks[0]["device"],
        "torch": ranks[0]["torch"],
        "step_lines_ms": [[a * 1e3, a0 * 1e3] for a, a0 in step_lines],
        "compute_lines_ms": [[a * 1e3, a0 * 1e3] for a, a0 in compute_lines],
        "solo_samples_per_s": speeds,
        # each rank's speed over rank 0's, divided by its share over rank 0's: about 1 everywhere where the shares took
        # effect and speed follows them (MPS off: the slow shares read well above 1)
        "speed_vs_share": [v / speeds[0] / (s / config.shares[0]) for v, s in zip(speeds, config.shares, strict=True)],
        "interference": [r["concurrent_step_s"] / solo for r, solo in zip(ranks, solo_even, strict=True)],
        "loader_samples_per_s": [r["loader_samples_per_s"] for r in ranks],
        "ideal_compute_ms": best * 1e3,
        "ideal_split": [round(b, 1) for b in split],
        "even_compute_ms": even * 1e3,
        "ideal_ratio_lines": best / even,
        "ranks": ranks,
    }


def run_view(run: dict[str, Any]) -> dict[str, Any] | None:
    """One fit's numbers on rank 0's clock, its split and its loss over every rank's samples."""
    ranks = run.get("ranks") or []
    if run.get("status") != "ok" or not ranks or any(r is None or not r.get("ok") for r in ranks):
        return None
    zero = ranks[0]
    samples = sum(r["loss_samples"] for r in ranks)
    return {
        "steady_s": sum(zero["epoch_s"][1:]),
        "train_s": zero["train_s"],
        "step_ms": zero["steady"]["cycle_ms"],
        "split": zero["split"],
        "loss": sum(r["loss_sum"] for r in ranks) / samples if samples else None,
    }


def summarise_workload(config: Config, calibration: dict[str, Any] | None, runs: Sequence[dict]) -> dict[str, Any]:
    """Measured ratios over the repeats' (DDP, Cannikin) pairs, the ideal from the solo lines and DDP's fixed costs,
    the fraction of it reached and the shortfall's parts (:func:`benchmarks.shortfall.decompose`)."""
    views = {(r["strategy"], r["repeat"]): run_view(r) for r in runs}
    pairs = [
        (views[("ddp", k)], views[("cannikin", k)])
        for k in range(config.repeats)
        if views.get(("ddp", k)) and views.get(("cannikin", k))
    ]

    def ratio(key: str) -> float | None:
        values = [c[key] / d[key] for d, c in pairs if c[key] and d[key]]
        return statistics.median(values) if values else None

    table = rank_table(calibration, runs)
    summary: dict[str, Any] = {
        "pairs": len(pairs),
        "measured_ratio_steady": ratio("steady_s"),
        "measured_ratio_fit": ratio("train_s"),
        "measured_ratio_step": ratio("step_ms"),
        "ratios_steady_per_repeat": [c["steady_s"] / d["steady_s"] for d, c in pairs],
        "ddp_step_ms": _median([d["step_ms"] for d, _ in pairs]),
        "cannikin_step_ms": _median([c["step_ms"] for _, c in pairs]),
        "cannikin_split": pairs[-1][1]["split"] if pairs else None,
        "loss": {
            "ddp": _median([d["loss"] for d, _ in pairs]),
            "cannikin": _median([c["loss"] for _, c in pairs]),
        },
        "ranks": table,
    }
    cannikin = [r["ranks"][0].get("cannikin") for r in runs if r["strategy"] == "cannikin" and run_view(r)]
    summary["cannikin_view"] = cannikin[-1] if cannikin else None
    if calibration is None:
        return summary
    summary["ideal_ratio_lines"] = calibration["ideal_ratio_lines"]
    summary["ideal_split"] = calibration["ideal_split"]
    decomposition = decompose(table, calibration["compute_lines_ms"], config.total) if pairs else None
    summary["shortfall"] = decomposition
    if decomposition is not None:
        summary["ideal_ratio"] = decomposition["ideal_ratio"]
        summary["fraction_of_ideal"] = fraction_of_ideal(summary["measured_ratio_steady"], summary["ideal_ratio"])
        summary["fraction_of_ideal_step"] = decomposition["fraction_of_ideal"]
        summary["cause"] = decomposition["cause_line"]
    return summary


def rank_table(calibration: dict[str, Any] | None, runs: Sequence[dict]) -> dict[str, list[dict[str, Any]]]:
    """Per strategy and rank, the steady medians over the repeats, beside the calibrated compute line at that batch."""
    table: dict[str, list[dict[str, Any]]] = {}
    for strategy in STRATEGIES:
        fits = [r["ranks"] for r in runs if r["strategy"] == strategy and run_view(r)]
        if not fits:
            continue
        rows = []
        for rank in range(len(fits[0])):
            steady = [ranks[rank]["steady"] for ranks in fits]
            row: dict[str, Any] = {"rank": rank}
            for key in ("batch", "compute_ms", "host_ms", "exposed_ms", "after_ms", "gap_ms", "step_ms", "cycle_ms"):
                row[key] = _median([s[key] for s in steady])
            if calibration is not None and row["batch"] is not None:
                solo = line_time(calibration["compute_lines_ms"][rank], row["batch"])
                row["solo_compute_ms"] = solo
                row["compute_vs_solo"] = row["compute_ms"] / solo if row["compute_ms"] and solo > 0 else None
            rows.append(row)
        table[strategy] = rows
    return table


HEADLINE_KEYS = (
    "measured_ratio_steady",
    "measured_ratio_fit",
    "measured_ratio_step",
    "ideal_ratio",
    "ideal_ratio_lines",
    "fraction_of_ideal",
    "fraction_of_ideal_step",
    "cannikin_split",
    "ideal_split",
    "cause",
)


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The numbers a summary shows, per workload."""
    out: dict[str, Any] = {"sharing": result["sharing"], "device": result.get("device")}
    for workload, summary in result["summary"].items():
        out[workload] = {key: _rounded(summary.get(key)) for key in HEADLINE_KEYS}
        contributions = (summary.get("shortfall") or {}).get("contributions")
        out[workload]["contributions"] = _rounded(contributions)
    return out


@dataclass
class Mps:
    """The MPS control daemon: started here where it can be (and then stopped here), used as is where it runs.

    Nothing about it can hang the run: the daemon starts under a bounded wait, a short probe (a CUDA client in a process
    of its own) must answer before any rank uses it, a daemon that does not answer is stopped and skipped within
    seconds, and the ranks then time-slice the GPU (``sharing``: ``"time-sliced"``)."""

    control: str | None = None
    started: bool = False
    active: bool = False
    note: str = ""
    sharing: str = "time-sliced"
    seconds: float = 0.0  # spent starting and probing it
    log: list[str] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        control: str | None = None,
        start_timeout: float = MPS_START_TIMEOUT_S,
        probe: Sequence[str] | None = None,
        probe_timeout: float = MPS_PROBE_TIMEOUT_S,
        share: int = 100,
    ) -> Mps:
        """Start (or find) the daemon and probe it.

        Args:
            control: the control program (default: ``$GPU_SHARES_MPS_CONTROL``, the path, the GPU machines' place).
            start_timeout: seconds ``control -d`` may take.
            probe: the client command that must finish within ``probe_timeout`` (default: a CUDA init and a sum).
            probe_timeout: seconds the probe may take.
            share: the probe's ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``.

        """
        began = time.monotonic()
        mps = cls._start(control or mps_control(), start_timeout)
        if mps.active:
            ok, why = probe_client(probe, probe_timeout, share)
            if not ok:
                stopped = "stopped" if mps.started else "left running (not started here), bypassed"
                mps.stop()
                mps.active = False
                mps.note += f"; a client did not work under it ({why}): {stopped}, the ranks time-slice the GPU"
        mps.sharing = "MPS shares" if mps.active else "time-sliced"
        mps.seconds = time.monotonic() - began
        return mps

    @classmethod
    def _start(cls, control: str | None, timeout: float) -> Mps:
        if control is None:
            return cls(note=f"{MPS_CONTROL} not found: the ranks time-slice the GPU without SM limits")
        if mps_daemon_running():
            return cls(control, active=True, note="an MPS daemon was running already: used, left running")
        try:
            # no pipes: the daemon forks and would hold them open, and a wait for their end would never return
            done = subprocess.run(
                [control, "-d"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            mps = cls(control, started=mps_daemon_running())
            mps.stop()  # one that came up after all does not outlive the run
            return cls(control, note=f"`{control} -d` did not return in {timeout:.0f} s: MPS skipped, time-sliced")
        except OSError as error:
            return cls(control, note=f"`{control} -d` could not run ({error}): MPS skipped, time-sliced")
        if done.returncode != 0:
            return cls(control, note=f"`{control} -d` exited with {done.returncode} (root needed?): time-sliced")
        for _ in range(50):
            if mps_daemon_running():
                return cls(control, started=True, active=True, note="started here, stopped at the end")
            time.sleep(0.1)
        return cls(control, note="`-d` returned 0 but no daemon process appeared: time-sliced")

    def stop(self) -> None:
        """Stop the daemon started here: ``quit`` under a timeout, then SIGTERM and SIGKILL to what is left of it."""
        if not (self.started and self.control is not None):
            return
        self.started = False
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            subprocess.run(
                [self.control],
                input="quit\n",
                text=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=MPS_QUIT_TIMEOUT_S,
                check=False,
            )
        for sent in (None, signal.SIGTERM, signal.SIGKILL):
            if sent is not None:
                for pid in mps_daemon_pids():
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, sent)
            for _ in range(30):
                if not mps_daemon_running():
                    return
                time.sleep(0.1)


def probe_client(command: Sequence[str] | None, timeout: float, share: int) -> tuple[bool, str]:
    """Run one MPS client (``command``; default a CUDA init and a sum) in a session of its own; ``(worked, why not)``.
    One past ``timeout`` is asked to end (SIGTERM) before it is killed: a SIGKILLed client can wedge the server."""
    command = list(command) if command is not None else [sys.executable, "-c", MPS_PROBE]
    env = {**os.environ, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(share)}
    try:
        process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
    except OSError as error:
        return False, str(error)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_session(process, grace=CLIENT_TERM_GRACE_S)
        return False, f"no answer in {timeout:.0f} s"
    if process.returncode != 0:
        return False, f"exit {process.returncode}: {' '.join(output.strip().splitlines()[-1:])}"
    return True, ""


def end_session(process: subprocess.Popen, grace: float) -> None:
    """End ``process`` and the rest of its session: SIGTERM, up to ``grace`` seconds, then SIGKILL."""
    end_sessions([process], grace)


def end_sessions(processes: Sequence[subprocess.Popen], grace: float) -> None:
    """End every process we started (each the leader of a session of its own, with its children: loader workers),
    asking first: SIGTERM to every session, up to ``grace`` seconds together, then SIGKILL to what is left. A leader
    is reaped only after the last signal to its group, so its id cannot have been reused by then."""
    live = [p for p in processes if not _exited(p)]
    for process in live:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    until = time.monotonic() + grace
    while any(not _exited(p) for p in live) and time.monotonic() < until:
        time.sleep(0.05)
    for process in live:
        with contextlib.suppress(ProcessLookupError):  # the session has ended, workers and all
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _exited(process: subprocess.Popen) -> bool:
    """Whether ``process`` has ended, without reaping it (its id stays its own until ``wait``)."""
    if process.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def mps_control() -> str | None:
    """The MPS control program: ``$GPU_SHARES_MPS_CONTROL``, on the path, or where the GPU machines seen so far have
    it."""
    if os.environ.get(MPS_CONTROL_ENV):
        return os.environ[MPS_CONTROL_ENV]
    return shutil.which(MPS_CONTROL) or (MPS_CONTROL_PATH if os.access(MPS_CONTROL_PATH, os.X_OK) else None)


def mps_daemon_pids() -> list[int]:
    """Processes named ``nvidia-cuda-mps-*`` (the control daemon and its server; their comm, cut to 15 characters),
    read from /proc: the control client itself would wait on a pipe where no daemon listens."""
    pids = []
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == MPS_CONTROL[:15]:
                pids.append(int(comm.parent.name))
        except (OSError, ValueError):
            continue
    return pids


def mps_daemon_running() -> bool:
    return bool(mps_daemon_pids())


def _agent_store(world_size: int) -> Any:
    """The rendezvous store, hosted here as torchrun's agent hosts it (``TORCHELASTIC_USE_AGENT_STORE``): bound to a
    port the system picks and held for the whole run, so no rank races another process for a port found free."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)


def rank_env(config: Config, rank: int, port: int, run_id: str) -> dict[str, str]:
    """The environment torchelastic gives a rank of ``devices=1, num_nodes=world``, plus its SM share."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN_PREFIXES)}
    world = str(config.world_size)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=world,
        LOCAL_RANK="0",
        GROUP_RANK=str(rank),
        NODE_RANK=str(rank),
        LOCAL_WORLD_SIZE="1",
        GROUP_WORLD_SIZE=world,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID=run_id,
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT="0",
        OMP_NUM_THREADS=str(config.threads),
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    if not config.smoke:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(config.shares[rank])
    return env


def launch(
    config: Config, job: dict[str, Any], run_dir: Path, timeout: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Start every rank of ``job`` (``env`` added to each rank's), wait (a rank that fails ends the run: the others
    would wait on it), collect."""
    run_dir.mkdir(parents=True, exist_ok=True)
    job_path = run_dir / "job.json"
    job_path.write_text(json.dumps({**job, "config": asdict(config)}, indent=1))
    store, started = _agent_store(config.world_size), time.monotonic()
    port = store.port
    processes: list[subprocess.Popen] = []
    status, failed_at = "ok", None
    # time this process did not run (the machine or the job stopped: a VM paused, SLURM's suspend, SIGSTOP) stopped the
    # ranks too, so it does not count against them: a run is timed out on the time it could have run
    paused, last = 0.0, started
    try:
        for rank in range(config.world_size):
            with open(run_dir / f"rank{rank}.log", "w") as log:  # the child keeps its own descriptor
                processes.append(
                    subprocess.Popen(
                        [sys.executable, str(Path(__file__).resolve()), "--worker", str(job_path)],
                        env={**rank_env(config, rank, port, run_dir.name), **(env or {})},
                        cwd=run_dir,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # its own process group: a timeout ends it with its loader workers
                    )
                )
        while None in (codes := [p.poll() for p in processes]):
            now = time.monotonic()
            if now - last > PAUSE_GAP_S:
                paused += now - last
            last = now
            if now - started - paused > timeout:
                status = "timeout"
            elif failed_at is None and any(code not in (None, 0) for code in codes):
                failed_at = now
            if failed_at is not None and now - failed_at > 20:
                status = "failed"
            if status != "ok":
                break
            time.sleep(0.2)
        if status == "timeout":  # say where each rank waits before ending it: the log alone ends mid-step
            _dump_stacks(processes)
    finally:  # a run that failed or timed out, or this script ended (SIGTERM): no rank outlives it on the GPU
        end_sessions(processes, CLIENT_TERM_GRACE_S)
    if status == "ok" and any(p.returncode != 0 for p in processes):
        status = "failed"
    del store  # every rank has ended
    if status != "ok":
        for rank, process in enumerate(processes):
            # a rank that failed on its own says why; a timed-out run shows every rank, its stacks included
            if status == "timeout" or process.returncode not in (0, -signal.SIGKILL, -signal.SIGTERM):
                lines = (run_dir / f"rank{rank}.log").read_text(errors="replace").splitlines()
                tail = lines[-(TIMEOUT_TAIL if status == "timeout" else 15) :]
                print(f"{run_dir.name}: rank {rank} exited with {process.returncode}:", *tail, sep="\n  ", flush=True)
    ranks = []
    for rank in range(config.world_size):
        path = run_dir / f"rank{rank}.json"
        ranks.append(json.loads(path.read_text()) if path.is_file() else None)
    seconds = time.monotonic() - started - paused
    return {**job, "status": status, "seconds": seconds, "paused_s": paused, "ranks": ranks, "logs": str(run_dir)}


def _dump_stacks(processes: Sequence[subprocess.Popen]) -> None:
    """Ask every live rank, and its loader workers, to write all its threads' stacks into its log."""
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, STACKS_SIGNAL)
    time.sleep(STACKS_GRACE_S)


def run_benchmark(
    config: Config, out: Path, logs: Path, mps_control_path: str | None = None, mps_timeout: float | None = None
) -> dict[str, Any]:
    """Calibrate, run the interleaved fits within the deadline, summarise; writes ``out/gpu_shares.json``.

    The deadline plans the run: a (DDP, Cannikin) pair starts only where the longest run so far says both can end
    before it (the first pair of every workload before any second one), so a short budget runs fewer repeats, not
    half pairs. ``mps_control_path`` (a smoke run tries MPS only with it) and ``mps_timeout`` bound the daemon."""
    began = time.monotonic()
    if config.smoke and mps_control_path is None:
        mps = Mps(note="smoke run on CPU: no MPS", sharing="CPU (smoke)")
    else:
        timeout = MPS_START_TIMEOUT_S if mps_timeout is None else mps_timeout
        mps = Mps.start(mps_control_path, start_timeout=timeout, share=min(config.shares))
        print(f"MPS: {mps.sharing} ({mps.note}; {mps.seconds:.1f} s)", flush=True)
    runs: list[dict[str, Any]] = []
    calibration_run: dict[str, Any] = {}

    def left() -> float:
        return config.deadline - (time.monotonic() - began)

    def sharing_env() -> dict[str, str]:
        """Time-sliced on a GPU: the ranks look for MPS's pipes in an empty folder, so a daemon that does not answer
        (one running before, not stopped here) cannot take them as its clients; they run without MPS."""
        if config.smoke or mps.active:
            return {}
        empty = logs / "no-mps-pipes"
        empty.mkdir(parents=True, exist_ok=True)
        return {"CUDA_MPS_PIPE_DIRECTORY": str(empty)}

    try:
        timeout = max(min(config.run_timeout, left()), 1.0)
        calibration_run = launch(config, {"kind": "calibrate"}, logs / "calibrate", timeout, sharing_env())
        if calibration_run["status"] != "ok" and mps.active:
            # the ranks could not use the daemon (its logs say why): measure time-sliced rather than not at all;
            # speed_vs_share then shows the shares did not take effect
            stopped = "stopped" if mps.started else "bypassed (not started here)"
            mps.stop()
            mps.active, mps.sharing = False, "time-sliced"
            mps.note += f"; the calibration failed under it: {stopped}, the ranks time-slice the GPU"
            timeout = max(min(config.run_timeout, left()), 1.0)
            calibration_run = launch(config, {"kind": "calibrate"}, logs / "calibrate-no-mps", timeout, sharing_env())
        longest = calibration_run["seconds"]
        for repeat in range(config.repeats):
            for workload in config.workloads:
                if left() < 2.1 * longest:  # both runs of the pair, or neither
                    if repeat == 0:
                        for strategy in STRATEGIES:
                            job = {"kind": "fit", "workload": workload, "strategy": strategy, "repeat": repeat}
                            runs.append({**job, "status": "skipped: the deadline", "ranks": []})
                    continue
                for strategy in STRATEGIES:  # DDP, Cannikin, DDP, Cannikin...: a drift of the machine hits both
                    job = {"kind": "fit", "workload": workload, "strategy": strategy, "repeat": repeat}
                    name = f"{workload}-{strategy}-{repeat}"
                    timeout = max(min(config.run_timeout, left()), 1.0)
                    run = launch(config, job, logs / name, timeout, sharing_env())
                    longest = max(longest, run["seconds"])
                    runs.append(run)
                    print(f"{name}: {run['status']} in {run['seconds']:.0f} s", flush=True)
    finally:
        mps.stop()
    result = assemble(config, mps, calibration_run, runs, time.monotonic() - began, str(logs))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_shares.json").write_text(json.dumps(result, indent=1))
    return result


def assemble(
    config: Config, mps: Mps, calibration_run: dict[str, Any], runs: list[dict[str, Any]], seconds: float, logs: str
) -> dict[str, Any]:
    """The JSON of a run from its calibration and fits (the rank processes' results): the same for a real run, a
    smoke run and the dry run's synthetic one."""
    calibration = summarise_calibration(config, calibration_run.get("ranks") or [])
    summary = {
        w: summarise_workload(config, calibration, [r for r in runs if r["workload"] == w]) for w in config.workloads
    }
    result = {
        "benchmark": "gpu_shares",
        "mode": "smoke (CPU)" if config.smoke else "gpu",
        "sharing": mps.sharing,
        "device": calibration["device"] if calibration else None,
        "torch": torch.__version__,
        "config": asdict(config),
        "mps": asdict(mps),
        "seconds": seconds,
        "definitions": DEFINITIONS,
        "calibration": calibration if calibration is not None else {"status": calibration_run.get("status")},
        "summary": summary,
        "runs": runs,
        "logs": logs,
    }
    result["headline"] = headline(result)
    return result


@dataclass(frozen=True)
class SyntheticLoop:
    """A loop whose every part is known (ms): the dry run's numbers and the tests'. Ranks meet at the all-reduce and
    at the broadcast, so each rank's step is built as a real one is: its input and compute, then waiting at the
    all-reduce for the slowest rank and the reduction, its optimizer step, then waiting at the broadcast."""

    per_sample_ms: tuple[float, ...] = (0.10, 0.24, 0.34)  # about 3.4 : 1.4 : 1, as the only real-GPU run learned
    intercept_ms: float = 2.0
    interference: float = 1.08  # measured compute over the solo line
    input_ms: tuple[float, float] = (0.3, 0.3)  # a step's host input: DDP, Cannikin
    pre_ms: float = 0.2  # batch start to forward start
    allreduce_ms: tuple[float, float] = (6.0, 6.5)
    broadcast_ms: tuple[float, float] = (4.0, 9.0)  # the broadcast itself, past waiting for the slowest optimizer
    optimizer_ms: tuple[float, ...] = (1.0, 1.6, 2.2)
    cannikin_split: tuple[int, ...] | None = None  # default: the optimal split of the lines, rounded

    def ranks(self, config: Config, strategy: str) -> list[dict[str, Any]]:
        """Every rank's fit result (the steady medians a rank process reports) under ``strategy``."""
        which = STRATEGIES.index(strategy)
        if strategy == "ddp":
            split = [config.even] * config.world_size
        else:
            split = list(self.cannikin_split or _rounded_split(self.lines_ms(), config.total))
        computes = [self.interference * line_time(line, b) for line, b in zip(self.lines_ms(), split, strict=True)]
        arrive = [self.input_ms[which] + self.pre_ms + c for c in computes]
        slowest_optimizer = max(self.optimizer_ms)
        rows = []
        for rank, (b, compute, x) in enumerate(zip(split, computes, arrive, strict=True)):
            exposed = self.allreduce_ms[which] + max(arrive) - x
            after = self.optimizer_ms[rank]
            gap = self.broadcast_ms[which] + slowest_optimizer - after
            step = self.pre_ms + compute + exposed + after
            cycle = gap + self.input_ms[which] + step
            steady = {
                "steps": config.steps * (config.epochs - 1),
                "batch": b,
                "compute_ms": compute,
                "host_ms": self.input_ms[which],
                "exposed_ms": exposed,
                "after_ms": after,
                "gap_ms": gap,
                "step_ms": step,
                "cycle_ms": cycle,
            }
            epoch_s = [1.3 * cycle * config.steps / 1e3] + [cycle * config.steps / 1e3] * (config.epochs - 1)
            rows.append(
                {
                    "ok": True,
                    "rank": rank,
                    "fit_s": sum(epoch_s) + 1.0,
                    "train_s": sum(epoch_s),
                    "epoch_s": epoch_s,
                    "loss_sum": 2.0 * b,
                    "loss_samples": b,
                    "input_from": "synthetic",
                    "steady": steady,
                    "per_epoch": [steady] * config.epochs,
                    "split": split,
                    "splits_per_epoch": [split] * config.epochs,
                }
            )
        if strategy == "cannikin":
            rows[0]["cannikin"] = {"plan": split, "predicted_step_ms": None, "history": 0, "lines_ms": None}
        return rows

    def lines_ms(self) -> list[tuple[float, float]]:
        return [(a, self.intercept_ms) for a in self.per_sample_ms]

    def calibration_ranks(self, config: Config) -> list[dict[str, Any]]:
        """Every rank's calibration result: its solo compute on the lines, its solo step with its optimizer step."""
        ranks = []
        for rank, line in enumerate(self.lines_ms()):
            compute = [line_time(line, b) / 1e3 for b in config.calib_sizes]
            step = [c + self.optimizer_ms[rank] / 1e3 for c in compute]
            ranks.append(
                {
                    "ok": True,
                    "rank": rank,
                    "device": "synthetic",
                    "torch": torch.__version__,
                    "sizes": list(config.calib_sizes),
                    "solo_compute_s": compute,
                    "solo_step_s": step,
                    "concurrent_step_s": self.interference * step[1],
                    "concurrent_compute_s": self.interference * compute[1],
                    "loader_samples_per_s": 5e4,
                }
            )
        return ranks


def _rounded_split(lines: Sequence[Sequence[float]], total: int) -> list[int]:
    """The optimal continuous split rounded to whole samples that add up to ``total``."""
    _, split = water_fill(lines, total)
    whole = [int(b) for b in split]
    for index in sorted(range(len(split)), key=lambda i: whole[i] - split[i])[: total - sum(whole)]:
        whole[index] += 1
    return whole


def synthetic_result(config: Config | None = None, loop: SyntheticLoop | None = None) -> dict[str, Any]:
    """A whole ``gpu_shares`` result on a :class:`SyntheticLoop`'s numbers, through the same summary as a real run's
    (:func:`assemble`): what the GPU check's dry run reports, marked ``"synthetic": true``."""
    config = config or Config(repeats=1)
    loop = loop or SyntheticLoop()
    calibration_run = {"kind": "calibrate", "status": "ok", "seconds": 0.0, "ranks": loop.calibration_ranks(config)}
    runs = [
        {"kind": "fit", "workload": w, "strategy": s, "repeat": k, "status": "ok", "seconds": 0.0,
         "ranks": loop.ranks(config, s)}
        for k in range(config.repeats)
        for w in config.workloads
        for s in STRATEGIES
    ]  # fmt: skip
    mps = Mps(note="synthetic: nothing ran", sharing="synthetic")
    result = assemble(config, mps, calibration_run, runs, 0.0, "")
    result.update(mode="synthetic (dry run: no GPU; every number is made up)", synthetic=True, loop=asdict(loop))
    return result


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="where gpu_shares.json goes (default %(default)s)"
    )
    parser.add_argument(
        "--logs", type=Path, default=None, help="every run's job, logs and rank JSON (default: a temp dir)"
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, no MPS, tiny sizes: checks the code path")
    parser.add_argument("--repeats", type=int, default=None, help="DDP/Cannikin pairs per workload (default 2)")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="global batches an epoch")
    parser.add_argument("--total", type=int, default=None, help="global batch (a multiple of the ranks)")
    parser.add_argument("--width", type=int, default=None, help="the model's first channel count")
    parser.add_argument("--shares", type=str, default=None, help="SM percentages, one a rank (default 60,25,15)")
    parser.add_argument("--workloads", type=str, default=None, help="compute,loader (default both)")
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds after which no run starts (default 180): plans the repeats",
    )
    parser.add_argument(
        "--mps-control",
        type=str,
        default=None,
        help=f"the MPS control program (default ${MPS_CONTROL_ENV}, the path, {MPS_CONTROL_PATH}); a smoke run tries"
        " MPS only with it",
    )
    parser.add_argument(
        "--mps-timeout", type=float, default=None, help=f"seconds its `-d` may take (default {MPS_START_TIMEOUT_S:.0f})"
    )
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def config_of(args: argparse.Namespace) -> Config:
    config = SMOKE if args.smoke else Config()
    changes: dict[str, Any] = {}
    for name in ("repeats", "epochs", "steps", "total", "width", "deadline"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.shares:
        changes["shares"] = tuple(int(s) for s in args.shares.split(","))
    if args.workloads:
        changes["workloads"] = tuple(w for w in args.workloads.split(",") if w)
    config = replace(config, **changes)
    if config.total % config.world_size or set(config.workloads) - set(WORKLOADS):
        raise SystemExit(f"--total must be a multiple of {config.world_size} ranks; --workloads among {WORKLOADS}")
    return config


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker)
    config = config_of(args)
    # ended from outside (gpu_check's timeout): unwind, so that the ranks end and an MPS daemon started here stops
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if not config.smoke and not torch.cuda.is_available():  # no context here: MPS clients must be the first on the GPU
        print("gpu_shares: no CUDA device; `--smoke` runs the code path on CPU", file=sys.stderr)
        return 2
    logs = args.logs or Path(tempfile.mkdtemp(prefix="gpu_shares_"))
    result = run_benchmark(config, args.out, logs, args.mps_control, args.mps_timeout)
    print(json.dumps(result["headline"], indent=1))
    print(f"{result['sharing']}: {result['mps']['note']}; logs in {logs}; JSON in {args.out / 'gpu_shares.json'}")
    # runs the deadline skipped are reported, not failures; a failed or timed-out run, or a workload without a pair, is
    failed = any(r["status"] in ("failed", "timeout") for r in result["runs"])
    unpaired = any(summary["pairs"] == 0 for summary in result["summary"].values())
    return 1 if failed or unpaired or result["calibration"].get("ideal_ratio_lines") is None else 0


if __name__ == "__main__":
    sys.exit(main())
