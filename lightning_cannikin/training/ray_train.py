"""``CannikinRayStrategy``: Cannikin's DDP inside Ray Train workers (``strategy="cannikin_ray"``).

Ray Train starts the workers, places them and creates the process group; ``ray.train.lightning.prepare_trainer``
only accepts strategies that are Ray's own classes (or subclasses) and Ray's ``RayLightningEnvironment``. This class is
both a :class:`~lightning_cannikin.CannikinStrategy` and a ``RayDDPStrategy``: the method resolution order is
``CannikinRayStrategy -> CannikinStrategy -> UnevenBatchesMixin -> RayDDPStrategy -> DDPStrategy``, so every step,
the uneven loader, the weighted all-reduce and the re-plans are Cannikin's (through the same engine), while Ray's class
contributes the device Ray assigned (``root_device``) and the sampler's world (``distributed_sampler_kwargs``, which
Cannikin's uneven sampler then replaces). Nothing of the step or the re-plan protocol lives here.

Ray is an optional dependency (``pip install "lightning-cannikin[ray]"``); this module imports it, and nothing else in
the package imports this module before the user asks for the strategy.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.environments import ClusterEnvironment
from typing_extensions import override

from lightning_cannikin.training._lightning_compat import StrategyRegistryType
from lightning_cannikin.training.strategy import CannikinStrategy

RAY_INSTALL = 'pip install "lightning-cannikin[ray]"'

try:
    import ray.train
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment
except ModuleNotFoundError as error:  # the extra is not installed
    raise ModuleNotFoundError(
        f"`strategy='cannikin_ray'` (CannikinRayStrategy) needs Ray Train: {RAY_INSTALL}. ({error})", name=error.name
    ) from error

__all__ = ["NOT_IN_A_RAY_WORKER_ERROR", "NOT_RAY_ENVIRONMENT_ERROR", "RAY_INSTALL", "CannikinRayStrategy"]

NOT_IN_A_RAY_WORKER_ERROR = (
    "CannikinRayStrategy (`strategy='cannikin_ray'`) runs inside a Ray Train worker, and this process is not one"
    " (`ray.train.get_context()` has no world: {reason}). Build the Trainer inside the training function you give"
    " `ray.train.torch.TorchTrainer(train_loop_per_worker=...)`; outside Ray use `strategy='cannikin'`."
)
NOT_RAY_ENVIRONMENT_ERROR = (
    "CannikinRayStrategy (`strategy='cannikin_ray'`) takes its ranks from Ray Train, but the Trainer's cluster"
    " environment is {found}. Pass `plugins=[ray.train.lightning.RayLightningEnvironment()]` to the Trainer (or"
    " `CannikinRayStrategy(cluster_environment=RayLightningEnvironment())`)."
)


class CannikinRayStrategy(CannikinStrategy, RayDDPStrategy):
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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("start_method", "popen") != "popen":
            raise ValueError(
                f"`start_method={kwargs['start_method']!r}` cannot be combined with CannikinRayStrategy: Ray Train"
                " starts one worker per device. Leave `start_method` unset; `ScalingConfig(num_workers=...)` sets the"
                " workers."
            )
        super().__init__(*args, **kwargs)

    @override
    def set_world_ranks(self) -> None:
        # Lightning asks the environment for the ranks first here, when the Trainer is built, before the launcher is
        # configured (with Ray's world: `_launch_world_size`) and again at setup; outside a Ray worker Ray's
        # environment fails with a bare "not initialized", so say what to do instead
        self._check_ray_world()
        super().set_world_ranks()

    @override
    def setup_environment(self) -> None:
        self._check_ray_world()  # before any collective could wait for ranks that do not exist
        super().setup_environment()

    def _check_ray_world(self) -> None:
        """A clear error outside a Ray Train worker or without Ray's cluster environment."""
        environment: ClusterEnvironment | None = self.cluster_environment
        if not isinstance(environment, RayLightningEnvironment):
            raise ValueError(NOT_RAY_ENVIRONMENT_ERROR.format(found=type(environment).__name__))
        try:
            ray.train.get_context().get_world_size()
        except Exception as error:  # Ray raises RuntimeError (v2) or returns a context without a session (v1)
            raise RuntimeError(NOT_IN_A_RAY_WORKER_ERROR.format(reason=error)) from error

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        # `lightning_cannikin._registration` registers the name lazily (without importing Ray); this is for direct use
        if "cannikin_ray" not in strategy_registry:
            strategy_registry.register("cannikin_ray", cls, description="Cannikin heterogeneity-aware DDP in Ray Train")
