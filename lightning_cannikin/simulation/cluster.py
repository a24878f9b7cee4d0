"""Cluster specifications: ``"4xA100,4xV100,8xT4"`` or a JSON/YAML file.

A cluster is an ordered list of device groups, one GPU type per group. Every group sits on nodes of its own type
(``gpus_per_node`` from the profiled machines unless given), so a cluster with two or more groups, or one group
larger than a node, communicates across nodes.

Pure Python: imports neither torch nor Lightning.
"""

from __future__ import annotations

import json
import math
import os
import re
import reprlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_cannikin.core.profile import FORMAT as RUN_PROFILE_FORMAT
from lightning_cannikin.simulation.gpu_profiles import GPU_TYPES, canonical_gpu

__all__ = ["Cluster", "DeviceGroup", "parse_cluster"]

_TERM = re.compile(r"^\s*(?:(\d+)\s*[x*]\s*)?([A-Za-z0-9 _\-]+?)\s*$")


@dataclass(frozen=True)
class DeviceGroup:
    """``count`` GPUs of one type.

    Attributes:
        gpu: canonical GPU name.
        count: number of GPUs (>= 1).
        gpus_per_node: GPUs per node for this group.

    """

    gpu: str
    count: int
    gpus_per_node: int

    @property
    def nodes(self) -> int:
        """Nodes this group occupies."""
        return math.ceil(self.count / self.gpus_per_node)


@dataclass(frozen=True)
class Cluster:
    """An ordered collection of device groups; device ``i`` belongs to the group that covers index ``i``.

    Attributes:
        groups: the groups, in spec order (types may repeat; they are kept apart, which only matters for nodes).

    """

    groups: tuple[DeviceGroup, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("A cluster needs at least one device group.")

    @property
    def num_devices(self) -> int:
        """Total GPUs."""
        return sum(g.count for g in self.groups)

    @property
    def num_nodes(self) -> int:
        """Total nodes."""
        return sum(g.nodes for g in self.groups)

    @property
    def multi_node(self) -> bool:
        """Whether the all-reduce crosses nodes."""
        return self.num_nodes > 1

    @property
    def gpu_types(self) -> tuple[str, ...]:
        """Distinct GPU types, in order of first appearance."""
        return tuple(dict.fromkeys(g.gpu for g in self.groups))

    def device_types(self) -> tuple[str, ...]:
        """GPU type of every device, in device order."""
        return tuple(g.gpu for g in self.groups for _ in range(g.count))

    def counts(self) -> dict[str, int]:
        """GPUs per type."""
        return dict(Counter(self.device_types()))

    def scaled(self, factor: int) -> Cluster:
        """The same mix with every group ``factor`` times larger."""
        if factor < 1:
            raise ValueError(f"`factor` must be >= 1, got {factor}.")
        return Cluster(tuple(DeviceGroup(g.gpu, g.count * factor, g.gpus_per_node) for g in self.groups))

    def spec(self) -> str:
        """The compact form, e.g. ``"4xA100,4xV100,8xT4"``."""
        return ",".join(f"{g.count}x{g.gpu}" for g in self.groups)

    def __str__(self) -> str:
        return self.spec()


def _group(gpu: str, count: Any, gpus_per_node: Any = None) -> DeviceGroup:
    name = canonical_gpu(str(gpu))
    count = int(count)
    if count < 1:
        raise ValueError(f"GPU count must be >= 1, got {count} for {name}.")
    per_node = GPU_TYPES[name].gpus_per_node if gpus_per_node is None else int(gpus_per_node)
    if per_node < 1:
        raise ValueError(f"`gpus_per_node` must be >= 1, got {per_node} for {name}.")
    return DeviceGroup(name, count, per_node)


def _parse_string(spec: str) -> Cluster:
    groups = []
    for term in spec.split(","):
        if not term.strip():
            continue
        match = _TERM.match(term)
        if match is None:
            raise ValueError(f"Cannot read cluster term {term!r}; write e.g. '4xA100,8xT4'.")
        count, gpu = match.groups()
        groups.append(_group(gpu, count or 1))
    if not groups:
        raise ValueError(f"Empty cluster spec {spec!r}.")
    return Cluster(tuple(groups))


def _parse_mapping(data: Any) -> Cluster:
    if isinstance(data, str):
        return _parse_string(data)
    if isinstance(data, Mapping):
        if "cluster" in data:
            return _parse_mapping(data["cluster"])
        if "devices" in data:
            return _parse_mapping(data["devices"])
        # {"A100": 4, "T4": 8}
        return Cluster(tuple(_group(gpu, count) for gpu, count in data.items()))
    if isinstance(data, Sequence):
        groups = []
        for item in data:
            if isinstance(item, str):
                groups.extend(_parse_string(item).groups)
            elif isinstance(item, Mapping):
                gpu = item.get("gpu", item.get("type"))
                if gpu is None:
                    raise ValueError(f"Device group {reprlib.repr(item)} needs a 'gpu' key.")
                groups.append(_group(gpu, item.get("count", 1), item.get("gpus_per_node")))
            else:
                raise ValueError(f"Cannot read device group {reprlib.repr(item)}.")
        return Cluster(tuple(groups))
    raise ValueError(f"Cannot read a cluster from {type(data).__name__}.")


def parse_cluster(spec: str | os.PathLike[str] | Mapping[str, Any] | Sequence[Any] | Cluster) -> Cluster:
    """Read a cluster from a compact string, a JSON/YAML file, or already-parsed data.

    Accepted forms:

    * ``"4xA100,4xV100,8xT4"`` (``x`` or ``*``; a bare type means one GPU; case and spaces do not matter);
    * a path to a ``.json``, ``.yaml`` or ``.yml`` file holding any of the forms below;
    * ``{"cluster": "4xA100,8xT4"}``, ``{"A100": 4, "T4": 8}``, or
      ``{"devices": [{"gpu": "A100", "count": 4, "gpus_per_node": 8}, ...]}`` (``gpus_per_node`` optional).

    Raises:
        ValueError: unknown GPU type, bad count, or unreadable spec.

    """
    if isinstance(spec, Cluster):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        if path.suffix.lower() in {".json", ".yaml", ".yml"}:
            text = path.read_text()
            if path.suffix.lower() == ".json":
                try:
                    data = json.loads(text)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path} is not a cluster spec: not valid JSON ({err}).") from None
            else:
                try:
                    import yaml
                except ImportError as err:  # PyYAML is not a dependency of the package
                    raise ValueError(
                        f"Reading {path} needs PyYAML (pip install pyyaml); JSON works without it."
                    ) from err
                data = yaml.safe_load(text)
            if isinstance(data, Mapping) and data.get("format") == RUN_PROFILE_FORMAT:
                raise ValueError(
                    f"{path} is a run's profile, not a cluster spec: use `cannikin simulate --profile {path}`."
                )
            return _parse_mapping(data)
        return _parse_string(str(spec))
    return _parse_mapping(spec)
