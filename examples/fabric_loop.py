"""A Lightning Fabric training loop on an emulated 1x : 2x : 4x cluster, balanced by ``CannikinFabricStrategy``.

    python examples/fabric_loop.py                    # digits, 3 CPU processes, fork launcher
    python examples/fabric_loop.py --epochs 2 --per-sample-ms 1 3
    python examples/fabric_loop.py --smoke            # a quick check that it runs: 2 epochs on a slice of the data

Three additions to an ordinary Fabric loop: the strategy, ``strategy.uneven_dataloader(...)`` for the training
loader, and ``with strategy.step():`` around forward and backward (it weights the all-reduce for the batch in hand,
times the step and re-plans when due). Rank r sleeps ``fixed_ms + per_sample_ms[r] * b_r`` ms per step, standing in
for devices of different speeds. Rank zero prints the split each epoch and the test accuracy (torchmetrics).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.data import ImageClassifier, accuracy, load_dataset, smoke_subset
from lightning_cannikin import CannikinFabricStrategy


def train(fabric: L.Fabric, strategy: CannikinFabricStrategy, args: argparse.Namespace) -> None:
    train_set, test_set, shape = load_dataset("digits", seed=args.seed)
    if args.smoke:
        train_set, test_set = smoke_subset(train_set), smoke_subset(test_set)
    model = ImageClassifier(shape).net  # the example CNN as a plain nn.Module
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    loader = strategy.uneven_dataloader(DataLoader(train_set, batch_size=args.batch_size, shuffle=True))
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=False)
    delay = args.per_sample_ms[fabric.global_rank] / 1000.0
    started = time.perf_counter()
    for epoch in range(args.epochs):
        fabric.print(f"epoch {epoch}: local batch sizes {list(strategy.plan.local_batch_sizes)}")
        for x, y in loader:
            with strategy.step():
                loss = nn.functional.cross_entropy(model(x), y)
                time.sleep(args.fixed_ms / 1000.0 + delay * len(y))  # the emulated device
                fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    elapsed = time.perf_counter() - started
    if fabric.global_rank == 0:
        score = accuracy(model.module, test_set)
        print(f"final local batch sizes {list(strategy.plan.local_batch_sizes)}", flush=True)
        print(f"train_time={elapsed:.1f}s test_accuracy={score:.4f}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-sample-ms", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="one per device")
    parser.add_argument("--fixed-ms", type=float, default=5.0)
    parser.add_argument("--batch-size", type=int, default=32, help="per-device batch size (total = x devices)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="2 epochs on a slice of the data: a check that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.epochs = 2
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # several ranks share a couple of cores
    L.seed_everything(args.seed, verbose=False)
    strategy = CannikinFabricStrategy(start_method="fork")
    fabric = L.Fabric(accelerator="cpu", devices=len(args.per_sample_ms), strategy=strategy)
    fabric.launch(train, strategy, args)


if __name__ == "__main__":
    main()
