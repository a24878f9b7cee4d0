"""Lightning's demo Transformer on an emulated 1x:2x:4x cluster: DDP vs Cannikin without and with the evidence's reach.

Issue 51's "Too far on too little" case, side by side. Lightning's demo ``LightningTransformer``
(``lightning.pytorch.demos``), unchanged but for a no-op ``prepare_data`` (the demo's downloads WikiText-2; this runs
offline), trains on synthetic tokens shaped as the demo's ``WikiText2`` yields them (``(inputs, target)`` blocks of 35
tokens, the target shifted by one). Three ranks, ``EmulatedCluster(per_sample_ms=[0.5, 1, 2], fixed_ms=10)``, loader
batch 16 a rank (total 48). Each step is mostly the model's real per-sample CPU work. Configurations, run interleaved
in every repeat with the same seed, initial weights and data order (each repeat starts one configuration later, so
that none is always first):

- ``ddp``: Lightning ``ddp_fork``, the total fixed at 48;
- ``cannikin-jump``: ``Cannikin(max_batch_size=512)`` with ``CannikinSettings(evidence_reach=None)``: a new total is
  planned at once, however far it is from the sizes timed (the behaviour before the reach, the "before");
- ``cannikin``: ``Cannikin(max_batch_size=512)`` with the default settings (``evidence_reach=2.0``: no plan gives a
  rank more than twice the largest local batch it has run).

Per run it records: the fit's wall time (rank zero, ``on_train_start`` to ``on_train_end``); every step's loss,
sample-weighted over the ranks (gathered once at the end, so nothing is added to a step); every rank's local batch at
every step; the Cannikin callback's ``history`` (the total and split of every re-plan, predicted and measured step
times); and, after the fit and off the clock, the loss on 512 held-out synthetic blocks. From these:

- ``final_loss``: the sample-weighted training loss over the fit's last ``--window`` samples;
- ``time_to_ddp_loss``: the first time the run's trailing ``--window``-sample loss is at or under the same repeat's
  DDP ``final_loss`` (with ``--target-loss``, the target) (``None`` if never);
- ``jumps``: for every step and rank, its local batch over the largest that rank ran before (probes included), the
  largest such factor, and the same for each re-plan of the history.

Ratios are taken within a repeat (every configuration beside the DDP run of the same repeat), then the median over
repeats is quoted. Prints a table and writes ``benchmarks/results/demo_transformer.json``.

    python benchmarks/demo_transformer.py [--repeats 3] [--epochs 3] [--samples 4080] [--vocab 1000]
        [--window 480] [--target-loss L] [--configs ddp,cannikin-jump,cannikin] [--out PATH]

Arguments: ``--repeats`` interleaved repeats; ``--epochs`` epochs per fit; ``--samples`` training blocks (35 tokens
each; the default, 85 x 48, leaves no short last batch); ``--vocab`` the demo model's ``vocab_size`` (its
constructor's own argument; the demo's default, 33,278, makes a step about 4-5x slower on CPU); ``--window`` the
samples averaged for a loss; ``--target-loss`` stops each fit once its loss over the last ``--window`` samples is at
or under it (``--epochs`` is then a cap), so that every configuration is timed to the same loss; ``--configs`` which
configurations, in order; ``--seed`` the seed of weights, data and order; ``--out`` the JSON path. A configuration
whose fit crashes is recorded with its error, and the others still run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos import LightningTransformer
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import quiet_cpu_trainer
from lightning_cannikin import Cannikin, CannikinSettings, EmulatedCluster
from lightning_cannikin.training.frontends.lightning_hooks import BalancingCallback

PER_SAMPLE_MS = [0.5, 1.0, 2.0]
FIXED_MS = 10.0
LOADER_BATCH = 16  # a rank's; the total is 48
MAX_BATCH_SIZE = 512
BLOCK = 35  # the demo WikiText2's block_size
CONFIGS = ("ddp", "cannikin-jump", "cannikin")
RESULTS = Path(__file__).parent / "results"


class SyntheticTokens(Dataset):
    """Blocks of a token stream from a seeded random bigram chain (each token has 4 likely successors), as the demo's
    ``WikiText2`` yields them: ``(inputs, target)``, ``target`` the next ``BLOCK`` tokens, shifted by one."""

    def __init__(self, num_blocks: int, vocab_size: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        successors = torch.randint(0, vocab_size, (vocab_size, 4), generator=gen)
        length = num_blocks * BLOCK + 1
        picks = torch.randint(0, 4, (length,), generator=gen)
        stream = torch.empty(length, dtype=torch.int64)
        stream[0] = 0
        for i in range(1, length):  # a few ten thousand tokens: a Python loop is fine
            stream[i] = successors[stream[i - 1], picks[i]]
        self.data = stream
        self.num_blocks = num_blocks

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * BLOCK
        return self.data[start : start + BLOCK], self.data[start + 1 : start + BLOCK + 1]


class OfflineTransformer(LightningTransformer):
    """The demo model as it is; only its ``prepare_data``, which downloads WikiText-2, does nothing."""

    def prepare_data(self) -> None:
        pass


class StepLog(Callback):
    """Every step's wall time (rank zero), local loss and local batch (each rank); gathered to rank zero at the end,
    which writes them with the Cannikin history to ``out``.

    With ``target_loss`` set, every step all-reduces its sample-weighted loss (two floats, in every configuration
    alike) and every rank stops the fit at the same step, once the loss over the last ``window`` samples is at or
    under the target.
    """

    def __init__(self, out: Path, target_loss: float | None = None, window: int = 480) -> None:
        self.out = out
        self.target_loss = target_loss
        self.window = window
        self.recent: list[tuple[float, int]] = []  # (loss sum, samples) of the last steps, the same on every rank
        self.started = 0.0
        self.times: list[float] = []
        self.losses: list[float] = []
        self.sizes: list[int] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.times.append(time.perf_counter() - self.started)
        self.losses.append(float(loss.detach()))
        self.sizes.append(len(batch[0]))
        if self.target_loss is None:
            return
        pair = torch.tensor([float(loss.detach()) * len(batch[0]), float(len(batch[0]))], dtype=torch.float64)
        dist.all_reduce(pair)
        self.recent.append((float(pair[0]), int(pair[1])))
        while sum(n for _, n in self.recent[1:]) >= self.window:
            self.recent.pop(0)
        seen = sum(n for _, n in self.recent)
        if seen >= self.window and sum(v for v, _ in self.recent) / seen <= self.target_loss:
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        wall = time.perf_counter() - self.started
        gathered: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(gathered, (self.losses, self.sizes))  # once, after the clock stopped
        if not trainer.is_global_zero:
            return
        cannikin = next((cb for cb in trainer.callbacks if isinstance(cb, BalancingCallback)), None)
        steps = len(self.times)
        sizes = [[gathered[r][1][s] for r in range(trainer.world_size)] for s in range(steps)]
        losses = [
            sum(gathered[r][0][s] * gathered[r][1][s] for r in range(trainer.world_size)) / sum(sizes[s])
            for s in range(steps)
        ]
        result = {
            "wall_time": wall,
            "step_times": self.times,
            "step_losses": losses,
            "step_sizes": sizes,
            "history": cannikin.history if cannikin is not None else [],
        }
        self.out.write_text(json.dumps(result))


def configure(name: str) -> tuple[str, list[Callback]]:
    """The strategy and callbacks of a configuration."""
    if name == "ddp":
        return "ddp_fork", []
    if name == "cannikin-jump":
        settings = CannikinSettings(evidence_reach=None)
        return "cannikin_fork", [Cannikin(max_batch_size=MAX_BATCH_SIZE, save_profile=False, settings=settings)]
    if name == "cannikin":
        return "cannikin_fork", [Cannikin(max_batch_size=MAX_BATCH_SIZE, save_profile=False)]
    raise ValueError(f"`--configs`: unknown configuration {name!r}; choose from {', '.join(CONFIGS)}.")


def held_out_loss(model: pl.LightningModule, data: Dataset) -> float:
    """The mean loss on ``data`` in eval mode (no dropout), in the parent after the fit."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for inputs, target in DataLoader(data, batch_size=64):
            output = model(inputs, target)
            total += float(torch.nn.functional.nll_loss(output, target.reshape(-1), reduction="sum"))
            count += target.numel()
    return total / count


def fit(
    name: str,
    train: Dataset,
    test: Dataset,
    vocab: int,
    epochs: int,
    seed: int,
    target_loss: float | None = None,
    window: int = 480,
) -> dict[str, Any]:
    """One fit of ``name``; rank zero's measurements, plus the held-out loss."""
    torch.set_num_threads(1)
    pl.seed_everything(seed, verbose=False)
    model = OfflineTransformer(vocab_size=vocab)
    strategy, callbacks = configure(name)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cluster = EmulatedCluster(PER_SAMPLE_MS, FIXED_MS, seed=seed)
        trainer = quiet_cpu_trainer(
            strategy, len(PER_SAMPLE_MS), epochs, [cluster, StepLog(out, target_loss, window), *callbacks]
        )
        loader = DataLoader(train, batch_size=LOADER_BATCH, shuffle=True, generator=torch.Generator().manual_seed(seed))
        trainer.fit(model, loader)
        result = json.loads(out.read_text())
    result["held_out_loss"] = held_out_loss(model, test)  # the fork launcher brought rank zero's weights back
    return result


def trailing_losses(result: dict[str, Any], window: int) -> list[float]:
    """At every step, the sample-weighted loss over the last ``window`` samples (fewer at the start)."""
    out = []
    for s in range(len(result["step_losses"])):
        loss_sum, count, i = 0.0, 0, s
        while i >= 0 and count < window:
            n = sum(result["step_sizes"][i])
            loss_sum += result["step_losses"][i] * n
            count += n
            i -= 1
        out.append(loss_sum / count)
    return out


def jumps(result: dict[str, Any]) -> dict[str, Any]:
    """Each rank's local batch over the largest it had run before, at every step and at every re-plan."""
    sizes = result["step_sizes"]
    ranks = len(sizes[0]) if sizes else 0
    largest = [0] * ranks
    per_step = []
    for s, split in enumerate(sizes):
        if s > 0:
            factors = [b / m for b, m in zip(split, largest, strict=True)]
            if max(factors) > 1:
                per_step.append({"step": s, "split": split, "largest_before": list(largest), "factors": factors})
        largest = [max(m, b) for m, b in zip(largest, split, strict=True)]
    replans = []
    for entry in result["history"]:
        step = entry["step"]
        before = [max((sizes[s][r] for s in range(min(step, len(sizes)))), default=0) for r in range(ranks)]
        split = entry["local_batch_sizes"]
        factors = [b / m if m else None for b, m in zip(split, before, strict=True)]
        replans.append(
            {
                "step": step,
                "total": entry["total_batch_size"],
                "split": split,
                "largest_before": before,
                "factors": factors,
                "predicted_ms": None if entry["predicted_step_time"] is None else 1000 * entry["predicted_step_time"],
                "measured_ms": None if entry["measured_step_time"] is None else 1000 * entry["measured_step_time"],
            }
        )
    known = [f for r in replans for f in r["factors"] if f is not None]
    return {
        "max_step_factor": max((max(j["factors"]) for j in per_step), default=1.0),
        "max_replan_factor": max(known, default=1.0),
        "growth_steps": per_step,
        "replans": replans,
    }


def summarize(result: dict[str, Any], window: int) -> dict[str, Any]:
    """The run's own figures (ratios to DDP come in :func:`compare`)."""
    trail = trailing_losses(result, window)
    totals = [sum(s) for s in result["step_sizes"]]
    # the total of every re-plan (the history's), not of every step: an epoch's short last batch is no re-plan
    planned = [entry["total_batch_size"] for entry in result["history"]] or totals[:1]
    sequence = planned[:1]
    for t in planned[1:]:
        if t != sequence[-1]:
            sequence.append(t)
    return {
        "wall_time": result["wall_time"],
        "steps": len(totals),
        "samples": sum(totals),
        "final_loss": trail[-1],
        "min_trailing_loss": min(trail),
        "held_out_loss": result["held_out_loss"],
        "totals_sequence": sequence,
        "jumps": jumps(result),
        "trailing_loss": trail,
    }


def time_to(result: dict[str, Any], trail: list[float], target: float) -> float | None:
    """The first step time at which the trailing loss is at or under ``target``."""
    return next((t for t, loss in zip(result["step_times"], trail, strict=True) if loss <= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4080)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--window", type=int, default=480)
    parser.add_argument("--target-loss", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--out", type=Path, default=RESULTS / "demo_transformer.json")
    args = parser.parse_args()
    configs = args.configs.split(",")
    for name in configs:
        configure(name)  # a bad name fails here, before any fit
    if "ddp" not in configs:
        parser.error("`--configs` must include ddp: every ratio is taken against it.")
    train = SyntheticTokens(args.samples, args.vocab, seed=args.seed)
    test = SyntheticTokens(512, args.vocab, seed=args.seed)  # the same chain (same seed), a stream of its own length
    test.data = SyntheticTokens(args.samples + 512, args.vocab, seed=args.seed).data[args.samples * BLOCK :]
    repeats: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        runs: dict[str, dict[str, Any]] = {}
        raw: dict[str, dict[str, Any]] = {}
        for name in configs[repeat % len(configs) :] + configs[: repeat % len(configs)]:  # each repeat starts later
            try:
                raw[name] = fit(name, train, test, args.vocab, args.epochs, args.seed, args.target_loss, args.window)
            except Exception as error:  # a crash is a result: recorded, and the other configurations still run
                message = str(error).strip().splitlines()[-1]
                runs[name] = {"crashed": message}
                print(f"repeat {repeat} {name}: crashed: {message}", flush=True)
                continue
            runs[name] = summarize(raw[name], args.window)
            print(
                f"repeat {repeat} {name}: {runs[name]['wall_time']:.1f} s, final loss {runs[name]['final_loss']:.3f}, "
                f"totals {runs[name]['totals_sequence']}, max jump {runs[name]['jumps']['max_step_factor']:.2f}x",
                flush=True,
            )
        ddp = runs["ddp"]
        if "crashed" in ddp:
            repeats.append(runs)
            continue
        # the loss every run is timed to: DDP's final one, or the target itself (DDP's last step may overshoot it)
        reference = ddp["final_loss"] if args.target_loss is None else max(ddp["final_loss"], args.target_loss)
        ddp_time_to = time_to(raw["ddp"], ddp["trailing_loss"], reference)
        for name, run in runs.items():
            if "crashed" in run:
                continue
            reached = time_to(raw[name], run["trailing_loss"], reference)
            run["time_to_ddp_loss"] = reached
            run["wall_ratio_to_ddp"] = run["wall_time"] / ddp["wall_time"]
            run["time_to_ddp_loss_ratio"] = None if reached is None or not ddp_time_to else reached / ddp_time_to
            run["step_times"] = raw[name]["step_times"]
            run["step_losses"] = raw[name]["step_losses"]
        repeats.append(runs)

    def med(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None and math.isfinite(v)]
        return statistics.median(known) if len(known) == len(values) and known else None

    summary = {}
    for name in configs:
        crashes = [r[name]["crashed"] for r in repeats if "crashed" in r[name]]
        per = [r[name] for r in repeats if "crashed" not in r[name] and "crashed" not in r["ddp"]]
        if not per:
            summary[name] = {"crashed": crashes}
            continue
        summary[name] = {
            "repeats_completed": len(per),
            "crashed": crashes,
            "wall_time_median": med([p["wall_time"] for p in per]),
            "wall_ratio_to_ddp_median": med([p["wall_ratio_to_ddp"] for p in per]),
            "wall_ratio_to_ddp_runs": [p["wall_ratio_to_ddp"] for p in per],
            "time_to_ddp_loss_ratio_median": med([p["time_to_ddp_loss_ratio"] for p in per]),
            "time_to_ddp_loss_ratio_runs": [p["time_to_ddp_loss_ratio"] for p in per],
            "final_loss_median": med([p["final_loss"] for p in per]),
            "held_out_loss_median": med([p["held_out_loss"] for p in per]),
            "max_step_factor": max(p["jumps"]["max_step_factor"] for p in per),
            "totals_sequences": [p["totals_sequence"] for p in per],
        }
    print("\n| config | wall s (median) | / DDP | time to DDP's loss / DDP's | final loss | held-out loss | max jump |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, s in summary.items():
        if "wall_time_median" not in s:
            print(f"| {name} | crashed in every repeat: {s['crashed'][0]} | | | | | |")
            continue
        ttl = s["time_to_ddp_loss_ratio_median"]
        print(
            f"| {name} | {s['wall_time_median']:.1f} | {s['wall_ratio_to_ddp_median']:.2f}x | "
            f"{'not reached' if ttl is None else f'{ttl:.2f}x'} | {s['final_loss_median']:.3f} | "
            f"{s['held_out_loss_median']:.3f} | {s['max_step_factor']:.2f}x |"
        )
    setup = {
        "per_sample_ms": PER_SAMPLE_MS,
        "fixed_ms": FIXED_MS,
        "loader_batch": LOADER_BATCH,
        "max_batch_size": MAX_BATCH_SIZE,
        "block": BLOCK,
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "torch": torch.__version__,
        "lightning": pl.__version__,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"setup": setup, "summary": summary, "repeats": repeats}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
