"""The two-piece all-reduce model against measured multi-node step times (``/work/shared/data/gpu-profiles``).

The profiles (Pollux's T4 traces, Apache-2.0; Sia's V100/A100/2080 Ti traces, internal use only) give, per placement
(GPUs per node) and local batch ``b``, the whole step and ``sync_time``: from the last gradient hook to the end of the
all-reduce, the part backward did not hide (what :class:`~lightning_cannikin.core.step_record.StepRecord` calls
``exposed``). The compute is ``step - sync``. Every device of a placement is alike, so OptPerf(B) is the step time
at ``b = B / n``, and predicting it at 0.25x-4x the total is predicting the step at ``b / 4`` to ``4 b``.

The model (:func:`~lightning_cannikin.core.timing.step_time_pieces` as the speed model calls it): a step costs
``max(t(b) + c_last, s t(b) + c)``, ``c`` the reductions' own time, ``c_last`` the last bucket's, ``s`` the share of
the compute done when the first bucket is ready. The compute ``t(b)`` is given its measured value at every size, so
only the all-reduce model is judged. Three fits:

- ``form``: ``(c, c_last, s)`` by least squares over every size of the placement: how well the form can describe the
  measured steps at all (what a timer reporting the reductions' own times, ``comm_busy`` and ``last_bucket``, could
  reach from one total; the profiles do not hold those times, so they cannot be read off one row);
- ``spans``: from the one middle size only, as the speed model falls back when a timer gives only spans:
  ``c = exposed + (1 - s) t(b*)`` (first bucket to the end) and ``c_last = exposed``, ``s`` from the ``form`` fit;
- the error of each at every measured size from ``b* / 4`` to ``4 b*``.

Usage: ``python benchmarks/allreduce_profiles.py [--data DIR] [--json PATH] [--with-sia]``. The saved results are
the T4 ones only (Apache-2.0 data); Sia's carry no licence, so ``--with-sia`` is for a local look (write the JSON
elsewhere).
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import numpy as np

from lightning_cannikin.core.timing import CommModel, LinearTimeModel, step_time_pieces

DATA = Path("/work/shared/data/gpu-profiles")
JOBS = ("cifar10", "imagenet", "bert", "deepspeech2", "yolov3", "ncf")
SOURCES = {  # cluster -> (folder, file suffix, GPU)
    "aws": ("pollux/simulator/traces", "", "T4"),
    "azure": ("sia/sia-simulator/traces", "-azure", "V100"),
    "dgx-ext": ("sia/sia-simulator/traces", "-dgx-ext", "A100"),
    "rtx": ("sia/sia-simulator/traces", "-rtx", "2080Ti"),
}


def read_placements(path: Path) -> dict[str, list[tuple[int, float, float]]]:
    """``{placement: [(local batch, step s, sync s), ...]}`` sorted by batch (columns read by name)."""
    rows: dict[str, list[tuple[int, float, float]]] = {}
    with path.open() as handle:
        for row in csv.DictReader(handle):
            rows.setdefault(row["placement"], []).append(
                (int(row["local_bsz"]), float(row["step_time"]), float(row["sync_time"]))
            )
    return {key: sorted(value) for key, value in rows.items()}


def predict(compute: np.ndarray, comm: float, last: float, share: float) -> np.ndarray:
    """The step time at each measured compute, through the speed model's own pieces."""
    models = [LinearTimeModel(0.0, float(t)) for t in compute]  # the measured compute at each size, as intercepts
    _, offsets = step_time_pieces(
        models, CommModel(max(comm, last), last), backward_fraction=0.0, forward_fraction=share
    )
    return offsets.max(axis=1)  # the slopes are zero: each size is its own intercept


def fit_form(compute: np.ndarray, step: np.ndarray) -> tuple[float, float, float]:
    """``(c, c_last, s)`` minimising the squared relative error of the step over every size (a grid search, refined
    three times around the best point)."""
    top = float(step.max())
    low, high = np.zeros(3), np.array([top, top / 2, 1.0])  # c, c_last, s
    best = (0.0, 0.0, 0.0)
    for _ in range(4):
        c, last, s = np.meshgrid(*(np.linspace(lo, hi, 25) for lo, hi in zip(low, high, strict=True)), indexing="ij")
        pred = np.maximum(compute + last[..., None], s[..., None] * compute + c[..., None])
        error = (((pred - step) / step) ** 2).sum(axis=-1)
        index = np.unravel_index(int(np.argmin(error)), error.shape)
        best = (float(c[index]), float(last[index]), float(s[index]))
        width = (high - low) / 6
        low, high = np.maximum(np.array(best) - width, 0.0), np.minimum(np.array(best) + width, [top, top, 1.0])
    return best


def evaluate(rows: list[tuple[int, float, float]]) -> dict | None:
    """The fits of one placement and their errors from a quarter to four times the middle size."""
    if len(rows) < 6:
        return None
    sizes = np.array([b for b, _, _ in rows])
    step = np.array([t for _, t, _ in rows])
    sync = np.array([e for _, _, e in rows])
    compute = step - sync
    middle = len(rows) // 2
    inside = (sizes >= sizes[middle] / 4) & (sizes <= sizes[middle] * 4)
    comm, last, share = fit_form(compute, step)
    form = predict(compute, comm, last, share) / step - 1.0
    spans_comm = sync[middle] + (1.0 - share) * compute[middle]
    spans = predict(compute, spans_comm, sync[middle], share) / step - 1.0
    exposed_only = (compute + sync[middle]) / step - 1.0  # one piece: compute + the exposed part measured at b*
    return {
        "sizes": sizes[inside].tolist(),
        "middle": int(sizes[middle]),
        "regime_at_middle": "allreduce" if sync[middle] > 0.1 * step[middle] else "compute",
        "fit": {"comm_s": comm, "last_bucket_s": last, "first_bucket_share": share},
        "form_abs_error_max": float(np.abs(form[inside]).max()),
        "form_abs_error_median": float(np.median(np.abs(form[inside]))),
        "spans_abs_error_max": float(np.abs(spans[inside]).max()),
        "spans_abs_error_median": float(np.median(np.abs(spans[inside]))),
        "exposed_only_abs_error_max": float(np.abs(exposed_only[inside]).max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "allreduce_profiles.json")
    parser.add_argument(
        "--with-sia", action="store_true", help="also Sia's V100/A100/2080 Ti traces (no licence: keep it local)"
    )
    args = parser.parse_args()
    results = []
    clusters = SOURCES if args.with_sia else {"aws": SOURCES["aws"]}
    for cluster, (folder, suffix, gpu) in clusters.items():
        for job in JOBS:
            path = args.data / folder / job / f"placements{suffix}.csv"
            if not path.exists():
                continue
            for placement, rows in read_placements(path).items():
                if len(placement) < 2:
                    continue  # one node: not a multi-node all-reduce
                entry = evaluate(rows)
                if entry is not None:
                    results.append({"job": job, "gpu": gpu, "cluster": cluster, "placement": placement, **entry})
    if not results:
        raise SystemExit(f"No multi-node placements under {args.data} (the profiles are not in the repository).")
    summary = {}
    for gpu in sorted({r["gpu"] for r in results}):
        for job in ("all", *JOBS):
            mine = [r for r in results if r["gpu"] == gpu and job in ("all", r["job"])]
            if mine:
                summary[f"{gpu}/{job}"] = _summarise(mine)
    print(json.dumps(summary, indent=1))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"summary": summary}, indent=1) + "\n")


def _summarise(results: list[dict]) -> dict:
    """Median and 90th percentile of each fit's largest error per placement, and the share within 10%."""
    out: dict = {"placements": len(results)}
    for key in ("form", "spans", "exposed_only"):
        errors = [r[f"{key}_abs_error_max"] for r in results]
        out[key] = {
            "max_error_median": round(float(np.median(errors)), 4),
            "max_error_p90": round(float(np.quantile(errors, 0.9)), 4),
            "within_10pct": round(float(np.mean([e <= 0.10 for e in errors])), 3),
        }
    return out


if __name__ == "__main__":
    main()
