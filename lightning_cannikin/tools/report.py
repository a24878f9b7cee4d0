"""Plots of a Cannikin profile (``cannikin report``): device models, step-time predictions, the adaptive schedule.

matplotlib is imported lazily, and only its object-oriented API with the Agg canvas is used: no pyplot, so the
process-wide backend of a notebook or a training script that imports this module is left alone.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lightning_cannikin.core.profile import Profile

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "COMPUTE_TIME_PNG",
    "PLOTS_INSTALL",
    "STEP_TIME_PNG",
    "TRAINING_PNG",
    "matplotlib_available",
    "plot_compute_time",
    "plot_or_skip",
    "plot_step_time",
    "plot_training",
    "write_report",
]

COMPUTE_TIME_PNG = "compute_time.png"
STEP_TIME_PNG = "step_time.png"
TRAINING_PNG = "training.png"

_DPI = 110
# Up to this many noise measurements, each gets a marker (and a bar for its bounds).
_FEW_POINTS = 60
# How to get matplotlib: the one fix every "no plot" message gives.
PLOTS_INSTALL = 'pip install "lightning-cannikin[plots]"'


def matplotlib_available() -> bool:
    """Whether matplotlib can be imported (it is the optional ``plots`` extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_or_skip(plot: Callable[[Path], object], path: str | os.PathLike[str]) -> Path | None:
    """``plot(path)`` and return ``path``; without matplotlib, print one line saying how to get the plot instead.

    For scripts whose plot comes last (the benchmarks): their results are already saved, and a missing optional
    package must not turn a finished run into a failed one.
    """
    path = Path(path)
    if not matplotlib_available():
        print(f"skipped the plot {path}: matplotlib is not installed ({PLOTS_INSTALL} to get it)")
        return None
    plot(path)
    return path


def write_report(profile: Profile, out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write the report's PNGs into ``out_dir`` (created if missing) and return their paths.

    - ``compute_time.png``: measured compute time vs local batch per device, with the fitted lines.
    - ``step_time.png``: predicted vs measured step time per re-plan.
    - ``training.png``: total batch, LR factor and noise scale over training; the noise panel adds the noise
      scale's confidence bounds, where recorded, and the total batch.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, plot in (
        (COMPUTE_TIME_PNG, plot_compute_time),
        (STEP_TIME_PNG, plot_step_time),
        (TRAINING_PNG, plot_training),
    ):
        figure = plot(profile)
        path = out / name
        figure.savefig(path, dpi=_DPI)
        written.append(path)
    return written


def _figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)  # attaches itself to the figure
    return figure


def _no_data(ax: Axes, message: str) -> None:
    _empty(ax, message)
    ax.set_xticks([])


def plot_compute_time(profile: Profile) -> Figure:
    """Measured compute time vs local batch per device (raw samples) with each device's fitted line."""
    many = profile.world_size > 6
    figure = _figure(12.5 if many else 8.0, 5.0 + 0.12 * max(0, profile.world_size - 16))
    ax = figure.add_subplot()
    ax.set_title(f"Compute time per device ({profile.world_size} ranks)")
    colors = _colors(profile.world_size)
    largest = max((max(d.batch_sizes) for d in profile.devices if d.batch_sizes), default=0)
    if largest == 0:
        _no_data(ax, "no timing samples in this profile")
        return figure
    grid = np.linspace(0.0, 1.08 * largest, 50)
    for device, color in zip(profile.devices, colors, strict=True):
        label = f"rank {device.rank}"
        if device.batch_sizes:
            # Plans repeat a few batch sizes many times: transparency shows where samples pile up.
            ax.scatter(
                device.batch_sizes, 1000 * np.asarray(device.seconds), s=14, alpha=0.35, color=color, linewidths=0
            )
        if device.model is not None:
            slope_ms, intercept_ms = 1000 * device.model.slope, 1000 * device.model.intercept
            label += f": {slope_ms:.3g} ms/sample + {intercept_ms:.3g} ms ({len(device.batch_sizes)} samples)"
            ax.plot(grid, 1000 * device.model(grid), color=color, linewidth=1.6, label=label)
        else:
            ax.plot([], [], color=color, label=f"{label}: no model")
    ax.set_xlim(0, grid[-1])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("local batch size (samples)")
    ax.set_ylabel("forward + backward compute (ms)")
    ax.grid(alpha=0.3)
    if many:
        # Beside the axes: a legend this long inside them would hide the samples.
        figure.legend(loc="outside right upper", fontsize="small")
    else:
        ax.legend(loc="upper left", fontsize="small")
    if profile.tail > 0:
        ax.text(
            0.99,
            0.02,
            f"step tail (all-reduce exposed + optimizer): {1000 * profile.tail:.3g} ms",
            ha="right",
            va="bottom",
            transform=ax.transAxes,
            fontsize="small",
            color="0.3",
        )
    return figure


def plot_step_time(profile: Profile) -> Figure:
    """Predicted vs measured step time per re-plan: over training, and against each other."""
    figure = _figure(11.0, 4.5)
    over_time, versus = figure.subplots(1, 2, width_ratios=(1.6, 1.0))
    rows = [
        (entry.get("step"), entry.get("predicted_step_time"), entry.get("measured_step_time"))
        for entry in profile.history
    ]
    # A plan's step time is measured only once the next re-plan has seen it run, so the newest entry has none yet.
    rows = [(s, p, m) for s, p, m in rows if s is not None and _finite(p) and _finite(m)]
    over_time.set_title("Step time per re-plan")
    versus.set_title("Measured vs predicted")
    if not rows:
        message = "no re-plan with both a predicted\nand a measured step time yet"
        _no_data(over_time, message)
        _no_data(versus, message)
        return figure
    steps = np.array([r[0] for r in rows], dtype=float)
    predicted = 1000 * np.array([r[1] for r in rows], dtype=float)
    measured = 1000 * np.array([r[2] for r in rows], dtype=float)
    over_time.plot(steps, predicted, marker="o", markersize=4, label="predicted")
    over_time.plot(steps, measured, marker="s", markersize=4, label="measured (median)")
    over_time.set_xlabel("training step of the re-plan")
    over_time.set_ylabel("step time (ms)")
    over_time.set_ylim(bottom=0)
    over_time.grid(alpha=0.3)
    over_time.legend(fontsize="small")
    versus.scatter(predicted, measured, s=18, color="C2")
    top = 1.08 * max(predicted.max(), measured.max())
    versus.plot([0, top], [0, top], color="0.5", linestyle="--", linewidth=1, label="measured = predicted")
    error = np.median(np.abs(measured - predicted) / measured) * 100
    versus.set_xlim(0, top)
    versus.set_ylim(0, top)
    versus.set_aspect("equal")
    versus.set_xlabel("predicted (ms)")
    versus.set_ylabel("measured (ms)")
    versus.grid(alpha=0.3)
    versus.legend(fontsize="small", loc="upper left", title=f"median |error| {error:.1f}% over {len(rows)}")
    return figure


def plot_training(profile: Profile) -> Figure:
    """Total batch, LR factor and noise scale over training, one panel each (a panel without data says so).

    The noise panel also shows the noise scale's confidence bounds where the profile has them, and the total batch
    on the same axis, so that a reader sees the total follow the bounds.
    """
    figure = _figure(8.0, 8.0)
    batch_ax, lr_ax, noise_ax = figure.subplots(3, 1, sharex=True)
    history = profile.history
    batch = _series(history, "total_batch_size")
    lr = _series(history, "lr_factor")
    noise = _series(profile.noise_scale_history, "noise_scale")
    bounds = _noise_bounds(profile.noise_scale_history)
    panels = (
        (batch_ax, batch, "total batch size", "C0", "no plan history"),
        (lr_ax, lr, "LR factor", "C1", "no LR factor recorded"),
    )
    for ax, (steps, values), label, color, empty in panels:
        ax.set_ylabel(label)
        if steps.size == 0:
            _empty(ax, empty)
            continue
        # A plan holds from its re-plan to the next: a step function, not a line between re-plans.
        ax.step(steps, values, where="post", color=color, marker="o", markersize=3)
        ax.grid(alpha=0.3)
    if batch[0].size and profile.base_batch_size is not None:
        batch_ax.axhline(profile.base_batch_size, color="0.5", linestyle="--", linewidth=1)
        batch_ax.text(
            0.01,
            profile.base_batch_size,
            f" base batch {profile.base_batch_size}",
            transform=batch_ax.get_yaxis_transform(),
            va="bottom",
            fontsize="small",
            color="0.3",
        )
    _plot_noise(noise_ax, noise, bounds, batch)
    noise_ax.set_xlabel("training step")
    if not (batch[0].size or lr[0].size or noise[0].size or bounds[0].size):
        noise_ax.set_xticks([])  # a 0..1 step axis with nothing on it would look like data
    figure.suptitle("Adaptive schedule")
    return figure


def _plot_noise(
    ax: Axes,
    noise: tuple[np.ndarray, np.ndarray],
    bounds: tuple[np.ndarray, np.ndarray, np.ndarray],
    batch: tuple[np.ndarray, np.ndarray],
) -> None:
    """The noise panel: the estimate, its confidence band or lower bound, and the total batch in samples."""
    ax.set_ylabel("noise scale (samples)")
    steps, low, high = bounds
    if noise[0].size == 0 and steps.size == 0:
        _empty(ax, "noise scale not measured (track_noise_scale off?)")
        return
    # A marker on each measurement shows a few of them; over a dense trail (one per update) markers hide the band.
    few = max(noise[0].size, steps.size) <= _FEW_POINTS
    banded = np.isfinite(high)
    if banded.any():
        # Like the estimate's step line, a bound holds until the next measurement.
        edges = np.append(steps, steps[-1])
        values = np.where(banded, high, np.nan)
        band = ax.stairs(values, edges, baseline=low, fill=True, color="C2", alpha=0.18, label="confidence band")
        band.sticky_edges.y.clear()  # a margin below the lowest bound, as for the lines
        if few:
            ax.vlines(steps[banded], low[banded], high[banded], color="C2", linewidth=1, alpha=0.5)
    if not banded.all():
        lower_only = np.where(banded, np.nan, low)
        ax.step(
            steps, lower_only, "^--" if few else "--", where="post", color="C2", markersize=4, label="lower bound only"
        )
    if noise[0].size:
        ax.step(*noise, "o-" if few else "-", where="post", color="C2", markersize=3, label="noise scale")
    if batch[0].size:
        ax.step(*batch, where="post", color="C0", linewidth=1.2, alpha=0.8, label="total batch")
    # A lower bound of 0 is no bound at all: it must not keep the axis linear.
    shown = np.concatenate([noise[1], low[low > 0], high[banded], batch[1]])
    if shown.size and shown.min() > 0 and shown.max() / shown.min() > 20:
        ax.set_yscale("log")  # the noise scale grows by orders of magnitude over a run
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="best")


def _noise_bounds(entries: Iterable[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(steps, low, high)`` of the noise-scale confidence bounds, sorted by step.

    An entry counts where its step and a finite ``noise_low`` are known; its ``noise_high`` is ``inf`` where it is
    missing, ``None`` (how a profile stores infinity) or not finite: a lower bound only.
    """
    rows = sorted(
        (float(e["step"]), float(e["noise_low"]), float(e["noise_high"]) if _finite(e.get("noise_high")) else math.inf)
        for e in entries
        if e.get("step") is not None and _finite(e.get("noise_low"))
    )
    if not rows:
        return np.empty(0), np.empty(0), np.empty(0)
    steps, low, high = (np.asarray(column, dtype=float) for column in zip(*rows, strict=True))
    return steps, low, high


def _empty(ax: Axes, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_yticks([])


def _series(entries: Iterable[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of the entries where both the step and a finite value are known, sorted by step."""
    pairs = sorted(
        (float(e["step"]), float(e[key])) for e in entries if e.get("step") is not None and _finite(e.get(key))
    )
    if not pairs:
        return np.empty(0), np.empty(0)
    steps, values = zip(*pairs, strict=True)
    return np.asarray(steps), np.asarray(values)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _colors(n: int) -> Sequence[Any]:
    from matplotlib import colormaps

    # tab10 is distinct up to ten devices; beyond that a continuous map at least keeps neighbours apart.
    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    return [colormaps["viridis"](i / max(1, n - 1)) for i in range(n)]
