"""Reading the measured GPU profiles: where they live, which GPU types each job has, and the raw numbers.

Two kinds of data exist (``lightning_cannikin/data/gpu-profiles/README.md`` has the schemas):

* Shipped with the package (Apache-2.0): Pollux's T4 traces (single GPU up to 64 GPUs on 16 nodes, and the
  gradient-noise runs of all six jobs) and Zeus's single-GPU epoch times on V100, A40, RTX 6000 and P100.
* Read at run time only, never copied into the project: the Sia artifact's single-GPU profiles of A100, V100,
  RTX 6000 and RTX 2080 Ti. It has no licence, so the simulator looks for a local copy (``CANNIKIN_GPU_PROFILES``
  or ``../shared/data/gpu-profiles`` beside a source checkout) and works without it.

Pure Python and numpy: imports neither torch nor Lightning.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "GPU_TYPES",
    "JOBS",
    "ZEUS_WORKLOADS",
    "ComputeProfile",
    "GpuType",
    "ProfileStore",
    "canonical_gpu",
    "read_csv",
]

JOBS: tuple[str, ...] = ("cifar10", "imagenet", "bert", "deepspeech2", "yolov3", "ncf")
"""The six data-parallel jobs of the Pollux artifact."""

ENV_VAR = "CANNIKIN_GPU_PROFILES"
"""Environment variable naming a ``gpu-profiles`` folder that holds the unshipped ``sia/`` files."""


@dataclass(frozen=True)
class GpuType:
    """One GPU type the profiles cover.

    Attributes:
        name: canonical name used in cluster specs (``"A100"``).
        aliases: other spellings accepted in specs, lower case (the Sia cluster suffix among them).
        gpus_per_node: GPUs per node of the profiled machines; only decides whether a homogeneous group fits on one
            node (intra-node all-reduce) in the network model.
        description: the GPU and machine the data came from.
        sia_label: ``gpu_type`` label in Sia's seed files, if Sia profiled it.
        zeus_file: suffix of Zeus's ``summary_power_<suffix>.csv``, if Zeus profiled it.

    """

    name: str
    aliases: tuple[str, ...]
    gpus_per_node: int
    description: str
    sia_label: str | None = None
    zeus_file: str | None = None


GPU_TYPES: dict[str, GpuType] = {
    gpu.name: gpu
    for gpu in (
        GpuType("T4", ("t4", "aws"), 4, "NVIDIA T4 16 GB, AWS g4dn.12xlarge (Pollux)", sia_label="t4"),
        GpuType("V100", ("v100", "azure"), 8, "NVIDIA V100 (Sia: Azure ND40rs_v2; Zeus: single GPU)", "v100", "v100"),
        GpuType("A100", ("a100", "dgx", "dgx-ext", "dgx-a100"), 8, "NVIDIA A100 40 GB, DGX-A100 (Sia)", "dgx"),
        GpuType(
            "RTX6000",
            ("rtx6000", "rtx-6000", "rtx_6000", "quadro", "quad", "quadrortx6000"),
            4,
            "NVIDIA Quadro RTX 6000 (Sia: 4-GPU node; Zeus: single GPU)",
            "quad",
            "rtx6000",
        ),
        GpuType("2080Ti", ("2080ti", "rtx2080ti", "rtx-2080ti", "rtx"), 8, "NVIDIA RTX 2080 Ti (Sia)", "rtx"),
        # Zeus does not record the machines' node size; 4 is an assumption that only matters for all-A40/P100 jobs.
        GpuType("A40", ("a40",), 4, "NVIDIA A40 (Zeus, single GPU; input-bound at large batch)", zeus_file="a40"),
        GpuType("P100", ("p100",), 4, "NVIDIA P100 (Zeus, single GPU)", zeus_file="p100"),
    )
}


def canonical_gpu(name: str) -> str:
    """Map a GPU spelling from a cluster spec to its canonical name.

    Args:
        name: e.g. ``"a100"``, ``"Quadro"``, ``"RTX 2080 Ti"``.

    Returns:
        The key of :data:`GPU_TYPES`.

    Raises:
        ValueError: for an unknown GPU type (the message lists the known ones).

    """
    key = name.strip().lower().replace(" ", "").replace("nvidia", "")
    for gpu in GPU_TYPES.values():
        if key == gpu.name.lower() or key in gpu.aliases:
            return gpu.name
    known = ", ".join(GPU_TYPES)
    raise ValueError(f"Unknown GPU type {name!r}; the profiles cover {known}.")


@dataclass(frozen=True)
class ZeusWorkload:
    """How one of our jobs maps onto a Zeus workload.

    Attributes:
        dataset, network, optimizer: the Zeus row keys.
        samples_per_epoch: N in ``t(b) = time_per_epoch * b / N``; None means "use the job's own N" (same data set,
            size derived from the Pollux runs).
        caveat: what differs from the Pollux job, in words.

    """

    dataset: str
    network: str
    optimizer: str
    samples_per_epoch: int | None
    caveat: str


# Only the workloads that are the same model on the same data as a Pollux job. Zeus's DeepSpeech2 trains on
# LibriSpeech (Pollux: VoxForge), with another optimizer and unknown N; its shufflenet/CIFAR-100 is another model.
ZEUS_WORKLOADS: dict[str, ZeusWorkload] = {
    "imagenet": ZeusWorkload(
        "imagenet",
        "resnet50",
        "adadelta",
        1_281_167,
        "FP32 and data loading included (Pollux's T4 runs used AMP and exclude loading), so other GPUs look slower "
        "next to a T4 than they would with AMP",
    ),
    "bert": ZeusWorkload(
        "squad",
        "bert_base_uncased",
        "adamw",
        None,
        "N taken from the Pollux job (SQuAD v1.1 features at sequence length 384); data loading included",
    ),
    "ncf": ZeusWorkload(
        "movielens-1m",
        "ncf",
        "adam",
        None,
        "N taken from the Pollux job (MovieLens-1M with 4 negatives per positive); data loading included",
    ),
}


def read_csv(path: str | os.PathLike[str]) -> dict[str, list[str]]:
    """Read a CSV file into columns of strings, keyed by header name.

    Columns are read by name because Pollux and Sia order them differently.

    Args:
        path: the file.

    Returns:
        ``{column: [value, ...]}``.

    """
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        columns: dict[str, list[str]] = {name: [] for name in reader.fieldnames or ()}
        for row in reader:
            for name in columns:
                columns[name].append(row[name])
    return columns


def _floats(values: Iterable[str]) -> np.ndarray:
    return np.asarray([float(v) for v in values], dtype=np.float64)


@dataclass(frozen=True)
class ComputeProfile:
    """Measured single-GPU compute time of one job on one GPU type.

    Attributes:
        job: job name.
        gpu: canonical GPU name.
        source: ``"pollux"``, ``"sia"`` or ``"zeus"``.
        batch_sizes: local batch sizes, ascending, unique.
        seconds: compute seconds per step at each batch size (``step_time - sync_time`` for Pollux/Sia; epoch time
            scaled to one step for Zeus).

    """

    job: str
    gpu: str
    source: str
    batch_sizes: np.ndarray
    seconds: np.ndarray


def _sorted_unique(batch: np.ndarray, seconds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(batch, kind="stable")
    batch, seconds = batch[order], seconds[order]
    # Average repeated sizes rather than keep one arbitrarily (none are repeated in the current data).
    unique, inverse = np.unique(batch, return_inverse=True)
    means = np.bincount(inverse, weights=seconds) / np.bincount(inverse)
    return unique, means


def _default_shipped_root() -> Path:
    return Path(__file__).resolve().parent.parent / "data" / "gpu-profiles"


def _default_shared_root() -> Path | None:
    """Find a ``gpu-profiles`` folder that has the unshipped Sia files, or None."""
    candidates: list[Path] = []
    env = os.environ.get(ENV_VAR)
    if env:
        candidates.append(Path(env))
    # A source checkout sits beside ``shared/``: <repo>/lightning_cannikin/simulation/profiles.py -> <repo>/../shared.
    repo = Path(__file__).resolve().parents[2]
    candidates.append(repo.parent / "shared" / "data" / "gpu-profiles")
    candidates.append(Path.cwd().parent / "shared" / "data" / "gpu-profiles")
    for root in candidates:
        if (root / "sia" / "adaptdl" / "adaptdl" / "adaptdl" / "torch" / "seed").is_dir():
            return root
    return None


class ProfileStore:
    """Access to the profile files, shipped and (optionally) local-only.

    Args:
        shipped_root: folder holding ``pollux/`` and ``zeus/`` (default: the copy inside the package).
        shared_root: folder holding ``sia/`` (default: found automatically; None if absent).
        use_sia: ``None`` (default) uses Sia's profiles when found; False ignores them (what a clean install sees);
            True requires them.

    Raises:
        FileNotFoundError: ``use_sia=True`` but no Sia files were found, or the shipped files are missing.

    """

    def __init__(
        self,
        shipped_root: str | os.PathLike[str] | None = None,
        shared_root: str | os.PathLike[str] | None = None,
        use_sia: bool | None = None,
    ) -> None:
        self.shipped_root = Path(shipped_root) if shipped_root is not None else _default_shipped_root()
        if not (self.shipped_root / "pollux" / "simulator" / "traces").is_dir():
            raise FileNotFoundError(f"No Pollux traces under {self.shipped_root}; the package data is incomplete.")
        found = Path(shared_root) if shared_root is not None else _default_shared_root()
        if found is not None and not (found / "sia").is_dir():
            found = None
        if use_sia is True and found is None:
            raise FileNotFoundError(
                "Sia profiles requested but not found: set CANNIKIN_GPU_PROFILES to a gpu-profiles folder with sia/."
            )
        self.sia_root: Path | None = None if use_sia is False else (found / "sia" if found is not None else None)

    @property
    def sia_available(self) -> bool:
        """Whether the unshipped Sia profiles are in use."""
        return self.sia_root is not None

    # ----------------------------------------------------------------------------------------------- Pollux (T4)
    def pollux_dir(self, job: str) -> Path:
        """The Pollux trace folder of ``job``."""
        if job not in JOBS:
            raise ValueError(f"Unknown job {job!r}; choose one of {', '.join(JOBS)}.")
        return self.shipped_root / "pollux" / "simulator" / "traces" / job

    def placements(self, job: str) -> dict[str, np.ndarray]:
        """T4 ``placements.csv`` with ``num_nodes`` and ``num_replicas`` derived from the placement string.

        Returns:
            Arrays ``placement`` (str), ``num_nodes``, ``num_replicas``, ``local_bsz``, ``step_time``, ``sync_time``.

        """
        raw = read_csv(self.pollux_dir(job) / "placements.csv")
        placement = np.asarray(raw["placement"])
        return {
            "placement": placement,
            "num_nodes": np.asarray([len(p) for p in placement], dtype=np.int64),
            "num_replicas": np.asarray([sum(int(d) for d in p) for p in placement], dtype=np.int64),
            "local_bsz": _floats(raw["local_bsz"]),
            "step_time": _floats(raw["step_time"]),
            "sync_time": _floats(raw["sync_time"]),
        }

    def scalability(self, job: str) -> dict[str, np.ndarray]:
        """T4 ``scalability.csv`` (6 to 16 nodes, up to 64 GPUs)."""
        raw = read_csv(self.pollux_dir(job) / "scalability.csv")
        return {
            "num_nodes": np.asarray([int(v) for v in raw["num_nodes"]], dtype=np.int64),
            "num_replicas": np.asarray([int(v) for v in raw["num_replicas"]], dtype=np.int64),
            "local_bsz": _floats(raw["local_bsz"]),
            "step_time": _floats(raw["step_time"]),
            "sync_time": _floats(raw["sync_time"]),
        }

    def validation_runs(self, job: str) -> dict[int, dict[str, np.ndarray]]:
        """All ``validation-<M>.csv`` runs of ``job``, keyed by total batch size M, ascending."""
        runs: dict[int, dict[str, np.ndarray]] = {}
        for path in self.pollux_dir(job).glob("validation-*.csv"):
            size = int(path.stem.split("-")[-1])
            raw = read_csv(path)
            runs[size] = {name: _floats(values) for name, values in raw.items()}
        return dict(sorted(runs.items()))

    # --------------------------------------------------------------------------------------- single-GPU compute
    def available_gpus(self, job: str) -> dict[str, str]:
        """GPU types with a single-GPU profile for ``job``, mapped to the source that will be used.

        Preference: Pollux (T4, same code as the noise traces), then Sia (same AdaptDL code as Pollux, when found),
        then Zeus (another code base; only for jobs with the same model and data set).
        """
        found: dict[str, str] = {}
        for gpu, source in self.all_profiles(job):  # in order of preference
            found.setdefault(gpu, source)
        return found

    def all_profiles(self, job: str) -> list[tuple[str, str]]:
        """Every ``(gpu, source)`` pair with a profile for ``job``, including types two sources cover."""
        pairs = [("T4", "pollux")]
        if self.sia_root is not None:
            pairs += [(g.name, "sia") for g in GPU_TYPES.values() if g.sia_label and g.name != "T4"]
        if job in ZEUS_WORKLOADS:
            pairs += [(g.name, "zeus") for g in GPU_TYPES.values() if g.zeus_file]
        return pairs

    def compute_profile(self, job: str, gpu: str, source: str | None = None) -> ComputeProfile:
        """Single-GPU compute time vs local batch for one job and GPU type.

        Args:
            job: job name.
            gpu: GPU type (any accepted spelling).
            source: ``"pollux"``, ``"sia"`` or ``"zeus"``; None picks as :meth:`available_gpus` does.

        Raises:
            ValueError: the job has no profile for this GPU type from this source.

        """
        gpu = canonical_gpu(gpu)
        if source is None:
            available = self.available_gpus(job)
            if gpu not in available:
                hint = "" if self.sia_available else " (A100, 2080Ti and most V100/RTX6000 jobs need the Sia files)"
                raise ValueError(f"No {gpu} profile for job {job!r}; available: {', '.join(available)}{hint}.")
            source = available[gpu]
        if source == "pollux":
            if gpu != "T4":
                raise ValueError(f"Pollux profiles only T4, not {gpu}.")
            data = self.placements(job)
            single = data["placement"] == "1"
            batch = data["local_bsz"][single]
            seconds = data["step_time"][single] - data["sync_time"][single]
        elif source == "sia":
            label = GPU_TYPES[gpu].sia_label
            if self.sia_root is None or label is None:
                raise ValueError(f"No Sia profile for {gpu} (Sia files found: {self.sia_available}).")
            raw = read_csv(self.sia_root / "adaptdl" / "adaptdl" / "adaptdl" / "torch" / "seed" / f"{job}.csv")
            rows = np.asarray(raw["gpu_type"]) == label
            batch = _floats(raw["local_bsz"])[rows]
            seconds = _floats(raw["step_time"])[rows] - _floats(raw["sync_time"])[rows]
        elif source == "zeus":
            batch, seconds = self._zeus(job, gpu)
        else:
            raise ValueError(f"Unknown source {source!r}.")
        batch, seconds = _sorted_unique(batch, seconds)
        return ComputeProfile(job, gpu, source, batch, seconds)

    def samples_per_epoch(self, job: str) -> float:
        """N of the Pollux job, derived from its base run: progress per effective epoch (in B0-steps) times B0."""
        runs = self.validation_runs(job)
        base = min(runs)
        return float(runs[base]["progress"][0]) * base

    def _zeus(self, job: str, gpu: str) -> tuple[np.ndarray, np.ndarray]:
        workload = ZEUS_WORKLOADS.get(job)
        suffix = GPU_TYPES[gpu].zeus_file
        if workload is None or suffix is None:
            raise ValueError(f"Zeus has no profile of job {job!r} on {gpu}.")
        path = self.shipped_root / "zeus" / "examples" / "research_reproducibility" / "zeus_nsdi23" / "trace"
        raw = read_csv(path / f"summary_power_{suffix}.csv")
        rows = (
            (np.asarray(raw["dataset"]) == workload.dataset)
            & (np.asarray(raw["network"]) == workload.network)
            & (np.asarray(raw["optimizer"]) == workload.optimizer)
        )
        power = _floats(raw["power_limit"])[rows]
        # The highest power limit in the file is the GPU's default (uncapped) setting.
        top = power == power.max()
        batch = _floats(raw["batch_size"])[rows][top]
        epoch = _floats(raw["time_per_epoch"])[rows][top]
        samples = workload.samples_per_epoch or self.samples_per_epoch(job)
        return batch, epoch * batch / samples
