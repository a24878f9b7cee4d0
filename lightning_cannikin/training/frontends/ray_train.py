"""Cannikin in Ray Train workers: ``CannikinRayStrategy`` (DDP, ``strategy="cannikin_ray"``) and
``CannikinRayFSDPStrategy`` (FSDP2, ``strategy="cannikin_ray_fsdp"``).

Ray Train starts the workers, places them and creates the process group; ``ray.train.lightning.prepare_trainer``
only accepts strategies that are Ray's own classes (or subclasses) and Ray's ``RayLightningEnvironment``.
``CannikinRayStrategy`` is both a :class:`~lightning_cannikin.CannikinStrategy` and a ``RayDDPStrategy``: the method
resolution order is ``CannikinRayStrategy -> CannikinStrategy -> UnevenBatchesMixin -> RayDDPStrategy -> DDPStrategy``,
so every step, the uneven loader, the weighted all-reduce and the re-plans are Cannikin's (through the same engine),
while Ray's class contributes the device Ray assigned (``root_device``) and the sampler's world
(``distributed_sampler_kwargs``, which Cannikin's uneven sampler then replaces). Nothing of the step or the re-plan
protocol lives here.

Ray has no wrapper of Lightning's ``ModelParallelStrategy`` (FSDP2), so ``prepare_trainer`` refuses any FSDP2 strategy;
it only validates, and the fit works without it. ``CannikinRayFSDPStrategy`` is
:class:`~lightning_cannikin.CannikinModelParallelStrategy` with the device Ray assigned (as Ray's own strategies do).

Ray is an optional dependency (``pip install "lightning-cannikin[ray]"``); this module imports it, and nothing else in
the package imports this module before the user asks for one of these strategies.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from lightning_cannikin.training._lightning_compat import StrategyRegistryType
from lightning_cannikin.training.frontends.fsdp import CannikinModelParallelStrategy
from lightning_cannikin.training.frontends.strategy import CannikinStrategy

RAY_INSTALL = 'pip install "lightning-cannikin[ray]"'

try:
    import ray.train
    import ray.train.torch
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment
except ModuleNotFoundError as error:  # the extra is not installed
    raise ModuleNotFoundError(
        f"Cannikin's Ray strategies (`strategy='cannikin_ray'`, `'cannikin_ray_fsdp'`) need Ray Train: {RAY_INSTALL}."
        f" ({error})",
        name=error.name,
    ) from error

__all__ = [
    "NOT_IN_A_RAY_WORKER_ERROR",
    "NOT_RAY_ENVIRONMENT_ERROR",
    "RAY_INSTALL",
    "CannikinRayFSDPStrategy",
    "CannikinRayStrategy",
]

NOT_IN_A_RAY_WORKER_ERROR = (
    "{name} runs inside a Ray Train worker, and this process is not one"
    " (`ray.train.get_context()` has no world: {reason}). Build the Trainer inside the training function you give"
    " `ray.train.torch.TorchTrainer(train_loop_per_worker=...)`; outside Ray use `strategy='{plain}'`."
)
NOT_RAY_ENVIRONMENT_ERROR = (
    "{name} takes its ranks from Ray Train, but the Trainer's cluster"
    " environment is {found}. Pass `plugins=[ray.train.lightning.RayLightningEnvironment()]` to the Trainer (or"
    " `{cls}(cluster_environment=RayLightningEnvironment())`)."
)


class _InRayWorker:
    """The checks both strategies make (placed before the Lightning strategy in the bases)."""

    cluster_environment: Any
    strategy_name: str
    _plain_name: str  # the same strategy outside Ray

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("start_method", "popen") != "popen":
            raise ValueError(
                f"`start_method={kwargs['start_method']!r}` cannot be combined with {type(self).__name__}: Ray Train"
                " starts one worker per device. Leave `start_method` unset; `ScalingConfig(num_workers=...)` sets the"
                " workers."
            )
        super().__init__(*args, **kwargs)

    def set_world_ranks(self) -> None:
        # Lightning asks the environment for the ranks first here, when the Trainer is built, before the launcher is
        # configured (with Ray's world: `_launch_world_size`) and again at setup; outside a Ray worker Ray's
        # environment fails with a bare "not initialized", so say what to do instead
        self._check_ray_world()
        super().set_world_ranks()  # type: ignore[misc]

    def setup_environment(self) -> None:
        self._check_ray_world()  # before any collective could wait for ranks that do not exist
        super().setup_environment()  # type: ignore[misc]

    def _check_ray_world(self) -> None:
        """A clear error outside a Ray Train worker or without Ray's cluster environment."""
        cls = type(self).__name__
        name = f"{cls} (`strategy='{self.strategy_name}'`)"
        environment = self.cluster_environment
        if not isinstance(environment, RayLightningEnvironment):
            raise ValueError(NOT_RAY_ENVIRONMENT_ERROR.format(name=name, found=type(environment).__name__, cls=cls))
        try:
            ray.train.get_context().get_world_size()
        except Exception as error:  # Ray raises RuntimeError (v2) or returns a context without a session (v1)
            message = NOT_IN_A_RAY_WORKER_ERROR.format(name=name, reason=error, plain=self._plain_name)
            raise RuntimeError(message) from error


class CannikinRayStrategy(_InRayWorker, CannikinStrategy, RayDDPStrategy):
    """Cannikin's data parallelism (uneven local batches, weighted all-reduce, re-plans) in Ray Train workers.

    Use it inside the training function of a ``ray.train.torch.TorchTrainer``, with ``RayLightningEnvironment`` as the
    Trainer's cluster environment; it passes ``ray.train.lightning.prepare_trainer``::

        trainer = L.Trainer(strategy=CannikinRayStrategy(), plugins=[RayLightningEnvironment()],
                            callbacks=[Cannikin(), RayTrainReportCallback()], devices="auto", accelerator="auto")
        trainer = ray.train.lightning.prepare_trainer(trainer)

    Args:
        *args: the arguments of :class:`~lightning_cannikin.CannikinStrategy` (``local_batch_sizes``,
            ``loss_normalisation``, ``sample_costs``, ``batch_units``) and every ``DDPStrategy`` argument but
            ``process_group_backend``, ``timeout`` and ``start_method``, which Ray's ``TorchConfig`` decides.
        **kwargs: as ``*args``.

    """

    strategy_name = "cannikin_ray"
    _plain_name = "cannikin"

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        # `lightning_cannikin._registration` registers the name lazily (without importing Ray); this is for direct use
        if "cannikin_ray" not in strategy_registry:
            strategy_registry.register("cannikin_ray", cls, description="Cannikin heterogeneity-aware DDP in Ray Train")


class CannikinRayFSDPStrategy(_InRayWorker, CannikinModelParallelStrategy):
    """Cannikin's FSDP2 (:class:`~lightning_cannikin.CannikinModelParallelStrategy`) in Ray Train workers.

    Ray has no wrapper of Lightning's ``ModelParallelStrategy``, so ``ray.train.lightning.prepare_trainer`` refuses
    this strategy: skip it (it only validates). With ``RayLightningEnvironment`` as the Trainer's cluster environment::

        trainer = L.Trainer(strategy=CannikinRayFSDPStrategy(), plugins=[RayLightningEnvironment()],
                            callbacks=[Cannikin(), RayTrainReportCallback()], devices="auto", accelerator="auto")

    Args:
        *args: the arguments of :class:`~lightning_cannikin.CannikinModelParallelStrategy` but ``start_method`` (Ray
            starts the workers).
        **kwargs: as ``*args``.

    """

    strategy_name = "cannikin_ray_fsdp"
    _plain_name = "cannikin_fsdp"

    @property
    @override
    def root_device(self) -> torch.device:
        # the device Ray assigned this worker (Lightning's own indexes its `devices` by the local rank, and the
        # Trainer's `devices="auto"` counts one device per Ray worker)
        return ray.train.torch.get_device()
