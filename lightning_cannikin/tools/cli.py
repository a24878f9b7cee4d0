"""The ``cannikin`` console script.

    cannikin simulate --cluster "4xV100,4xRTX6000,8xT4" --job imagenet
    cannikin simulate --profile lightning_logs/version_0/cannikin_profile.json --devices 0:3 --batch-size 192
    cannikin plan lightning_logs/version_0/cannikin_profile.json --batch-size 512
    cannikin report lightning_logs/version_0/cannikin_profile.json -o report/

Exit codes: 0 success, 2 bad input (unknown command or option, unreadable profile, infeasible batch size).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

USAGE = """usage: cannikin COMMAND [ARGS]

commands:
  simulate   time-to-target of DDP, AdaptDL-like and Cannikin on a simulated heterogeneous GPU cluster;
             with --profile PROFILE, what-if on the cluster a run measured (more or fewer of its devices, other
             total batches, the adaptive batch on or off)
  plan       the optimal split of a total batch for a profiled cluster, beside the even and proportional splits
  report     plots (PNG) of a profile: device models, predicted vs measured step time, the adaptive schedule

Run `cannikin COMMAND --help` for a command's options."""

# A profile that cannot be read and a batch size that cannot be planned are both bad input, like a bad option.
EXIT_BAD_INPUT = 2
# An error is one line; a longer message quotes the input rather than explains it.
ERROR_CHARS = 400


def _simulate(argv: list[str]) -> int:
    if any(arg == "--profile" or arg.startswith("--profile=") for arg in argv):
        return _what_if(argv)
    from lightning_cannikin.simulation.cli import main as simulate_main

    return simulate_main(argv)


def _what_if(argv: list[str]) -> int:
    """``cannikin simulate --profile``: what-if on the cluster a run measured (see :mod:`.what_if`)."""
    from lightning_cannikin.tools.what_if import print_what_if, run, what_if_parser

    args = _parse(what_if_parser(), argv)
    if isinstance(args, int):
        return args
    profile = _load("simulate", args.profile)
    if isinstance(profile, int):
        return profile
    try:
        result, notes = run(profile, args)
    except ValueError as err:
        return _error("simulate", str(err))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_what_if(result, notes)
    return 0


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    """Parsed arguments, or the exit code argparse chose (``--help``: 0, a usage error: 2) so ``main`` returns it."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else EXIT_BAD_INPUT


def _error(command: str, message: str) -> int:
    """Print one line of error (a parser's or a file's message can span lines or quote a file) and return 2."""
    line = " ".join(message.split())
    if len(line) > ERROR_CHARS:
        line = line[: ERROR_CHARS - 3] + "..."
    print(f"cannikin {command}: error: {line}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _load(command: str, path: str) -> Any:
    """The profile at ``path``, or an exit code after printing why it cannot be read."""
    from lightning_cannikin.core.profile import load_profile

    try:
        return load_profile(path)
    except OSError as err:
        return _error(command, f"cannot read profile {path}: {err.strerror or err}")
    except ValueError as err:
        return _error(command, str(err))


def plan_parser() -> argparse.ArgumentParser:
    """The argument parser of ``cannikin plan``."""
    parser = argparse.ArgumentParser(
        prog="cannikin plan",
        description="Split a total batch across the profiled devices with OptPerf and compare it with the even"
        " (plain DDP) and the speed-proportional splits, using the profile's fitted compute-time models.",
    )
    parser.add_argument("profile", metavar="PROFILE", help="a profile JSON written by the Cannikin callback")
    parser.add_argument("-b", "--batch-size", type=int, required=True, help="total batch size B to split")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")
    return parser


def compare_splits(balancer: Any, total_batch_size: int) -> dict[str, Any]:
    """The optimal, even and speed-proportional splits of ``total_batch_size`` with their predicted step times.

    Args:
        balancer: a fitted :class:`~lightning_cannikin.core.speed_model.SpeedModel` (every rank has samples).
        total_batch_size: ``B``.

    Returns:
        ``{"optimal": ..., "even": ..., "proportional": ...}``, each with ``local_batch_sizes``,
        ``predicted_step_time`` (seconds), ``throughput`` (samples/s) and ``within_bounds``; the alternatives also carry
        ``optimal_speedup`` (their step time over the optimal one). ``proportional`` is ``None`` when undefined.

    Raises:
        ValueError: no split of ``total_batch_size`` satisfies the bounds.

    """
    from lightning_cannikin.core.plan import even_split, proportional_sizes

    optimal = balancer.plan_split(total_batch_size)  # raises ValueError when B is infeasible
    optimal_time = float(optimal.predicted_step_time)  # type: ignore[arg-type]
    slopes = [m.slope for m in balancer.models()]
    lower, upper = balancer.lower, balancer.upper

    def entry(sizes: Sequence[int], step_time: float) -> dict[str, Any]:
        within = all(b >= lo for b, lo in zip(sizes, lower, strict=True)) and (
            upper is None or all(b <= hi for b, hi in zip(sizes, upper, strict=True))
        )
        return {
            "local_batch_sizes": [int(b) for b in sizes],
            "predicted_step_time": float(step_time),
            "throughput": total_batch_size / step_time if step_time > 0 else None,
            "within_bounds": within,
        }

    result: dict[str, Any] = {"optimal": entry(optimal.local_batch_sizes, optimal_time)}
    alternatives: dict[str, tuple[int, ...] | None] = {"even": even_split(total_batch_size, balancer.world_size)}
    try:
        alternatives["proportional"] = proportional_sizes(total_batch_size, [1.0 / a for a in slopes])
    except (ValueError, ZeroDivisionError):
        alternatives["proportional"] = None  # a zero slope: "proportional to speed" is undefined
    for name, sizes in alternatives.items():
        if sizes is None:
            result[name] = None
            continue
        row = entry(sizes, balancer.predict(sizes))
        row["optimal_speedup"] = row["predicted_step_time"] / optimal_time if optimal_time > 0 else None
        result[name] = row
    return result


def _plan(argv: list[str]) -> int:
    args = _parse(plan_parser(), argv)
    if isinstance(args, int):
        return args
    if args.batch_size < 1:
        return _error("plan", f"--batch-size must be a positive integer, got {args.batch_size}.")
    profile = _load("plan", args.profile)
    if isinstance(profile, int):
        return profile
    missing = [d.rank for d in profile.devices if d.model is None]
    if missing:
        return _error("plan", f"{args.profile}: no timing samples for rank(s) {missing}; nothing to plan with.")
    balancer = profile.speed_model()
    try:
        splits = compare_splits(balancer, args.batch_size)
    except ValueError as err:
        return _error("plan", f"batch size {args.batch_size} cannot be split on this cluster: {err}")
    models = balancer.models()
    if args.json:
        output = {
            "profile": str(args.profile),
            "world_size": balancer.world_size,
            "total_batch_size": args.batch_size,
            "tail": balancer.tail(),
            "bounds": {"lower": list(balancer.lower), "upper": balancer.upper},
            "devices": [{"rank": i, "slope": m.slope, "intercept": m.intercept} for i, m in enumerate(models)],
            **splits,
        }
        print(json.dumps(output, indent=2))
        return 0
    _print_plan(args.profile, args.batch_size, balancer, models, splits)
    return 0


def _print_plan(path: str, total: int, balancer: Any, models: Sequence[Any], splits: dict[str, Any]) -> None:
    from lightning_cannikin.tools.console import print_line, print_table

    names = {"optimal": "Optimal (OptPerf)", "even": "Even (DDP)", "proportional": "Speed-proportional"}
    headers = {"optimal": "optimal b (ms)", "even": "even b (ms)", "proportional": "proport. b (ms)"}
    shown = [key for key in names if splits[key] is not None]
    rows = []
    for rank, model in enumerate(models):
        cells = [str(rank), f"{1000 * model.slope:.4g}", f"{1000 * model.intercept:.4g}"]
        for key in shown:
            b = splits[key]["local_batch_sizes"][rank]
            # The rank's own predicted time shows who waits for whom under that split.
            cells.append(f"{b} ({1000 * (model.slope * b + model.intercept):.1f})")
        rows.append(cells)
    print_table(
        f"Split of B = {total} across {balancer.world_size} devices: local batch (that rank's compute ms)",
        [("rank", True), ("ms/sample", True), ("fixed ms", True), *((headers[key], True) for key in shown)],
        rows,
    )
    summary = []
    for key in shown:
        row = splits[key]
        speedup = row.get("optimal_speedup")
        note = "" if row["within_bounds"] else " (violates bounds)"
        summary.append(
            [
                names[key] + note,
                f"{1000 * row['predicted_step_time']:.2f}",
                "-" if row["throughput"] is None else f"{row['throughput']:.1f}",
                "-" if speedup is None else f"{speedup:.3f}x",
            ]
        )
    print_table(
        f"Predicted step time (step tail {1000 * balancer.tail():.3g} ms included)",
        [("split", False), ("step ms", True), ("samples/s", True), ("optimal is faster by", True)],
        summary,
    )
    optimal = splits["optimal"]
    # One plain line that scripts can grep.
    print_line(
        f"optimal split: {optimal['local_batch_sizes']}  predicted step {1000 * optimal['predicted_step_time']:.2f} ms"
        f"  ({path})"
    )


def report_parser() -> argparse.ArgumentParser:
    """The argument parser of ``cannikin report``."""
    parser = argparse.ArgumentParser(
        prog="cannikin report",
        description="Plot a Cannikin profile: compute time vs local batch per device with the fitted lines, predicted"
        " vs measured step time per re-plan, and total batch / LR factor / noise scale over training.",
    )
    parser.add_argument("profile", metavar="PROFILE", help="a profile JSON written by the Cannikin callback")
    parser.add_argument("-o", "--output-dir", required=True, metavar="DIR", help="directory for the PNG files")
    return parser


def _report(argv: list[str]) -> int:
    args = _parse(report_parser(), argv)
    if isinstance(args, int):
        return args
    from lightning_cannikin.tools.console import print_line
    from lightning_cannikin.tools.report import PLOTS_INSTALL, matplotlib_available, write_report

    if not matplotlib_available():
        return _error("report", f"needs matplotlib: {PLOTS_INSTALL}")
    profile = _load("report", args.profile)
    if isinstance(profile, int):
        return profile

    try:
        written = write_report(profile, args.output_dir)
    except OSError as err:
        return _error("report", f"cannot write to {args.output_dir}: {err.strerror or err}")
    print_line(f"Report of {args.profile} ({profile.world_size} devices, {len(profile.history)} re-plans):")
    for path in written:
        print_line(f"  {path}  ({path.stat().st_size // 1024} KiB)")
    return 0


COMMANDS: dict[str, Callable[[list[str]], int]] = {"simulate": _simulate, "plan": _plan, "report": _report}


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``cannikin COMMAND ...``; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"cannikin: unknown command {args[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return command(args[1:])


if __name__ == "__main__":
    sys.exit(main())
