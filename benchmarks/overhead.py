"""What Cannikin costs per step where there is nothing to balance: zero emulated delay, side by side with Lightning DDP.

Three CPU ranks (``--ranks 2``: one per core of this two-core machine; gloo, fork launcher, one thread each) train
a 784-256-256-10 MLP with SGD on a fixed total batch of 96, the same model and data for every variant. The data are
random 28x28 "images" with random labels, generated from a seed: the per-step cost of the machinery does not depend
on what the pixels show (Fashion-MNIST, the issue's case, is not installed on the build machines). Variants, run
interleaved in every repeat so that a change in the machine's load hits all of them alike:

- ``ddp``: Lightning's ``DDPStrategy``, even split (the reference);
- ``cannikin``: ``strategy="cannikin"`` as a new user would write it (the callback is added, the total batch is
  fixed, the split is balanced on measured speed);
- ``cannikin_noise``: the same plus the gradient-noise statistics (``CannikinSettings(track_noise_scale=True)``), every
  step measured, through the Python comm hook;
- ``cannikin_noise_every4``: the statistics of one step in four (``noise_every_n_steps=4``; the total is fixed), the
  comm hook on every step;
- ``cannikin_adaptive``: the default adaptive configuration, ``Cannikin(max_batch_size=96)`` and nothing else (the
  default settings: the statistics of every step while the noise bounds may still move the total, one in eight
  once they cannot, the total reconsidered when the bounds prove a move); the cap is the starting total, so the
  machinery is measured and not a larger batch's throughput;
- ``cannikin_even``, ``cannikin_noise_even``: the same two with ``balance=False`` (timing, re-plans and statistics
  all run, the split stays even): the cost of the machinery alone, apart from the split the balancer picks;
- ``fixed``: ``CannikinStrategy(local_batch_sizes=[32, 32, 32])``, no callback: the loss carries ``n * b_i / B`` and
  DDP's own C++ all-reduce (a mean) gives the weighted mean, as in every run without noise statistics;
- ``fixed_hook``: the same through Cannikin's Python comm hook (what noise statistics and manual optimization use):
  the cost of a Python call per bucket, measured.

The figure is each variant's samples/s over the epochs after the first (warm-up, first re-plans) divided by DDP's in
the same repeat; the report gives the median ratio, every repeat's ratio, and each variant's median samples/s. On a
shared machine wall time moves with other people's load, so the report also gives the CPU time all ranks spent per
sample (``time.process_time``, every thread of every rank) over the same span, as a ratio to DDP's: the machinery's
own cost, less disturbed by the machine's load (gloo waits in the kernel, not spinning). Where ``fixed`` runs, each
variant's samples/s over the fixed split's in the same repeat is reported too: the engine's own cost.

    python benchmarks/overhead.py [--repeats 7] [--epochs 4] [--model deep] [--variants ...]
    python benchmarks/overhead.py --quick --variants cannikin_adaptive   # a few minutes, for diagnosing
    python benchmarks/overhead.py --quick --variants cannikin_adaptive --profile cannikin_adaptive
    python benchmarks/overhead.py --quick --variants cannikin_adaptive --set noise_every_n_steps=16
    python benchmarks/overhead.py --pool benchmarks/results/overhead.json

``--quick`` runs 3 repeats of 3 epochs and saves to the temporary folder; ``--profile VARIANT`` first runs that
variant once more with cProfile in rank 0 over the measured span (left out of the figures) and prints where its
CPU time goes (``--profile ddp`` for the reference); ``--set`` changes the default adaptive configuration's
:class:`CannikinSettings` (diagnosis only; the saved report names it).

Every median ratio comes with a bootstrap 95% interval over the repeats (:func:`median_interval`): on these shared
hosts a repeat's ratio moves by tens of percent, and a target inside the interval is neither met nor missed by the
run. ``--pool REPORT...`` runs nothing: it pools the per-repeat ratios of saved reports (runs of the same code) and
prints each variant's median and interval over all of them.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_cost import engine_alone
from lightning_cannikin import Cannikin, CannikinSettings, CannikinStrategy

WORLD_SIZE = 3  # the default: three ranks share this machine's two cores (``--ranks 2``: a core each)
VARIANTS = (
    "ddp",
    "cannikin",
    "cannikin_noise",
    "cannikin_noise_every4",
    "cannikin_adaptive",
    "cannikin_even",
    "cannikin_noise_even",
    "fixed",
    "fixed_hook",
)


class HookedStrategy(CannikinStrategy):
    """The weighted all-reduce through the Python comm hook even where DDP's own all-reduce would do."""

    def _comm_hook_needed(self) -> bool:
        return True


def strategy_and_callbacks(
    variant: str, total_batch: int, overrides: dict[str, Any] | None = None, world_size: int = WORLD_SIZE
) -> tuple[Any, list[Callback]]:
    even = [total_batch // world_size] * world_size
    if variant == "ddp":
        return "ddp_fork", []
    if variant == "fixed":
        return CannikinStrategy(local_batch_sizes=even, start_method="fork"), []
    if variant == "fixed_hook":
        return HookedStrategy(local_batch_sizes=even, start_method="fork"), []
    if variant == "cannikin":
        return "cannikin_fork", []  # as a new user writes it: the strategy adds its default callback
    if variant == "cannikin_adaptive":
        if overrides:  # diagnosis only (`--set`): the report names what was changed
            return "cannikin_fork", [Cannikin(max_batch_size=total_batch, settings=CannikinSettings(**overrides))]
        return "cannikin_fork", [Cannikin(max_batch_size=total_batch)]  # the default settings
    # every step measured unless the variant says otherwise
    every = 4 if variant.endswith("_every4") else 1
    settings = CannikinSettings(track_noise_scale="noise" in variant, noise_every_n_steps=every)
    return "cannikin_fork", [Cannikin(balance=not variant.endswith("_even"), settings=settings)]


class MLP(pl.LightningModule):
    """784-256-256-10 (6 parameter tensors, 1 MB); ``deep``: 784-128, 24 x 128-128, -10 (52 tensors, 2 MB), where
    whatever a measured step does per parameter shows."""

    def __init__(self, lr: float = 0.05, deep: bool = False) -> None:
        super().__init__()
        if deep:
            hidden = [layer for _ in range(24) for layer in (nn.Linear(128, 128), nn.ReLU())]
            self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), *hidden, nn.Linear(128, 10))
        else:
            self.net = nn.Sequential(
                nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
            )
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Clock(Callback):
    """Rank zero's wall clock at every epoch start and at the end of training, and the samples of every epoch.

    The measured span runs from an epoch's start to the end of training, so the work done at epoch ends (Cannikin's
    re-plans, whichever order the callbacks run in) is inside it for every variant.
    """

    def __init__(self, out: Path, profile_from: int | None = None) -> None:
        self.out = out
        self.profile_from = profile_from  # rank zero runs cProfile from this epoch's start on (None: never)
        self.profiler: cProfile.Profile | None = None
        self.starts: list[float] = []
        self.cpu_starts: list[float] = []
        self.thread_starts: list[float] = []  # this rank's main thread: its hooks and compute, not gloo's threads
        self.steps: list[int] = []
        self.samples: list[int] = []
        self.splits: list[list[int]] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and self.profile_from == trainer.current_epoch:
            self.profiler = cProfile.Profile(time.process_time)  # CPU time, as the figures count it
            self.profiler.enable()
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())
        self.thread_starts.append(time.thread_time())
        self.steps.append(0)
        self.samples.append(0)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        sizes = getattr(trainer.strategy, "step_sizes", None)
        self.samples[-1] += sum(sizes) if sizes else len(args[1][0]) * trainer.world_size
        self.steps[-1] += 1

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plan = getattr(trainer.strategy, "plan", None)
        self.splits.append(list(plan.local_batch_sizes) if plan is not None else [])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        end, cpu_end, thread_end = time.perf_counter(), time.process_time(), time.thread_time()
        if self.profiler is not None:
            self.profiler.disable()
            self.profiler.dump_stats(str(self.out / "profile.prof"))
        cpu = [cpu_end - start for start in self.cpu_starts]  # this rank's CPU seconds from each epoch's start on
        thread = [thread_end - start for start in self.thread_starts]
        (self.out / f"cpu{trainer.global_rank}.json").write_text(json.dumps({"process": cpu, "thread": thread}))
        if trainer.is_global_zero:
            engine = getattr(trainer.strategy, "engine", None)  # a Cannikin strategy's (DDP has none)
            # plans adopted (one per step)
            replans = len(engine.controller.history.entries) if engine is not None else 0
            result = {"starts": self.starts, "end": end, "samples": self.samples, "splits": self.splits}
            result["steps"] = self.steps
            result["replans"] = replans
            (self.out / "clock.json").write_text(json.dumps(result))


def run(
    variant: str,
    dataset: TensorDataset,
    total_batch: int,
    epochs: int,
    seed: int,
    deep: bool = False,
    overrides: dict[str, Any] | None = None,
    profile_from: int | None = None,
    world_size: int = WORLD_SIZE,
) -> dict[str, Any]:
    """One fit of ``variant`` on ``world_size`` ranks; rank zero's epoch times, samples and splits, every rank's CPU
    times, and rank zero's profile (``profile_from``: the epoch it starts at) as text."""
    torch.set_num_threads(1)
    pl.seed_everything(seed, verbose=False)
    strategy, callbacks = strategy_and_callbacks(variant, total_batch, overrides, world_size)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        trainer = pl.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=world_size,
            max_epochs=epochs,
            callbacks=[*callbacks, Clock(out, profile_from)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        loader = DataLoader(dataset, batch_size=total_batch // world_size, shuffle=True)
        trainer.fit(MLP(deep=deep), loader)
        result = json.loads((out / "clock.json").read_text())
        per_rank = [json.loads((out / f"cpu{rank}.json").read_text()) for rank in range(world_size)]
        result["cpu"] = [entry["process"] for entry in per_rank]
        result["thread_cpu"] = [entry["thread"] for entry in per_rank]
        if (out / "profile.prof").is_file():
            text = io.StringIO()
            stats = pstats.Stats(str(out / "profile.prof"), stream=text)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats("lightning_cannikin", 40)  # the package's own share
            result["profile"] = text.getvalue()
        return result


def steady_throughput(result: dict[str, Any], skip_epochs: int) -> float:
    """Samples per second from the start of epoch ``skip_epochs`` to the end of training."""
    return sum(result["samples"][skip_epochs:]) / (result["end"] - result["starts"][skip_epochs])


def cpu_per_sample(result: dict[str, Any], skip_epochs: int) -> float:
    """CPU seconds of all ranks together per sample, over the same span."""
    return sum(cpu[skip_epochs] for cpu in result["cpu"]) / sum(result["samples"][skip_epochs:])


def thread_cpu_per_rank_step(result: dict[str, Any], skip_epochs: int) -> float:
    """Main-thread CPU seconds per rank and step over the same span: the rank's own Python and compute (the hooks of
    the strategy and the engine included), without gloo's threads or time spent waiting."""
    threads = [cpu[skip_epochs] for cpu in result["thread_cpu"]]
    return sum(threads) / len(threads) / sum(result["steps"][skip_epochs:])


def median_interval(
    values: Sequence[float], level: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """A bootstrap percentile interval of the median of ``values``: the repeats resampled with replacement, with a
    fixed ``seed`` so that a report reads the same every time it is made."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        raise ValueError("`values` is empty: there are no repeats to take an interval over.")
    if not 0.0 < level < 1.0:
        raise ValueError(f"`level` must be in (0, 1), got {level}.")
    medians = np.median(np.random.default_rng(seed).choice(data, size=(resamples, data.size)), axis=1)
    tail = 50.0 * (1.0 - level)
    low, high = np.percentile(medians, [tail, 100.0 - tail])
    return float(low), float(high)


# the per-repeat ratios a report holds for each variant, and how ``--pool`` names them
_POOLED = {"ratios": "samples/s / ddp", "cpu_per_sample_ratios": "CPU per sample / ddp", "vs_fixed_ratios": "/ fixed"}


def pooled(reports: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every variant's per-repeat ratios to DDP (and to the fixed split, where run) over several saved reports, with
    their medians and 95% intervals."""
    ratios: dict[str, dict[str, list[float]]] = {}
    for report in reports:
        for key, value in report.items():
            if key.endswith("_vs_ddp"):
                entry = ratios.setdefault(key[: -len("_vs_ddp")], {})
                for name in _POOLED:
                    entry.setdefault(name, []).extend(value.get(name, []))
    return {
        variant: {
            name: {"repeats": len(values), "median": statistics.median(values), "ci95": median_interval(values)}
            for name, values in entry.items()
            if values  # the pairing with the fixed split exists only where it ran
        }
        for variant, entry in ratios.items()
    }


def markdown(report: dict[str, Any], variants: tuple[str, ...]) -> str:
    """The report as a self-explanatory table (``<out>.md`` beside the JSON)."""
    setup = report["setup"]
    load = setup["load_average"]
    lines = [
        f"# Per-step cost at zero emulated delay (`{setup['command']}`)",
        "",
        f"{setup['world_size']} ranks (fork launcher), fixed total batch {setup['total_batch_size']},"
        f" {setup['model']}; {setup['repeats']} interleaved repeats of {setup['epochs']} epochs"
        f" ({setup['samples_per_epoch']} samples each), the first {setup['skip_epochs']} left out; medians of the"
        " per-repeat ratios to Lightning DDP in the same repeat. CPU time per sample is every rank's"
        " `time.process_time` (all threads) over the measured span, summed over the ranks, divided by the samples:"
        " the work each variant does, which the machine's other load disturbs much less than the wall clock.",
        f"Machine: {setup['cpus']} CPUs; load average (1, 5, 15 min) {load['start']} at the start,"
        f" {load['end']} at the end; `cannikin_adaptive` settings: {setup['cannikin_adaptive_settings']}.",
        "",
        "| variant | CPU per sample / DDP | per repeat | samples/s / DDP | per repeat | samples/s / fixed, paired |"
        " re-plans (median) |",
        "|---|---:|---|---:|---|---:|---:|",
        f"| ddp ({report['cpu_us_per_sample_median']['ddp']:.0f} CPU-us/sample,"
        f" {report['samples_per_s_median']['ddp']:.0f} samples/s) | 1.000 | | 1.000 | | | 0 |",
    ]
    for variant in variants[1:]:
        r = report[f"{variant}_vs_ddp"]
        cpu_repeats = ", ".join(f"{x:.2f}" for x in r["cpu_per_sample_ratios"])
        wall_repeats = ", ".join(f"{x:.2f}" for x in r["ratios"])
        paired = f"{r['vs_fixed_median']:.3f} {_interval(r['vs_fixed_ci95'])}" if "vs_fixed_median" in r else ""
        wall = f"{r['median']:.3f} {_interval(r['ci95'])}"
        lines.append(
            f"| {variant} | {r['cpu_per_sample_median']:.3f} | {cpu_repeats} | {wall} | {wall_repeats}"
            f" | {paired} | {statistics.median(report['replans'][variant]):.0f} |"
        )
    if "engine_thread_cpu_us_per_rank_step" in report:
        engine = report["engine_thread_cpu_us_per_rank_step"]
        thread = report["thread_cpu_us_per_rank_step_median"]
        lines += [
            "",
            "The engine's own CPU per rank and step: each variant's main-thread CPU (`time.thread_time`: its hooks"
            " and compute, not gloo's threads) per rank and step, less the fixed split's in the same repeat, the median"
            f" over the repeats (the fixed split's own: {thread['fixed']:.0f} us): "
            + ", ".join(f"`{name}` {value:.0f} us" for name, value in engine.items())
            + ' (`default` is `strategy="cannikin"` alone).',
        ]
    if "engine_alone_thread_cpu_us_per_step" in report:
        alone = report["engine_alone_thread_cpu_us_per_step"]
        lines += [
            "",
            "The default engine alone on its thread (`benchmarks/engine_cost.py`: its step API over "
            f"{alone['steps_per_block']} steps of a {alone['ranks']}-rank emulated cluster, re-plans included, less the"
            f" fixed split's, interleaved blocks): {alone['default_over_fixed_us_median']:.1f} us per step (blocks "
            + ", ".join(f"{x:.0f}" for x in alone["default_over_fixed_us"])
            + ")."
            + (
                f" The ranks' vote, answered in-process there, costs {alone['vote_call_us']:.0f} us of a rank's thread"
                f" CPU to start on a gloo group of {alone['ranks']} ranks: "
                f"{alone['vote_call_us'] / alone['vote_every_n_steps']:.0f} us per step at one vote every"
                f" {alone['vote_every_n_steps']} steps."
                if "vote_call_us" in alone
                else ""
            ),
        ]
    lines += [
        "",
        f"Spread of DDP's own repeats (max - min over the median): {100 * report['ddp_spread']:.0f}% in samples/s,"
        f" {100 * report['ddp_cpu_spread']:.0f}% in CPU per sample. Where the wall-clock spread is far above 5%, the"
        " samples/s ratios cannot show a 5% difference; the CPU ratios are the figure to read then: at 0.95x DDP's"
        " throughput a variant may spend at most 1/0.95 = 1.053x DDP's CPU per sample. In brackets: a bootstrap 95%"
        " interval of the median ratio over these repeats; a target inside it is neither met nor missed by this run.",
        "",
        'Variants: `ddp` Lightning\'s DDPStrategy (the reference); `cannikin` `strategy="cannikin"` alone (balancing, '
        "fixed total); `cannikin_adaptive` `Cannikin(max_batch_size=<the total>)` with the default settings (noise "
        "statistics on every step while their bounds may move the total, one in eight once they cannot, local change "
        "checks compared every 4 steps; capped at the "
        "starting total so the machinery is measured, not a larger "
        "batch); `fixed` a fixed even split through Cannikin's strategy, no callback (a variant over it in the same"
        " repeat, paired: the engine's own cost). Re-plans: plans adopted per run"
        " (warm-up, epoch ends, speed changes the ranks' checks saw, the settling re-plan after each, the total's "
        "reconsiderations); on a shared host each one is rank zero's fit and decision while the other ranks wait.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--skip-epochs", type=int, default=1, help="epochs left out of the steady state")
    parser.add_argument("--total-batch", type=int, default=96)
    parser.add_argument("--ranks", type=int, default=WORLD_SIZE, help="3 share the 2 cores; 2: one core per rank")
    parser.add_argument("--samples", type=int, default=12288, help="training samples (128 global batches of 96)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="ddp is always run")
    parser.add_argument("--model", choices=("mlp", "deep"), default="mlp", help="deep: 52 parameter tensors, not 6")
    parser.add_argument("--out", type=Path, help="default: results/overhead.json (overhead_deep.json for --model deep)")
    parser.add_argument("--quick", action="store_true", help="3 repeats of 3 epochs (diagnosis; not for the record)")
    parser.add_argument("--profile", choices=VARIANTS, help="cProfile rank 0 of this variant in an extra run first")
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="NAME=VALUE",
        help="change a CannikinSettings field of cannikin_adaptive (diagnosis), e.g. noise_every_n_steps=16",
    )
    parser.add_argument(
        "--pool", nargs="+", type=Path, metavar="REPORT", help="run nothing: pool saved reports' repeats (same code)"
    )
    args = parser.parse_args(argv)
    if args.pool:
        return print_pooled(args.pool)
    if args.quick:
        args.repeats, args.epochs = min(args.repeats, 3), min(args.epochs, 3)
    overrides = {name: _value(value) for name, value in (item.split("=", 1) for item in args.set)}
    deep = args.model == "deep"
    if args.out is None and args.quick:  # a diagnosis never overwrites a recorded result
        args.out = Path(tempfile.gettempdir()) / "overhead_quick.json"
    if args.out is None:
        args.out = Path(__file__).parent / "results" / ("overhead_deep.json" if deep else "overhead.json")
    variants = ("ddp", *(v for v in VARIANTS if v in args.variants and v != "ddp"))
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(
        torch.rand(args.samples, 1, 28, 28, generator=generator),
        torch.randint(0, 10, (args.samples,), generator=generator),
    )
    throughput: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    thread: dict[str, list[float]] = {v: [] for v in variants}
    splits: dict[str, list[list[int]]] = {v: [] for v in variants}
    replans: dict[str, list[int]] = {v: [] for v in variants}
    started, load_at_start = time.perf_counter(), _load()
    if args.profile:  # a run of its own, left out of the figures (the profiler slows rank zero down)
        result = run(
            args.profile, dataset, args.total_batch, args.epochs, 0, deep, overrides, args.skip_epochs, args.ranks
        )
        print(f"--- rank 0 profile of {args.profile}, epochs {args.skip_epochs}+ ---\n{result['profile']}", flush=True)
    for repeat in range(args.repeats):
        # rotate the order too, so that no variant always runs first (or right after another one) in a repeat
        order = variants[repeat % len(variants) :] + variants[: repeat % len(variants)]
        for variant in order:
            result = run(variant, dataset, args.total_batch, args.epochs, repeat, deep, overrides, None, args.ranks)
            throughput[variant].append(steady_throughput(result, args.skip_epochs))
            cpu[variant].append(cpu_per_sample(result, args.skip_epochs))
            thread[variant].append(thread_cpu_per_rank_step(result, args.skip_epochs))
            splits[variant].append(result["splits"][-1])
            replans[variant].append(result["replans"])
            print(
                f"  repeat {repeat} {variant:20s} {throughput[variant][-1]:8.1f} samples/s"
                f" {1e6 * cpu[variant][-1]:7.1f} CPU-us/sample {result['replans']:3d} re-plans",
                flush=True,
            )
    report: dict[str, Any] = {
        "setup": {
            "world_size": args.ranks,
            "total_batch_size": args.total_batch,
            "samples_per_epoch": args.samples,
            "epochs": args.epochs,
            "skip_epochs": args.skip_epochs,
            "repeats": args.repeats,
            "model": ("MLP 784-128-(24 x 128)-10" if deep else "MLP 784-256-256-10")
            + ", SGD, random 28x28 inputs, CPU, gloo, one thread per rank",
            "wall_time_s": time.perf_counter() - started,
            "cannikin_adaptive_settings": overrides or "defaults",
            "command": " ".join(["python benchmarks/overhead.py", *(argv if argv is not None else sys.argv[1:])]),
            "cpus": os.cpu_count(),
            "load_average": {"start": load_at_start},
        },
        "samples_per_s_median": {v: statistics.median(throughput[v]) for v in variants},
        "samples_per_s": throughput,
        "cpu_us_per_sample_median": {v: 1e6 * statistics.median(cpu[v]) for v in variants},
        "thread_cpu_us_per_rank_step_median": {v: 1e6 * statistics.median(thread[v]) for v in variants},
        "thread_cpu_us_per_rank_step": {v: [1e6 * x for x in thread[v]] for v in variants},
        "final_splits": splits,
        "replans": replans,
    }
    for variant in variants[1:]:
        ratios = [c / d for c, d in zip(throughput[variant], throughput["ddp"], strict=True)]
        cpu_ratios = [c / d for c, d in zip(cpu[variant], cpu["ddp"], strict=True)]
        report[f"{variant}_vs_ddp"] = {
            "median": statistics.median(ratios),
            "ci95": median_interval(ratios),
            "ratios": ratios,
            "cpu_per_sample_median": statistics.median(cpu_ratios),
            "cpu_per_sample_ratios": cpu_ratios,
        }
        if "fixed" in variants and variant != "fixed":
            # the same strategy without the engine, in the same repeat: the engine's own cost, which the machine's
            # load (moving DDP's own repeats by tens of percent) disturbs least
            paired = [c / f for c, f in zip(throughput[variant], throughput["fixed"], strict=True)]
            report[f"{variant}_vs_ddp"].update(
                vs_fixed_median=statistics.median(paired), vs_fixed_ci95=median_interval(paired), vs_fixed_ratios=paired
            )
    if "fixed" in variants:
        # the engine's own CPU per rank and step: each variant's main-thread CPU over the fixed split's in the same
        # repeat (the same strategy, model and data without the engine), the median over the repeats; `default` is
        # `strategy="cannikin"` alone
        report["engine_thread_cpu_us_per_rank_step"] = {
            ("default" if v == "cannikin" else v): 1e6
            * statistics.median(t - f for t, f in zip(thread[v], thread["fixed"], strict=True))
            for v in variants
            if v not in ("ddp", "fixed")
        }
    # the same engine alone on its thread, where a few microseconds are resolved (the runs above resolve hundreds)
    report["engine_alone_thread_cpu_us_per_step"] = engine_alone()
    # how noisy the machine was: the spread of DDP's own repeats
    ddp = throughput["ddp"]
    report["ddp_spread"] = (max(ddp) - min(ddp)) / statistics.median(ddp)
    report["ddp_cpu_spread"] = (max(cpu["ddp"]) - min(cpu["ddp"])) / statistics.median(cpu["ddp"])
    report["setup"]["load_average"]["end"] = _load()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    args.out.with_suffix(".md").write_text(markdown(report, variants))
    for variant in variants[1:]:
        r = report[f"{variant}_vs_ddp"]
        repeats = ", ".join(f"{x:.2f}" for x in r["ratios"])
        print(
            f"{variant:20s} / ddp = {r['median']:.3f}x samples/s {_interval(r['ci95'])} (repeats {repeats});"
            f" CPU per sample {r['cpu_per_sample_median']:.3f}x"
            + (
                f"; / fixed in the same repeat {r['vs_fixed_median']:.3f}x {_interval(r['vs_fixed_ci95'])}"
                if "vs_fixed_median" in r
                else ""
            )
        )
    print(
        f"DDP's own spread across repeats: {100 * report['ddp_spread']:.1f}% of its median in samples/s,"
        f" {100 * report['ddp_cpu_spread']:.1f}% in CPU per sample"
    )
    print(f"saved {args.out}")
    return report


def _interval(bounds: Sequence[float]) -> str:
    return f"({bounds[0]:.3f}-{bounds[1]:.3f})"


def print_pooled(paths: Sequence[Path]) -> dict[str, dict[str, Any]]:
    """``--pool``: the pooled medians and intervals of saved reports, printed."""
    result = pooled([json.loads(Path(path).read_text()) for path in paths])
    for variant, figures in result.items():
        for name, figure in figures.items():
            print(
                f"{variant:22s} {_POOLED[name]:21s} {figure['median']:.3f} {_interval(figure['ci95'])}"
                f" over {figure['repeats']} repeats"
            )
    return result


def _load() -> list[float]:
    """The machine's load average over 1, 5 and 15 minutes (others' work shows here)."""
    return [round(x, 2) for x in os.getloadavg()]


def _value(text: str) -> Any:
    """A ``--set`` value: an integer, a float, ``None``, ``True``/``False``, or the text."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"None": None, "True": True, "False": False}.get(text, text)


if __name__ == "__main__":
    main()
