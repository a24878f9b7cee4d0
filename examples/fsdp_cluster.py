"""Sharded training (FSDP2) on an emulated 3-device cluster (1x : 2x : 4x slower): balanced beside even batches.

    python examples/fsdp_cluster.py                  # both runs, their training times and the ratio
    python examples/fsdp_cluster.py --strategy even  # one run only: cannikin or even
    python examples/fsdp_cluster.py --smoke          # a quick check that it runs: 2 epochs on a slice of the data

An MLP on scikit-learn's digits, sharded per layer with ``fully_shard`` in ``configure_model`` over the data-parallel
mesh, as Lightning documents for its ``ModelParallelStrategy``. Both runs shard the same model over all ranks (pure
sharded data parallelism), start from the same weights and train on the same total batch (``--batch-size`` x 3), both
with ``CannikinModelParallelStrategy`` under the fork launcher (so that one command runs both):

- ``even``: ``local_batch_sizes=[b, b, b]``, the even split Lightning's own ``ModelParallelStrategy`` gives every
  device, held fixed: the fast devices wait for the slowest at every layer's collective;
- ``cannikin``: learns each device's own compute (the waits inside FSDP's collectives left out), gives each the batch
  that makes them finish together, and weights each rank's loss so that FSDP's averaging reduce-scatter still yields
  the exact mean gradient over the whole batch.

So the two runs differ only in the split. ``benchmarks/fsdp.py`` measures ``strategy="cannikin_fsdp"`` against
Lightning's own ``ModelParallelStrategy``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.data import accuracy, load_dataset, smoke_subset
from lightning_cannikin import CannikinModelParallelStrategy, EmulatedCluster


class ShardedClassifier(pl.LightningModule):
    """An MLP classifier whose every linear layer is an FSDP unit (and the whole net the root)."""

    def __init__(self, in_features: int = 64, hidden: int = 128, num_classes: int = 10, lr: float = 0.05) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )
        self.lr = lr

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def strategy_for(name: str, devices: int, batch_size: int) -> CannikinModelParallelStrategy:
    """``cannikin``: balanced; ``even``: ``batch_size`` on every device, fixed (both pure sharded data parallel)."""
    if name == "cannikin":
        return CannikinModelParallelStrategy(start_method="fork")
    return CannikinModelParallelStrategy(local_batch_sizes=[batch_size] * devices, start_method="fork")


class TrainClock(Callback):
    """Rank zero's training time so far, logged at each epoch end (so it reaches the launching process too)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.log("train_time", time.perf_counter() - self.started, rank_zero_only=True)
        plan = getattr(trainer.strategy, "plan", None)
        if trainer.is_global_zero and plan is not None:
            print(f"epoch {trainer.current_epoch}: local batch sizes {list(plan.local_batch_sizes)}", flush=True)


# the training time is rank zero's own clock, on purpose not averaged over the ranks as Lightning suggests
warnings.filterwarnings("ignore", message=".*when logging on epoch level in distributed setting.*")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="both", choices=["both", "cannikin", "even"])
    parser.add_argument("--per-sample-ms", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    parser.add_argument("--fixed-ms", type=float, default=10.0)
    parser.add_argument("--batch-size", type=int, default=32, help="per-device batch size (total = x devices)")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="2 epochs on a slice of the data: a check that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.epochs = 2
    return args


def run(name: str, args: argparse.Namespace) -> dict:
    """One fit on the emulated cluster; returns rank zero's training time and the test accuracy."""
    pl.seed_everything(args.seed, verbose=False)  # the same initial weights for every run
    train, test, _shape = load_dataset("digits", seed=args.seed)
    if args.smoke:
        train, test = smoke_subset(train), smoke_subset(test)
    devices = len(args.per_sample_ms)
    trainer = pl.Trainer(
        strategy=strategy_for(name, devices, args.batch_size),
        accelerator="cpu",
        devices=devices,
        max_epochs=args.epochs,
        callbacks=[EmulatedCluster(args.per_sample_ms, args.fixed_ms), TrainClock()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = ShardedClassifier()
    print(f"--- {name}: {devices} emulated devices, per_sample_ms={args.per_sample_ms}", flush=True)
    trainer.fit(model, DataLoader(train, batch_size=args.batch_size, shuffle=True))
    # the launcher brings rank zero's full (gathered) weights back to this process's unsharded model
    result = {"train_time": float(trainer.callback_metrics["train_time"]), "test_accuracy": accuracy(model, test)}
    print(f"{name}: train_time={result['train_time']:.1f}s test_accuracy={result['test_accuracy']:.4f}", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # several ranks share two cores: one thread each avoids oversubscription
    names = ["cannikin", "even"] if args.strategy == "both" else [args.strategy]
    results = {name: run(name, args) for name in names}
    if len(results) == 2:
        ratio = results["even"]["train_time"] / results["cannikin"]["train_time"]
        print(
            f"Cannikin FSDP {results['cannikin']['train_time']:.1f}s vs even batches"
            f" {results['even']['train_time']:.1f}s: {ratio:.2f}x faster (same cluster, data, total batch and"
            f" {args.epochs} epochs)",
            flush=True,
        )


if __name__ == "__main__":
    main()
