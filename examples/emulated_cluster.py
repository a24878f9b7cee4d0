"""Train on an emulated 3-device heterogeneous cluster (1x : 2x : 4x slower) with real data.

    python examples/emulated_cluster.py                 # digits, 3 emulated devices, Cannikin
    python examples/emulated_cluster.py --strategy ddp  # the same run with Lightning's plain DDP

The LightningModule is ordinary; ``strategy="cannikin"`` (registered by ``import lightning_cannikin``) splits each
global batch unevenly and weights the gradient all-reduce so the update is the exact mean over all samples.
``EmulatedCluster`` makes rank r sleep ``fixed_ms + per_sample_ms[r] * b_r`` ms per step, so one CPU machine behaves
like devices of different speeds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning_cannikin  # noqa: F401  (registers strategy="cannikin")
from examples.data import ImageClassifier, accuracy, load_dataset
from lightning_cannikin import EmulatedCluster


class SplitReporter(Callback):
    """Prints, on rank zero, the split in force at the start of each epoch."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plan = getattr(trainer.strategy, "plan", None)
        if trainer.is_global_zero and plan is not None:
            print(f"epoch {trainer.current_epoch}: local batch sizes {list(plan.local_batch_sizes)}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="digits", choices=["digits", "fashion-mnist"])
    parser.add_argument("--strategy", default="cannikin", help="a registry name: cannikin, ddp, ...")
    parser.add_argument("--per-sample-ms", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--fixed-ms", type=float, default=5.0)
    parser.add_argument("--batch-size", type=int, default=32, help="per-device batch size (total = x devices)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # several ranks share two cores: one thread each avoids oversubscription
    pl.seed_everything(args.seed, verbose=False)
    train, test, shape = load_dataset(args.data, seed=args.seed)
    devices = len(args.per_sample_ms)
    trainer = pl.Trainer(
        strategy=args.strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=args.epochs,
        callbacks=[EmulatedCluster(args.per_sample_ms, args.fixed_ms), SplitReporter()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = ImageClassifier(shape, lr=args.lr)
    started = time.perf_counter()
    trainer.fit(model, DataLoader(train, batch_size=args.batch_size, shuffle=True))
    elapsed = time.perf_counter() - started
    if trainer.is_global_zero:
        print(
            f"strategy={args.strategy} devices={devices} per_sample_ms={args.per_sample_ms} data={args.data}"
            f" train_time={elapsed:.1f}s test_accuracy={accuracy(model, test):.4f}",
            flush=True,
        )
    if "LOCAL_RANK" in os.environ and trainer.world_size > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
