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
from lightning_cannikin.tools.report import plot_or_skip

PER_SAMPLE_MS = [0.5, 1.0, 2.0]
RESULTS = Path(__file__).parent / "results"


def time_to_target(result: dict, target: float) -> float | None:
    for point in result["curve"]:
        if point["accuracy"] >= target:
            return point["time"]
    return None


def samples_to_target(result: dict, target: float) -> int | None:
    for point in result["curve"]:
        if point["accuracy"] >= target:
            return point["samples"]
    return None


def emulated_bound(
    runs: list[dict], ddp_samples: float, base_batch: int, max_batch: int, per_sample_ms: list, fixed_ms: list
) -> dict[str, float]:
    """Ideal time ratios from the emulated costs and the noise scale measured along Cannikin's runs.

    Progress is counted in samples at B0 (what DDP needed to reach the target, ``ddp_samples``). Each stretch of
    progress costs ``samples / goodput`` at the best total batch for the noise scale last measured before it (none
    before the first: B0 is best): OptPerf splits for Cannikin, even splits for the adaptive baseline, B0 at its OptPerf
    split for balance-only, B0 evenly for DDP.
    """
    slopes, offsets = np.asarray(per_sample_ms) / 1000, np.asarray(fixed_ms) / 1000
    n = len(slopes)
    candidates = candidate_batch_sizes(base_batch, max_batch)
    balanced = optperf(slopes, offsets, candidates)
    even = np.array([step_time(slopes, offsets, even_split(int(b), n)) for b in candidates])
    ddp_rate = base_batch / step_time(slopes, offsets, even_split(base_batch, n))
    balance_only_rate = base_batch / float(balanced[0])  # candidates[0] is B0

    def best(times: np.ndarray, phi: float | None) -> float:
        return float(np.max(goodput(candidates, times, phi, base_batch)))

    # the noise scale at each evaluation, by samples seen, pooled over Cannikin's repeats (median per grid point)
    points: dict[int, list[float]] = {}
    for result in runs:
        for point in result["curve"]:
            if point.get("noise_scale") is not None:
                points.setdefault(point["samples"] // 1000, []).append(point["noise_scale"])
    measured = [(1000.0 * key, float(np.median(points[key]))) for key in sorted(points)]
    seconds = dict.fromkeys(("adaptive_even", "balance_only", "cannikin"), 0.0)
    phi, done = None, 0.0
    for end, next_phi in [*[m for m in measured if m[0] < ddp_samples], (ddp_samples, None)]:
        stretch, done = end - done, end
        seconds["balance_only"] += stretch / balance_only_rate
        seconds["adaptive_even"] += stretch / best(even, phi)
        seconds["cannikin"] += stretch / best(balanced, phi)
        phi = next_phi
    return {
        "cannikin_vs_ddp": seconds["cannikin"] / (ddp_samples / ddp_rate),
        "cannikin_vs_adaptive_even": seconds["cannikin"] / seconds["adaptive_even"],
        "cannikin_vs_balance_only": seconds["cannikin"] / seconds["balance_only"],
    }


NAMES = ("ddp", "adaptive-even", "balance-only", "cannikin")


def configure(name: str, max_batch_size: int) -> tuple[str, list]:
    if name == "ddp":
        return "ddp_fork", []
    if name == "balance-only":
        return "cannikin_fork", [Cannikin()]  # the total batch stays B0
    balance = name == "cannikin"
    return "cannikin_fork", [Cannikin(max_batch_size=max_batch_size, balance=balance, lr_scaling="adascale")]


def plot(runs: dict[str, list[dict]], path: Path, base_batch: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(7, 10), sharex=True)
    colours = dict(zip(runs, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for name, results in runs.items():
        curve, colour = results[0]["curve"], colours[name]
        times = [p["time"] for p in curve]
        # every run starts at B0; the curve's points are its evaluations (the first after 5,000 samples)
        totals = [p["total_batch_size"] for p in curve]
        axes[0].step([0.0, *times], [base_batch, *totals], where="post", color=colour, label=name)
        lrs = [p["lr_factor"] * p.get("scheduled_lr", 1.0) for p in curve]
        axes[1].step(times, lrs, where="post", color=colour, label=name)
        measured = [(p["time"], p["noise_scale"]) for p in curve if p.get("noise_scale") is not None]
        if measured:
            axes[2].plot(*zip(*measured, strict=True), marker=".", color=colour, label=name)
        axes[3].plot(times, [p["accuracy"] for p in curve], marker="o", color=colour, label=name)
    axes[0].set_ylabel("total batch size")
    axes[1].set_ylabel("LR (schedule x factor)" if "scheduled_lr" in curve[0] else "LR factor")
    axes[2].axhline(base_batch, color="grey", linestyle=":", label="B0")
    axes[2].set_ylabel("noise scale (samples)")
    axes[2].legend()
    axes[3].set_ylabel("test accuracy")
    axes[3].set_xlabel("training time (s, evaluation excluded), first repeat")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def scenario_options(args: argparse.Namespace) -> dict:
    """The devices and the task of the chosen scenario."""
    if args.scenario == "gpu-mix":
        from benchmarks.gpu_mix import NUM_CLASSES, GlossClassifier, gpu_costs, load_wordnet

        per_sample, fixed, devices = gpu_costs(args.scale)
        train, test = load_wordnet()
        horizon = args.horizon_epochs * len(train) / (args.batch_size * len(per_sample))
        lr = args.lr or 1.5
        task = (train, test, lambda: GlossClassifier(lr=lr, horizon=horizon), NUM_CLASSES)
        return {
            "per_sample_ms": per_sample,
            "fixed_ms": fixed,
            "devices": devices,
            "task": task,
            "lr": lr,
            "data": "wordnet",
            "target": args.target or 0.52,
            "out": args.out or RESULTS / "time_to_accuracy_gpu_mix",
            "cosine_horizon_b0_steps": horizon,
        }
    fixed = [args.fixed_ms] * len(PER_SAMPLE_MS)
    return {
        "per_sample_ms": PER_SAMPLE_MS,
        "fixed_ms": fixed,
        "devices": "1x : 2x : 4x",
        "task": None,
        "lr": args.lr or 0.05,
        "data": args.data,
        "target": args.target or (0.89 if args.data == "fashion-mnist" else 0.95),
        "out": args.out or RESULTS / "time_to_accuracy",
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=("fashion-mnist", "gpu-mix"), default="fashion-mnist")
    parser.add_argument("--data", default="fashion-mnist" if fashion_mnist_available() else "digits")
    parser.add_argument("--train-samples", type=int, default=None, help="a subset of the training set (default: all)")
    parser.add_argument("--target", type=float, default=None, help="default: 0.89 Fashion-MNIST, 0.52 gpu-mix")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="initial per-device batch (B0 = 3x)")
    parser.add_argument("--max-batch-size", type=int, default=None, help="default: 1024 Fashion-MNIST, 4096 gpu-mix")
    parser.add_argument("--max-epochs", type=int, default=None, help="default: 30 Fashion-MNIST, 3 gpu-mix")
    parser.add_argument("--eval-every", type=int, default=5000, help="evaluate every this many training samples")
    parser.add_argument("--lr", type=float, default=None, help="default: 0.05 Fashion-MNIST, 1.5 gpu-mix")
    parser.add_argument("--fixed-ms", type=float, default=20.0, help="Fashion-MNIST's fixed cost per step")
    parser.add_argument("--scale", type=float, default=1.0, help="gpu-mix: the common factor on the GPUs' costs")
    parser.add_argument("--horizon-epochs", type=float, default=2.0, help="gpu-mix: cosine decay length, B0-epochs")
    parser.add_argument("--runs", default=",".join(NAMES), help="which runs, comma-separated")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    gpu_mix = args.scenario == "gpu-mix"
    max_batch = args.max_batch_size or (4096 if gpu_mix else 1024)
    max_epochs = args.max_epochs or (3 if gpu_mix else 30)
    options = scenario_options(args)
    target, out = options["target"], options["out"]
    names = tuple(n for n in NAMES if n in args.runs.split(","))
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names:  # interleaved: every repeat runs each configuration once, in the same order
            strategy, callbacks = configure(name, max_batch)
            result = run(
                strategy,
                options["per_sample_ms"],
                options["fixed_ms"],
                args.batch_size,
                max_epochs,
                data=options["data"],
                callbacks=callbacks,
                lr=options["lr"],
                seed=repeat,
                target_accuracy=target,
                train_samples=args.train_samples,
                eval_every_samples=args.eval_every,
                task=options["task"],
            )
            result["time_to_target"] = time_to_target(result, target)
            result["samples_to_target"] = samples_to_target(result, target)
            runs[name].append(result)
            reached = result["time_to_target"]
            print(
                f"repeat {repeat} {name:14s} time to {target:.2f}: "
                f"{'not reached' if reached is None else f'{reached:.1f} s'}"
                f" after {result['curve'][-1]['samples']} samples,"
                f" final total batch {result['curve'][-1]['total_batch_size']}",
                flush=True,
            )

    def med(name: str, key: str = "time_to_target") -> float | None:
        values = [r[key] for r in runs.get(name, [])]
        return median(values) if values and all(v is not None for v in values) else None

    summary = {name: med(name) for name in names}

    def ratio(other: str) -> float | None:
        mine, theirs = summary.get("cannikin"), summary.get(other)
        return mine / theirs if mine and theirs else None

    ratios = {
        "cannikin_vs_ddp": ratio("ddp"),
        "cannikin_vs_adaptive_even": ratio("adaptive-even"),
        "cannikin_vs_balance_only": ratio("balance-only"),
    }
    base_batch = args.batch_size * len(options["per_sample_ms"])
    ddp_samples = med("ddp", "samples_to_target")
    bound = (
        emulated_bound(
            runs.get("cannikin", []), ddp_samples, base_batch, max_batch, options["per_sample_ms"], options["fixed_ms"]
        )
        if ddp_samples and runs.get("cannikin")
        else None
    )
    of_bound = {
        key: bound[key] / value for key, value in ratios.items() if bound is not None and value is not None
    }  # measured speedup over the bound's speedup
    report = {
        "scenario": args.scenario,
        "data": options["data"],
        "devices": options["devices"],
        "train_samples": args.train_samples,
        "target_accuracy": target,
        "per_sample_ms": options["per_sample_ms"],
        "fixed_ms": options["fixed_ms"],
        "initial_total_batch": base_batch,
        "max_batch_size": max_batch,
        "lr": options["lr"],
        "cosine_horizon_b0_steps": options.get("cosine_horizon_b0_steps"),
        "median_time_to_target_s": summary,
        "median_samples_to_target": {name: med(name, "samples_to_target") for name in names},
        "ratios": ratios,
        "bound": bound,
        "measured_speedup_over_bound_speedup": of_bound,
        "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    rows = [
        "| run | median time to target (s) | per-repeat (s) | median samples to target | final total batch (1st) |",
        "|---|---:|---|---:|---:|",
    ]
    for name in names:
        per = ", ".join("n/a" if r["time_to_target"] is None else f"{r['time_to_target']:.1f}" for r in runs[name])
        value = "n/a" if summary[name] is None else f"{summary[name]:.1f}"
        samples = report["median_samples_to_target"][name]
        rows.append(
            f"| {name} | {value} | {per} | {'n/a' if samples is None else f'{samples:.0f}'} |"
            f" {runs[name][0]['curve'][-1]['total_batch_size']} |"
        )
    rows.append("")
    for key, value in ratios.items():
        ideal = "" if bound is None else f" (emulated bound {bound[key]:.2f}x)"
        rows.append(f"- {key}: {'n/a' if value is None else f'{value:.2f}x the time'}{ideal}")
    if of_bound:
        rows.append("")
        rows.append("Measured speedup as a share of the bound's (bound ratio / measured ratio):")
        rows.extend(f"- {key}: {value:.0%}" for key, value in of_bound.items())
    table = "\n".join(rows)
    subset = args.train_samples or "all"
    title = f"# Time to {target:.0%} test accuracy ({args.scenario}: {options['data']}, {subset} training samples)"
    out.with_suffix(".md").write_text(f"{title}\n\n{table}\n")
    figure = plot_or_skip(lambda path: plot(runs, path, base_batch), out.with_suffix(".png"))
    print(table)
    print(f"saved {out.with_suffix('.json')}, .md" + (", .png" if figure else ""))
    return report


if __name__ == "__main__":
    main()
