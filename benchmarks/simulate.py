"""Simulated time-to-target of DDP, AdaptDL-like and Cannikin on 16 to 1,024-GPU heterogeneous clusters.

Drives :mod:`lightning_cannikin.simulation` (the project's planner, goodput and fitter code against measured GPU
profiles) and writes ``benchmarks/results/simulate.{json,md,png}``:

1. validation: how well the fitted models predict held-out measurements (computed here, from the CSVs);
2. 16-GPU mixes like the paper's: every job the profiles cover, four policies plus hindsight-tuned DDP;
3. scale: the main mix at 16, 64, 256 and 1,024 GPUs, under two network extrapolations and two batch caps;
4. planner wall time per re-plan (50 candidates) at each size, median of repeats.

Mixes that need A100 or RTX 2080 Ti (and V100/RTX 6000 for CIFAR-10, DeepSpeech2, YOLOv3) use the Sia profiles,
which are never shipped: they run only where a local copy is found (``CANNIKIN_GPU_PROFILES`` or
``../shared/data/gpu-profiles``) and are skipped otherwise. The shipped-data mixes always run.

    python benchmarks/simulate.py [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_cannikin.core import goodput
from lightning_cannikin.core.policy import PolicySettings, decide
from lightning_cannikin.simulation import (
    JOBS,
    ClusterModel,
    Comparison,
    ProfileStore,
    compare,
    load_job,
    parse_cluster,
)
from lightning_cannikin.simulation.cli import run
from lightning_cannikin.simulation.validation import validate
from lightning_cannikin.tools.report import plot_or_skip

SIA_MIXES = ("4xA100,4xV100,8xT4", "4xA100,4xRTX6000,4x2080Ti,4xT4")
"""16-GPU mixes that need the local-only Sia profiles (A100, RTX 2080 Ti, and V100/RTX 6000 for most jobs)."""

SHIPPED_MIXES = ("4xV100,4xRTX6000,8xT4", "4xV100,4xP100,8xT4")
"""16-GPU mixes the shipped Pollux (T4) + Zeus (V100, RTX 6000, P100) profiles cover: ImageNet, BERT and NCF."""

CONTROL = "16xT4"
"""Homogeneous control: Cannikin must equal the even split."""

SCALES = (1, 4, 16, 64)
"""Multiples of the 16-GPU mix: 16, 64, 256 and 1,024 GPUs."""


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.3f}"


def _pct(value: float) -> str:
    return f"{value * 100:.0f}%"


def comparisons_for(mix: str, store: ProfileStore, data: str, **kwargs) -> list[dict]:
    cluster = parse_cluster(mix)
    done, skipped = run(cluster, JOBS, store, **kwargs)
    rows = []
    for result in done:
        row = result.to_dict()
        row["data"] = data
        row["cluster_gpus"] = cluster.num_devices
        row["split_by_type"] = {p: r.split_by_type(cluster) for p, r in result.results.items()}
        rows.append(row)
    return rows + [{"cluster": mix, "data": data, "skipped": reason} for reason in skipped]


def mixes(stores: dict[str, ProfileStore]) -> list[dict]:
    rows = []
    for mix in SHIPPED_MIXES:
        rows += comparisons_for(mix, stores["shipped"], "shipped")
    rows += comparisons_for(CONTROL, stores["shipped"], "shipped")
    if "sia" in stores:
        for mix in SIA_MIXES:
            rows += comparisons_for(mix, stores["sia"], "sia")
    return rows


def scale(stores: dict[str, ProfileStore], quick: bool) -> list[dict]:
    rows = []
    base = {"shipped": SHIPPED_MIXES[0], **({"sia": SIA_MIXES[0]} if "sia" in stores else {})}
    factors = SCALES[:2] if quick else SCALES
    for data, mix in base.items():
        cluster0 = parse_cluster(mix)
        for factor in factors:
            cluster = cluster0.scaled(factor)
            for scaling in ("linear", "log"):
                for cap in ("validated", "weak"):
                    for name in JOBS:
                        if any(g not in stores[data].available_gpus(name) for g in cluster.gpu_types):
                            continue
                        job = load_job(name, cluster.gpu_types, stores[data], scaling)
                        # "weak": B0 per GPU as the cap, beyond the largest validated batch (statistics held there).
                        limit = None
                        if cap == "weak":
                            limit = max(job.max_validated_batch, cluster.num_devices * job.base_batch_size)
                        result: Comparison = compare(ClusterModel(job, cluster), max_batch_size=limit)
                        row = result.to_dict()
                        for policy in row["policies"].values():
                            policy.pop("trajectory")
                        row.update(data=data, gpus=cluster.num_devices, scaling=scaling, cap=cap)
                        rows.append(row)
    return rows


def planner_timing(stores: dict[str, ProfileStore], repeats: int) -> list[dict]:
    """Wall time of one re-plan: OptPerf for 50 candidates, and the whole ``decide()`` (choice and chosen split)."""
    data = "sia" if "sia" in stores else "shipped"
    mix = parse_cluster(SIA_MIXES[0] if data == "sia" else SHIPPED_MIXES[0])
    rows = []
    for factor in SCALES:
        cluster = mix.scaled(factor)
        job = load_job("imagenet", cluster.gpu_types, stores[data])
        model = ClusterModel(job, cluster)
        # 50 candidates over every total batch one micro-step can hold, so every size plans over a full grid.
        grid = goodput.candidate_batch_sizes(model.minimum("cannikin"), model.capacity("cannikin"), 50)
        phi = float(job.noise(0.5 * job.target_progress, grid[0]))
        settings = PolicySettings(max_batch_size=int(grid[-1]), candidates=50)
        start = model.plan("cannikin", int(grid[0]))
        optperf_times, replan_times = [], []
        for _ in range(repeats):
            tick = time.perf_counter()
            model.optperf(grid)
            mid = time.perf_counter()
            decide(model, start, settings, phi, job.base_batch_size)
            end = time.perf_counter()
            optperf_times.append(mid - tick)
            replan_times.append(end - mid)
        rows.append(
            {
                "gpus": cluster.num_devices,
                "candidates": int(grid.size),
                "repeats": repeats,
                "optperf_ms_median": statistics.median(optperf_times) * 1e3,
                "replan_ms_median": statistics.median(replan_times) * 1e3,
                "replan_ms_max": max(replan_times) * 1e3,
            }
        )
    return rows


def headline(rows: list[dict]) -> dict:
    """Reductions of Cannikin's time-to-target on the heterogeneous 16-GPU mixes, per data source."""
    out = {}
    for data in ("shipped", "sia"):
        picked = [r for r in rows if r.get("data") == data and "policies" in r and r["cluster"] != CONTROL]
        if not picked:
            continue
        summary = {}
        for base in ("ddp", "ddp_tuned", "adaptdl"):
            values = [r["cannikin_reduction"][base] for r in picked]
            best = max(picked, key=lambda r, b=base: r["cannikin_reduction"][b])
            summary[base] = {
                "median": float(np.median(values)),
                "min": float(np.min(values)),
                "max": float(np.max(values)),
                "max_at": f"{best['job']} on {best['cluster']}",
                "n": len(values),
            }
        out[data] = summary
    control = [r for r in rows if r.get("cluster") == CONTROL and "policies" in r]
    if control:
        out["control_max_abs_cannikin_vs_adaptdl"] = max(abs(r["cannikin_reduction"]["adaptdl"]) for r in control)
    return out


def markdown(report: dict) -> str:
    v = report["validation"]
    lines = [
        "# Simulated time-to-target on heterogeneous clusters",
        "",
        "Generated by `python benchmarks/simulate.py` (see `docs/simulation.md` for the model and its caveats).",
        f"Profiles: Pollux T4 + Zeus (shipped){' + Sia (local only, not shipped)' if report['sia_available'] else ''}.",
        f"Python {report['python']}, numpy {report['numpy']}; wall time {report['wall_seconds']:.0f} s.",
        "",
        "Policies: **DDP** fixed total batch (B0 per GPU), even split; **Cannikin split** OptPerf split at that fixed",
        "batch; **AdaptDL-like** even split, goodput-adaptive batch; **Cannikin** OptPerf split, goodput-adaptive",
        "batch; **tuned DDP** the best fixed batch in hindsight (no real run has it). Reductions are",
        "1 - time(Cannikin) / time(baseline). The adaptive policies re-plan when a training run's Replanner says",
        "(asked after every step; mid-epoch re-plans keep the accumulation, which changes at epoch ends).",
        "",
        "## Headline: 16-GPU mixes",
        "",
    ]
    for data, summary in report["headline"].items():
        if not isinstance(summary, dict):
            continue
        label = "shipped profiles (ImageNet, BERT, NCF)" if data == "shipped" else "with the Sia profiles (all jobs)"
        parts = [
            f"vs {base.replace('_', ' ')}: median {_pct(s['median'])} (range {_pct(s['min'])} to {_pct(s['max'])},"
            f" best: {s['max_at']})"
            for base, s in summary.items()
        ]
        lines.append(f"- {label}, {summary['ddp']['n']} job-mix pairs: " + "; ".join(parts) + ".")
    if "control_max_abs_cannikin_vs_adaptdl" in report["headline"]:
        lines.append(
            f"- Homogeneous control {CONTROL}: |Cannikin vs AdaptDL-like| <= "
            f"{report['headline']['control_max_abs_cannikin_vs_adaptdl'] * 100:.2g}% (nothing to balance)."
        )
    lines += [
        "",
        "| data | cluster | job | DDP h | Cannikin split h | AdaptDL-like h | Cannikin h | tuned DDP h (B) |"
        " vs DDP | vs tuned DDP | vs AdaptDL | Cannikin mean B | planner err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["mixes"]:
        if "policies" not in r:
            continue
        p = r["policies"]
        red = r["cannikin_reduction"]
        lines.append(
            f"| {r['data']} | {r['cluster']} | {r['job']} | {_hours(p['ddp']['time_to_target_s'])} |"
            f" {_hours(p['cannikin_fixed']['time_to_target_s'])} | {_hours(p['adaptdl']['time_to_target_s'])} |"
            f" {_hours(p['cannikin']['time_to_target_s'])} |"
            f" {_hours(r['ddp_tuned']['time_to_target_s'])} ({r['ddp_tuned']['batch_size']}) |"
            f" {_pct(red['ddp'])} | {_pct(red['ddp_tuned'])} | {_pct(red['adaptdl'])} |"
            f" {p['cannikin']['mean_batch_size']:.0f} | {p['cannikin']['prediction_error_median'] * 100:.1f}% |"
        )
    skipped = sorted({f"{r['cluster']}: {r['skipped']}" for r in report["mixes"] if "skipped" in r})
    if skipped:
        lines += ["", "Not simulated (no profile for a GPU type): " + "; ".join(skipped) + "."]
    lines += [
        "",
        "## Scale: the main mix at 16 to 1,024 GPUs",
        "",
        "`validated`: total batch capped at the job's largest validated batch (no statistics beyond it).",
        "`weak`: B0 per GPU allowed (the cap grows with the cluster; noise scale held at the largest validated run",
        "beyond it).",
        "`linear`: Pollux's all-reduce model, cost linear in GPUs; `log`: the same data fitted with a log term. Both",
        "fit the measured 2-64 T4 GPUs; beyond 64 they are extrapolations that bracket the truth.",
        "",
        "| data | job | GPUs | network | cap | T_net s | start B | Cannikin B | vs DDP | vs tuned DDP | vs AdaptDL |"
        " extrapolated |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["scale"]:
        red = r["cannikin_reduction"]
        lines.append(
            f"| {r['data']} | {r['job']} | {r['gpus']} | {r['scaling']} | {r['cap']} | {r['network_time_s']:.2f} |"
            f" {r['start_batch_size']} | {r['policies']['cannikin']['mean_batch_size']:.0f} | {_pct(red['ddp'])} |"
            f" {_pct(red['ddp_tuned'])} | {_pct(red['adaptdl'])} | {'yes' if r['extrapolated'] else ''} |"
        )
    lines += [
        "",
        "## Planner wall time per re-plan",
        "",
        "OptPerf over all candidates, the goodput choice and the chosen split, for ImageNet on the main mix scaled up"
        f" (median of {report['planner'][0]['repeats']} repeats; target < 50 ms at 1,024 devices x 50 candidates).",
        "",
        "| GPUs | candidates | OptPerf ms | re-plan ms (median) | re-plan ms (max) |",
        "|---|---|---|---|---|",
    ]
    for r in report["planner"]:
        lines.append(
            f"| {r['gpus']} | {r['candidates']} | {r['optperf_ms_median']:.2f} | {r['replan_ms_median']:.2f} |"
            f" {r['replan_ms_max']:.2f} |"
        )
    lines += [
        "",
        "## Validation (computed from the profiles)",
        "",
        "Step time of T4 jobs on 6-16 nodes (up to 64 GPUs), held out: the network model was fitted on 1-4 nodes",
        "(up to 16 GPUs). `clock`: measured compute + fitted network (what the simulator charges); `planner`: the",
        "project's linear compute fit + fitted network (what the planner predicts); `library`: the linear compute fit",
        "in the library's two-regime step model `max(t + e c, s t + c)` (share `s` and exposed fraction `e` fitted on",
        "the same 1-4-node runs; the library measures both live).",
        "",
        "| job | network | held-out rows | clock median | clock p90 | planner median | planner p90 | library median |"
        " library p90 | s, e |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in v["network"]:
        lines.append(
            f"| {r['job']} | {r['scaling']} | {r['heldout_rows']} | {r['heldout_median_err'] * 100:.1f}% |"
            f" {r['heldout_p90_err'] * 100:.1f}% | {r['heldout_planner_median_err'] * 100:.1f}% |"
            f" {r['heldout_planner_p90_err'] * 100:.1f}% | {r['heldout_library_median_err'] * 100:.1f}% |"
            f" {r['heldout_library_p90_err'] * 100:.1f}% | {r['library_share']:.2f}, {r['library_exposed']:.2f} |"
        )
    lines += [
        "",
        "Single-GPU linear fits `t(b) = a*b + a0` with the project's fitter (leave-one-out: fit without one batch",
        "size, predict it). Coefficients are listed for the shipped sources only.",
        "",
        "| job | GPU | source | used | points | b range | a ms/sample | a0 ms | R2 | median err | leave-one-out |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in v["single_gpu"]:
        shipped = r["source"] != "sia"
        coeffs = f"{r['a_ms']:.4g} | {r['a0_ms']:.4g}" if shipped else "- | -"
        lines.append(
            f"| {r['job']} | {r['gpu']} | {r['source']} | {'yes' if r['used'] else 'no'} | {r['n']} |"
            f" {r['b_min']}-{r['b_max']} | {coeffs} | {r['r2']:.3f} | {r['median_err'] * 100:.1f}% |"
            f" {r['loo_median_err'] * 100:.1f}% |"
        )
    lines += [
        "",
        "Steps to each validation run's final progress at fixed batch M: the simulator's count (noise scale",
        "interpolated between runs, the run itself left out) vs the run's measured count. Positive = the simulator",
        "is pessimistic.",
        "",
        "| job | M | measured steps | predicted (in-sample) | predicted (run left out) | error (left out) |",
        "|---|---|---|---|---|---|",
    ]
    for r in v["progress"]:
        lines.append(
            f"| {r['job']} | {r['batch_size']} | {r['measured']:.0f} | {r['predicted']:.0f} |"
            f" {r['heldout_predicted']:.0f} | {r['heldout_err'] * 100:+.1f}% |"
        )
    lines += ["", "**Failures** (median error > 10% or linear R2 < 0.9), from the tables above:", ""]
    lines += [f"- {f}" for f in v["failures"]] or ["- none"]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    rows = [r for r in report["mixes"] if "policies" in r and r["cluster"] != CONTROL]
    labels = [f"{r['job']}\n{r['cluster']}" + ("*" if r["data"] == "sia" else "") for r in rows]
    x = np.arange(len(rows))
    policies = [
        ("ddp", "DDP"),
        ("cannikin_fixed", "Cannikin split, fixed B"),
        ("adaptdl", "AdaptDL-like"),
        ("cannikin", "Cannikin"),
    ]
    width = 0.2
    for i, (key, name) in enumerate(policies):
        values = [r["policies"][key]["time_to_target_s"] / r["policies"]["ddp"]["time_to_target_s"] for r in rows]
        axes[0].bar(x + (i - 1.5) * width, values, width, label=name)
    axes[0].set_xticks(x, labels, rotation=90, fontsize=6)
    axes[0].set_ylabel("time to target / DDP")
    axes[0].set_title("16-GPU mixes (* = Sia profiles)")
    axes[0].legend(fontsize=7)

    for (data, scaling, cap), style in {
        ("shipped", "linear", "validated"): "-",
        ("shipped", "log", "weak"): "--",
        ("sia", "linear", "validated"): "-",
        ("sia", "log", "weak"): "--",
    }.items():
        for job in JOBS:
            pts = [
                r for r in report["scale"] if (r["data"], r["scaling"], r["cap"], r["job"]) == (data, scaling, cap, job)
            ]
            if not pts:
                continue
            axes[1].plot(
                [r["gpus"] for r in pts],
                [r["cannikin_reduction"]["adaptdl"] * 100 for r in pts],
                style,
                marker="o" if data == "sia" else "s",
                label=f"{job} ({data}, {scaling}, {cap})",
            )
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("GPUs")
    axes[1].set_ylabel("Cannikin time saved vs AdaptDL-like (%)")
    axes[1].set_title("Scale (solid: validated batch, linear network; dashed: weak, log)")
    axes[1].legend(fontsize=5, ncol=2)

    gpus = [r["gpus"] for r in report["planner"]]
    axes[2].plot(gpus, [r["replan_ms_median"] for r in report["planner"]], marker="o", label="re-plan (median)")
    axes[2].plot(gpus, [r["optperf_ms_median"] for r in report["planner"]], marker="s", label="OptPerf, 50 candidates")
    axes[2].axhline(50, color="grey", ls=":", label="50 ms target")
    axes[2].set_xscale("log", base=2)
    axes[2].set_yscale("log")
    axes[2].set_xlabel("devices")
    axes[2].set_ylabel("ms")
    axes[2].set_title("Planner wall time")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--quick", action="store_true", help="16 and 64 GPUs only, fewer timing repeats")
    parser.add_argument("--repeats", type=int, default=21, help="planner timing repeats (median reported)")
    parser.add_argument(
        "--shipped-only", action="store_true", help="ignore the local Sia profiles even when found (clean-install view)"
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    stores = {"shipped": ProfileStore(use_sia=False)}
    auto = stores["shipped"] if args.shipped_only else ProfileStore()
    if auto.sia_available:
        stores["sia"] = auto
    report: dict = {
        "sia_available": "sia" in stores,
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    report["validation"] = validate(auto)
    for row in report["validation"]["single_gpu"]:
        if row["source"] == "sia":  # derived numbers of unlicensed data stay out of committed results
            row.pop("a_ms")
            row.pop("a0_ms")
    report["mixes"] = mixes(stores)
    report["headline"] = headline(report["mixes"])
    report["scale"] = scale(stores, args.quick)
    report["planner"] = planner_timing(stores, 5 if args.quick else args.repeats)
    report["wall_seconds"] = time.perf_counter() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulate.json").write_text(json.dumps(report, indent=1, default=float) + "\n")
    (out / "simulate.md").write_text(markdown(report))
    figure = plot_or_skip(lambda path: plot(report, path), out / "simulate.png")
    print(markdown(report))
    written = "simulate.md, simulate.png" if figure else "simulate.md"
    print(f"wrote {out / 'simulate.json'}, {written} in {report['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
