"""Variable-length data, MEASURED end to end: Cannikin splitting by cost vs Cannikin by sample count vs Lightning DDP.

The task: classify WordNet glosses (``examples/varlen_data.py``, real text whose token counts vary several-fold) into
their 45 lexicographer classes with a bag-of-embeddings model. Each rank's device is emulated per token
(``EmulatedCluster(batch_cost=)``: ``fixed_ms + per_token_ms * tokens`` of what the rank holds, devices of speed
1x : 2x : 4x), at a fixed total batch. Methods, run interleaved (a slow spell of the shared machine hits all alike):

- ``cost_aware``: ``CannikinStrategy(sample_costs="lengths")``: each global batch split by tokens and the devices'
  measured speeds (each rank timed over its tokens);
- ``sample_count``: ``strategy="cannikin"``: OptPerf sample counts from per-sample timings;
- ``ddp``: Lightning's ``ddp`` (an even split).

The figure is steady-state samples per second (the epochs after ``--skip-epochs``), medians over repeats of the
per-repeat ratios; beside each, the ideal ratio the emulated costs allow
(:func:`benchmarks.variable_length_model.compare` on the same lengths: a lower bound on the step time no split beats,
against the sample-count split the planner converges to, and against the even split). A control with every gloss cut
or padded to the median length checks that cost-aware splitting costs nothing where lengths are equal.

A sample's cost is its token count plus an attention term, ``length**2 / 64`` (``--attention``: a transformer whose
attention costs what its other layers do at 64 tokens); the sampler is given the same cost
(``sample_costs=[length + length**2 / 64, ...]``), the emulator charges it. Scenarios: ``small_batches``, 6 ranks (two
of each speed) at a global batch of 24 (4 samples per rank on average, what long sequences leave a device), where a
rank's summed cost varies most; ``default``, 3 ranks at 64. Each step costs the emulated time plus Lightning's and
gloo's own work on a shared 2-core machine, which no method saves: the measured ratios sit below the ideal ones.

Beside each wall-clock figure, every run records per rank and step the emulated delay the emulator slept, the lengths
held, the wall clock and the process's CPU time (:class:`RecordedCluster`); ``emulated_ratios`` are the same ratios
over the emulated time alone (each steady step lasting its slowest rank's delay): the planner's share, apart from this
machine. Per method: ``emulated_over_exact_model`` (its steps' emulated time over that of :func:`split_by_cost` with
the emulator's exact costs on the same global batches: 1.0 is a perfect time model), ``overhead_ms`` (wall step minus
emulated step), ``cpu_ms_per_rank_step``, ``slowest_rank_wake_to_end_ms`` (from the slowest rank's wake-up to its
step's end: backward, the all-reduce, the optimizer) and ``slowest_over_median_rank_ms`` (how far the slowest rank's
delay sits above the median rank's: small when the ranks are balanced, so their CPU work after the sleep contends).
``ideal_over_steps_run``: the ideal ratio on the batches each run ran (:func:`ideal_over_steps_run`).

    python benchmarks/variable_length.py [--repeats 3] [--epochs 3] [--scenarios small_batches default]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.fsdp import EpochThroughput
from benchmarks.harness import median
from benchmarks.variable_length_model import FIXED_MS, PER_TOKEN_MS, compare
from examples.varlen_data import read_wordnet_glosses, tokenize
from lightning_cannikin import CannikinStrategy, EmulatedCluster
from lightning_cannikin.core.cost_split import lower_bound, split_by_cost

RESULTS = Path(__file__).resolve().parent / "results" / "variable_length.json"
PAD, UNKNOWN, VOCABULARY = 0, 1, 8000
SCENARIOS = {"small_batches": (2, 24), "default": (1, 64)}  # (copies of the 1x:2x:4x devices, global batch)


class Glosses(Dataset):
    """Token ids of WordNet glosses and their classes; ``lengths`` is every gloss's token count (its cost)."""

    def __init__(self, ids: list[list[int]], labels: list[int]) -> None:
        self.ids, self.labels = ids, labels
        self.lengths = [len(x) for x in ids]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> tuple[list[int], int]:
        return self.ids[index], self.labels[index]


def collate(batch: list[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids padded to the batch's longest, lengths, labels)``."""
    lengths = torch.tensor([len(ids) for ids, _ in batch])
    padded = torch.full((len(batch), int(lengths.max())), PAD)
    for row, (ids, _) in enumerate(batch):
        padded[row, : len(ids)] = torch.tensor(ids)
    return padded, lengths, torch.tensor([label for _, label in batch])


def load_glosses(num_samples: int, equal_length: int | None, seed: int = 0) -> tuple[Glosses, Glosses]:
    """A seeded subset of the glosses for training and the next as many for testing (ids over the training
    subset's most frequent words); ``equal_length``: every gloss cut or padded (with the unknown id) to it."""
    texts, labels = read_wordnet_glosses()
    order = np.random.default_rng(seed).permutation(len(texts))[: 2 * num_samples]
    tokens = [tokenize(texts[i]) for i in order]
    counts: dict[str, int] = {}
    for words in tokens[:num_samples]:
        for word in words:
            counts[word] = counts.get(word, 0) + 1
    frequent = sorted(counts, key=lambda w: (-counts[w], w))[: VOCABULARY - 2]
    index = {word: i + 2 for i, word in enumerate(frequent)}
    ids = [[index.get(word, UNKNOWN) for word in words] or [UNKNOWN] for words in tokens]
    if equal_length is not None:
        ids = [(x + [UNKNOWN] * equal_length)[:equal_length] for x in ids]
    classes = [labels[i] for i in order]
    return Glosses(ids[:num_samples], classes[:num_samples]), Glosses(ids[num_samples:], classes[num_samples:])


class GlossClassifier(pl.LightningModule):
    """The mean of a gloss's token embeddings, then a linear layer over the 45 classes; the loss is a sample mean."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, 32, padding_idx=PAD)
        self.head = nn.Linear(32, 45)
        self.lr = lr

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).sum(1) / lengths[:, None])

    def training_step(self, batch, batch_idx):
        ids, lengths, labels = batch
        return nn.functional.cross_entropy(self(ids, lengths), labels)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def sample_cost(length: float, attention: float | None) -> float:
    """A sample's work in tokens: its length, plus ``length**2 / attention`` for an attention term (its quadratic part
    equals its linear part at ``attention`` tokens)."""
    return length + (length * length / attention if attention else 0.0)


class RecordedCluster(EmulatedCluster):
    """:class:`EmulatedCluster` that also records, per step of this rank, its epoch, its samples' lengths, the emulated
    delay it slept and its wall clock at the step's end, and writes them to ``out_dir/rank{r}.json`` at the end."""

    def __init__(self, *args, out_dir: Path, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.out_dir = out_dir
        self.steps: list[dict] = []

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        delay = self.delay_ms(trainer.global_rank, self._batch_size, self._step)
        self.steps.append(
            {
                "epoch": trainer.current_epoch,
                "lengths": batch[1].tolist(),
                "delay_ms": delay,
                "start": time.perf_counter(),
            }
        )

    @override
    def on_before_backward(self, trainer, pl_module, loss) -> None:
        super().on_before_backward(trainer, pl_module, loss)
        self.steps[-1]["woke"] = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.steps[-1]["end"] = time.perf_counter()
        self.steps[-1]["cpu"] = time.process_time()  # this process's CPU seconds so far

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.steps))


def emulated_figures(out_dir: Path, world_size: int, skip: int, per_token_ms, fixed_ms, attention) -> dict:
    """The steady steps' emulated times (each step's slowest rank's emulated delay) beside the wall clock, and what
    the emulator's own costs would give for the same global batches split by :func:`split_by_cost` with the exact
    costs (the split a perfect time model makes) and by the fractional bound no split beats."""
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
    fixed, per_cost = np.asarray(fixed_ms), np.asarray(per_token_ms)
    steady = [k for k, step in enumerate(ranks[0]) if step["epoch"] >= skip]
    emulated, exact, bound, wall, samples, cpu, after, spread = [], [], [], [], 0, [], [], []
    for k in steady:
        steps = [rank[k] for rank in ranks]
        emulated.append(max(step["delay_ms"] for step in steps))
        spread.append(emulated[-1] - float(np.median([step["delay_ms"] for step in steps])))
        costs = np.array([sample_cost(float(n), attention) for step in steps for n in step["lengths"]])
        exact.append(split_by_cost(costs, fixed, per_cost).step_time)
        bound.append(lower_bound(costs, fixed, per_cost))
        samples += len(costs)
        if k > 0:
            cpu.append(np.mean([rank[k]["cpu"] - rank[k - 1]["cpu"] for rank in ranks]))
        slowest = max(steps, key=lambda step: step["delay_ms"])
        after.append(1e3 * (slowest["end"] - slowest["woke"]))
        if k > 0:
            wall.append(1e3 * (ranks[0][k]["end"] - ranks[0][k - 1]["end"]))
    return {
        "steady_steps": len(steady),
        "emulated_samples_per_s": 1e3 * samples / sum(emulated),
        "exact_model_samples_per_s": 1e3 * samples / sum(exact),
        "bound_samples_per_s": 1e3 * samples / sum(bound),
        "emulated_step_ms": float(np.mean(emulated)),
        "wall_step_ms": float(np.mean(wall)),
        "overhead_ms": float(np.mean(wall) - np.mean(emulated[-len(wall) :])),
        "emulated_over_exact_model": float(sum(emulated) / sum(exact)),
        "cpu_ms_per_rank_step": 1e3 * float(np.mean(cpu)),
        "slowest_rank_wake_to_end_ms": float(np.mean(after)),
        "slowest_over_median_rank_ms": float(np.mean(spread)),
    }


def ideal_over_steps_run(per_run_emulated: dict[str, list[dict]]) -> dict[str, float]:
    """Against each other method, the ideal ratio on the steps it ran: the median over repeats of its runs' emulated
    time over the fractional bound on the same global batches (the bound's time over an epoch barely depends on how
    the epoch is batched, so it stands for the ideal split on any method's batches)."""
    return {
        f"cost_aware_vs_{m}": median([r["bound_samples_per_s"] / r["emulated_samples_per_s"] for r in rs])
        for m, rs in per_run_emulated.items()
        if m != "cost_aware"
    }


def strategy_for(method: str, costs: list[float]):
    if method == "cost_aware":
        return CannikinStrategy(sample_costs=costs, start_method="fork")
    return CannikinStrategy(start_method="fork") if method == "sample_count" else "ddp_fork"


def run(method: str, train: Glosses, per_token_ms: list[float], fixed_ms: list[float], batch: int, args, seed: int):
    """One fit; rank zero's per-epoch times and samples."""
    torch.set_num_threads(1)
    pl.seed_everything(seed, verbose=False)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        attention = args.attention

        def batch_cost(batch: tuple) -> float:  # what the rank holds, in the same unit as `sample_cost`
            return sum(sample_cost(float(length), attention) for length in batch[1])

        emulator = RecordedCluster(per_token_ms, fixed_ms, seed=seed, batch_cost=batch_cost, out_dir=Path(tmp))
        trainer = pl.Trainer(
            strategy=strategy_for(method, [sample_cost(length, attention) for length in train.lengths]),
            accelerator="cpu",
            devices=len(per_token_ms),
            max_epochs=args.epochs,
            callbacks=[emulator, EpochThroughput(out)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        loader = DataLoader(train, batch_size=batch // len(per_token_ms), shuffle=True, collate_fn=collate)
        trainer.fit(GlossClassifier(), loader)
        result = json.loads(out.read_text())
        skip = args.skip_epochs
        result["emulated"] = emulated_figures(Path(tmp), len(per_token_ms), skip, per_token_ms, fixed_ms, attention)
    result["throughput"] = sum(result["epoch_samples"][skip:]) / sum(result["epoch_times"][skip:])
    return result


def scenario(name: str, copies: int, batch: int, equal: bool, methods: list[str], args) -> dict:
    per_token = [v * args.scale for v in PER_TOKEN_MS] * copies
    fixed = [v * args.scale for v in FIXED_MS] * copies
    steps = args.steps_per_epoch
    train, _ = load_glosses(batch * steps, int(args.equal_length) if equal else None)
    runs: dict[str, list[dict]] = {method: [] for method in methods}
    for repeat in range(args.repeats):
        for method in methods:  # interleaved
            result = run(method, train, per_token, fixed, batch, args, seed=repeat)
            runs[method].append(result)
            label = f"{name}{' equal' if equal else ''}"
            e = result["emulated"]
            print(
                f"  {label} {repeat} {method:12s} {result['throughput']:7.1f}/s;"
                f" emulated {e['emulated_samples_per_s']:.1f}/s"
                f" (exact model {e['exact_model_samples_per_s']:.1f}/s), step {e['wall_step_ms']:.0f} ms wall,"
                f" {e['emulated_step_ms']:.0f} ms emulated",
                flush=True,
            )
    # the ideal on the same lengths: the model's costs are these scaled, and its ratios do not depend on the scale
    quadratic = 1.0 / args.attention if args.attention else 0.0
    model = compare(np.array(train.lengths), batch, steps, quadratic, exact=False, copies=copies)["throughput_ratios"]

    def ratios(other: str, key=lambda r: r["throughput"]) -> list[float]:
        return [key(a) / key(b) for a, b in zip(runs["cost_aware"], runs[other], strict=True)]

    def emulated(r: dict) -> float:
        return r["emulated"]["emulated_samples_per_s"]

    def figure(name: str) -> dict[str, float]:  # a method's median of one of its emulated figures
        return {method: median([r["emulated"][name] for r in rs]) for method, rs in runs.items()}

    return {
        "ranks": len(per_token),
        "global_batch": batch,
        "per_token_ms": per_token,
        "fixed_ms": fixed,
        "attention": args.attention,
        "lengths": "every gloss cut or padded to its median token count" if equal else "WordNet gloss token counts",
        "mean_length": float(np.mean(train.lengths)),
        "samples_per_epoch": len(train),
        "samples_per_s": {method: median([r["throughput"] for r in rs]) for method, rs in runs.items()},
        "ratios": {f"cost_aware_vs_{m}": median(ratios(m)) for m in methods if m != "cost_aware"},
        "ratios_per_repeat": {f"cost_aware_vs_{m}": ratios(m) for m in methods if m != "cost_aware"},
        "ideal": {f"cost_aware_vs_{m}": model[f"ideal_vs_{m}"] for m in methods if m != "cost_aware"},
        "model_prediction": {f"cost_aware_vs_{m}": model[f"cost_aware_vs_{m}"] for m in methods if m != "cost_aware"},
        # the same ratios over the emulated time of the steps each run ran (no machine overhead): the planner's share
        "emulated_ratios": {f"cost_aware_vs_{m}": median(ratios(m, emulated)) for m in methods if m != "cost_aware"},
        "emulated_ratios_per_repeat": {f"cost_aware_vs_{m}": ratios(m, emulated) for m in methods if m != "cost_aware"},
        "emulated_samples_per_s": figure("emulated_samples_per_s"),
        "wall_step_ms": figure("wall_step_ms"),
        "emulated_step_ms": figure("emulated_step_ms"),
        "overhead_ms": figure("overhead_ms"),
        "cpu_ms_per_rank_step": figure("cpu_ms_per_rank_step"),
        "slowest_rank_wake_to_end_ms": figure("slowest_rank_wake_to_end_ms"),
        "slowest_over_median_rank_ms": figure("slowest_over_median_rank_ms"),
        "emulated_over_exact_model": figure("emulated_over_exact_model"),
        "per_run_emulated": {method: [r["emulated"] for r in rs] for method, rs in runs.items()},
        "ideal_over_steps_run": ideal_over_steps_run(
            {method: [r["emulated"] for r in rs] for method, rs in runs.items()}
        ),
        "final_splits": {method: [r["final_split"] for r in rs] for method, rs in runs.items()},
        "settings": {k: str(v) for k, v in vars(args).items()},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--skip-epochs", type=int, default=1, help="epochs left out of the steady state")
    parser.add_argument("--steps-per-epoch", type=int, default=30)
    parser.add_argument("--scale", type=float, default=300.0, help="the model benchmark's costs times this")
    parser.add_argument("--attention", type=float, default=64.0, help="length at which attention doubles the cost")
    parser.add_argument("--equal-length", type=int, default=13, help="the control's length (the median gloss)")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    # scenarios run by an earlier invocation are kept (they take long: one invocation per scenario is fine)
    report: dict = json.loads(args.out.read_text()) if args.out.exists() else {"scenarios": {}}
    for name in args.scenarios:
        copies, batch = SCENARIOS[name]
        report["scenarios"][name] = scenario(name, copies, batch, False, ["cost_aware", "sample_count", "ddp"], args)
        equal = scenario(name, copies, batch, True, ["cost_aware", "sample_count"], args)
        report["scenarios"][f"{name}_equal_lengths"] = equal
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))  # what is done so far survives an interruption
    headline = "small_batches" if "small_batches" in report["scenarios"] else args.scenarios[0]
    varied, equal = report["scenarios"][headline], report["scenarios"][f"{headline}_equal_lengths"]
    for key in ("ratios", "ideal", "emulated_ratios", "ideal_over_steps_run"):
        report[key] = {
            "cost_aware_vs_sample_count": varied[key]["cost_aware_vs_sample_count"],
            "cost_aware_vs_sample_count_equal_lengths": equal[key]["cost_aware_vs_sample_count"],
            "cost_aware_vs_ddp": varied[key]["cost_aware_vs_ddp"],
        }
    report["headline_scenario"] = headline
    args.out.write_text(json.dumps(report, indent=2))
    for name, r in report["scenarios"].items():
        shown = ", ".join(f"{k} {v:.3f}x (ideal {r['ideal'][k]:.3f}x)" for k, v in r["ratios"].items())
        emulated = ", ".join(f"{k} {v:.3f}x" for k, v in r.get("emulated_ratios", {}).items())
        print(f"{name:28s} {shown}; emulated time alone: {emulated or 'n/a'}")
    print(f"saved {args.out}")
    return report


if __name__ == "__main__":
    main()
