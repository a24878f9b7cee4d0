"""Throughput of ``strategy="cannikin_fsdp"`` against Lightning's ``ModelParallelStrategy`` (FSDP2, even batches).

Three emulated devices, a fixed total batch, scikit-learn digits, the MLP of ``examples/fsdp_cluster.py`` sharded per
layer over all ranks by both strategies. Runs alternate Lightning / Cannikin, repeated; the figure is the ratio of
steady-state samples/s (the epochs after ``--skip-epochs``), medians over repeats, beside the ideal ratio the emulated
delays allow (even split over the exact OptPerf split, the real compute and the collectives left out). Scenarios:

- ``heterogeneous``: 1x : 2x : 4x slower (per_sample_ms 1, 2, 4 times ``--scale``), fixed_ms on every device;
- ``homogeneous``: all devices equal: a control, Cannikin must cost nothing where there is nothing to balance.

    python benchmarks/fsdp.py [--repeats 3] [--epochs 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader
from typing_extensions import override

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.balance import ideal_ratio
from benchmarks.harness import median
from examples.data import load_dataset
from examples.fsdp_cluster import ShardedClassifier
from lightning_cannikin import CannikinModelParallelStrategy, EmulatedCluster
from lightning_cannikin.training._lightning_compat import _ShardedLauncher


class ForkedModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` as it is (even batches), launched with fork so that one process runs it
    beside Cannikin's (Lightning's own launcher for it re-runs the script once per rank). The launcher is the one
    ``cannikin_fsdp_fork`` uses, an internal of the package: a benchmark may reach in, the examples use only the
    public API."""

    @override
    def _configure_launcher(self) -> None:
        self._launcher = _ShardedLauncher(self, start_method="fork")


def strategy_for(name: str, devices: int) -> ModelParallelStrategy:
    """``cannikin``: ``strategy="cannikin_fsdp_fork"``; ``lightning``: Lightning's own (pure sharded DP)."""
    if name == "cannikin":
        return CannikinModelParallelStrategy(start_method="fork")
    return ForkedModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)


class EpochThroughput(Callback):
    """Rank zero's wall clock per epoch and the samples every rank trained on in it (no evaluation: a sharded model
    cannot be evaluated by one rank alone)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.starts: list[float] = []
        self.samples: list[int] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.starts.append(time.perf_counter())
        self.samples.append(0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        sizes = getattr(trainer.strategy, "step_sizes", None)
        self.samples[-1] += sum(sizes) if sizes else len(batch[0]) * trainer.world_size

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            ends = [*self.starts[1:], time.perf_counter()]
            plan = getattr(trainer.strategy, "plan", None)
            result = {
                "epoch_times": [end - start for start, end in zip(self.starts, ends, strict=True)],
                "epoch_samples": self.samples,
                "final_split": list(plan.local_batch_sizes) if plan is not None else None,
            }
            self.out.write_text(json.dumps(result))


def run(name: str, per_sample_ms: list[float], fixed_ms: float, batch_size: int, epochs: int, seed: int) -> dict:
    """One fit; rank zero's per-epoch times and samples."""
    torch.set_num_threads(1)
    pl.seed_everything(seed, verbose=False)
    train, _test, _shape = load_dataset("digits", seed=seed)
    devices = len(per_sample_ms)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        trainer = pl.Trainer(
            strategy=strategy_for(name, devices),
            accelerator="cpu",
            devices=devices,
            max_epochs=epochs,
            callbacks=[EmulatedCluster(per_sample_ms, fixed_ms, seed=seed), EpochThroughput(out)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(ShardedClassifier(), DataLoader(train, batch_size=batch_size, shuffle=True))
        return json.loads(out.read_text())


def scenario(name: str, per_sample_ms: list[float], args: argparse.Namespace) -> dict:
    batch = args.total_batch // len(per_sample_ms)
    runs: dict[str, list[dict]] = {"lightning": [], "cannikin": []}
    for repeat in range(args.repeats):
        for strategy in ("lightning", "cannikin"):  # interleaved: a slow spell of the machine hits both
            result = run(strategy, per_sample_ms, args.fixed_ms, batch, args.epochs, seed=repeat)
            skip = args.skip_epochs
            result["throughput"] = sum(result["epoch_samples"][skip:]) / sum(result["epoch_times"][skip:])
            runs[strategy].append(result)
            print(f"  {name} repeat {repeat} {strategy:9s} {result['throughput']:8.1f} samples/s", flush=True)
    ratios = [c["throughput"] / d["throughput"] for d, c in zip(runs["lightning"], runs["cannikin"], strict=True)]
    return {
        "per_sample_ms": per_sample_ms,
        "fixed_ms": args.fixed_ms,
        "total_batch_size": args.total_batch,
        "lightning_samples_per_s": median([r["throughput"] for r in runs["lightning"]]),
        "cannikin_samples_per_s": median([r["throughput"] for r in runs["cannikin"]]),
        "ratio_median": median(ratios),
        "ratios": ratios,
        "ideal_ratio": ideal_ratio(per_sample_ms, args.fixed_ms, args.total_batch),
        "final_splits": [r["final_split"] for r in runs["cannikin"]],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--skip-epochs", type=int, default=2, help="epochs left out of the steady state")
    parser.add_argument("--total-batch", type=int, default=96)
    parser.add_argument("--scale", type=float, default=2.0, help="ms per sample of the fastest device")
    parser.add_argument("--fixed-ms", type=float, default=0.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fsdp.json")
    args = parser.parse_args(argv)
    scenarios = {
        "heterogeneous": scenario("heterogeneous", [args.scale * f for f in (1.0, 2.0, 4.0)], args),
        "homogeneous": scenario("homogeneous", [args.scale * 2.0] * 3, args),
    }
    report = {
        "ratios": {name: r["ratio_median"] for name, r in scenarios.items()},
        "ideal": {name: r["ideal_ratio"] for name, r in scenarios.items()},
        "scenarios": scenarios,
        "settings": {k: str(v) for k, v in vars(args).items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for name, r in scenarios.items():
        print(
            f"{name:14s} cannikin_fsdp / ModelParallelStrategy = {r['ratio_median']:.2f}x (ideal"
            f" {r['ideal_ratio']:.2f}x, runs {', '.join(f'{x:.2f}' for x in r['ratios'])}); final splits"
            f" {r['final_splits']}"
        )
    print(f"saved {args.out}")
    return report


if __name__ == "__main__":
    main()
