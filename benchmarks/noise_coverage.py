"""Run-level coverage of the noise-scale bounds: how often, over a whole run, the lower bound ever exceeds the truth.

The engine acts (grows the total batch) as soon as the lower bound of the noise scale proves a move, and it looks
after every update, so what matters is the fraction of *runs* in which ``low`` is ever above the true noise scale,
not the fraction of checks. This runs the synthetic problem of ``tests/test_noise_scale.py`` (per-sample gradients of
``|G|^2 = 1`` and isotropic covariance of trace ``phi`` in 64 dimensions, two groups of 5/8 and 3/8 of the total) with
``NoiseScaleEstimator(64)`` and compares, per cell:

- ``bounds(2.0)``, the per-look 2-sigma bounds the engine used, and
- ``window_bounds(level)``, the run-level bounds of the run's moving average alone (what ``run_bounds`` returned
  before the straight-line fit that reads the present), and
- ``run_bounds(level)``, the run-level bounds (``level`` 0.05 by default),

reporting the per-run rate of ``low > truth`` (with a 95% Wilson upper bound over the seeds), the per-check rate,
the worst ``low / truth``, the median update at which ``low`` first reaches ``truth / 2`` (the speed cost of the
wider bound; ``null`` when fewer than half the seeds reach it; ``reached`` is the fraction that did), and the share of
these stationary runs in which the recent window saw a change that is not there (``restarted``).

Then a *fall*: the noise scale drops by 4x and by 32x at B0 every step (``FALLS``), and each run reports the update,
counted from the fall, from which the run-level ``low`` stays at or below the new truth, with the recent window and
the straight-line fit (the default, ``followed``), with the fit alone (``fit_only``: ``follow_changes=False``) and with
neither (``not_followed``: the window's bounds alone).

Then *trends* (``TRENDS``): the noise scale rises 3x (or falls 3x) evenly over 1,000 updates at B0 every step, then
stays for 500, and each cell reports, over ``TREND_SEEDS`` runs, for the window's bounds alone (``before``) and for
``run_bounds`` (``after``): the median ``low / truth`` and the median lag of ``low`` and of the point estimate (the
average before, the fit's present after), in updates (how long ago the truth had that value, at the middle and at the
end of the ramp), the share of runs in which ``low`` ever exceeds the *current* truth during the ramp and after it,
and the worst ``low / truth``.

    python benchmarks/noise_coverage.py [--seeds 400] [--level 0.05] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from lightning_cannikin.core.noise_scale import NoiseScaleEstimator

BASE = 64
DIM = 64
NOISE_SCALES = (64.0, 250.0, 1000.0, 4000.0)
# (name, total batch, one update measured in `every` steps, updates)
REGIMES = (
    ("B0 every step", 64, 1, 2000),
    ("1024 one step in 8", 1024, 8, 1000),
    ("B0 every step, long", 64, 1, 6000),
)
# (before, after, updates before the fall, updates after it), all at B0 every step
FALLS = ((1000.0, 250.0, 2000, 3000), (3200.0, 100.0, 2000, 4000))
FALL_SEEDS = 100
# (direction, noise scale at the start, at the end of the ramp), a ramp of TREND_RAMP updates, then TREND_FLAT more
TRENDS = (
    ("rise", 64.0, 192.0),
    ("fall", 192.0, 64.0),
    ("rise", 250.0, 750.0),
    ("fall", 750.0, 250.0),
    ("rise", 1000.0, 3000.0),
    ("fall", 3000.0, 1000.0),
)
TREND_RAMP, TREND_FLAT, TREND_SEEDS = 1000, 500, 100
RESULTS = Path(__file__).parent / "results" / "noise_coverage.json"


def norms(
    noise_scale: float | np.ndarray, seed: int, updates: int, total: int
) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """``Z`` (updates x 2) and ``Y`` (updates) of the synthetic problem, drawn at once (the estimator is the cost);
    ``noise_scale`` is one value or one per update."""
    rng = np.random.default_rng(seed)
    sizes = np.array([total * 5 // 8, total - total * 5 // 8], dtype=float)
    mean = np.ones(DIM) / math.sqrt(DIM)
    scales = np.broadcast_to(np.asarray(noise_scale, dtype=float), (updates,))
    noise = rng.standard_normal((updates, 2, DIM)) * np.sqrt(scales[:, None, None] / DIM / sizes[None, :, None])
    groups = mean + noise
    reduced = (sizes[None, :, None] * groups).sum(axis=1) / sizes.sum()
    return (groups**2).sum(axis=2), (reduced**2).sum(axis=1), sizes.tolist()


def one_run(noise_scale: float, seed: int, updates: int, total: int, every: int, level: float) -> dict:
    """Per width: whether ``low`` ever exceeded the truth, in how many checks, its worst ratio, first reach of half."""
    z, y, sizes = norms(noise_scale, seed, updates, total)
    estimator = NoiseScaleEstimator(BASE)
    widths = {
        "old_2sigma": lambda: estimator.bounds(2.0),
        "window_only": lambda: estimator.window_bounds(level),
        "run_level": lambda: estimator.run_bounds(level),
    }
    out = {name: {"checks": 0, "above": 0, "worst": 0.0, "half_at": None} for name in widths}
    out["restarted"] = False
    for step in range(updates):
        estimator.update(z[step], sizes, float(y[step]), steps=every)
        for name, get in widths.items():
            bounds = get()
            if bounds is None:
                continue
            row, ratio = out[name], bounds[0] / noise_scale
            row["checks"] += 1
            row["above"] += ratio > 1.0
            row["worst"] = max(row["worst"], ratio)
            if row["half_at"] is None and ratio >= 0.5:
                row["half_at"] = step
    out["restarted"] = estimator.restarts > 0
    return out


def back_under(before: float, after: float, seed: int, ahead: int, behind: int, follow: bool, trend: bool) -> int:
    """Updates after the fall from which the run-level ``low`` stays at or below the new truth (``behind`` if never)."""
    rng_seed = 1_000_000 + seed
    z_before, y_before, sizes = norms(before, rng_seed, ahead, BASE)
    z_after, y_after, _ = norms(after, rng_seed + 1, behind, BASE)
    estimator = NoiseScaleEstimator(BASE, follow_changes=follow, follow_trend=trend)
    for step in range(ahead):
        estimator.update(z_before[step], sizes, float(y_before[step]))
    last_above = -1
    for step in range(behind):
        estimator.update(z_after[step], sizes, float(y_after[step]))
        bounds = estimator.run_bounds()
        if bounds is not None and bounds[0] > after:
            last_above = step
    return last_above + 1


def falls(seeds: int) -> list[dict]:
    out = []
    for before, after, ahead, behind in FALLS:
        row: dict = {"before": before, "after": after, "updates_before": ahead, "updates_after": behind}
        for name, follow, trend in (
            ("followed", True, True),
            ("fit_only", False, True),
            ("not_followed", False, False),
        ):
            back = sorted(back_under(before, after, seed, ahead, behind, follow, trend) for seed in range(seeds))
            row[name] = {
                "median_updates_until_low_stays_under": float(np.median(back)),
                "max_updates_until_low_stays_under": back[-1],
                "never_back": sum(b >= behind for b in back) / seeds,
            }
        print(f"fall {before:.0f} -> {after:.0f}: {row}", flush=True)
        out.append(row)
    return out


def trend_run(start: float, end: float, seed: int, level: float) -> dict:
    """One run of a ramp from ``start`` to ``end`` over ``TREND_RAMP`` updates, then ``TREND_FLAT`` at ``end``: per
    side (``before``: the window's bounds and average; ``after``: ``run_bounds`` and the fit's present), ``low / truth``
    and the lags of ``low`` and of the point estimate at the middle and the end of the ramp, and the worst
    ``low / truth`` during the ramp and after it."""
    slope = (end - start) / (TREND_RAMP - 1)
    truth = np.r_[start + slope * np.arange(TREND_RAMP), np.full(TREND_FLAT, end)]
    z, y, sizes = norms(truth, 2_000_000 + seed, len(truth), BASE)
    estimator = NoiseScaleEstimator(BASE)
    sides = {
        "before": (lambda: estimator.window_bounds(level), lambda: estimator.noise_scale),
        "after": (lambda: estimator.run_bounds(level), lambda: estimator.present_noise_scale),
    }
    out = {name: {"worst_ramp": 0.0, "worst_after": 0.0} for name in sides}
    marks = {"mid": TREND_RAMP // 2, "end": TREND_RAMP - 1}

    def lag(value: float | None, step: int) -> float:
        """Updates since the truth had ``value`` (on the ramp's line, so beyond its start where it is further)."""
        return math.nan if value is None or not math.isfinite(value) else step - (value - start) / slope

    for step in range(len(truth)):
        estimator.update(z[step], sizes, float(y[step]))
        for name, (get_bounds, get_point) in sides.items():
            bounds, row = get_bounds(), out[name]
            low = math.nan if bounds is None else bounds[0]
            if bounds is not None:
                key = "worst_ramp" if step < TREND_RAMP else "worst_after"
                row[key] = max(row[key], low / truth[step])
            for mark, at in marks.items():
                if step == at:
                    row[f"low_over_truth_{mark}"] = low / truth[step]
                    row[f"low_lag_{mark}"] = lag(None if bounds is None else low, step)
                    row[f"estimate_lag_{mark}"] = lag(get_point(), step)
    out["restarted"] = estimator.restarts > 0
    return out


def trends(seeds: int, level: float) -> list[dict]:
    out = []
    for direction, start, end in TRENDS:
        began = time.perf_counter()
        runs = [trend_run(start, end, seed, level) for seed in range(seeds)]
        row: dict = {"direction": direction, "start": start, "end": end, "ramp": TREND_RAMP, "flat": TREND_FLAT}
        for side in ("before", "after"):
            rows = [run[side] for run in runs]
            summary = {
                key: float(np.nanmedian([r[key] for r in rows]))
                for key in rows[0]
                if key.startswith(("low_over", "low_lag", "estimate_lag"))
            }
            summary["runs_low_above_current_on_ramp"] = sum(r["worst_ramp"] > 1.0 for r in rows) / seeds
            summary["runs_low_above_current_after_ramp"] = sum(r["worst_after"] > 1.0 for r in rows) / seeds
            summary["worst_low_over_truth"] = max(max(r["worst_ramp"], r["worst_after"]) for r in rows)
            row[side] = summary
        row["restarted"] = sum(run["restarted"] for run in runs) / seeds
        b, a = row["before"], row["after"]
        print(
            f"{direction} {start:.0f} -> {end:.0f}: low/truth at the end of the ramp {b['low_over_truth_end']:.3f}"
            f" -> {a['low_over_truth_end']:.3f}, lag of low {b['low_lag_end']:.0f} -> {a['low_lag_end']:.0f}"
            f" updates, of the estimate {b['estimate_lag_end']:.0f} -> {a['estimate_lag_end']:.0f}; runs with"
            f" low above the current truth on the ramp {b['runs_low_above_current_on_ramp']:.2f} ->"
            f" {a['runs_low_above_current_on_ramp']:.2f}, after it {b['runs_low_above_current_after_ramp']:.2f}"
            f" -> {a['runs_low_above_current_after_ramp']:.2f}; restarted {row['restarted']:.2f}"
            f" [{time.perf_counter() - began:.0f} s]",
            flush=True,
        )
        out.append(row)
    return out


def wilson_upper(hits: int, n: int, z: float = 1.96) -> float:
    """95% upper end of the Wilson interval of a binomial rate."""
    p = hits / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre + spread) / (1 + z * z / n)


def cell(noise_scale: float, total: int, every: int, updates: int, seeds: int, level: float) -> dict:
    runs = [one_run(noise_scale, seed, updates, total, every, level) for seed in range(seeds)]
    summary = {}
    for name in ("old_2sigma", "window_only", "run_level"):
        rows = [run[name] for run in runs]
        crossed = sum(row["worst"] > 1.0 for row in rows)
        half = sorted(math.inf if row["half_at"] is None else row["half_at"] for row in rows)
        median_half = float(np.median(half))
        summary[name] = {
            "runs_above": crossed / seeds,
            "runs_above_upper95": round(wilson_upper(crossed, seeds), 4),
            "checks_above": sum(row["above"] for row in rows) / max(sum(row["checks"] for row in rows), 1),
            "worst_low_over_truth": max(row["worst"] for row in rows),
            "median_update_low_reaches_half": None if math.isinf(median_half) else median_half,
            "reached_half": sum(math.isfinite(h) for h in half) / seeds,
        }
    summary["restarted"] = sum(run["restarted"] for run in runs) / seeds
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=400)
    parser.add_argument("--level", type=float, default=0.05)
    parser.add_argument("--quick", action="store_true", help="40 seeds, a quarter of the updates, nothing saved")
    args = parser.parse_args()
    seeds = 40 if args.quick else args.seeds
    results, start = [], time.perf_counter()
    for name, total, every, updates in REGIMES:
        updates = updates // 4 if args.quick else updates
        for noise_scale in NOISE_SCALES:
            began = time.perf_counter()
            summary = cell(noise_scale, total, every, updates, seeds, args.level)
            results.append(
                {"regime": name, "noise_scale": noise_scale, "total": total, "every": every, "updates": updates}
                | summary
            )
            old, window, new = summary["old_2sigma"], summary["window_only"], summary["run_level"]
            print(
                f"{name:>20} phi={noise_scale:>6.0f}: runs above old {old['runs_above']:.3f} window"
                f" {window['runs_above']:.3f} (half at {window['median_update_low_reaches_half']}) new"
                f" {new['runs_above']:.3f} (<= {new['runs_above_upper95']:.3f}); checks above old"
                f" {old['checks_above']:.4f} new {new['checks_above']:.5f}; worst low/truth old"
                f" {old['worst_low_over_truth']:.2f} new {new['worst_low_over_truth']:.2f}; median update low >= phi/2"
                f" old {old['median_update_low_reaches_half']} new {new['median_update_low_reaches_half']}"
                f" (reached {old['reached_half']:.2f} / {new['reached_half']:.2f});"
                f" restarted {summary['restarted']:.3f}"
                f" [{time.perf_counter() - began:.0f} s]",
                flush=True,
            )
    fall_seeds = FALL_SEEDS // 4 if args.quick else FALL_SEEDS
    fall_rows = falls(fall_seeds)
    trend_seeds = TREND_SEEDS // 4 if args.quick else TREND_SEEDS
    trend_rows = trends(trend_seeds, args.level)
    report = {
        "base_batch_size": BASE,
        "dim": DIM,
        "group_shares": [5 / 8, 3 / 8],
        "seeds": seeds,
        "level": args.level,
        "seconds": round(time.perf_counter() - start, 1),
        "cells": results,
        "fall_seeds": fall_seeds,
        "falls": fall_rows,
        "trend_seeds": trend_seeds,
        "trends": trend_rows,
    }
    if not args.quick:
        RESULTS.write_text(json.dumps(report, indent=1) + "\n")
        print(f"saved {RESULTS}")


if __name__ == "__main__":
    main()
