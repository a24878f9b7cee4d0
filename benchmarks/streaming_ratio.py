"""Issue 54's speed check: ``examples/streaming.py``'s ratio (Cannikin / DDP training time) beside
``examples/emulated_cluster.py``'s, measured side by side, and where a gap between them comes from.

Both examples train the same CNN on scikit-learn's digits, on the same emulated 1x:2x:4x cluster, with the same total
batch and epochs, each beside Lightning's DDP; one reads the data from memory (map-style), the other streams it from
LitData chunks written by ``litdata.optimize``. Every repeat runs the four fits interleaved (map DDP, map Cannikin,
stream DDP, stream Cannikin, the order rotated each repeat) in one process through the examples' own ``run``, so a
change in this shared machine's load hits all of them alike. Reported per fit: rank zero's training time (the
examples' own clock), each epoch's time, and the split of every step (so the epoch at which each split took over can
be read off); per repeat the two ratios; over the repeats their medians. Beside them, in this process: the time to read
one epoch's items through ``dataset[i]`` from memory and from the stream, in storage order and in a shuffled share's
order (the decoding that no split can shrink).

    python benchmarks/streaming_ratio.py [--repeats 3] [--epochs 8]      # the examples' own settings
    python benchmarks/streaming_ratio.py --out benchmarks/results/streaming_ratio.json

Needs the ``litdata`` extra (see docs/streaming.md for a CPU machine's install).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples import emulated_cluster, streaming
from examples.data import load_dataset


class EpochClock(Callback):
    """Rank zero's time of every epoch and every rank's batch size in every step, written to ``path`` at the end."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epochs: list[float] = []
        self.steps: list[list[int]] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, index: int
    ) -> None:
        sizes = getattr(trainer.strategy, "step_sizes", None)  # Cannikin's: every rank's; DDP: the even split
        local = len(batch[0])
        self.steps.append(list(sizes) if sizes is not None else [local] * trainer.world_size)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epochs.append(time.perf_counter() - self.started)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps({"epoch_times": self.epochs, "step_sizes": self.steps}))


def read_cost(data_dir: Path, seed: int, repeats: int = 3) -> dict[str, Any]:
    """Seconds to read one epoch's items one by one (``dataset[i]``, one process) in four orders, the median of
    ``repeats``: from memory; from the stream in storage order; in the order one rank's shuffled share reads it with
    the items of each chunk fully permuted (``window=0``, what this package did before); and kept within LitData's
    decode windows (what it does now)."""
    from litdata import StreamingDataset

    from lightning_cannikin.core.plan import Plan
    from lightning_cannikin.core.stream_shares import replanned_shares
    from lightning_cannikin.training.data.streaming import read_layout

    stream = StreamingDataset(str(data_dir), shuffle=True, seed=seed)
    memory, _, _ = load_dataset("digits", seed=seed)
    chunk_sizes, window = read_layout(stream)
    items = sum(chunk_sizes)

    def shuffled(window: int) -> list[int]:
        shares = replanned_shares(chunk_sizes, {0: Plan((96,))}, 0, 0, True, seed, 1, window=window)
        return [int(i) for ids in shares for i in ids]

    orders = {
        "memory": (memory, list(range(items))),
        "stream_storage_order": (stream, list(range(items))),
        "stream_shuffled_full_chunk": (stream, shuffled(0)),
        "stream_shuffled_in_windows": (stream, shuffled(window)),
    }
    result: dict[str, Any] = {"items": items, "decode_window": window}
    for name, (dataset, order) in orders.items():
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            for i in order:
                dataset[i]
            times.append(time.perf_counter() - started)
        result[f"{name}_epoch_read_s"] = statistics.median(times)
    return result


def fit(example: str, name: str, args: argparse.Namespace, data_dir: Path, scratch: Path) -> dict[str, Any]:
    """One of the examples' own fits, with the epoch clock beside it."""
    clock = scratch / f"{example}-{name}.json"
    clock.unlink(missing_ok=True)
    if example == "map":
        result = emulated_cluster.run(name, args, extra_callbacks=[EpochClock(str(clock))])
    else:
        result = streaming.run(name, args, data_dir, extra_callbacks=[EpochClock(str(clock))])
    return {**result, **json.loads(clock.read_text())}


def first_epoch_of(steps: list[list[int]], epochs: int) -> list[list[int]]:
    """The split each epoch starts with (the steps are ``epochs`` equal runs)."""
    per_epoch = len(steps) // epochs
    return [steps[e * per_epoch] for e in range(epochs)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8, help="the examples' default")
    parser.add_argument("--out", default=None, help="JSON report (default: a temporary folder)")
    options = parser.parse_args(argv)
    # the examples' own defaults, as their command lines give them
    args = emulated_cluster.parse_args(["--epochs", str(options.epochs)])
    args.data = "digits"
    torch.set_num_threads(1)
    load = [os.getloadavg()]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as temporary:
        scratch = Path(temporary)
        data_dir = scratch / "stream"
        streaming.write_stream(data_dir, args.seed)
        reads = read_cost(data_dir, args.seed)
        fits = [("map", "ddp"), ("map", "cannikin"), ("stream", "ddp"), ("stream", "cannikin")]
        for repeat in range(options.repeats):
            order = fits[repeat % len(fits) :] + fits[: repeat % len(fits)]
            results = {f"{example}_{name}": fit(example, name, args, data_dir, scratch) for example, name in order}
            run = {"repeat": repeat, "order": [f"{e}_{n}" for e, n in order], **results}
            for example in ("map", "stream"):
                run[f"{example}_ratio"] = (
                    results[f"{example}_cannikin"]["train_time"] / results[f"{example}_ddp"]["train_time"]
                )
            runs.append(run)
            print(f"repeat {repeat}: map {run['map_ratio']:.3f}x, stream {run['stream_ratio']:.3f}x", flush=True)
    load.append(os.getloadavg())
    report = summarise(runs, reads, options, load)
    out = Path(options.out) if options.out else Path(tempfile.gettempdir()) / "streaming_ratio.json"
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"], indent=1))
    print(f"saved {out}")


def summarise(runs: list[dict], reads: dict, options: argparse.Namespace, load: list) -> dict[str, Any]:
    """Medians over the repeats: the ratios, each fit's time, each epoch's time, the split at each epoch's start."""
    keys = ("map_ddp", "map_cannikin", "stream_ddp", "stream_cannikin")
    summary: dict[str, Any] = {}
    for example in ("map", "stream"):
        ratios = [run[f"{example}_ratio"] for run in runs]
        summary[f"{example}_ratio_median"] = statistics.median(ratios)
        summary[f"{example}_ratios"] = [round(r, 4) for r in ratios]
    summary["stream_over_map_ratio"] = summary["stream_ratio_median"] / summary["map_ratio_median"]
    for key in keys:
        summary[f"{key}_train_time_median"] = statistics.median(run[key]["train_time"] for run in runs)
        summary[f"{key}_epoch_times_median"] = [
            round(float(t), 3) for t in np.median([run[key]["epoch_times"] for run in runs], axis=0)
        ]
        summary[f"{key}_epoch_start_splits_repeat0"] = first_epoch_of(runs[0][key]["step_sizes"], options.epochs)
    summary["reads"] = reads
    return {
        "command": "python benchmarks/streaming_ratio.py " + " ".join(sys.argv[1:]),
        "repeats": options.repeats,
        "epochs": options.epochs,
        "machine": {"cpus": os.cpu_count(), "load_average_start_end": load},
        "summary": summary,
        "runs": runs,
    }


if __name__ == "__main__":
    main()
