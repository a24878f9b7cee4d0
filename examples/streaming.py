"""Streaming data: LitData's ``StreamingDataset`` under Cannikin beside Lightning's DDP on an emulated 1x:2x:4x cluster.

    pip install "lightning-cannikin[litdata]"   # a CPU-only torch: see the README's "Streaming data" for the install
    python examples/streaming.py                 # both runs, their training times and the ratio
    python examples/streaming.py --strategy ddp  # one run only: cannikin or ddp
    python examples/streaming.py --smoke         # a quick check that it runs: 2 epochs on a slice of the data

scikit-learn's digits are written once with ``litdata.optimize`` into a local folder of chunks (``--data-dir``; a
temporary one by default), then streamed back by a ``StreamingDataset`` and ``StreamingDataLoader`` built in the
LightningModule's ``train_dataloader`` (in the ranks, where LitData sees the distributed world). The model and loader
code is the same for both runs: under DDP LitData gives every rank an even share of the stream and the fast devices
wait for the slowest; under ``strategy="cannikin"`` each rank reads its own share in proportion to its speed, every
item once per epoch, and the gradient all-reduce is weighted so each update is the exact mean over the global batch.
The cluster is ``examples/emulated_cluster.py``'s (``EmulatedCluster``: rank r sleeps ``fixed_ms + per_sample_ms[r] *
b_r`` ms per step), so the two examples' ratios can be compared.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning_cannikin  # noqa: F401  (registers strategy="cannikin")
from examples.data import ImageClassifier, accuracy, load_dataset, smoke_subset
from examples.emulated_cluster import STRATEGIES, SplitReporter, TrainClock
from lightning_cannikin import EmulatedCluster

warnings.filterwarnings("ignore", message=".*when logging on epoch level in distributed setting.*")


class StreamedClassifier(ImageClassifier):
    """The examples' classifier, trained from a LitData stream (an ordinary LightningModule: nothing Cannikin)."""

    def __init__(self, *args, data_dir: str, batch_size: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.data_dir, self.batch_size = data_dir, batch_size

    def train_dataloader(self):
        from litdata import StreamingDataLoader, StreamingDataset

        return StreamingDataLoader(StreamingDataset(self.data_dir, shuffle=True, seed=0), batch_size=self.batch_size)


def _digit(sample: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    image, label = sample
    return image, int(label)


def write_stream(data_dir: Path, seed: int, smoke: bool = False) -> None:
    """The digits' training split (a slice of it for ``smoke``) as LitData chunks of 64 items in ``data_dir``."""
    from litdata import optimize

    train, _, _ = load_dataset("digits", seed=seed)
    if smoke:
        train = smoke_subset(train)
    start = multiprocessing.get_start_method()
    optimize(fn=_digit, inputs=list(train), output_dir=str(data_dir), chunk_size=64, num_workers=1, mode="overwrite")
    multiprocessing.set_start_method(start, force=True)  # optimize switches the whole process to spawn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="both", choices=["both", *STRATEGIES])
    parser.add_argument("--data-dir", default=None, help="where the optimized chunks go (default: a temporary folder)")
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


def run(name: str, args: argparse.Namespace, data_dir: Path, extra_callbacks: Sequence[Callback] = ()) -> dict:
    """One fit on the emulated cluster; returns rank zero's training time and the test accuracy (``extra_callbacks``:
    a benchmark's own probes, e.g. ``benchmarks/streaming_ratio.py``'s epoch clock)."""
    pl.seed_everything(args.seed, verbose=False)  # the same initial weights for every run
    _, test, shape = load_dataset("digits", seed=args.seed)
    if args.smoke:
        test = smoke_subset(test)
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
    model = StreamedClassifier(shape, lr=args.lr, data_dir=str(data_dir), batch_size=args.batch_size)
    print(f"--- {name}: {devices} emulated devices, per_sample_ms={args.per_sample_ms}, streamed digits", flush=True)
    trainer.fit(model)
    result = {"train_time": float(trainer.callback_metrics["train_time"]), "test_accuracy": accuracy(model, test)}
    print(f"{name}: train_time={result['train_time']:.1f}s test_accuracy={result['test_accuracy']:.4f}", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # several ranks share two cores: one thread each avoids oversubscription
    with tempfile.TemporaryDirectory() as temporary:
        data_dir = Path(args.data_dir or temporary)
        started = time.perf_counter()
        write_stream(data_dir, args.seed, args.smoke)
        print(f"optimized the digits into {data_dir} in {time.perf_counter() - started:.1f}s", flush=True)
        names = list(STRATEGIES) if args.strategy == "both" else [args.strategy]
        results = {name: run(name, args, data_dir) for name in names}
    if len(results) == 2:
        ratio = results["cannikin"]["train_time"] / results["ddp"]["train_time"]
        print(
            f"Cannikin {results['cannikin']['train_time']:.1f}s vs DDP {results['ddp']['train_time']:.1f}s:"
            f" ratio {ratio:.2f}x the training time of DDP (same cluster, stream, total batch and {args.epochs}"
            " epochs)",
            flush=True,
        )


if __name__ == "__main__":
    main()
