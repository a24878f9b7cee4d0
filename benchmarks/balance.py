"""Throughput of Cannikin's balanced split against Lightning DDP's even split, side by side.

Three emulated devices, fixed total batch 96, scikit-learn digits. Runs alternate DDP / Cannikin, repeated; the
figure is the ratio of steady-state samples/s (epochs after the planner's second re-plan), with medians over
repeats, beside the ideal ratio the emulated delays allow (even split over the exact OptPerf split, the real
compute left out). Scenarios:

- ``heterogeneous``: per_sample_ms 0.5, 1.0, 2.0 and fixed_ms 20 on every device;
- ``homogeneous``: all devices equal: a control, Cannikin must cost nothing where there is nothing to balance;
- ``unequal_intercepts``: per_sample_ms 0.5, 1.0, 2.0 and fixed_ms 10, 20, 30 (a speed-proportional split is wrong);
- ``jittery``: the heterogeneous devices with 3 ms of per-step jitter and first steps up to 3x slower;
- ``saturation``: 0.6, 1.6, 4.0 ms per sample, 20 ms fixed, flat below 160, 64, 24 samples, total 192;
- ``contention``: the heterogeneous devices' costs times three (1.5, 3, 6 ms per sample, 60 ms fixed), the fastest
  one 2.5x slower every third step (a shared GPU);
- ``slowdown``: the same three devices, the fastest one becoming 4x slower mid-epoch (step 40);
- ``host_input``: the contention devices (1.5, 3, 6 ms per sample, 60 ms fixed) on equal hosts that spend 2 ms per
  sample preparing each batch in the input pipeline (the loader's ``collate_fn``, no workers: outside the device's
  step, in series with it). The best split (44/32/20) is less skewed than the devices' alone (54/28/14, 1.13x its
  time; the even split 1.44x);
- ``unequal_hosts``: equal devices (3 ms per sample, 60 ms fixed) on hosts of 0.5, 2 and 4 ms per sample: only the
  input pipeline tells the ranks apart (best 44/30/22; the even split 1.33x its time);
- ``optimizer_steps``: the contention devices whose optimizer steps, after the all-reduce, take 10, 20 and 40 ms (a
  slower device's optimizer is slower too), outside the compute span. Lightning's loop (from 2.5.2) broadcasts from
  rank zero at each step's start, so rank zero and rank 2 go on 40 ms after the all-reduce and rank 1 after 20: the
  best split is 51/32/13 (the even split 1.64x its time, the devices' alone, 54/28/14, 1.03x). Without that meeting
  (older Lightning, a Fabric loop) each rank would go on after its own: best 60/26/10, the even split 1.83x.

Their costs are larger than the old scenarios' so that this shared machine's own cost of a step (30-45 ms under
the load of the final runs, in both strategies) is not most of it: it shrinks every measured ratio towards 1. The
new scenarios train a softmax regression instead of the CNN (:class:`SoftmaxRegression`: the devices are then
the emulated ones), saturation on the digits four times over (30 steps an epoch instead of 8, whose epoch ends
would otherwise weigh like nothing real) for 6 epochs, the others for 10. Their ideal is found by brute force over
every split under the emulated costs (contention and a speed change included): the even split's time over the best
split's, the best taken apart before and after a change of speed and for an epoch's shorter last step, over the
steady-state steps. ``emulated_ratio_median`` is the even split's emulated time over that of the splits Cannikin
really ran: the ratio the planner reached, without this machine's own per-step costs; ``steady_step_ms`` is the
wall time per steady step of each strategy.

    python benchmarks/balance.py [--repeats 3] [--epochs 5] [--only saturation contention slowdown]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
from torch import nn
from torch.utils.data import TensorDataset

from benchmarks.harness import median, run
from examples.data import ImageClassifier, load_dataset
from lightning_cannikin.core.optperf import optimal_split, step_time
from lightning_cannikin.core.plan import even_split
from lightning_cannikin.simulation.emulated_devices import EmulatedDevices
from lightning_cannikin.training.emulator import loop_meets_each_step


class SoftmaxRegression(ImageClassifier):
    """One linear layer on the digits: a model whose own compute is negligible beside the emulated costs.

    The new scenarios train it instead of the CNN: on this shared two-core machine the CNN's real compute grows with
    the local batch at about the rate of the fastest emulated device (the saturation run with the CNN ran 284 ms a
    step where its splits' emulated cost was 140 ms, DDP 331 ms for 270 ms), so a balanced split was measured against
    devices that were not the emulated ones. With this model, the devices are the emulated ones, and what is left of
    the machine is a per-step cost shared by both strategies.
    """

    def __init__(self, image_shape: tuple[int, ...] = (1, 8, 8), lr: float = 0.05, num_classes: int = 10) -> None:
        super().__init__(image_shape, lr, num_classes)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(image_shape)), num_classes))


def light_task(seed: int, copies: int = 1) -> tuple:
    """The digits (``copies`` times over: longer epochs) and :class:`SoftmaxRegression`, as
    ``benchmarks.harness.run``'s ``task``."""
    train, test, shape = load_dataset("digits", seed=seed)
    if copies > 1:
        train = TensorDataset(*(t.repeat(copies, *[1] * (t.dim() - 1)) for t in train.tensors))
    return train, test, lambda: SoftmaxRegression(shape), 10


def ideal_ratio(per_sample_ms: list[float], fixed_ms: float | list[float], total: int) -> float:
    """Even-split step time over the best integer split's, from the emulated delays alone."""
    n = len(per_sample_ms)
    fixed = fixed_ms if isinstance(fixed_ms, list) else [float(fixed_ms)] * n
    slopes, offsets = np.array(per_sample_ms)[:, None], np.array(fixed)[:, None]
    return step_time(slopes, offsets, even_split(total, n)) / optimal_split(slopes, offsets, total).step_time


def emulated_costs(
    emulated: dict, per_sample_ms: list[float], fixed: float | list[float], total: int, steps: range
) -> tuple[np.ndarray, EmulatedDevices]:
    """Every rank's clean emulated cost (contention and speed changes included) at every step of ``steps`` and every
    local batch size up to ``total``: ``(n, len(steps), total + 1)`` milliseconds."""
    options = {k: v for k, v in emulated.items() if k not in ("jitter_ms", "warmup_steps", "warmup_factor")}
    devices = EmulatedDevices(per_sample_ms, fixed, **options)
    n = len(per_sample_ms)
    # from the all-reduce: the optimizer steps as the loop lets each rank go on (Lightning's broadcast from rank zero
    # at each step's start, where it has one), then the rank's host prepares its batch and its device runs it
    meeting = "broadcast" if loop_meets_each_step() else "none"
    costs = np.array([[[devices.step_ms(r, b, s, meeting) for b in range(total + 1)] for s in steps] for r in range(n)])
    return costs, devices


def three_way_splits(total: int) -> np.ndarray:
    """Every split of ``total`` over three ranks with at least one sample each: ``(splits, 3)``."""
    first = np.repeat(np.arange(1, total - 1), np.arange(total - 2, 0, -1))
    second = np.concatenate([np.arange(1, total - a) for a in range(1, total - 1)])
    return np.stack([first, second, total - first - second], axis=1)


def brute_ideal_ratio(
    emulated: dict, per_sample_ms: list[float], fixed: float | list[float], totals: list[int], steps: range
) -> float:
    """Even-split time over the best split's under the emulated costs, summed over ``steps``, by brute force over
    every split of each step's total ``totals[step]`` (the best chosen apart between changes of speed, and for an
    epoch's shorter last step apart)."""
    costs, devices = emulated_costs(emulated, per_sample_ms, fixed, max(totals), steps)
    n = len(per_sample_ms)
    assert n == 3, "brute force over the splits of three ranks"
    step_totals = np.array([totals[s] for s in steps])
    bounds = [0] + [i for i, s in enumerate(steps) if s in devices.speed_changes] + [len(steps)]
    best = 0.0
    for start, end in itertools.pairwise(bounds):
        for total in set(step_totals[start:end].tolist()):
            rows = start + np.flatnonzero(step_totals[start:end] == total)
            splits = three_way_splits(total)
            window = costs[:, rows, :]  # (n, S, max total + 1)
            per_split = np.max([window[r][:, splits[:, r]] for r in range(n)], axis=0).sum(axis=0)  # (splits,)
            best += float(per_split.min())
    return float(split_time(costs, [even_split(int(t), n) for t in step_totals]) / best)


def split_time(costs: np.ndarray, sizes: list[list[int]]) -> float:
    """The emulated time of running ``sizes[k]`` at the ``k``-th step of ``costs`` (the slowest rank of each)."""
    n, steps = costs.shape[0], costs.shape[1]
    index = np.array(sizes)  # (steps, n)
    return float(costs[np.arange(n)[None, :], np.arange(steps)[:, None], index].max(axis=1).sum())


def emulated_ratio(
    result: dict, emulated: dict, per_sample_ms: list[float], fixed: float | list[float], steps: range
) -> float | None:
    """The even split's emulated time over that of the splits a run really ran, over ``steps``: the planner's share of
    the ratio, without this machine's own per-step costs (the real compute, the collectives)."""
    sizes = result.get("step_sizes") or []
    if len(sizes) < steps.stop or any(sizes[s] is None for s in steps):
        return None
    n = len(per_sample_ms)
    ran = [sizes[s] for s in steps]
    costs, _ = emulated_costs(emulated, per_sample_ms, fixed, max(sum(b) for b in ran), steps)
    return split_time(costs, [even_split(sum(b), n) for b in ran]) / split_time(costs, ran)


def steady_throughput(result: dict, skip_epochs: int) -> float:
    samples = sum(result["epoch_samples"][skip_epochs:])
    seconds = sum(result["epoch_times"][skip_epochs:])
    return samples / seconds


def steady_step_ms(result: dict, total: int, args: argparse.Namespace) -> float:
    """Wall milliseconds per step over the steady-state epochs."""
    return 1000.0 * sum(result["epoch_times"][args.skip_epochs :]) / len(steady_steps(result, total, args))


def step_totals(result: dict, total: int) -> list[int]:
    """Every step's total batch: ``total``, and an epoch's last step what is left of its samples."""
    totals = []
    for samples in result["epoch_samples"]:
        full, rest = divmod(samples, total)
        totals += [total] * full + ([rest] if rest else [])
    return totals


def steady_steps(result: dict, total: int, args: argparse.Namespace) -> range:
    """The training steps of the steady-state epochs."""
    per_epoch = [-(-samples // total) for samples in result["epoch_samples"]]
    return range(sum(per_epoch[: args.skip_epochs]), sum(per_epoch))


def prediction_error(result: dict) -> float | None:
    errors = [
        abs(h["predicted_step_time"] - h["measured_step_time"]) / h["measured_step_time"]
        for h in result["history"]
        if h.get("measured_step_time")
    ]
    return errors[-1] if errors else None


def scenario(
    name: str,
    per_sample_ms: list[float],
    args: argparse.Namespace,
    fixed_ms: float | list[float] | None = None,
    emulated: dict | None = None,
    total: int | None = None,
    brute_force: bool = False,
    epochs: int | None = None,
    light: int = 0,
) -> dict:
    """One scenario, DDP and Cannikin interleaved over ``args.repeats``; ``light``: train :class:`SoftmaxRegression` on
    this many copies of the digits (0: the CNN on the digits)."""
    total = args.total_batch if total is None else total
    epochs = args.epochs if epochs is None else epochs
    batch = total // len(per_sample_ms)
    fixed = args.fixed_ms if fixed_ms is None else fixed_ms
    runs: dict[str, list[dict]] = {"ddp": [], "cannikin": []}
    for repeat in range(args.repeats):
        for strategy in ("ddp", "cannikin"):
            task = light_task(repeat, light) if light else None
            result = run(
                f"{strategy}_fork", per_sample_ms, fixed, batch, epochs, seed=repeat, emulated=emulated, task=task
            )
            result["throughput"] = steady_throughput(result, args.skip_epochs)
            runs[strategy].append(result)
            print(f"  {name} repeat {repeat} {strategy:8s} {result['throughput']:8.1f} samples/s", flush=True)
    ratios = [c["throughput"] / d["throughput"] for d, c in zip(runs["ddp"], runs["cannikin"], strict=True)]
    errors = [e for e in (prediction_error(r) for r in runs["cannikin"]) if e is not None]
    steps = steady_steps(runs["ddp"][0], total, args)
    planner = [emulated_ratio(r, emulated or {}, per_sample_ms, fixed, steps) for r in runs["cannikin"]]
    planner = [p for p in planner if p is not None]
    return {
        "per_sample_ms": per_sample_ms,
        "fixed_ms": fixed,
        "emulated": emulated or {},
        "total_batch_size": total,
        "model": "softmax regression" if light else "CNN",
        "ddp_samples_per_s": median([r["throughput"] for r in runs["ddp"]]),
        "cannikin_samples_per_s": median([r["throughput"] for r in runs["cannikin"]]),
        "ratio_median": median(ratios),
        "ratios": ratios,
        "ideal_ratio": (
            brute_ideal_ratio(emulated or {}, per_sample_ms, fixed, step_totals(runs["ddp"][0], total), steps)
            if brute_force
            else ideal_ratio(per_sample_ms, fixed, total)
        ),
        # the even split's emulated time over that of the splits Cannikin ran: the ratio without this machine's costs
        "emulated_ratio_median": median(planner) if planner else None,
        "emulated_ratios": planner,
        # measured wall time per steady step, beside the emulated time of the splits each strategy ran
        "steady_step_ms": {k: median([steady_step_ms(r, total, args) for r in v]) for k, v in runs.items()},
        "prediction_error_median": median(errors) if errors else None,
        "final_splits": [r["history"][-1]["local_batch_sizes"] for r in runs["cannikin"] if r["history"]],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--skip-epochs", type=int, default=2, help="epochs left out of the steady state")
    parser.add_argument("--total-batch", type=int, default=96)
    parser.add_argument("--fixed-ms", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "balance.json")
    parser.add_argument("--only", nargs="*", default=None, help="run only these scenarios")
    args = parser.parse_args(argv)

    def slow_scenario(name: str, per_sample_ms: list[float], emulated: dict) -> dict:
        """Devices with 60 ms of fixed cost a step and what real ones do (``emulated``), on the softmax regression,
        judged against the brute-force best split, for at least 10 epochs."""
        epochs = max(args.epochs, 10)
        return scenario(name, per_sample_ms, args, 60.0, emulated, brute_force=True, light=1, epochs=epochs)

    scenarios = {
        "heterogeneous": lambda: scenario("heterogeneous", [0.5, 1.0, 2.0], args),
        "homogeneous": lambda: scenario("homogeneous", [1.0, 1.0, 1.0], args),
        "unequal_intercepts": lambda: scenario(
            "unequal_intercepts", [0.5, 1.0, 2.0], args, fixed_ms=[10.0, 20.0, 30.0]
        ),
        "jittery": lambda: scenario(
            "jittery", [0.5, 1.0, 2.0], args, emulated={"jitter_ms": 3.0, "warmup_steps": 4, "warmup_factor": 3.0}
        ),
        "saturation": lambda: scenario(
            "saturation",
            [0.6, 1.6, 4.0],
            args,
            fixed_ms=20.0,
            emulated={"saturation_batch": [160.0, 64.0, 24.0]},
            total=192,
            brute_force=True,
            light=4,
            epochs=max(args.epochs, 6),
        ),
        "contention": lambda: slow_scenario("contention", [1.5, 3.0, 6.0], {"contention": {0: (2.5, 3)}}),
        "slowdown": lambda: slow_scenario("slowdown", [1.5, 3.0, 6.0], {"speed_changes": {40: [6.0, 3.0, 6.0]}}),
        "host_input": lambda: slow_scenario("host_input", [1.5, 3.0, 6.0], {"host_per_sample_ms": 2.0}),
        "unequal_hosts": lambda: slow_scenario("unequal_hosts", [3.0] * 3, {"host_per_sample_ms": [0.5, 2.0, 4.0]}),
        "optimizer_steps": lambda: slow_scenario("optimizer_steps", [1.5, 3.0, 6.0], {"optimizer_ms": [10, 20, 40]}),
    }
    names = list(scenarios) if args.only is None else args.only
    report = json.loads(args.out.read_text()) if args.only is not None and args.out.exists() else {}
    report.update({name: scenarios[name]() for name in names})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for name, r in report.items():
        error = r["prediction_error_median"]
        planned = r.get("emulated_ratio_median")
        print(
            f"{name:14s} cannikin/ddp = {r['ratio_median']:.2f}x (ideal {r['ideal_ratio']:.2f}x,"
            f" {100 * r['ratio_median'] / r['ideal_ratio']:.0f}% of it; the splits run"
            f" {'n/a' if planned is None else f'{planned:.2f}x'} under the emulated costs alone; runs"
            f" {', '.join(f'{x:.2f}' for x in r['ratios'])}); prediction error"
            f" {'n/a' if error is None else f'{100 * error:.1f}%'}; final splits {r['final_splits']}"
        )
    print(f"saved {args.out}")
    return report


if __name__ == "__main__":
    main()
