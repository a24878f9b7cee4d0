"""Cannikin beside Lightning's plain DDP on the same emulated 3-device cluster (1x : 2x : 4x slower), real data.

    python examples/emulated_cluster.py                  # both runs, their training times and the ratio
    python examples/emulated_cluster.py --strategy ddp   # one run only: cannikin or ddp
    python examples/emulated_cluster.py --smoke          # a quick check that it runs: 2 epochs on a slice of the data

Both runs train the same model from the same initial weights on scikit-learn's digits with the same total batch
(``--batch-size`` x 3) for the same epochs. ``EmulatedCluster`` makes rank r sleep ``fixed_ms + per_sample_ms[r] * b_r``
ms per step, so one CPU machine behaves like devices of different speeds: under DDP every device gets the same batch
and the fast ones wait for the slowest; Cannikin learns the speeds, gives each device the batch that makes them finish
together, and weights the gradient all-reduce so each update is still the exact mean over the whole batch.
Both use Lightning's fork launcher (``cannikin_fork``, ``ddp_fork``) so that one command runs both.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning_cannikin  # noqa: F401  (registers strategy="cannikin")
from examples.data import ImageClassifier, accuracy, load_dataset, smoke_subset
from lightning_cannikin import EmulatedCluster


class SplitReporter(Callback):
    """Prints, on rank zero, the split in force at the start of each epoch and at the end."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plan = getattr(trainer.strategy, "plan", None)
        if trainer.is_global_zero and plan is not None:
            print(f"epoch {trainer.current_epoch}: local batch sizes {list(plan.local_batch_sizes)}", flush=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plan = getattr(trainer.strategy, "plan", None)
        if trainer.is_global_zero and plan is not None:
            print(f"final local batch sizes {list(plan.local_batch_sizes)}", flush=True)


class TrainClock(Callback):
    """Rank zero's training time so far, logged at each epoch end (so it reaches the launching process too)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.log("train_time", time.perf_counter() - self.started, rank_zero_only=True)


STRATEGIES = {"cannikin": "cannikin_fork", "ddp": "ddp_fork"}
# the training time is rank zero's own clock, on purpose not averaged over the ranks as Lightning suggests
warnings.filterwarnings("ignore", message=".*when logging on epoch level in distributed setting.*")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="digits", choices=["digits", "fashion-mnist"])
    parser.add_argument("--strategy", default="both", choices=["both", *STRATEGIES])
    parser.add_argument("--per-sample-ms", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    parser.add_argument("--fixed-ms", type=float, default=10.0)
    parser.add_argument("--batch-size", type=int, default=32, help="per-device batch size (total = x devices)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="2 epochs on a slice of the data: a check that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.epochs = 2
    return args


def run(name: str, args: argparse.Namespace, extra_callbacks: Sequence[Callback] = ()) -> dict:
    """One fit on the emulated cluster; returns rank zero's training time and the test accuracy (``extra_callbacks``:
    a benchmark's own probes, e.g. ``benchmarks/streaming_ratio.py``'s epoch clock)."""
    pl.seed_everything(args.seed, verbose=False)  # the same initial weights for every run
    train, test, shape = load_dataset(args.data, seed=args.seed)
    if args.smoke:
        train, test = smoke_subset(train), smoke_subset(test)
    devices = len(args.per_sample_ms)
    callbacks = [EmulatedCluster(args.per_sample_ms, args.fixed_ms), SplitReporter(), TrainClock(), *extra_callbacks]
    trainer = pl.Trainer(
        strategy=STRATEGIES[name],
        accelerator="cpu",
        devices=devices,
        max_epochs=args.epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = ImageClassifier(shape, lr=args.lr)
    print(f"--- {name}: {devices} emulated devices, per_sample_ms={args.per_sample_ms}, data={args.data}", flush=True)
    trainer.fit(model, DataLoader(train, batch_size=args.batch_size, shuffle=True))
    # the fork launcher brings rank zero's weights and logged metrics back to this process
    result = {"train_time": float(trainer.callback_metrics["train_time"]), "test_accuracy": accuracy(model, test)}
    print(f"{name}: train_time={result['train_time']:.1f}s test_accuracy={result['test_accuracy']:.4f}", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # several ranks share two cores: one thread each avoids oversubscription
    names = list(STRATEGIES) if args.strategy == "both" else [args.strategy]
    results = {name: run(name, args) for name in names}
    if len(results) == 2:
        ratio = results["cannikin"]["train_time"] / results["ddp"]["train_time"]
        print(
            f"Cannikin {results['cannikin']['train_time']:.1f}s vs DDP {results['ddp']['train_time']:.1f}s:"
            f" ratio {ratio:.2f}x the training time of DDP (same cluster, data, total batch and {args.epochs} epochs)",
            flush=True,
        )


if __name__ == "__main__":
    main()
