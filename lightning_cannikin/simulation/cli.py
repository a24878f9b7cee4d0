"""``cannikin simulate``: time-to-target of DDP, AdaptDL-like and Cannikin on a simulated heterogeneous cluster.

Examples::

    cannikin simulate --cluster "4xA100,4xV100,8xT4" --job cifar10
    cannikin simulate --cluster cluster.yaml --job all --json out.json
    cannikin simulate --validate

Pure Python: imports neither torch nor Lightning.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from lightning_cannikin.core.goodput import ADAPT_MARGIN
from lightning_cannikin.simulation.cluster import Cluster, parse_cluster
from lightning_cannikin.simulation.comparison import Comparison, compare
from lightning_cannikin.simulation.engine import POLICIES, ClusterModel
from lightning_cannikin.simulation.gpu_profiles import JOBS, ProfileStore
from lightning_cannikin.simulation.models import NETWORK_SCALINGS, load_job

__all__ = ["build_parser", "main", "run"]

_LABELS = {
    "ddp": "DDP (fixed B, even)",
    "ddp_tuned": "DDP, best fixed B*",
    "cannikin_fixed": "Cannikin split, fixed B",
    "adaptdl": "AdaptDL-like (even, adaptive B)",
    "cannikin": "Cannikin (OptPerf, adaptive B)",
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``cannikin simulate``."""
    parser = argparse.ArgumentParser(
        prog="cannikin simulate",
        description="Simulate training to target on a heterogeneous GPU cluster driven by measured GPU profiles.",
        epilog="What-if on the cluster a run measured, from its cannikin_profile.json: `cannikin simulate --profile"
        " PROFILE` (options: `cannikin simulate --profile PROFILE --help`).",
    )
    parser.add_argument(
        "--cluster",
        default="4xV100,4xRTX6000,8xT4",
        help="'4xA100,4xV100,8xT4' or a .json/.yaml file (default: %(default)s, covered by the shipped profiles)",
    )
    parser.add_argument(
        "--job",
        action="append",
        choices=[*JOBS, "all"],
        help="job to simulate; repeat for several, 'all' for every job with profiles for the cluster (default: all)",
    )
    parser.add_argument(
        "--profiles",
        choices=("auto", "shipped", "sia"),
        default="auto",
        help="'shipped': Pollux T4 + Zeus only; 'sia': require the unshipped Sia profiles; 'auto': Sia when found",
    )
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of %(default)s")
    parser.add_argument("--batch-size", type=int, help="DDP's fixed (and every policy's starting) total batch")
    parser.add_argument("--max-batch-size", type=int, help="cap of the adaptive policies (default: largest validated)")
    parser.add_argument(
        "--replans",
        type=int,
        default=100,
        help="noise grid: the run's progress in REPLANS x 10 cells, the noise scale read per cell; the re-plans come"
        " when the training run's Replanner says (default: %(default)s)",
    )
    parser.add_argument("--margin", type=float, default=ADAPT_MARGIN, help="goodput hysteresis (default: %(default)s)")
    parser.add_argument(
        "--network-scaling",
        choices=NETWORK_SCALINGS,
        default="linear",
        help="all-reduce growth with GPUs beyond the measured 64: Pollux's linear fit or a log fit",
    )
    parser.add_argument("--network-time", type=float, help="override the all-reduce term T_net (seconds)")
    parser.add_argument("--no-tuned", action="store_true", help="skip hindsight-tuned fixed-batch DDP")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--validate", action="store_true", help="print how well the models predict held-out measurements, then exit"
    )
    return parser


def run(
    cluster: Cluster,
    jobs: Sequence[str],
    store: ProfileStore,
    policies: Sequence[str] = POLICIES,
    network_scaling: str = "linear",
    network_time: float | None = None,
    batch_size: int | None = None,
    max_batch_size: int | None = None,
    tuned_ddp: bool = True,
    **kwargs: int | float,
) -> tuple[list[Comparison], list[str]]:
    """Simulate every job that has profiles for all of the cluster's GPU types.

    Returns:
        ``(comparisons, skipped)``: one :class:`Comparison` per simulated job, and a reason per skipped job.

    """
    done, skipped = [], []
    for name in jobs:
        available = store.available_gpus(name)
        missing = [g for g in cluster.gpu_types if g not in available]
        if missing:
            skipped.append(f"{name}: no {', '.join(missing)} profile (has {', '.join(available)})")
            continue
        job = load_job(name, cluster.gpu_types, store, network_scaling)
        model = ClusterModel(job, cluster, network_time)
        done.append(compare(model, policies, batch_size, max_batch_size, tuned_ddp=tuned_ddp, **kwargs))
    return done, skipped


def format_comparison(result: Comparison, cluster: Cluster) -> str:
    """A plain-text table of one comparison."""
    lines = [
        f"{result.job} on {result.cluster}: T_net = {result.network_time * 1e3:.1f} ms, start/DDP batch = "
        f"{result.start_batch_size}",
        f"  {'policy':34s} {'time to target':>15s} {'vs Cannikin':>11s} {'mean B':>8s} {'pred. err':>9s}  final split",
    ]
    reference = result.results.get("cannikin")
    rows = list(result.results.items())
    for name, r in rows:
        ratio = f"{r.time_to_target / reference.time_to_target:10.2f}x" if reference else ""
        split = ", ".join(f"{gpu} {b:.0f}" for gpu, b in r.split_by_type(cluster).items())
        if r.final_plan.accumulation_steps > 1:
            split += f" (x{r.final_plan.accumulation_steps} accum.)"
        lines.append(
            f"  {_LABELS[name]:34s} {r.time_to_target / 3600:13.3f} h {ratio:>11s} {r.mean_batch_size:8.0f}"
            f" {r.prediction_error * 100:8.1f}%  {split}"
        )
    if result.ddp_tuned is not None:
        batch, seconds = result.ddp_tuned
        ratio = f"{seconds / reference.time_to_target:10.2f}x" if reference else ""
        lines.append(f"  {_LABELS['ddp_tuned']:34s} {seconds / 3600:13.3f} h {ratio:>11s} {batch:8d}")
    if reference:
        parts = [
            f"{base}: {result.reduction(base) * 100:.0f}%"
            for base in ("ddp", "ddp_tuned", "adaptdl")
            if base in result.results or (base == "ddp_tuned" and result.ddp_tuned is not None)
        ]
        lines.append("  Cannikin saves vs " + ", ".join(parts))
    return "\n".join(lines)


def _print_validation(store: ProfileStore, scaling: str) -> None:
    from lightning_cannikin.simulation.validation import validate

    report = validate(store, scaling=scaling)
    print(f"Sia profiles in use: {report['sia_available']}")
    print("Compute t(b) = a*b + a0 (project fitter), single GPU:")
    for row in report["single_gpu"]:
        print(
            f"  {row['job']:12s} {row['gpu']:8s} {row['source']:6s} R2={row['r2']:.3f} "
            f"median err {row['median_err'] * 100:5.1f}%  leave-one-out {row['loo_median_err'] * 100:5.1f}%"
        )
    print("Step time on 6-16 T4 nodes (held out; network fitted on <= 4 nodes):")
    for row in report["network"]:
        print(
            f"  {row['job']:12s} {row['scaling']:6s} median {row['heldout_median_err'] * 100:5.1f}% "
            f"p90 {row['heldout_p90_err'] * 100:5.1f}% (planner's linear model: "
            f"{row['heldout_planner_median_err'] * 100:.1f}%)"
        )
    print("Steps to target at batch M (leave-one-run-out):")
    for row in report["progress"]:
        print(f"  {row['job']:12s} M={row['batch_size']:6d} error {row['heldout_err'] * 100:+6.1f}%")
    print("Failures (median error > 10% or R2 < 0.9):")
    for line in report["failures"]:
        print(f"  {line}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cannikin simulate``.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        0 on success (``--help`` included), 2 on a bad cluster, job or option.

    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # argparse exits on --help and on usage errors; report the code instead
        return stop.code if isinstance(stop.code, int) else 2
    try:
        store = ProfileStore(use_sia={"auto": None, "shipped": False, "sia": True}[args.profiles])
        if args.validate:
            _print_validation(store, args.network_scaling)
            return 0
        cluster = parse_cluster(args.cluster)
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        unknown = [p for p in policies if p not in POLICIES]
        if unknown:
            raise ValueError(f"Unknown policies {unknown}; choose from {', '.join(POLICIES)}.")
        jobs = list(JOBS) if not args.job or "all" in args.job else list(dict.fromkeys(args.job))
        results, skipped = run(
            cluster,
            jobs,
            store,
            policies,
            args.network_scaling,
            args.network_time,
            args.batch_size,
            args.max_batch_size,
            tuned_ddp=not args.no_tuned,
            replans=args.replans,
            margin=args.margin,
        )
    except (ValueError, FileNotFoundError) as err:
        print(f"cannikin simulate: error: {err}", file=sys.stderr)
        return 2
    print(
        f"Cluster {cluster} ({cluster.num_devices} GPUs, {cluster.num_nodes} nodes); profiles: "
        f"{'Pollux + Sia + Zeus' if store.sia_available else 'Pollux + Zeus (shipped)'}"
    )
    for result in results:
        print()
        print(format_comparison(result, cluster))
    for reason in skipped:
        print(f"\nskipped {reason}")
    if results:
        print("\n* hindsight-tuned: the best fixed batch found after the fact; no real DDP run has it.")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {"cluster": cluster.spec(), "results": [r.to_dict() for r in results], "skipped": skipped},
                handle,
                indent=2,
            )
    if not results:
        print("cannikin simulate: error: no job has profiles for every GPU type of this cluster", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
