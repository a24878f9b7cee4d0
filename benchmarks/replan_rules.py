"""What each of the change detector's rules buys: replayed latency and regret, with the rule and without it.

The re-plan protocol runs without Lightning (``benchmarks/replay.py``: 3 emulated ranks, the speed model, ``decide``,
every rank's change check and the ranks' vote as the engine makes them) on the scenarios that hold the detector's
constants: slowdowns and a speed-up mid-run, the same on 7 ms steps, glitches of 4 steps at 4x and of 8 at 2x, a
12-step stall taken for a change, periodic stalls, jitter on identical devices, saturation, and small lasting
changes. For every scenario and seed: the steps from the change to the re-plan that acts on it (``latency``), the
changes and rescales seen, and the mean regret from the change on (the plan's step time over the best split's, less
one, on the clean devices; under periodic stalls no split reaches each step's own best, and the planner aims at the
expected step time, so there only the changes and rescales count). ``--without RULE`` replays the same with one rule
switched off; the medians over seeds are saved to ``benchmarks/results/replan_rules.json``, one entry per variant.

    python benchmarks/replan_rules.py [--seeds 6] [--without suspicion fast_window skip small_change return_rule]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.replay import replay
from lightning_cannikin.core import change
from lightning_cannikin.simulation.emulated_devices import EmulatedDevices

ONSET = 100  # the step at which the scenario's change begins
SPEEDS = [0.5, 1.0, 2.0]  # ms per sample, 10 ms fixed: rank 0 is the fastest
WARMUP = {"warmup_steps": 4, "warmup_factor": 3.0}
# (args, options, steps); a jitter of 2 ms a step unless an option says otherwise
SCENARIOS: dict[str, tuple[tuple[Any, ...], dict[str, Any], int]] = {
    "slowdown_4x": ((SPEEDS, 10.0), {"speed_changes": {ONSET: [2.0, 1.0, 2.0]}}, 300),
    "slowdown_2x": ((SPEEDS, 10.0), {"speed_changes": {ONSET: [1.0, 1.0, 2.0]}}, 300),
    "slowdown_1.4x": ((SPEEDS, 10.0), {"speed_changes": {ONSET: [0.7, 1.0, 2.0]}}, 300),
    "slowdown_1.12x": ((SPEEDS, 10.0), {"speed_changes": {ONSET: [0.56, 1.0, 2.0]}, "jitter_ms": 0.5}, 600),
    "slowdown_1.2x_jittery": ((SPEEDS, 10.0), {"speed_changes": {ONSET: [0.6, 1.0, 2.0]}}, 600),
    "speedup_2x": ((SPEEDS, 10.0), {"speed_changes": {ONSET: [0.5, 1.0, 1.0]}}, 300),
    "slowdown_4x_7ms_steps": (
        ([0.05, 0.1, 0.2], 2.0),
        {"speed_changes": {ONSET: [0.2, 0.1, 0.2]}, "jitter_ms": 0.2},
        300,
    ),
    "glitch_4_steps_4x": ((SPEEDS, 10.0), {"speed_changes": {ONSET: [2.0, 1.0, 2.0], ONSET + 4: SPEEDS}}, 300),
    "glitch_8_steps_2x": ((SPEEDS, 10.0), {"speed_changes": {ONSET: [0.5, 2.0, 2.0], ONSET + 8: SPEEDS}}, 300),
    "stall_12_steps_4x": ((SPEEDS, 10.0), {"speed_changes": {ONSET: [2.0, 1.0, 2.0], ONSET + 12: SPEEDS}}, 300),
    "stalls_every_3rd_step": ((SPEEDS, 10.0), {"contention": {0: (4.0, 3)}}, 300),
    "jitter_identical_devices": (([0.02] * 3, 3.0), {"jitter_ms": 1.0}, 300),
    "saturation": ((SPEEDS, 10.0), {"saturation_batch": [40, 10, 10]}, 300),
}
RULES = ("suspicion", "fast_window", "skip", "small_change", "return_rule")


@contextmanager
def without(rule: str | None) -> Iterator[dict[str, Any]]:
    """Switch ``rule`` off for the replays inside; yields the options each replay takes."""
    options: dict[str, Any] = {}
    saved = {name: getattr(change, name) for name in ("SUSPECT_RUN", "FAST_WINDOW", "RETURN_RUN")}
    if rule == "suspicion":
        change.SUSPECT_RUN = 10**6  # no run of slow steps is ever long enough to be suspected
    elif rule == "fast_window":
        change.FAST_WINDOW = change.DEFAULT_WINDOW  # twice the band over the whole window: no quicker rule
    elif rule == "return_rule":
        change.RETURN_RUN = 10**6  # a rescale is undone only as another change, by the same rule
    elif rule == "skip":
        options["change_check"] = partial(change.LocalChangeCheck, skip=0)
    elif rule == "small_change":
        options["change_check"] = partial(change.LocalChangeCheck, small_band=1e6)
    try:
        yield options
    finally:
        for name, value in saved.items():
            setattr(change, name, value)


def measure(seeds: int, rule: str | None) -> dict[str, dict[str, Any]]:
    """Every scenario's medians over ``seeds`` seeds, with ``rule`` switched off (``None``: every rule on)."""
    out = {}
    with without(rule) as options:
        for name, (args, kwargs, steps) in SCENARIOS.items():
            rows = []
            for seed in range(seeds):
                devices = EmulatedDevices(*args, seed=seed, **{"jitter_ms": 2.0, **kwargs}, **WARMUP)
                run = replay(devices, 3, 96, steps, epoch_steps=steps, **options)
                acted = [step for step in run.changes if step >= ONSET]
                regret = statistics.mean(run.regret(step) for step in range(ONSET, steps))
                rows.append((acted[0] - ONSET if acted else None, len(run.changes), len(run.drifts), regret))
            out[name] = {
                "latency_steps": [row[0] for row in rows],
                "changes_median": statistics.median(row[1] for row in rows),
                "rescales_median": statistics.median(row[2] for row in rows),
                "mean_regret_median": round(statistics.median(row[3] for row in rows), 4),
            }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--without", nargs="*", choices=RULES, default=list(RULES))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "replan_rules.json")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"seeds": args.seeds, "onset_step": ONSET, "variants": {}}
    for rule in [None, *args.without]:
        variant = "all_rules" if rule is None else f"without_{rule}"
        report["variants"][variant] = result = measure(args.seeds, rule)
        print(f"== {variant}")
        for name, row in result.items():
            print(
                f"  {name:26s} latency {row['latency_steps']}  changes {row['changes_median']:g}"
                f"  rescales {row['rescales_median']:g}  mean regret {100 * row['mean_regret_median']:.1f}%"
            )
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"saved {args.out}")
    return report


if __name__ == "__main__":
    main()
