"""Train with ``strategy="cannikin"`` on processes started by an external launcher (torchrun, SLURM's srun).

Every process runs this script; the launcher's environment tells Lightning the ranks, so nothing here is
launcher-specific. ``--num-nodes`` and ``--devices`` must match what the launcher started (nodes x processes per node).

    # two "nodes" on one machine (see examples/torchrun_two_nodes.sh)
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 1 --master_addr 127.0.0.1 --master_port 29500 \\
        examples/train_multinode.py --num-nodes 2 --devices 1 --per-sample-ms 1 3
    # under SLURM (see examples/slurm_job.sh)
    srun python examples/train_multinode.py --num-nodes 2 --devices 4 --accelerator gpu

Rank zero prints the cluster environment Lightning detected, the split in force each epoch, the final split and the
test accuracy. ``--per-sample-ms`` (one value per global rank) emulates devices of different speeds by sleeping.
``--smoke``: 2 epochs on a slice of the data, a quick check that a launch works.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning_cannikin  # noqa: F401  (registers strategy="cannikin")
from examples.data import ImageClassifier, accuracy, load_dataset, smoke_subset
from examples.emulated_cluster import SplitReporter
from lightning_cannikin import Cannikin, CannikinSettings, EmulatedCluster


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-nodes", type=int, default=1, help="Trainer(num_nodes=...): nodes the launcher used")
    parser.add_argument("--devices", type=int, default=1, help="Trainer(devices=...): processes per node")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--strategy", default="cannikin", help="a registry name: cannikin, ddp, ...")
    parser.add_argument(
        "--per-sample-ms",
        type=float,
        nargs="*",
        default=[],
        help="emulated ms per sample, one value per global rank (empty: no emulation, real devices)",
    )
    parser.add_argument("--fixed-ms", type=float, default=2.0, help="emulated ms per step (with --per-sample-ms)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-device batch size (total = x world size)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, default=8, help="CannikinSettings(warmup_steps=...)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default="digits", choices=["digits", "fashion-mnist"])
    parser.add_argument("--smoke", action="store_true", help="2 epochs on a slice of the data: a check that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.epochs = 2
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # several ranks may share a couple of cores
    pl.seed_everything(args.seed, verbose=False)
    train, test, shape = load_dataset(args.data, seed=args.seed)
    if args.smoke:
        train, test = smoke_subset(train), smoke_subset(test)
    callbacks: list[pl.Callback] = [SplitReporter()]
    if args.strategy.startswith("cannikin"):
        callbacks.append(Cannikin(settings=CannikinSettings(warmup_steps=args.warmup_steps)))
    if args.per_sample_ms:
        callbacks.append(EmulatedCluster(args.per_sample_ms, args.fixed_ms))
    trainer = pl.Trainer(
        strategy=args.strategy,
        accelerator=args.accelerator,
        num_nodes=args.num_nodes,
        devices=args.devices,
        max_epochs=args.epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if trainer.is_global_zero:
        environment = type(trainer.strategy.cluster_environment).__name__
        print(
            f"cluster_environment={environment} world_size={trainer.world_size} num_nodes={trainer.num_nodes}",
            flush=True,
        )
    model = ImageClassifier(shape, lr=args.lr)
    started = time.perf_counter()
    trainer.fit(model, DataLoader(train, batch_size=args.batch_size, shuffle=True))
    elapsed = time.perf_counter() - started
    if trainer.is_global_zero:
        plan = getattr(trainer.strategy, "plan", None)
        if plan is not None:
            print(f"final local batch sizes {list(plan.local_batch_sizes)}", flush=True)
        print(
            f"training finished: strategy={args.strategy} world_size={trainer.world_size}"
            f" per_sample_ms={args.per_sample_ms} train_time={elapsed:.1f}s test_accuracy={accuracy(model, test):.4f}",
            flush=True,
        )
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
