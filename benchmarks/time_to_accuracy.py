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

It also runs the *fixed-total oracle*: balanced Cannikin with the total batch pinned from the start at each of several
totals (``--fixed-totals``, default B0 x 1.5^k up to 8 B0: 96, 144, 216, 324, 486, 729 at B0 = 96), each with AdaScale
from the same B0 and the noise measured on every step, as the adaptive run's, so that its learning rate
follows the noise scale as the adaptive run's would at that total. The best of them is the best a total chosen once,
before training, could do; the issue's gate is Cannikin's median time at most ``GATE`` times that best fixed total's.
Every repeat runs every configuration once, the sweep's too, in the same order, so machine drift hits all alike.

Scenarios (``--scenario``):

- ``fashion-mnist`` (default): the devices above, the CNN of ``examples/data.py``, to 89%.
- ``gpu-mix``: measured GPU costs and WordNet glosses (``benchmarks/gpu_mix.py``), to 52%.
- ``fixed-cost``: the devices above (a large fixed cost per step, 20 ms, beside per-sample costs of 1:2:4), a
  Fashion-MNIST MLP (784-256-128-10), to 85%: a larger total pays where the noise scale allows it.
- ``per-sample``: no fixed cost, per-sample costs of 1:2:4 (``PER_SAMPLE_ONLY_MS``), the same MLP, to 85%. Balanced,
  every rank of a step ends together, so a step at total ``B`` lasts ``B / sum(1 / per_sample)``: the emulated
  throughput is the same at every total (up to the split's integer rounding, under 2% from 96 to 768), and a larger
  total changes nothing but the statistical efficiency, which only falls with ``B``. B0 is the best fixed total by
  construction (goodput = throughput x efficiency). The per-sample costs (1, 2, 4 ms: a 56 ms step at B0) are set
  large enough that this machine's own cost per step stays a small share of it (measured: about 10 ms a step at B0
  on two shared cores, the loop, the all-reduce, the real compute), since it acts as a fixed cost that larger totals
  amortise: it makes 2 x B0 about 9% faster a sample, which pays only at a noise scale near 1,000 (the MLP's was
  20-120 along the first 46,000 samples here, and ``gpu_mix.survey`` found it below 2 x B0 for most of a run).
- ``transformer``: the devices above with a 10 ms fixed cost (Lightning's demo Transformer's emulation), a small
  causal LM on synthetic text (``benchmarks/causal_lm.py``: 6,000 blocks of 32 tokens; Adam at 0.003; the gain is
  AdaScale's square root), to 70% next-token accuracy on held-out text: each step is mostly per-sample work, so a
  larger total pays little.

The fixed-total oracle's runs at large totals pay balanced Cannikin's warm-up at that total: the first ~16 steps at
an even split, while the speeds are measured (1 s a step at 768 on the per-sample devices).

    python benchmarks/time_to_accuracy.py [--scenario fixed-cost] [--repeats 3] [--target 0.85]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn

from benchmarks.harness import median, run
from examples.data import fashion_mnist_available, load_dataset
from lightning_cannikin import Cannikin, CannikinSettings
from lightning_cannikin.core.goodput import candidate_batch_sizes, goodput
from lightning_cannikin.core.noise_scale import t_quantile
from lightning_cannikin.core.optperf import optperf, step_time
from lightning_cannikin.core.plan import even_split
from lightning_cannikin.tools.report import plot_or_skip

PER_SAMPLE_MS = [0.5, 1.0, 2.0]
PER_SAMPLE_ONLY_MS = [1.0, 2.0, 4.0]  # per-sample: 1:2:4 and no fixed cost
# the oracle's default totals: a ladder from B0 in steps of this factor, up to this many B0 (a sweep of doublings
# missed a best between its rungs: on gpu-mix fixed 768 beat 384 in 2 of 3 repeats)
FIXED_TOTAL_STEP, FIXED_TOTAL_REACH = 1.5, 8
GATE = 1.05  # the gate: Cannikin's median time over the best fixed total's
SCENARIOS = ("fashion-mnist", "gpu-mix", "fixed-cost", "per-sample", "transformer")
# the small models: 10 epochs at most, and no balance-only run by default
SMALL_MODEL_SCENARIOS = ("fixed-cost", "per-sample", "transformer")
RESULTS = Path(__file__).parent / "results"


class MLPClassifier(pl.LightningModule):
    """A 784-256-128-10 MLP (``gpu_mix.survey``'s Fashion-MNIST candidate), SGD with momentum at a constant LR.

    Args:
        image_shape: the input images' shape (flattened in).
        lr: the learning rate tuned for the base batch.
        num_classes: output classes.

    """

    def __init__(self, image_shape: tuple[int, ...] = (1, 28, 28), lr: float = 0.05, num_classes: int = 10) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(int(np.prod(image_shape)), 256),
            nn.ReLU(),
            nn.Linear(256, 128),
            nn.ReLU(),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


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

    measured = noise_by_progress(runs)
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
# where the oracle's B0 run is balance-only with AdaScale (a gain of 1 at B0), balance-only is left out by default
SMALL_MODEL_NAMES = ("ddp", "adaptive-even", "cannikin")


def fixed_name(total: int) -> str:
    """The run name of the oracle's run pinned at ``total``."""
    return f"fixed-{total}"


def fixed_total_of(name: str) -> int | None:
    """The pinned total of an oracle run's name (``None``: not one)."""
    return int(name.removeprefix("fixed-")) if name.startswith("fixed-") else None


def fixed_totals(spec: str | None, base_batch: int, world_size: int) -> list[int]:
    """The oracle's totals from ``--fixed-totals`` (comma-separated; ``None``: B0 x 1.5^k up to 8 B0, each rounded
    down to a multiple of the ranks; ``"none"``: no sweep).

    Raises:
        ValueError: a total that the ranks cannot share evenly (the DataLoader's batch is ``total / world_size``).

    """
    if spec is None:
        rungs = int(np.log(FIXED_TOTAL_REACH) / np.log(FIXED_TOTAL_STEP) + 1e-9) + 1
        ladder = (int(base_batch * FIXED_TOTAL_STEP**k) // world_size * world_size for k in range(rungs))
        return sorted(set(ladder))
    if spec.strip().lower() in ("", "none"):
        return []
    totals = [int(part) for part in spec.split(",") if part.strip()]
    wrong = [t for t in totals if t < world_size or t % world_size]
    if wrong:
        raise ValueError(f"fixed totals {wrong} are not positive multiples of the {world_size} ranks")
    return sorted(set(totals))


def configure(name: str, max_batch_size: int, base_batch_size: int | None = None) -> tuple[str, list]:
    """The strategy and callbacks of a run; ``base_batch_size`` (B0) is the oracle runs' AdaScale base."""
    if name == "ddp":
        return "ddp_fork", []
    if fixed_total_of(name) is not None:
        # The total is the DataLoader's batch x world size. max_batch_size=None keeps it: no total is ever
        # reconsidered. (A cap of T with a base of B0 would not pin it: the policy's candidates run from B0 to the
        # cap, so the upper noise bound could shrink it.) base_batch_size=B0 still measures the noise scale and gives
        # the AdaScale gain of T over B0, the LR the adaptive run would take at T (less the floor of a grown total's
        # band, which only a total the policy chose has). With no total to decide, the engine measures the noise on
        # one step in noise_every_n_steps from the start, so the gain would wait about 8 x 10 steps (61,000
        # samples at 768, all at B0's LR); measuring every step gives it after about as many steps as the adaptive
        # run's bounds take (a few hundred microseconds of host time a step).
        settings = CannikinSettings(noise_every_n_steps=1)
        return "cannikin_fork", [Cannikin(lr_scaling="adascale", base_batch_size=base_batch_size, settings=settings)]
    if name == "balance-only":
        return "cannikin_fork", [Cannikin()]  # the total batch stays B0
    balance = name == "cannikin"
    return "cannikin_fork", [Cannikin(max_batch_size=max_batch_size, balance=balance, lr_scaling="adascale")]


def emulated_throughput(per_sample_ms: list, fixed_ms: list, totals: list[int]) -> list[float]:
    """Samples per second of a balanced (OptPerf) step at each total on the emulated devices alone."""
    times = optperf(np.asarray(per_sample_ms) / 1000, np.asarray(fixed_ms) / 1000, totals)
    return [float(t / s) for t, s in zip(totals, times, strict=True)]


def paired_ratio(mine: list[float | None], theirs: list[float | None], level: float = 0.90) -> dict | None:
    """The geometric mean of the per-repeat ratios ``mine[r] / theirs[r]`` (repeat ``r`` gives both runs the same seed:
    the same data order and initial weights) with its ``level`` interval, a Student-t interval on the log ratios;
    ``None`` where some repeat missed the target, or with fewer than two repeats."""
    pairs = [(a, b) for a, b in zip(mine, theirs, strict=True) if a is not None and b is not None]
    if len(pairs) < 2 or len(pairs) < len(mine):
        return None
    logs = np.log([a / b for a, b in pairs])
    centre, spread = float(logs.mean()), float(logs.std(ddof=1)) / np.sqrt(len(logs))
    width = t_quantile((1.0 - level) / 2.0, len(logs) - 1.0) * spread
    return {
        "geometric_mean": float(np.exp(centre)),
        "low": float(np.exp(centre - width)),
        "high": float(np.exp(centre + width)),
        "level": level,
        "repeats": len(pairs),
        "per_repeat": [a / b for a, b in pairs],
    }


def goodput_share(
    curve: list[dict], reference: list[tuple[float, float]], totals: np.ndarray, times: np.ndarray, base: int
) -> float | None:
    """The mean, over a run's steps, of its total's goodput over the best total's, both at the noise scale of a
    ``reference`` run (``(samples, noise scale)`` pairs, measured every step) nearest the same progress in samples, on
    the step times ``times`` of ``totals`` (the emulated devices' balanced steps). Each evaluation interval of
    ``curve`` counts for the steps it held (its samples over the total recorded at its end). ``None`` without
    reference points."""
    if not reference:
        return None
    ref_samples = np.array([s for s, _ in reference])
    ref_phi = np.array([phi for _, phi in reference])
    weight = share = 0.0
    done = 0
    for point in curve:
        total, samples = int(point["total_batch_size"]), int(point["samples"])
        steps, middle = (samples - done) / total, (samples + done) / 2.0
        done = samples
        if steps <= 0:
            continue
        phi = float(ref_phi[int(np.argmin(np.abs(ref_samples - middle)))])  # the reference nearest the interval
        time = float(np.interp(total, totals, times))
        share += steps * float(goodput(total, time, phi, base) / np.max(goodput(totals, times, phi, base)))
        weight += steps
    return share / weight if weight else None


def oracle(
    runs: dict[str, list[dict]], totals: list[int], cannikin_time: float | None, throughput: list[float]
) -> dict:
    """The fixed-total sweep: each total's median time and samples to target, the best total, Cannikin's ratio to it.

    A total that missed the target in some repeat has no median and cannot be the best.
    """
    sweep = []
    for total, rate in zip(totals, throughput, strict=True):
        results = runs.get(fixed_name(total), [])
        times = [r["time_to_target"] for r in results]
        samples = [r["samples_to_target"] for r in results]
        reached = bool(results) and all(t is not None for t in times)
        sweep.append(
            {
                "total": total,
                "median_time_to_target_s": median(times) if reached else None,
                "median_samples_to_target": median(samples) if reached else None,
                "time_to_target_s": times,
                "samples_to_target": samples,
                "emulated_samples_per_s": rate,
            }
        )
    timed = [entry for entry in sweep if entry["median_time_to_target_s"] is not None]
    best = min(timed, key=lambda entry: entry["median_time_to_target_s"]) if timed else None
    ratio = cannikin_time / best["median_time_to_target_s"] if best is not None and cannikin_time else None
    mine = [r["time_to_target"] for r in runs.get("cannikin", [])]
    paired = None if best is None or not mine else paired_ratio(mine, best["time_to_target_s"])
    return {
        "sweep": sweep,
        "best_fixed_total": None if best is None else best["total"],
        "best_fixed_time_s": None if best is None else best["median_time_to_target_s"],
        "cannikin_vs_best_fixed": ratio,
        "cannikin_vs_best_fixed_paired": paired,
        "gate": GATE,
        "within_gate": None if ratio is None else ratio <= GATE,
    }


def noise_by_progress(results: list[dict]) -> list[tuple[float, float]]:
    """``(samples, noise scale)``: the noise scale each evaluation of ``results`` recorded, by samples seen, pooled
    over the repeats (the median at each thousand samples)."""
    points: dict[int, list[float]] = {}
    for result in results:
        for point in result["curve"]:
            if point.get("noise_scale") is not None:
                points.setdefault(point["samples"] // 1000, []).append(point["noise_scale"])
    return [(1000.0 * key, float(np.median(points[key]))) for key in sorted(points)]


def reference_noise(runs: dict[str, list[dict]], base_batch: int) -> tuple[str, list[tuple[float, float]]]:
    """The noise scale by progress that goodput shares are taken at: the fixed-B0 run's (it measures every step and
    its total never moves), else Cannikin's own."""
    name = fixed_name(base_batch) if runs.get(fixed_name(base_batch)) else "cannikin"
    return name, noise_by_progress(runs.get(name, []))


def plot(runs: dict[str, list[dict]], path: Path, base_batch: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(7, 10), sharex=True)
    colours = dict(zip(runs, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for name, results in runs.items():
        curve, colour = results[0]["curve"], colours[name]
        times = [p["time"] for p in curve]
        # the adaptive runs start at B0; the curve's points are its evaluations (the first after 5,000 samples)
        totals = [p["total_batch_size"] for p in curve]
        start = fixed_total_of(name) or base_batch  # the oracle's runs start (and stay) at their total
        axes[0].step([0.0, *times], [start, *totals], where="post", color=colour, label=name)
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


def oracle_rows(fixed_oracle: dict, base_batch: int) -> list[str]:
    """The markdown lines of the fixed-total oracle: one row per pinned total, then the best and the gate."""
    rows = [
        "",
        f"## Fixed-total oracle (balanced, AdaScale from B0 = {base_batch}, the total pinned from the start)",
        "",
        "| fixed total | median time to target (s) | per-repeat (s) | median samples to target | emulated samples/s |",
        "|---:|---:|---|---:|---:|",
    ]
    for entry in fixed_oracle["sweep"]:
        time, samples = entry["median_time_to_target_s"], entry["median_samples_to_target"]
        per = ", ".join("n/a" if t is None else f"{t:.1f}" for t in entry["time_to_target_s"])
        rows.append(
            f"| {entry['total']} | {'n/a' if time is None else f'{time:.1f}'} | {per} |"
            f" {'n/a' if samples is None else f'{samples:.0f}'} | {entry['emulated_samples_per_s']:.0f} |"
        )
    best, ratio = fixed_oracle["best_fixed_total"], fixed_oracle["cannikin_vs_best_fixed"]
    rows.append("")
    if best is None:
        rows.append("- best fixed total: none reached the target in every repeat")
    else:
        rows.append(f"- best fixed total: {best} ({fixed_oracle['best_fixed_time_s']:.1f} s)")
    verdict = "" if ratio is None else (" (within" if ratio <= GATE else " (over") + f" the {GATE:.2f}x gate)"
    rows.append(f"- cannikin_vs_best_fixed: {'n/a' if ratio is None else f'{ratio:.2f}x the time'}{verdict}")
    paired = fixed_oracle.get("cannikin_vs_best_fixed_paired")
    if paired is not None:
        per = ", ".join(f"{v:.2f}" for v in paired["per_repeat"])
        rows.append(
            f"- paired over {paired['repeats']} repeats (same seed per repeat): geometric mean"
            f" {paired['geometric_mean']:.2f}x, {paired['level']:.0%} interval {paired['low']:.2f}-{paired['high']:.2f}"
            f" ({per})"
        )
    return rows


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
    if args.scenario == "transformer":
        from benchmarks.causal_lm import VOCAB, CausalLM, second_order_text

        per_sample = [float(ms) for ms in args.per_sample_ms.split(",")] if args.per_sample_ms else PER_SAMPLE_MS
        lr = args.lr or 0.003
        train = second_order_text(args.train_samples or 6000, seed=0)
        return {
            "per_sample_ms": per_sample,
            "fixed_ms": [args.fixed_ms if args.fixed_ms is not None else 10.0] * len(per_sample),
            "devices": " : ".join(f"{ms / min(per_sample):g}x" for ms in per_sample),
            "task": (train, second_order_text(500, seed=1), lambda: CausalLM(lr=lr), VOCAB),
            "model": "causal LM, 2 layers of width 64, 32 positions, Adam",
            "lr": lr,
            "data": "second-order chain",
            "target": args.target or 0.70,
            "out": args.out or RESULTS / "time_to_accuracy_transformer",
        }
    per_sample_only = args.scenario == "per-sample"
    per_sample = (
        [float(ms) for ms in args.per_sample_ms.split(",")]
        if args.per_sample_ms
        else (PER_SAMPLE_ONLY_MS if per_sample_only else PER_SAMPLE_MS)
    )
    fixed_ms = args.fixed_ms if args.fixed_ms is not None else (0.0 if per_sample_only else 20.0)
    options = {
        "per_sample_ms": per_sample,
        "fixed_ms": [fixed_ms] * len(per_sample),
        "devices": " : ".join(f"{ms / min(per_sample):g}x" for ms in per_sample),
        "task": None,
        "lr": args.lr or 0.05,  # the MLP's too: 0.1 took 125,000-165,000 samples to 85% at B0, 0.05 85,000-105,000
        "data": args.data,
        "target": args.target or (0.89 if args.data == "fashion-mnist" else 0.95),
        "out": args.out or RESULTS / "time_to_accuracy",
    }
    if args.scenario in ("fixed-cost", "per-sample"):
        train, test, shape = load_dataset(args.data)
        lr = options["lr"]
        options |= {
            "task": (train, test, lambda: MLPClassifier(shape, lr=lr), 10),
            "model": f"MLP {int(np.prod(shape))}-256-128-10",
            "target": args.target or (0.85 if args.data == "fashion-mnist" else 0.95),
            "out": args.out or RESULTS / f"time_to_accuracy_{args.scenario.replace('-', '_')}",
        }
    return options


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=SCENARIOS, default="fashion-mnist")
    parser.add_argument("--data", default="fashion-mnist" if fashion_mnist_available() else "digits")
    parser.add_argument("--train-samples", type=int, default=None, help="a subset of the training set (default: all)")
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        help="default: 0.89 Fashion-MNIST, 0.52 gpu-mix, 0.85 the MLPs, 0.70 transformer",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="initial per-device batch (B0 = 3x)")
    parser.add_argument("--max-batch-size", type=int, default=None, help="default: 1024 Fashion-MNIST, 4096 gpu-mix")
    parser.add_argument(
        "--max-epochs", type=int, default=None, help="default: 30 Fashion-MNIST, 3 gpu-mix, 10 the MLPs and transformer"
    )
    parser.add_argument("--eval-every", type=int, default=5000, help="evaluate every this many training samples")
    parser.add_argument("--lr", type=float, default=None, help="default: 0.05, 1.5 gpu-mix, 0.003 transformer")
    parser.add_argument(
        "--fixed-ms", type=float, default=None, help="fixed cost per step (default: 20, per-sample 0; not gpu-mix)"
    )
    parser.add_argument(
        "--per-sample-ms",
        default=None,
        help="comma-separated ms a sample per rank (default: 0.5,1,2; per-sample 1,2,4)",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="gpu-mix: the common factor on the GPUs' costs")
    parser.add_argument("--horizon-epochs", type=float, default=2.0, help="gpu-mix: cosine decay length, B0-epochs")
    parser.add_argument(
        "--runs",
        default=None,
        help=f"which runs, comma-separated (default: {','.join(NAMES)}; the small models no balance-only)",
    )
    parser.add_argument(
        "--fixed-totals",
        default=None,
        help="the oracle's pinned totals, comma-separated multiples of the ranks (default: B0 x 1,2,4,8; none)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    gpu_mix, small = args.scenario == "gpu-mix", args.scenario in SMALL_MODEL_SCENARIOS
    max_batch = args.max_batch_size or (4096 if gpu_mix else 1024)
    max_epochs = args.max_epochs or (3 if gpu_mix else 10 if small else 30)
    options = scenario_options(args)
    target, out = options["target"], options["out"]
    world_size = len(options["per_sample_ms"])
    base_batch = args.batch_size * world_size
    totals = fixed_totals(args.fixed_totals, base_batch, world_size)
    chosen = (args.runs or ",".join(SMALL_MODEL_NAMES if small else NAMES)).split(",")
    names = (*(n for n in NAMES if n in chosen), *(fixed_name(t) for t in totals))
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names:  # interleaved: every repeat runs each configuration once, in the same order
            strategy, callbacks = configure(name, max_batch, base_batch)
            pinned = fixed_total_of(name)
            result = run(
                strategy,
                options["per_sample_ms"],
                options["fixed_ms"],
                args.batch_size if pinned is None else pinned // world_size,
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

    throughput = emulated_throughput(options["per_sample_ms"], options["fixed_ms"], totals)
    fixed_oracle = oracle(runs, totals, summary.get("cannikin"), throughput) if totals else None
    ratios = {
        "cannikin_vs_ddp": ratio("ddp"),
        "cannikin_vs_adaptive_even": ratio("adaptive-even"),
        "cannikin_vs_balance_only": ratio("balance-only"),
    }
    if fixed_oracle is not None:
        ratios["cannikin_vs_best_fixed"] = fixed_oracle["cannikin_vs_best_fixed"]
    reference_name, reference = reference_noise(runs, base_batch)
    candidates = candidate_batch_sizes(base_batch, max_batch)
    balanced = optperf(np.asarray(options["per_sample_ms"]) / 1000, np.asarray(options["fixed_ms"]) / 1000, candidates)
    shares = {
        name: [goodput_share(r["curve"], reference, candidates, balanced, base_batch) for r in runs[name]]
        for name in names
        if name == "cannikin" or fixed_total_of(name) is not None
    }
    ddp_samples = med("ddp", "samples_to_target")
    bound = (
        emulated_bound(
            runs.get("cannikin", []), ddp_samples, base_batch, max_batch, options["per_sample_ms"], options["fixed_ms"]
        )
        if ddp_samples and runs.get("cannikin")
        else None
    )
    of_bound = {
        key: bound[key] / value for key, value in ratios.items() if bound is not None and key in bound and value
    }  # measured speedup over the bound's speedup
    report = {
        "scenario": args.scenario,
        "data": options["data"],
        "model": options.get("model"),
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
        "fixed_total_oracle": fixed_oracle,
        "goodput_share": {"reference_run": reference_name, "per_repeat": shares},
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
        ideal = "" if bound is None or key not in bound else f" (emulated bound {bound[key]:.2f}x)"
        rows.append(f"- {key}: {'n/a' if value is None else f'{value:.2f}x the time'}{ideal}")
    if of_bound:
        rows.append("")
        rows.append("Measured speedup as a share of the bound's (bound ratio / measured ratio):")
        rows.extend(f"- {key}: {value:.0%}" for key, value in of_bound.items())
    if fixed_oracle is not None:
        rows.extend(oracle_rows(fixed_oracle, base_batch))
    rows.extend(["", f"Goodput share (mean over steps, at {reference_name}'s noise scale by progress):"])
    for name, values in shares.items():
        known = [v for v in values if v is not None]
        text = ", ".join("n/a" if v is None else f"{v:.3f}" for v in values)
        rows.append(f"- {name}: median {np.median(known):.3f} ({text})" if known else f"- {name}: n/a")
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
