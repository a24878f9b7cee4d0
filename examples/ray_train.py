"""Cannikin in Ray Train: a ``TorchTrainer`` of 3 CPU workers on a local Ray cluster, emulated devices, real data.

    pip install torch==2.13.0 -e ".[ray]" && python examples/ray_train.py
    python examples/ray_train.py --resume-workers 2   # then one more epoch from Ray's checkpoint, on 2 workers
    python examples/ray_train.py --smoke              # a quick check that it runs: 1 epoch on a slice of the data

The script starts a local Ray cluster (``ray.init``, no dashboard) and shuts it down at the end. Each Ray worker builds
a Lightning ``Trainer`` with ``strategy="cannikin_ray"`` and ``RayLightningEnvironment``, passes it through
``ray.train.lightning.prepare_trainer`` and trains a small CNN on scikit-learn's digits (shipped in its wheel).
``EmulatedCluster`` makes worker r sleep ``fixed_ms + per_sample_ms[r] * b_r`` ms per step (1x, 2x, 4x slower by
default), so one CPU machine behaves like a mixed cluster; Cannikin moves samples to the faster workers. Worker 0 prints
the split at every epoch start. ``RayTrainReportCallback`` reports a Ray checkpoint at every epoch end: it holds
Cannikin's state (plan, speed model, noise estimate), so ``--resume-workers N`` continues from it on N workers (the
total batch is kept; on another worker count the split starts even and is re-planned as the devices are timed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.data import ImageClassifier, accuracy, load_dataset, smoke_subset  # noqa: E402
from examples.emulated_cluster import SplitReporter  # noqa: E402


def train_loop(config: dict[str, Any]) -> None:
    """What every Ray worker runs: an ordinary Lightning fit with Cannikin's Ray strategy."""
    import ray.train
    from ray.train.lightning import RayLightningEnvironment, RayTrainReportCallback, prepare_trainer

    import lightning_cannikin  # registers strategy="cannikin_ray" in this worker
    from lightning_cannikin import Cannikin, EmulatedCluster

    assert lightning_cannikin
    torch.set_num_threads(1)  # the workers share the machine's cores
    pl.seed_everything(config["seed"], verbose=False)
    train, test, shape = load_dataset("digits", seed=config["seed"])
    if config["smoke"]:
        train, test = smoke_subset(train), smoke_subset(test)
    world = ray.train.get_context().get_world_size()
    per_sample_ms = config["per_sample_ms"][:world]
    trainer = pl.Trainer(
        strategy="cannikin_ray",
        plugins=[RayLightningEnvironment()],
        accelerator="cpu",
        devices="auto",
        max_epochs=config["epochs"],
        callbacks=[
            Cannikin(),
            EmulatedCluster(per_sample_ms, config["fixed_ms"]),
            SplitReporter(),
            RayTrainReportCallback(),  # a Ray checkpoint (with Cannikin's state) at every epoch end
        ],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer = prepare_trainer(trainer)  # Ray's check: a RayDDPStrategy (CannikinRayStrategy is one) and Ray's env
    model = ImageClassifier(shape, lr=config["lr"])
    loader = DataLoader(train, batch_size=config["batch_size"], shuffle=True)
    checkpoint = ray.train.get_checkpoint() or config.get("checkpoint")
    if checkpoint is None:
        trainer.fit(model, loader)
    else:
        with checkpoint.as_directory() as folder:
            trainer.fit(model, loader, ckpt_path=str(Path(folder, RayTrainReportCallback.CHECKPOINT_NAME)))
    if trainer.global_rank == 0:
        print(f"{world} workers, per_sample_ms={per_sample_ms}: test accuracy {accuracy(model, test):.4f}", flush=True)


def fit(args: argparse.Namespace, workers: int, epochs: int, storage: str, checkpoint: Any = None) -> Any:
    """One ``TorchTrainer`` run on ``workers`` CPU workers; returns Ray's result (its last checkpoint included)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    config = {
        "per_sample_ms": args.per_sample_ms,
        "fixed_ms": args.fixed_ms,
        "batch_size": args.batch_size,
        "epochs": epochs,
        "lr": args.lr,
        "seed": args.seed,
        "smoke": args.smoke,
        "checkpoint": checkpoint,
    }
    trainer = TorchTrainer(
        train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
        run_config=RunConfig(name=f"cannikin-{workers}-workers", storage_path=storage),
    )
    result = trainer.fit()
    if result.error is not None:
        raise result.error
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-sample-ms", type=float, nargs="+", default=[1.0, 2.0, 4.0], help="one per worker")
    parser.add_argument("--fixed-ms", type=float, default=10.0)
    parser.add_argument("--batch-size", type=int, default=32, help="per-worker batch size (total = x workers)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume-workers", type=int, default=None, help="then 1 more epoch on this many workers")
    parser.add_argument("--storage", default=None, help="Ray's storage path (default: a temporary folder)")
    parser.add_argument("--smoke", action="store_true", help="1 epoch on a slice of the data: a check that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.epochs = 1
    return args


def main(argv: list[str] | None = None) -> None:
    import ray

    args = parse_args(argv)
    workers = len(args.per_sample_ms)
    if args.resume_workers is not None and not 1 <= args.resume_workers <= workers:
        raise SystemExit(f"--resume-workers must be between 1 and {workers} (one --per-sample-ms entry each)")
    # the workers import this repository's `examples` and `lightning_cannikin` (an editable install has the latter)
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    ray.init(num_cpus=workers, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        with tempfile.TemporaryDirectory() as temporary:
            storage = args.storage or temporary
            result = fit(args, workers, args.epochs, storage)
            print(f"Ray's last checkpoint: {result.checkpoint.path} (metrics {result.metrics})", flush=True)
            if args.resume_workers is not None:
                print(f"--- resuming on {args.resume_workers} workers for one more epoch", flush=True)
                fit(args, args.resume_workers, args.epochs + 1, storage, checkpoint=result.checkpoint)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
