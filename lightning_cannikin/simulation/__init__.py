"""Simulate Cannikin on 16 to 1,024-GPU heterogeneous clusters driven by measured GPU profiles.

``lightning_cannikin.simulation`` runs the project's own decision policy (:func:`lightning_cannikin.core.policy.decide`,
with its OptPerf solver and goodput rule) and compute-time fitter (:mod:`lightning_cannikin.core.timing`) against real
measurements (see ``docs/simulation.md``)::

    from lightning_cannikin.simulation import ClusterModel, compare, load_job, parse_cluster

    cluster = parse_cluster("4xV100,4xRTX6000,8xT4")
    job = load_job("imagenet", cluster.gpu_types)
    result = compare(ClusterModel(job, cluster))
    print(result.reduction("ddp"), result.reduction("adaptdl"))

Pure numpy/scipy: imports neither torch nor Lightning.
"""

from __future__ import annotations

from lightning_cannikin.simulation.cli import main
from lightning_cannikin.simulation.cluster import Cluster, DeviceGroup, parse_cluster
from lightning_cannikin.simulation.comparison import Comparison, best_fixed_batch_time, compare
from lightning_cannikin.simulation.engine import (
    POLICIES,
    ClusterModel,
    PolicyResult,
    default_batch_size,
    replan,
    simulate,
)
from lightning_cannikin.simulation.gpu_profiles import GPU_TYPES, JOBS, ProfileStore, canonical_gpu
from lightning_cannikin.simulation.models import (
    ComputeModel,
    JobModel,
    NetworkModel,
    fit_compute_model,
    fit_network_model,
    load_job,
)
from lightning_cannikin.simulation.noise import NoiseTrajectory

__all__ = [
    "GPU_TYPES",
    "JOBS",
    "POLICIES",
    "Cluster",
    "ClusterModel",
    "Comparison",
    "ComputeModel",
    "DeviceGroup",
    "JobModel",
    "NetworkModel",
    "NoiseTrajectory",
    "PolicyResult",
    "ProfileStore",
    "best_fixed_batch_time",
    "canonical_gpu",
    "compare",
    "default_batch_size",
    "fit_compute_model",
    "fit_network_model",
    "load_job",
    "main",
    "parse_cluster",
    "replan",
    "simulate",
]
