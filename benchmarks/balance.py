"""Throughput of Cannikin's balanced split against Lightning DDP's even split, side by side.

Three emulated devices (per_sample_ms = 0.5, 1.0, 2.0; fixed_ms = 20), fixed total batch 96, scikit-learn digits.
Runs alternate DDP / Cannikin, repeated; the figure is the ratio of steady-state samples/s (epochs after the
planner's second re-plan), with medians over repeats. A homogeneous control (all devices equal) checks that
Cannikin costs nothing where there is nothing to balance.

    python benchmarks/balance.py [--repeats 3] [--epochs 5]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import median, run


def ideal_ratio(per_sample_ms: list[float], fixed_ms: float, total: int) -> float:
    """Even-split step time over the continuous optimum, from the emulated delays alone."""
    even = fixed_ms + max(per_sample_ms) * total / len(per_sample_ms)
    best = fixed_ms + total / sum(1.0 / a for a in per_sample_ms)
    return even / best


def steady_throughput(result: dict, skip_epochs: int) -> float:
    samples = sum(result["epoch_samples"][skip_epochs:])
    seconds = sum(result["epoch_times"][skip_epochs:])
    return samples / seconds


def prediction_error(result: dict) -> float | None:
    errors = [
        abs(h["predicted_step_time"] - h["measured_step_time"]) / h["measured_step_time"]
        for h in result["history"]
        if h.get("measured_step_time")
    ]
    return errors[-1] if errors else None


def scenario(name: str, per_sample_ms: list[float], args: argparse.Namespace) -> dict:
    batch = args.total_batch // len(per_sample_ms)
    runs: dict[str, list[dict]] = {"ddp": [], "cannikin": []}
    for repeat in range(args.repeats):
        for strategy in ("ddp", "cannikin"):
            result = run(f"{strategy}_fork", per_sample_ms, args.fixed_ms, batch, args.epochs, seed=repeat)
            result["throughput"] = steady_throughput(result, args.skip_epochs)
            runs[strategy].append(result)
            print(f"  {name} repeat {repeat} {strategy:8s} {result['throughput']:8.1f} samples/s", flush=True)
    ratios = [c["throughput"] / d["throughput"] for d, c in zip(runs["ddp"], runs["cannikin"], strict=True)]
    errors = [e for e in (prediction_error(r) for r in runs["cannikin"]) if e is not None]
    return {
        "per_sample_ms": per_sample_ms,
        "fixed_ms": args.fixed_ms,
        "total_batch_size": args.total_batch,
        "ddp_samples_per_s": median([r["throughput"] for r in runs["ddp"]]),
        "cannikin_samples_per_s": median([r["throughput"] for r in runs["cannikin"]]),
        "ratio_median": median(ratios),
        "ratios": ratios,
        "ideal_ratio": ideal_ratio(per_sample_ms, args.fixed_ms, args.total_batch),
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
    args = parser.parse_args(argv)
    report = {
        "heterogeneous": scenario("heterogeneous", [0.5, 1.0, 2.0], args),
        "homogeneous": scenario("homogeneous", [1.0, 1.0, 1.0], args),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for name, r in report.items():
        error = r["prediction_error_median"]
        print(
            f"{name:14s} cannikin/ddp = {r['ratio_median']:.2f}x (ideal {r['ideal_ratio']:.2f}x, runs"
            f" {', '.join(f'{x:.2f}' for x in r['ratios'])}); prediction error"
            f" {'n/a' if error is None else f'{100 * error:.1f}%'}; final splits {r['final_splits']}"
        )
    print(f"saved {args.out}")
    return report


if __name__ == "__main__":
    main()
