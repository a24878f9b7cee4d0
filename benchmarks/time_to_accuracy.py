"""Time to a target test accuracy: Lightning DDP vs an even-split adaptive baseline vs Cannikin, side by side.

Three emulated devices, 1x : 2x : 4x (per_sample_ms = 0.5, 1.0, 2.0; fixed_ms = 20), real data (Fashion-MNIST from
Debian's ``dataset-fashion-mnist`` when installed, else scikit-learn's digits). In one invocation, repeated and
interleaved:

(a) ``ddp``: Lightning DDP, fixed total batch, even split;
(b) ``adaptive-even``: Cannikin's own adaptive layer (goodput-chosen total batch, AdaScale LR) with balancing off,
    the AdaptDL-like baseline;
(c) ``cannikin``: OptPerf balancing plus the adaptive layer.

Each run evaluates on the test set every 5,000 training samples (off the clock) and stops at the target. Reports the
median time to target of each, the ratios, and a plot of total batch, LR factor, noise scale and accuracy over time.

It also reports the *emulated bound*: the best ratios any implementation could reach on these emulated devices (their
sleep times alone, none of this machine's own overhead), given the noise scale Cannikin measured along its runs.
Balancing alone is worth ``optperf(B0) / ddp(B0)``; a larger batch adds the goodput gain that the noise scale allows
at each point of training. A target below the bound cannot be met by any implementation in this set-up.

    python benchmarks/time_to_accuracy.py [--repeats 3] [--target 0.89]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from benchmarks.harness import median, run
from examples.data import fashion_mnist_available
from lightning_cannikin import Cannikin
from lightning_cannikin.core.goodput import candidate_batch_sizes, goodput
from lightning_cannikin.core.optperf import optperf, step_time
from lightning_cannikin.core.plan import even_split

PER_SAMPLE_MS = [0.5, 1.0, 2.0]


def time_to_target(result: dict, target: float) -> float | None:
    for point in result["curve"]:
        if point["accuracy"] >= target:
            return point["time"]
    return None


def emulated_bound(
    cannikin_runs: list[dict], ddp_samples: float, base_batch: int, max_batch: int, fixed_ms: float
) -> dict[str, float]:
    """Ideal time ratios from the emulated costs and the noise scale measured along Cannikin's runs.

    Progress is counted in samples at B0 (what DDP needs to reach the target, ``ddp_samples``). Each stretch of
    progress costs ``samples / goodput`` at the best total batch for the noise scale measured there: OptPerf splits
    for Cannikin, even splits for the adaptive baseline; balancing alone keeps B0.
    """
    slopes, offsets = np.asarray(PER_SAMPLE_MS) / 1000, np.full(len(PER_SAMPLE_MS), fixed_ms / 1000)
    n = len(PER_SAMPLE_MS)
    candidates = candidate_batch_sizes(base_batch, max_batch)
    balanced = optperf(slopes, offsets, candidates)
    even = np.array([step_time(slopes, offsets, even_split(int(b), n)) for b in candidates])
    ddp_rate = base_batch / step_time(slopes, offsets, even_split(base_batch, n))
    balance_only_rate = base_batch / float(balanced[0])  # candidates[0] is B0

    def best(times: np.ndarray, phi: float | None) -> float:
        return float(np.max(goodput(candidates, times, phi, base_batch)))

    # the noise scale at each evaluation, by samples seen, pooled over Cannikin's repeats (median per grid point)
    points: dict[int, list[float]] = {}
    for result in cannikin_runs:
        for point in result["curve"]:
            if point.get("noise_scale") is not None:
                points.setdefault(point["samples"] // 1000, []).append(point["noise_scale"])
    seconds = {"ddp": ddp_samples / ddp_rate, "balance_only": 0.0, "adaptive_even": 0.0, "cannikin": 0.0}
    # each stretch of progress runs at the noise scale last measured before it (none before the first: B0 is best)
    phi, done = None, 0.0
    measured = [(1000.0 * key, float(np.median(points[key]))) for key in sorted(points)]
    for end, next_phi in [*[m for m in measured if m[0] < ddp_samples], (ddp_samples, None)]:
        stretch, done = end - done, end
        seconds["balance_only"] += stretch / balance_only_rate
        seconds["adaptive_even"] += stretch / best(even, phi)
        seconds["cannikin"] += stretch / best(balanced, phi)
        phi = next_phi
    return {
        "ideal_cannikin_vs_ddp": seconds["cannikin"] / seconds["ddp"],
        "ideal_balance_only_vs_ddp": seconds["balance_only"] / seconds["ddp"],
        "ideal_cannikin_vs_adaptive_even": seconds["cannikin"] / seconds["adaptive_even"],
    }


def configure(name: str, max_batch_size: int) -> tuple[str, list]:
    if name == "ddp":
        return "ddp_fork", []
    balance = name == "cannikin"
    return "cannikin_fork", [Cannikin(max_batch_size=max_batch_size, balance=balance, lr_scaling="adascale")]


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(7, 10), sharex=True)
    colours = dict(zip(runs, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for name, results in runs.items():
        curve, colour = results[0]["curve"], colours[name]
        times = [p["time"] for p in curve]
        axes[0].step(times, [p["total_batch_size"] for p in curve], where="post", color=colour, label=name)
        axes[1].step(times, [p["lr_factor"] for p in curve], where="post", color=colour, label=name)
        measured = [(p["time"], p["noise_scale"]) for p in curve if p.get("noise_scale") is not None]
        if measured:
            axes[2].plot(*zip(*measured, strict=True), marker=".", color=colour, label=name)
        axes[3].plot(times, [p["accuracy"] for p in curve], marker="o", color=colour, label=name)
    axes[0].set_ylabel("total batch size")
    axes[1].set_ylabel("LR factor")
    axes[2].axhline(curve[0]["total_batch_size"] if curve else 0, color="grey", linestyle=":", label="B0")
    axes[2].set_ylabel("noise scale (samples)")
    axes[2].legend()
    axes[3].set_ylabel("test accuracy")
    axes[3].set_xlabel("training time (s, evaluation excluded), first repeat")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="fashion-mnist" if fashion_mnist_available() else "digits")
    parser.add_argument("--train-samples", type=int, default=None, help="a subset of the training set (default: all)")
    parser.add_argument("--target", type=float, default=None, help="default: 0.89 Fashion-MNIST, 0.95 digits")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="initial per-device batch (B0 = 3x)")
    parser.add_argument("--max-batch-size", type=int, default=1024)
    parser.add_argument("--max-epochs", type=int, default=30)
    parser.add_argument("--eval-every", type=int, default=5000, help="evaluate every this many training samples")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--fixed-ms", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "time_to_accuracy")
    args = parser.parse_args(argv)
    target = args.target or (0.89 if args.data == "fashion-mnist" else 0.95)
    names = ("ddp", "adaptive-even", "cannikin")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names:
            strategy, callbacks = configure(name, args.max_batch_size)
            result = run(
                strategy,
                PER_SAMPLE_MS,
                args.fixed_ms,
                args.batch_size,
                args.max_epochs,
                data=args.data,
                callbacks=callbacks,
                lr=args.lr,
                seed=repeat,
                target_accuracy=target,
                train_samples=args.train_samples,
                eval_every_samples=args.eval_every,
            )
            result["time_to_target"] = time_to_target(result, target)
            runs[name].append(result)
            reached = result["time_to_target"]
            print(
                f"repeat {repeat} {name:14s} time to {target:.2f}: "
                f"{'not reached' if reached is None else f'{reached:.1f} s'}"
                f" after {result['curve'][-1]['samples']} samples,"
                f" final total batch {result['curve'][-1]['total_batch_size']}",
                flush=True,
            )

    def med(name: str) -> float | None:
        times = [r["time_to_target"] for r in runs[name]]
        return median(times) if all(t is not None for t in times) else None

    summary = {name: med(name) for name in names}
    ratios = {
        "cannikin_vs_ddp": summary["cannikin"] / summary["ddp"] if summary["cannikin"] and summary["ddp"] else None,
        "cannikin_vs_adaptive_even": (
            summary["cannikin"] / summary["adaptive-even"] if summary["cannikin"] and summary["adaptive-even"] else None
        ),
    }
    base_batch = args.batch_size * len(PER_SAMPLE_MS)
    reached = [r["curve"][-1]["samples"] for r in runs["ddp"] if r["time_to_target"] is not None]
    bound = (
        emulated_bound(runs["cannikin"], median(reached), base_batch, args.max_batch_size, args.fixed_ms)
        if reached
        else None
    )
    report = {
        "data": args.data,
        "train_samples": args.train_samples,
        "target_accuracy": target,
        "per_sample_ms": PER_SAMPLE_MS,
        "fixed_ms": args.fixed_ms,
        "initial_total_batch": base_batch,
        "max_batch_size": args.max_batch_size,
        "median_time_to_target_s": summary,
        "ratios": ratios,
        "emulated_bound": bound,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    rows = [
        "| run | median time to target (s) | per-repeat (s) | final total batch (first repeat) |",
        "|---|---:|---|---:|",
    ]
    for name in names:
        per = ", ".join("n/a" if r["time_to_target"] is None else f"{r['time_to_target']:.1f}" for r in runs[name])
        value = "n/a" if summary[name] is None else f"{summary[name]:.1f}"
        rows.append(f"| {name} | {value} | {per} | {runs[name][0]['curve'][-1]['total_batch_size']} |")
    rows.append("")
    for key, value in ratios.items():
        rows.append(f"- {key}: {'n/a' if value is None else f'{value:.2f}x the time'}")
    if bound is not None:
        rows.append("")
        rows.append("Emulated bound (the devices' sleep times alone, the noise scale Cannikin measured):")
        for key, value in bound.items():
            rows.append(f"- {key}: {value:.2f}x the time")
    table = "\n".join(rows)
    title = f"# Time to {target:.0%} test accuracy ({args.data}, {args.train_samples or 'all'} training samples)"
    args.out.with_suffix(".md").write_text(f"{title}\n\n{table}\n")
    plot(runs, args.out.with_suffix(".png"))
    print(table)
    print(f"saved {args.out.with_suffix('.json')}, .md, .png")
    return report


if __name__ == "__main__":
    main()
