"""``CannikinModelParallelStrategy``: sharded data parallelism (FSDP2) with uneven local batches.

Lightning's :class:`~lightning.pytorch.strategies.ModelParallelStrategy` with Cannikin's uneven loader, step weights,
timing and re-plans (through the same :class:`~lightning_cannikin.training.engine.BalancingEngine` as DDP). The user's
``configure_model`` applies ``fully_shard`` over ``self.device_mesh["data_parallel"]`` as Lightning documents.

FSDP2's reduce-scatter averages the ranks' gradients, so each rank's loss carries ``n`` times its weight under the
declared ``loss_normalisation`` (computed in :meth:`~lightning_cannikin.training.engine.BalancingEngine.begin_step`):
``n * b_i / B`` for a mean over samples, ``n`` for a sum over them, ``n * c_i / C`` for a mean over a per-sample count
such as tokens. The shards then hold the exact gradient of the global loss. Under gradient accumulation FSDP2
reduce-scatters every micro-batch (as Lightning's own strategy does) and adds the shards; each micro-batch's share of
its window is on its loss too, so the sum is the window's exact gradient.

Timing: FSDP's per-layer all-gathers and reduce-scatters make a fast rank wait for a slow one inside forward and
backward. The collectives go through FSDP2's public custom-comm seam (``set_custom_all_gather``,
``set_custom_reduce_scatter``), which tell the engine where gradients are ready and, on CPU, how long the host
waited in them, so each rank's own compute is what the speed model fits. The same reduce-scatters give the noise
statistics their inputs (:meth:`~lightning_cannikin.training.engine.BalancingEngine.reduce_scatter_for`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor
from typing_extensions import override

from lightning_cannikin.training._lightning_compat import StrategyRegistryType
from lightning_cannikin.training.data.cost_aware_sampler import SampleCosts
from lightning_cannikin.training.engine import BalancingEngine
from lightning_cannikin.training.frontends.uneven_strategy import UnevenBatchesMixin

__all__ = ["CannikinModelParallelStrategy", "TimedCollectives"]

TENSOR_PARALLEL_ERROR = (
    "`tensor_parallel_size={size}` is not supported by CannikinModelParallelStrategy: uneven local batches are"
    " balanced across the data-parallel dimension, and Cannikin's sampler, weights and timing assume every rank is a"
    " data-parallel replica. Leave `tensor_parallel_size` unset (or 1) for sharded data parallelism over all ranks,"
    " or use Lightning's `ModelParallelStrategy` for tensor parallelism with even batches."
)
NOT_SHARDED_ERROR = (
    "CannikinModelParallelStrategy found no module sharded with `fully_shard`: without it no gradient is reduced."
    " In `configure_model`, apply `torch.distributed.fsdp.fully_shard(layer, mesh=self.device_mesh['data_parallel'])`"
    " to each large layer and then to the whole model."
)


# newer torch (2.13 here) calls FSDP2's collectives `all_gather_single` and `reduce_scatter_single` and deprecates the
# old names; older releases in the declared range have only `all_gather_into_tensor` and `reduce_scatter_tensor`, which
# take the same arguments (a GPU machine on an older torch must not fail on a name)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class TimedCollectives:
    """FSDP2's all-gather and reduce-scatter, told to the engine (an object FSDP2's custom-comm seam accepts).

    Before each reduce-scatter of a reducing backward, a gradient bucket is ready (the latest one marks the end of
    the compute); after it, the reduction is done. On the host clock the time the host spent inside a collective is
    waiting for the other ranks (and the transfer), not this device's compute: the engine takes it out.
    """

    def __init__(self, engine: BalancingEngine, reducing: Any, gather: bool) -> None:
        self.engine = engine
        self._reducing = reducing  # () -> whether this backward is the window's reducing one
        self._gather = gather
        self._host = engine.reductions.host_clock
        self.calls = 0  # collectives issued (the strategy resets it around each backward)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: Any, *args: Any, **kwargs: Any) -> Any:
        engine = self.engine
        self.calls += 1
        reducing = not self._gather and self._reducing()
        if reducing:
            engine.reductions.gradient_ready()
        start = time.perf_counter()
        if self._gather:
            work = _all_gather_single(output_tensor, input_tensor, group=group, **kwargs)
        else:
            op = args[0] if args else kwargs.pop("op")
            work = _reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, **kwargs)
        if self._host and work is None:  # a synchronous collective: the host waited in it
            engine.reductions.host_waited(time.perf_counter() - start)
        if reducing:
            engine.reductions.reduction_done(output_tensor)
        return work


class CannikinModelParallelStrategy(UnevenBatchesMixin, ModelParallelStrategy):
    """FSDP2 sharded data parallelism with a per-rank local batch size and the exact mean gradient over all samples.

    Args:
        local_batch_sizes: a fixed split, one entry per rank. It turns split planning off. When ``None``, the first
            plan gives every rank the training DataLoader's ``batch_size``.
        loss_normalisation, sample_costs, batch_units: what the loss averages over and each sample's cost, as for
            :class:`~lightning_cannikin.training.frontends.strategy.CannikinStrategy` (the same weights reach FSDP2's
            averaging reduce-scatter).
        data_parallel_size: ``"auto"`` (the default) is the world size: pure sharded data parallelism (unlike
            ``ModelParallelStrategy``'s own "auto", which is the number of nodes).
        tensor_parallel_size: ``"auto"`` or 1; larger values are refused (see :data:`TENSOR_PARALLEL_ERROR`).
        start_method: "popen" (a script per rank, the default), "spawn" or "fork" (Python multiprocessing).
        **kwargs: every other :class:`~lightning.pytorch.strategies.ModelParallelStrategy` argument.

    """

    strategy_name = "cannikin_fsdp"

    def __init__(
        self,
        local_batch_sizes: Sequence[int] | None = None,
        loss_normalisation: str = "sample_mean",
        sample_costs: SampleCosts | None = None,
        batch_units: Callable[[Any], float] | None = None,
        data_parallel_size: Any = "auto",
        tensor_parallel_size: Any = "auto",
        start_method: str = "popen",
        **kwargs: Any,
    ) -> None:
        if tensor_parallel_size not in ("auto", 1):
            raise ValueError(TENSOR_PARALLEL_ERROR.format(size=tensor_parallel_size))
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"`start_method` must be 'popen', 'spawn', 'fork' or 'forkserver', got {start_method!r}.")
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=1, **kwargs)
        self._init_uneven(local_batch_sizes, loss_normalisation, sample_costs, batch_units)
        self._start_method = start_method
        self._accumulating = False
        self._reduce: TimedCollectives | None = None

    @override
    def _configure_launcher(self) -> None:
        # the earliest point where the world size is known and no process has been launched yet
        assert self.cluster_environment is not None
        self._launcher = self._checked_launcher(self._start_method, sharded=True)  # checks the fixed split first
        world_size = self._launch_world_size()
        if self._data_parallel_size not in ("auto", world_size):
            raise ValueError(
                f"`data_parallel_size={self._data_parallel_size}` must equal the world size ({world_size}) under"
                " CannikinModelParallelStrategy (tensor parallelism is not supported). Leave it unset."
            )

    @override
    def setup_environment(self) -> None:
        self._take_engine()
        self._data_parallel_size = self._launch_world_size()  # all ranks (Ray Train's workers under Ray)
        super().setup_environment()
        self._bind_engine(sharded=True)  # the noise statistics read FSDP2's reduce-scatters
        # FSDP2's reduce-scatter averages over the ranks: n * b_i / B on the loss makes its mean the weighted mean
        self.engine.reductions.reduce_with(loss_carries_weight=True, averaged_over=self.world_size)

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        from torch.distributed.fsdp import FSDPModule

        sharded = [module for module in self.model.modules() if isinstance(module, FSDPModule)]
        if not sharded and self.world_size > 1:
            raise ValueError(NOT_SHARDED_ERROR)
        engine = self.engine
        gather = TimedCollectives(engine, lambda: not self._accumulating, gather=True)
        reduce = self._reduce = TimedCollectives(engine, lambda: not self._accumulating, gather=False)
        for module in sharded:
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(engine.reductions.reduce_scatter_for(module, reduce))

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Lightning enters this around an accumulation micro-step; FSDP2 still reduce-scatters it (as Lightning's own
        # strategy does: its unsharded gradients would cost the memory sharding saves), but the step is no window end
        self._accumulating = True
        try:
            yield None
        finally:
            self._accumulating = False

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self._reduce is not None:
            self._reduce.calls = 0
        try:
            # a reducing backward's shards are the window's reduced gradient: the engine's noise statistics read them
            with self.engine.backward(closure_loss, not self._accumulating, self.model.parameters) as weighted:
                loss = super().backward(weighted, optimizer, *args, **kwargs)
        except torch.cuda.OutOfMemoryError as error:
            self._out_of_memory(error)
        if self._reduce is not None and self._reduce.calls == 0 and not self._accumulating:
            self.engine.reductions.gradient_ready()  # one rank: FSDP2 copies its gradients without a reduce-scatter
        return loss

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        # the names `lightning_cannikin._registration` registers lazily (it imports this module: no import back)
        cls._register_names(strategy_registry, "cannikin_fsdp", "FSDP2")
