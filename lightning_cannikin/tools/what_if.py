"""``cannikin simulate --profile``: what-if on the cluster a run measured, from its ``cannikin_profile.json``.

    cannikin simulate --profile lightning_logs/version_0/cannikin_profile.json --devices 0:3 -b 96 -b 192
    cannikin simulate --profile PROFILE --devices 2:0 --max-batch-size 1024

The what-if cluster is made of copies of the measured devices: ``--devices RANK:COUNT,...`` sets how many devices
like measured rank ``RANK`` it has (``0:3`` two more like rank 0, ``2:0`` none like rank 2; ranks not named keep
one). Each copy keeps its rank's fitted compute-time model and bounds, and every device keeps the step's measured
tail and all-reduce time: a ring all-reduce costs about the same on more devices over the same links, but more
nodes or slower links are not modelled. For each total batch both clusters get their OptPerf split and predicted step
time, beside the even split of plain DDP; with ``--max-batch-size`` the adaptive batch is on, and the library's own
decision (:func:`~lightning_cannikin.core.policy.decide`) picks the total from the profile's last noise scale.

Pure: numpy and the project's maths modules only (no torch, no Lightning).
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from lightning_cannikin.core.goodput import ADAPT_MARGIN, efficiency
from lightning_cannikin.core.optperf import most_even_split, optimal_split, optperf, step_time, with_micro_steps
from lightning_cannikin.core.plan import Plan
from lightning_cannikin.core.policy import PolicySettings, decide
from lightning_cannikin.core.profile import Profile
from lightning_cannikin.core.timing import step_time_pieces

__all__ = ["WhatIfCluster", "evaluate", "parse_devices", "print_what_if", "run", "what_if_parser"]


def what_if_parser() -> argparse.ArgumentParser:
    """The argument parser of ``cannikin simulate --profile``."""
    parser = argparse.ArgumentParser(
        prog="cannikin simulate",
        description="What-if on a cluster a run measured: more or fewer of its devices, other total batches, the"
        " adaptive batch on or off, predicted from the fitted per-rank models of its cannikin_profile.json.",
    )
    parser.add_argument("--profile", required=True, metavar="PROFILE", help="a profile the Cannikin callback wrote")
    parser.add_argument(
        "--devices",
        default="",
        metavar="RANK:COUNT,...",
        help="devices like each measured rank in the what-if cluster: '0:3' two more like rank 0, '2:0' none like rank"
        " 2; ranks not named keep one (default: the measured cluster)",
    )
    parser.add_argument(
        "-b",
        "--batch-size",
        type=int,
        action="append",
        metavar="B",
        help="a total batch to evaluate; repeat for several (default: the total of the profile's last plan)",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        help="turn the adaptive batch on with this cap: which total would the run choose from each --batch-size",
    )
    parser.add_argument("--noise-scale", type=float, help="the gradient noise scale (default: the profile's last)")
    parser.add_argument("--base-batch-size", type=int, help="B0, the LR's total batch (default: the profile's)")
    parser.add_argument("--margin", type=float, default=ADAPT_MARGIN, help="goodput hysteresis (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")
    return parser


def parse_devices(spec: str, world_size: int) -> tuple[int, ...]:
    """The measured rank of each what-if device, in rank order, from ``"RANK:COUNT,..."``.

    Raises:
        ValueError: a term is not ``RANK:COUNT``, a rank is outside the profile or named twice, a count is negative,
            or no device is left.

    """
    counts = [1] * world_size
    named: set[int] = set()
    for term in filter(None, (t.strip() for t in spec.split(","))):
        rank_text, colon, count_text = term.partition(":")
        if not colon or not rank_text.strip().isdigit() or not count_text.strip().isdigit():
            raise ValueError(f"--devices: cannot read {term!r}; write RANK:COUNT terms such as '0:3,2:0'.")
        rank, count = int(rank_text), int(count_text)
        if rank >= world_size:
            raise ValueError(f"--devices: rank {rank} is not in the profile (ranks 0 to {world_size - 1}).")
        if rank in named:
            raise ValueError(f"--devices: rank {rank} is named twice.")
        named.add(rank)
        counts[rank] = count
    devices = tuple(rank for rank, count in enumerate(counts) for _ in range(count))
    if not devices:
        raise ValueError("--devices: no device left; keep a count above 0 for at least one rank.")
    return devices


class WhatIfCluster:
    """The profile's step-time model over a chosen multiset of its devices: a
    :class:`~lightning_cannikin.core.policy.StepTimeModel`, so :func:`decide` plans on it as the callback would.

    Args:
        profile: a profile whose every rank has a fitted model.
        devices: the measured rank each device copies (a rank may repeat or be left out).

    """

    def __init__(self, profile: Profile, devices: Sequence[int]) -> None:
        speed = profile.speed_model()
        slopes, offsets = speed.pieces()
        index = np.asarray(devices, dtype=np.int64)
        self.devices = tuple(int(r) for r in devices)
        self.world_size = len(self.devices)
        self.slopes, self.offsets = slopes[index], offsets[index]
        micro_slopes, micro_offsets = step_time_pieces(speed.models(), None)  # a micro-step: the ranks' compute alone
        self.micro_slopes, self.micro_offsets = micro_slopes[index], micro_offsets[index]
        self.lower = [int(speed.lower[r]) for r in self.devices]
        upper = speed.upper
        self.upper = None if upper is None else [int(upper[r]) for r in self.devices]
        self.measured_identified = speed.identified

    identified = True  # the profile is all there is to learn from: decide on its models as they are, never probe

    def optperf(self, total_batch_sizes: Sequence[int], accumulation_steps: ArrayLike = 1) -> np.ndarray:
        totals = np.asarray(total_batch_sizes)
        times = optperf(self.slopes, self.offsets, totals, self.lower, self.upper)

        def micro_step(total: int) -> float:  # the ranks' compute at the step's split
            split = optimal_split(self.slopes, self.offsets, total, self.lower, self.upper).local_batch_sizes
            return float(step_time(self.micro_slopes, self.micro_offsets, split))

        return with_micro_steps(times, totals, accumulation_steps, micro_step)

    def predict(self, local_batch_sizes: ArrayLike, accumulation_steps: ArrayLike = 1) -> float | np.ndarray:
        micro = step_time(self.micro_slopes, self.micro_offsets, local_batch_sizes)
        return step_time(self.slopes, self.offsets, local_batch_sizes) + (np.asarray(accumulation_steps) - 1) * micro

    def plan_split(self, total_batch_size: int) -> Plan:
        split = optimal_split(self.slopes, self.offsets, total_batch_size, self.lower, self.upper)
        return Plan(split.local_batch_sizes, predicted_step_time=split.step_time)

    def probe(self, local_batch_sizes: Sequence[int]) -> tuple[int, ...]:
        return tuple(local_batch_sizes)


def _row(plan: Plan) -> dict[str, Any]:
    seconds = float(plan.predicted_step_time)  # type: ignore[arg-type]
    return {
        "total_batch_size": plan.total_batch_size,
        "local_batch_sizes": [int(b) for b in plan.local_batch_sizes],
        "accumulation_steps": plan.accumulation_steps,
        "predicted_step_time": seconds,
        "throughput": plan.total_batch_size / seconds,
    }


def evaluate(
    clusters: Mapping[str, WhatIfCluster],
    totals: Sequence[int],
    max_batch_size: int | None = None,
    noise_scale: float | None = None,
    base_batch_size: int | None = None,
    margin: float = ADAPT_MARGIN,
) -> dict[str, list[dict[str, Any]]]:
    """Every named cluster at every total: the OptPerf split and the even split, and with ``max_batch_size`` the
    adaptive decision from that total.

    Returns:
        ``{"fixed": [...], "adaptive": [...]}``, one row per cluster and total (``adaptive`` empty when off); a fixed
        row has ``even_step_time`` and ``optperf_speedup`` beside the split; an adaptive row has ``from_batch_size``,
        ``lr_factor``, ``efficiency`` and ``goodput`` (B0-samples per second), and ``fixed_goodput`` of the total
        kept.

    Raises:
        ValueError: a total cannot be split within a cluster's bounds.

    """
    fixed, adaptive = [], []
    for name, cluster in clusters.items():
        for total in totals:
            try:
                plan = cluster.plan_split(total)
            except ValueError as err:
                raise ValueError(f"batch size {total} cannot be split on the {name} cluster: {err}") from None
            row = {"cluster": name, **_row(plan)}
            even = most_even_split(total, cluster.world_size, cluster.lower, cluster.upper).local_batch_sizes
            row["even_step_time"] = float(cluster.predict(even))
            row["optperf_speedup"] = row["even_step_time"] / row["predicted_step_time"]
            fixed.append(row)
            if max_batch_size is None:
                continue
            assert noise_scale is not None and base_batch_size is not None
            settings = PolicySettings(max_batch_size=max_batch_size, margin=margin, split_margin=0.0)
            decision = decide(cluster, plan, settings, noise_scale, base_batch_size)
            chosen = {"cluster": name, "from_batch_size": total, **_row(decision.plan)}
            chosen["lr_factor"] = decision.lr_factor
            chosen["efficiency"] = float(efficiency(noise_scale, chosen["total_batch_size"], base_batch_size))
            chosen["goodput"] = chosen["throughput"] * chosen["efficiency"]
            chosen["fixed_goodput"] = row["throughput"] * float(efficiency(noise_scale, total, base_batch_size))
            adaptive.append(chosen)
    return {"fixed": fixed, "adaptive": adaptive}


def _last(entries: Sequence[Mapping[str, Any]], key: str) -> tuple[float, Any] | None:
    """``(value, step)`` of the newest entry with a finite positive ``key``, or ``None``."""
    for entry in reversed(entries):
        value = entry.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf"):
            return float(value), entry.get("step")
    return None


def run(profile: Profile, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """Resolve the defaults of ``args`` from ``profile`` and evaluate both clusters.

    Returns:
        ``(result, notes)``: :func:`evaluate`'s result with the inputs it used, and lines saying what was assumed.

    Raises:
        ValueError: a bad option, or a profile that lacks what the question needs; the message is one line.

    """
    missing = [d.rank for d in profile.devices if d.model is None]
    if missing:
        raise ValueError(f"{profile.path}: no timing samples for rank(s) {missing}; nothing to simulate with.")
    devices = parse_devices(args.devices, profile.world_size)
    last_total = _last(profile.history, "total_batch_size")
    default = last_total[0] if last_total is not None else profile.base_batch_size
    totals = args.batch_size or ([] if default is None else [int(default)])
    if not totals:
        raise ValueError(f"{profile.path} has no plan history: give the total batch with --batch-size.")
    if min(totals) < 1:
        raise ValueError(f"--batch-size must be a positive integer, got {min(totals)}.")
    if not args.margin >= 0:
        raise ValueError(f"--margin must be >= 0, got {args.margin}.")
    measured = WhatIfCluster(profile, range(profile.world_size))
    clusters = {"measured": measured}
    notes = [f"measured: {profile.world_size} devices, fitted in {profile.path}"]
    if devices != measured.devices:
        clusters["what-if"] = WhatIfCluster(profile, devices)
        notes.append(f"what-if: {len(devices)} devices ({describe(devices)})")
        notes.append(
            "assumed: every device keeps the measured step tail and all-reduce time (same links; more nodes or"
            " slower links are not modelled)"
        )
    if not measured.measured_identified:
        notes.append("note: some rank was timed at one batch size only; its slope is a guess")
    noise, base = None, None
    if args.max_batch_size is not None:
        if args.max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be a positive integer, got {args.max_batch_size}.")
        measured_noise = _last(profile.noise_scale_history, "noise_scale") or _last(profile.history, "noise_scale")
        if args.noise_scale is not None:
            if not 0 < args.noise_scale < float("inf"):
                raise ValueError(f"--noise-scale must be positive and finite, got {args.noise_scale}.")
            noise, source = args.noise_scale, "given"
        elif measured_noise is not None:
            noise, source = measured_noise[0], f"the profile's, at step {measured_noise[1]}"
        else:
            raise ValueError(f"{profile.path} holds no noise scale (noise tracking off?): give --noise-scale.")
        base = args.base_batch_size if args.base_batch_size is not None else profile.base_batch_size
        if base is None or base < 1:
            raise ValueError(f"{profile.path} does not say the base batch B0: give --base-batch-size.")
        notes.append(
            f"adaptive batch: max_batch_size {args.max_batch_size}, noise scale {noise:.4g} ({source}), B0 {base},"
            f" margin {args.margin:.0%}"
        )
    result = evaluate(clusters, totals, args.max_batch_size, noise, base, args.margin)
    inputs = {"profile": str(profile.path), "devices": {name: list(c.devices) for name, c in clusters.items()}}
    return {**inputs, "noise_scale": noise, "base_batch_size": base, **result}, notes


def describe(devices: Sequence[int]) -> str:
    """``"rank 0 x3, rank 1, rank 2"``: how many devices copy each measured rank."""
    return ", ".join(f"rank {r}" + (f" x{c}" if c > 1 else "") for r, c in Counter(devices).items())


def _ms(key: str) -> Callable[[Mapping[str, Any]], str]:
    return lambda row: f"{1000 * row[key]:.2f}"


def _number(key: str, digits: int = 0, suffix: str = "") -> Callable[[Mapping[str, Any]], str]:
    return lambda row: f"{row[key]:.{digits}f}{suffix}"


def _split(row: Mapping[str, Any]) -> str:
    return " ".join(map(str, row["local_batch_sizes"]))


# (header, right-aligned, cell) per column of each table
_FIXED_COLUMNS = (
    ("cluster", False, lambda row: row["cluster"]),
    ("B", True, lambda row: str(row["total_batch_size"])),
    ("split", False, _split),
    ("step ms", True, _ms("predicted_step_time")),
    ("samples/s", True, _number("throughput")),
    ("even ms", True, _ms("even_step_time")),
    ("gain", True, _number("optperf_speedup", 2, "x")),
)
_ADAPTIVE_COLUMNS = (
    ("cluster", False, lambda row: row["cluster"]),
    ("from B", True, lambda row: str(row["from_batch_size"])),
    ("to B", True, lambda row: str(row["total_batch_size"])),
    ("split", False, _split),
    ("step ms", True, _ms("predicted_step_time")),
    ("LR x", True, _number("lr_factor", 2)),
    ("goodput", True, _number("goodput")),
    ("kept", True, _number("fixed_goodput")),
)


def print_what_if(result: Mapping[str, list[dict[str, Any]]], notes: Sequence[str]) -> None:
    """The tables of :func:`evaluate`'s result, after the notes that say what was assumed."""
    from lightning_cannikin.tools.console import print_line, print_table

    for note in notes:
        print_line(note)
    print_line("")
    tables = (
        ("Fixed total: OptPerf split vs the even split (DDP)", _FIXED_COLUMNS, result["fixed"]),
        (
            "Adaptive batch: the total chosen (goodput in B0-samples/s; kept: at from B)",
            _ADAPTIVE_COLUMNS,
            result["adaptive"],
        ),
    )
    for title, columns, rows in tables:
        if rows:
            cells = [[cell(row) for _, _, cell in columns] for row in rows]
            print_table(title, [(header, right) for header, right, _ in columns], cells)
