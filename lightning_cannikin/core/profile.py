"""The Cannikin profile: a JSON snapshot of what the balancing engine learnt about the cluster, for `cannikin plan`.

At each re-plan the engine can write one profile into the trainer's log dir. It holds every rank's fitted
compute-time model and raw timing samples, the step's tail, the local batch bounds, the plan history and the
noise-scale history, plus the :class:`~lightning_cannikin.core.speed_model.SpeedModel`'s full state and settings, so
that :meth:`Profile.speed_model` rebuilds a speed model that fits the same models and plans the same splits.

Schema version 1 (JSON object; non-finite numbers are written as ``null`` so the file is strict JSON)::

    format               "lightning-cannikin/profile"
    version              1
    created_unix         float, seconds since the epoch when the profile was built
    world_size           int
    base_batch_size      int | null, the total batch the learning rate was tuned for
    devices              [{rank, model: {slope, intercept} | null, samples: {batch_sizes, seconds}}], seconds
    tail                 {seconds, samples}: the step's median cost beyond the slowest rank's compute
    comm                 {allreduce, exposed} | null: the gradient all-reduce's seconds, and its part not hidden
                         by backward (optional: readers ignore it when absent)
    bounds               {lower: [int], upper: [int] | null}
    settings             {half_life: float | null (null: infinite), tail_window, max_samples, drift_tolerance,
                          warmup_samples, probe_lever} (the last three optional: older profiles lack them)
    history              [{step, epoch, local_batch_sizes, total_batch_size, predicted_step_time,
                           measured_step_time, lr_factor, noise_scale}], one entry per re-plan
    noise_scale_history  [{step, noise_scale, noise_low, noise_high, ...}]: noise_low and noise_high (optional:
                         older profiles lack them) bound the noise scale in samples; null, like a missing key, is
                         unknown or unbounded, so an infinite noise_high is written as null
    balancer_state       SpeedModel.state_dict()

Pure: numpy and the project's pure modules only (no torch, no Lightning).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightning_cannikin.core.plan import BatchBounds
from lightning_cannikin.core.speed_model import SpeedModel, SpeedModelSettings
from lightning_cannikin.core.timing import LinearTimeModel

__all__ = [
    "FORMAT",
    "PROFILE_FILENAME",
    "VERSION",
    "DeviceProfile",
    "Profile",
    "build_profile",
    "load_profile",
    "save_profile",
]

FORMAT = "lightning-cannikin/profile"
VERSION = 1
# The name the callback is expected to use inside the trainer's log dir.
PROFILE_FILENAME = "cannikin_profile.json"

_REQUIRED = (
    "world_size",
    "base_batch_size",
    "devices",
    "tail",
    "bounds",
    "settings",
    "history",
    "noise_scale_history",
    "balancer_state",
)


def build_profile(
    balancer: SpeedModel,
    history: Sequence[Mapping[str, Any]],
    base_batch_size: int | None = None,
    noise_scale_history: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Snapshot a speed model and the callback's history as a JSON-ready profile (schema version 1).

    Args:
        balancer: the callback's speed model; ranks without samples get ``model: null``.
        history: the callback's ``history`` (one dict per re-plan).
        base_batch_size: the total batch the learning rate was tuned for, if known.
        noise_scale_history: dicts with at least ``step`` and ``noise_scale``, optionally ``noise_low`` and
            ``noise_high`` (its confidence bounds; an infinite one is stored as ``None``); ``None`` takes the
            history entries whose ``noise_scale`` is known and finite (their step, epoch, total batch and noise
            scale: no bounds).

    Returns:
        A dict of plain JSON types (numpy scalars converted, non-finite numbers as ``None``).

    """
    devices = []
    for rank, fitter in enumerate(balancer.fitters):
        # fitter.fit() rather than models(): the latter refuses while any rank lacks samples, and a profile
        # written early (or by a rank that joined late) should still show what is known.
        model = fitter.fit()
        state = fitter.state_dict()
        devices.append(
            {
                "rank": rank,
                "model": None if model is None else model.to_dict(),
                "samples": {"batch_sizes": state["batch_sizes"], "seconds": state["seconds"]},
            }
        )
    if noise_scale_history is None:
        noise_scale_history = [
            {
                "step": entry.get("step"),
                "epoch": entry.get("epoch"),
                "total_batch_size": entry.get("total_batch_size"),
                "noise_scale": entry["noise_scale"],
            }
            for entry in history
            # an infinite noise scale (no detectable signal) has no strict-JSON form and no point on a plot
            if entry.get("noise_scale") is not None and math.isfinite(entry["noise_scale"])
        ]
    profile = {
        "format": FORMAT,
        "version": VERSION,
        "created_unix": time.time(),
        "world_size": balancer.world_size,
        "base_batch_size": None if base_batch_size is None else int(base_batch_size),
        "devices": devices,
        "tail": {"seconds": balancer.tail(), "samples": list(balancer.tails)},
        "comm": None if (comm := balancer.comm()) is None else comm.to_dict(),
        "bounds": {"lower": list(balancer.lower), "upper": None if balancer.caps is None else list(balancer.caps)},
        "settings": {
            # JSON has no infinity: _jsonable writes an infinite half-life ("no recency weighting") as null
            "half_life": float(balancer.settings.half_life),
            "tail_window": balancer.settings.tail_window,
            "max_samples": balancer.settings.max_samples,
            "drift_tolerance": balancer.settings.drift_tolerance,
            "warmup_samples": balancer.settings.warmup_samples,
            "probe_lever": balancer.settings.probe_lever,
        },
        "history": [dict(entry) for entry in history],
        "noise_scale_history": [dict(entry) for entry in noise_scale_history],
        "balancer_state": balancer.state_dict(),
    }
    return _jsonable(profile)


def save_profile(path: str | os.PathLike[str], profile: Mapping[str, Any]) -> Path:
    """Write a profile atomically: a reader (``cannikin report`` during training) never sees half a file.

    Args:
        path: destination file; missing parent directories are created.
        profile: what :func:`build_profile` returned.

    Returns:
        The path written.

    Raises:
        ValueError: ``profile`` is not a valid profile (checked before anything is written).

    """
    path = Path(path)
    data = _jsonable(dict(profile))
    _parse(data, path)  # refuse to write something load_profile would reject
    text = json.dumps(data, indent=1, allow_nan=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The temporary file lives beside the target so os.replace is a same-filesystem rename, which is atomic. It is
    # created with mode 0666 less the umask, like any log file (mkstemp's 0600 would hide it from teammates).
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


@dataclass(frozen=True)
class DeviceProfile:
    """One rank's part of a profile.

    Attributes:
        rank: global rank.
        model: the fitted compute-time model, or ``None`` if the rank had no samples.
        batch_sizes: the raw samples' local batch sizes, oldest first.
        seconds: the raw samples' compute times, oldest first.

    """

    rank: int
    model: LinearTimeModel | None
    batch_sizes: tuple[int, ...]
    seconds: tuple[float, ...]


@dataclass(frozen=True)
class Profile:
    """A parsed profile (see the module docstring for the file's schema).

    Attributes:
        path: the file it was read from.
        world_size: number of ranks.
        base_batch_size: the total batch the learning rate was tuned for, if known.
        devices: one :class:`DeviceProfile` per rank.
        tail: seconds a step costs beyond the slowest rank's compute.
        lower: per-rank lower bounds on the local batch.
        upper: per-rank upper bounds, or ``None``.
        history: the callback's plan history, one dict per re-plan.
        noise_scale_history: dicts with at least ``step`` and ``noise_scale``, optionally ``noise_low`` and
            ``noise_high`` (``None`` where unknown or infinite).
        settings: the speed model's ``half_life`` (``None``: infinite), ``tail_window`` and ``max_samples``.
        balancer_state: the speed model's ``state_dict()`` (the key keeps the name of schema version 1).

    """

    path: Path
    world_size: int
    base_batch_size: int | None
    devices: tuple[DeviceProfile, ...]
    tail: float
    lower: tuple[int, ...]
    upper: tuple[int, ...] | None
    history: tuple[dict[str, Any], ...]
    noise_scale_history: tuple[dict[str, Any], ...]
    settings: dict[str, Any]
    balancer_state: dict[str, Any]

    def speed_model(self) -> SpeedModel:
        """A fresh :class:`SpeedModel` with the stored settings and state: same models, same splits."""
        half_life = self.settings.get("half_life")
        defaults = SpeedModelSettings()
        settings = SpeedModelSettings(
            half_life=math.inf if half_life is None else float(half_life),
            tail_window=int(self.settings["tail_window"]),
            max_samples=int(self.settings.get("max_samples", defaults.max_samples)),
            # profiles written before these settings existed were made with the defaults of their time
            drift_tolerance=float(self.settings.get("drift_tolerance", defaults.drift_tolerance)),
            warmup_samples=int(self.settings.get("warmup_samples", 0)),
            probe_lever=float(self.settings.get("probe_lever", defaults.probe_lever)),
            evidence_reach=None,  # a what-if plans totals the run never reached: the fitted lines as they are
        )
        model = SpeedModel(self.world_size, settings, BatchBounds(self.lower, self.upper))
        model.load_state_dict(self.balancer_state)
        return model


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read and validate a profile written by :func:`save_profile`.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not a Cannikin profile, has an unsupported version or is malformed; the message
            names the path.

    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not a Cannikin profile: not UTF-8 text ({err}).") from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not a Cannikin profile: not valid JSON ({err}).") from err
    return _parse(data, path)


def _parse(data: Any, path: Path) -> Profile:
    """Validate a profile's content and build the :class:`Profile`; every error names ``path``."""
    where = str(path)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{where} is not a Cannikin profile (expected a JSON object with format {FORMAT!r}).")
    version = data.get("version")
    if version != VERSION:
        raise ValueError(
            f"{where}: profile version {version!r} is not supported; this lightning-cannikin reads version {VERSION}."
        )
    missing = [key for key in _REQUIRED if key not in data]
    if missing:
        raise ValueError(f"{where}: malformed Cannikin profile, missing {', '.join(missing)}.")
    try:
        world_size = int(data["world_size"])
        devices = tuple(_device(d) for d in data["devices"])
        state = data["balancer_state"]
        bounds = data["bounds"]
        upper = bounds["upper"]
        settings = dict(data["settings"])
        profile = Profile(
            path=path,
            world_size=world_size,
            base_batch_size=None if data["base_batch_size"] is None else int(data["base_batch_size"]),
            devices=devices,
            tail=float(data["tail"]["seconds"]),
            lower=tuple(int(v) for v in bounds["lower"]),
            upper=None if upper is None else tuple(int(v) for v in upper),
            history=tuple(dict(entry) for entry in data["history"]),
            noise_scale_history=tuple(dict(entry) for entry in data["noise_scale_history"]),
            settings=settings,
            balancer_state=dict(state),
        )
        int(settings["tail_window"])
        consistent = (
            world_size >= 1
            and len(devices) == world_size
            and [d.rank for d in devices] == list(range(world_size))
            and int(state["world_size"]) == world_size
            and len(state["fitters"]) == world_size
            and len(profile.lower) == world_size
            and (profile.upper is None or len(profile.upper) == world_size)
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{where}: malformed Cannikin profile ({type(err).__name__}: {err}).") from err
    if not consistent:
        raise ValueError(f"{where}: malformed Cannikin profile, its per-rank entries do not match world_size.")
    return profile


def _device(data: Mapping[str, Any]) -> DeviceProfile:
    samples = data["samples"]
    sizes = tuple(int(b) for b in samples["batch_sizes"])
    seconds = tuple(float(t) for t in samples["seconds"])
    if len(sizes) != len(seconds):
        raise ValueError(f"rank {data['rank']} has {len(sizes)} batch sizes but {len(seconds)} times")
    model = data["model"]
    return DeviceProfile(
        rank=int(data["rank"]),
        model=None if model is None else LinearTimeModel.from_dict(model),
        batch_sizes=sizes,
        seconds=seconds,
    )


def _jsonable(value: Any) -> Any:
    """Plain JSON types: numpy scalars and arrays unwrapped, tuples as lists, non-finite floats as ``None``."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON has no NaN/Infinity; other readers (jq, browsers) would reject the file
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"Cannot store {type(value).__name__} in a Cannikin profile: {value!r}")
