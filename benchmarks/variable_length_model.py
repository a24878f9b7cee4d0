"""Variable-length data, a MODEL-BASED ESTIMATE: predicted step times of cost-aware splitting, of sample-count
balancing and of DDP's even split, on real WordNet gloss lengths and emulated per-token device costs.

Nothing is trained or timed end to end here: every step time is the time model's prediction
``t_r = fixed_r + per_token_r * tokens_r (+ per_square_r * sum of squared lengths_r)`` for the split each method makes,
and the step lasts ``max_r t_r``. The measured benchmark is ``benchmarks/variable_length.py`` (it takes its ideal
ratios from :func:`compare` here).

Methods, over many global batches of ``B`` consecutive samples of a seeded permutation:

- ``cost_aware``: :func:`~lightning_cannikin.core.cost_split.split_by_cost` on the batch's own lengths;
- ``sample_count``: today's Cannikin: OptPerf counts from each device's per-sample time at the data set's mean length
  (what the planner's fitted slope converges to), contiguous slices of the batch;
- ``ddp``: an even split, contiguous slices;
- ``ideal``: a bound no split beats (:func:`~lightning_cannikin.core.cost_split.lower_bound`), or the brute-force
  optimum where the batch is small enough to enumerate (``small_batch``).

Ratios are throughputs (samples per second over all batches: the inverse ratio of summed step times); per-batch
medians are reported beside them. It also measures the assignment itself: its ratio to the brute-force optimum on
small random cases (lengths varying >= 4x, random heterogeneous linear and quadratic rank models), how much worse
sample-count balancing is there, and the time to split a 1,024-sample batch across 64 ranks.

    python benchmarks/variable_length_model.py [--batches 1000] [--cases 2000]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from examples.varlen_data import gloss_lengths, length_statistics, wordnet_available
from lightning_cannikin.core.cost_split import lower_bound, predicted_times, split_by_cost
from lightning_cannikin.core.optperf import optimal_split
from lightning_cannikin.core.plan import even_split

RESULTS = Path(__file__).resolve().parent / "results" / "variable_length_model.json"
PER_TOKEN_MS = [0.04, 0.02, 0.01]  # devices of speed 1x : 2x : 4x
FIXED_MS = [1.0, 1.0, 1.0]


def brute_force(costs, fixed, per_cost, squares=None, per_square=None) -> float:
    """The best step time over every assignment that leaves no rank empty (vectorised enumeration)."""
    m, n = len(costs), len(fixed)
    work = np.outer(costs, per_cost) + (0.0 if per_square is None else np.outer(squares, per_square))
    assignment = np.array(list(itertools.product(range(n), repeat=m)), dtype=np.int64)
    onehot = assignment[:, :, None] == np.arange(n)
    loads = np.asarray(fixed)[None, :] + np.einsum("asr,sr->ar", onehot, work)
    feasible = onehot.any(axis=1).all(axis=1)
    return float(loads[feasible].max(axis=1).min())


def contiguous(counts) -> np.ndarray:
    """The rank of each position of a batch split into contiguous slices of ``counts``."""
    return np.repeat(np.arange(len(counts)), counts)


def compare(
    lengths: np.ndarray, batch: int, batches: int, quadratic: float, exact: bool, copies: int = 1, seed: int = 0
) -> dict:
    """Predicted step times of the three methods and the ideal over ``batches`` global batches of real lengths, on
    ``copies`` of each of the three devices."""
    fixed, per_cost = np.tile(FIXED_MS, copies), np.tile(PER_TOKEN_MS, copies)
    per_square = per_cost * quadratic if quadratic else None
    # today's planner: the per-sample slope it fits converges to the per-token cost at the data set's mean length
    per_sample = per_cost * lengths.mean() + (0.0 if per_square is None else per_square * np.mean(lengths**2.0))
    counts = optimal_split(per_sample, fixed, batch).local_batch_sizes
    even = even_split(batch, len(fixed))
    batches = min(batches, len(lengths) // batch)  # an epoch's worth at most: every sample once
    order = np.random.default_rng(seed).permutation(len(lengths))[: batch * batches].reshape(batches, batch)
    times: dict[str, list[float]] = {"cost_aware": [], "sample_count": [], "ddp": [], "ideal": []}
    for positions in order:
        costs = lengths[positions].astype(np.float64)
        squares = costs**2 if quadratic else None
        model = (fixed, per_cost, squares, per_square)
        times["cost_aware"].append(split_by_cost(costs, *model).step_time)
        times["sample_count"].append(float(predicted_times(contiguous(counts), costs, *model).max()))
        times["ddp"].append(float(predicted_times(contiguous(even), costs, *model).max()))
        times["ideal"].append(brute_force(costs, *model) if exact else lower_bound(costs, *model))
    t = {k: np.array(v) for k, v in times.items()}

    def throughput(a: str, b: str) -> float:  # a's samples per second over b's
        return float(t[b].sum() / t[a].sum())

    return {
        "global_batch": batch,
        "batches": batches,
        "per_token_ms": per_cost.tolist(),
        "fixed_ms": fixed.tolist(),
        "per_square_ms": None if per_square is None else per_square.tolist(),
        "sample_count_split": list(counts),
        "ideal_is": "brute-force optimum" if exact else "lower bound (fractional split; no assignment beats it)",
        "median_step_ms": {k: float(np.median(v)) for k, v in t.items()},
        "throughput_ratios": {
            "cost_aware_vs_sample_count": throughput("cost_aware", "sample_count"),
            "cost_aware_vs_ddp": throughput("cost_aware", "ddp"),
            "sample_count_vs_ddp": throughput("sample_count", "ddp"),
            "ideal_vs_sample_count": throughput("ideal", "sample_count"),
            "ideal_vs_ddp": throughput("ideal", "ddp"),
            "cost_aware_vs_ideal": throughput("cost_aware", "ideal"),
        },
        "median_per_batch_ratios": {
            "cost_aware_vs_sample_count": float(np.median(t["sample_count"] / t["cost_aware"])),
            "cost_aware_vs_ddp": float(np.median(t["ddp"] / t["cost_aware"])),
            "cost_aware_vs_ideal": float(np.median(t["ideal"] / t["cost_aware"])),
        },
        "worst_cost_aware_over_ideal": float(np.max(t["cost_aware"] / t["ideal"])),
    }


def assignment_quality(cases: int, seed: int = 0) -> dict:
    """The split's step time over the brute-force optimum on small random cases (3 ranks, 3..10 samples)."""
    rng = np.random.default_rng(seed)
    found: dict[str, list[float]] = {"split_by_cost": [], "local_search_only": [], "sample_count": []}
    for _ in range(cases):
        m, n = int(rng.integers(3, 11)), 3
        low = int(rng.integers(2, 20))
        costs = rng.integers(low, 8 * low + 1, size=m).astype(np.float64)
        costs[:2] = [low, 4 * low]  # lengths vary at least 4x
        rng.shuffle(costs)
        fixed, per_cost = rng.uniform(0.0, 2.0, n), rng.uniform(0.005, 0.05, n)
        quadratic = rng.random() < 0.3
        squares, per_square = (costs**2, rng.uniform(0.0, 0.002, n)) if quadratic else (None, None)
        case = (costs, fixed, per_cost, squares, per_square)
        best = brute_force(*case)
        found["split_by_cost"].append(split_by_cost(*case).step_time / best)
        found["local_search_only"].append(split_by_cost(*case, exact_samples=0).step_time / best)
        per_sample = per_cost * costs.mean() + (0.0 if per_square is None else per_square * squares.mean())
        counts = optimal_split(per_sample, fixed, m).local_batch_sizes
        found["sample_count"].append(float(predicted_times(contiguous(counts), *case).max()) / best)
    return {
        "cases": cases,
        **{
            name: {
                "worst_ratio_to_optimum": float(np.max(r)),
                "median_ratio_to_optimum": float(np.median(r)),
                "mean_ratio_to_optimum": float(np.mean(r)),
                "share_optimal": float(np.mean(np.array(r) <= 1 + 1e-9)),
                "share_within_5_percent": float(np.mean(np.array(r) <= 1.05)),
            }
            for name, r in found.items()
        },
    }


def assignment_time(m: int = 1024, n: int = 64, repeats: int = 30, seed: int = 0) -> dict:
    """Wall time of one split of ``m`` samples (real-like lengths 1..60) across ``n`` ranks of 1x/2x/4x speeds."""
    rng = np.random.default_rng(seed)
    per_cost, fixed = np.resize(PER_TOKEN_MS, n), rng.uniform(0.5, 1.5, n)
    seconds, gaps = [], []
    for _ in range(repeats):
        costs = rng.integers(1, 61, size=m).astype(np.float64)
        start = time.perf_counter()
        split = split_by_cost(costs, fixed, per_cost)
        seconds.append(time.perf_counter() - start)
        gaps.append(split.step_time / lower_bound(costs, fixed, per_cost))
    return {
        "samples": m,
        "ranks": n,
        "median_ms": 1e3 * float(np.median(seconds)),
        "min_ms": 1e3 * float(np.min(seconds)),
        "median_ratio_to_lower_bound": float(np.median(gaps)),
        "worst_ratio_to_lower_bound": float(np.max(gaps)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=1000)
    parser.add_argument("--cases", type=int, default=2000)
    args = parser.parse_args()
    if not wordnet_available():
        sys.exit("WordNet is not installed: `apt-get install wordnet-base` (the lengths are real gloss lengths).")
    lengths = gloss_lengths()
    median_length = int(np.median(lengths))
    report = {
        "kind": "model-based estimate: predicted step times, nothing trained or timed end to end",
        "data": {"source": "WordNet glosses (Debian wordnet-base), tokens = words and punctuation"}
        | length_statistics(lengths),
        "scenarios": {
            "linear": compare(lengths, 64, args.batches, 0.0, exact=False),
            "attention": compare(lengths, 64, args.batches, 1.0 / 64, exact=False),
            "equal_lengths": compare(np.full_like(lengths, median_length), 64, args.batches, 0.0, exact=False),
            "small_batch": compare(lengths, 9, min(args.batches, 300), 0.0, exact=True),
            "twelve_ranks": compare(lengths, 64, args.batches, 0.0, exact=False, copies=4),
        },
        # the gain shrinks as a rank's summed length averages over more samples
        "batch_sweep": {
            str(batch): compare(lengths, batch, args.batches, 0.0, exact=False)["throughput_ratios"]
            for batch in (16, 32, 64, 128, 256)
        },
        "assignment_quality": assignment_quality(args.cases),
        "assignment_time": assignment_time(),
    }
    linear, equal = report["scenarios"]["linear"], report["scenarios"]["equal_lengths"]
    keys = ("cost_aware_vs_sample_count", "cost_aware_vs_sample_count_equal_lengths", "cost_aware_vs_ddp")
    picked = (linear, equal, linear)
    report["ratios"] = {
        key: s["throughput_ratios"][key.replace("_equal_lengths", "")] for key, s in zip(keys, picked, strict=True)
    }
    report["ideal"] = {
        key: s["throughput_ratios"][key.replace("cost_aware", "ideal").replace("_equal_lengths", "")]
        for key, s in zip(keys, picked, strict=True)
    }
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("ratios", "ideal", "assignment_time")}, indent=2))


if __name__ == "__main__":
    main()
