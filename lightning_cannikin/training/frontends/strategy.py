"""``CannikinStrategy``: DDP with uneven local batches and an exact, sample-weighted gradient all-reduce."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_cannikin.training._lightning_compat import StrategyRegistryType, register_ddp_comm_hook
from lightning_cannikin.training.data.cost_aware_sampler import SampleCosts
from lightning_cannikin.training.frontends.strategy_checks import warn_about_sync_batchnorm
from lightning_cannikin.training.frontends.uneven_strategy import UnevenBatchesMixin
from lightning_cannikin.training.measurement.grad_ready import GradientReadiness


class CannikinStrategy(UnevenBatchesMixin, DDPStrategy):
    """Data-parallel training with a per-rank local batch size and the exact mean gradient over all samples.

    Each rank ``i`` trains on ``b_i`` samples per step, taken from one shared permutation of the dataset, and scales
    its gradient by ``b_i / B`` before a summing all-reduce. The split in force is a :class:`~lightning_cannikin.Plan`;
    the :class:`~lightning_cannikin.Cannikin` callback changes it between epochs as it learns each device's speed.

    Args:
        local_batch_sizes: a fixed split, one entry per rank (global rank order). It turns split planning off, and
            its sum replaces the DataLoader's ``batch_size x world size`` (a warning names both where they differ).
            When ``None``, the first plan gives every rank the training DataLoader's ``batch_size``.
        loss_normalisation: how ``training_step``'s loss is normalised, so that every rank's gradient gets the exact
            weight: ``"sample_mean"`` (a mean over the batch's samples, the default), ``"sample_sum"`` (a sum over
            them) or ``"count_mean"`` (a mean over a per-sample count such as tokens: the counts are ``sample_costs``,
            or ``batch_units``). A loss whose scale behaves like another one is warned about once.
        sample_costs: each training sample's cost (its token count): a sequence indexed like the training dataset, a
            function of the index, or ``"lengths"`` for the dataset's ``lengths`` attribute. Each global batch is then
            split across ranks by cost and each device's measured speed (equal predicted times), not by sample count.
        batch_units: for ``"count_mean"`` without ``sample_costs``: a function of the local batch giving its count
            (e.g. ``lambda batch: batch["mask"].sum()``); one small all-gather per step, no gradient accumulation.
        **kwargs: every :class:`~lightning.pytorch.strategies.DDPStrategy` argument except ``ddp_comm_hook``
            (Cannikin's weighted all-reduce is the hook; ``ddp_comm_wrapper``, e.g. fp16 compression, composes).

    """

    strategy_name = "cannikin"

    def __init__(
        self,
        local_batch_sizes: Sequence[int] | None = None,
        loss_normalisation: str = "sample_mean",
        sample_costs: SampleCosts | None = None,
        batch_units: Callable[[Any], float] | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("ddp_comm_hook") is not None:
            raise ValueError(
                "`ddp_comm_hook` cannot be combined with CannikinStrategy: its weighted all-reduce is the comm hook."
                " Use `ddp_comm_wrapper` to compose compression with it, or `strategy='ddp'` for your own hook."
            )
        if kwargs.get("model_averaging_period") is not None:
            raise ValueError("`model_averaging_period` (post-local SGD) is not supported by CannikinStrategy.")
        super().__init__(**kwargs)
        self._init_uneven(local_batch_sizes, loss_normalisation, sample_costs, batch_units)
        self._forward_hook: Any = None
        self._uses_comm_hook: bool | None = None
        self._readiness: GradientReadiness | None = None

    @override
    def _configure_launcher(self) -> None:
        # the earliest point where the world size is known and no process has been launched yet
        self._launcher = self._checked_launcher(self._start_method)

    @override
    def setup_environment(self) -> None:
        self._take_engine()  # `strategy="cannikin"` alone still balances the cluster
        super().setup_environment()
        self._bind_engine()  # the process group and the device are known now

    @property
    def uses_comm_hook(self) -> bool | None:
        """Whether the gradients go through Cannikin's Python comm hook (``False``: DDP's own C++ all-reduce of
        loss-weighted gradients; ``None`` before the model is wrapped)."""
        return self._uses_comm_hook

    def _comm_hook_needed(self) -> bool:
        """The Python hook is needed where something must see each bucket, where the loss cannot carry the weight
        (manual optimization) and where a ``ddp_comm_wrapper`` wraps it. With noise statistics (an adaptive total)
        it is always taken: they see the buckets on measured steps, and the timer times every bucket's reduction on
        every step, so the all-reduce model is exact at the totals the goodput choice weighs, not a fit of spans.
        Balancing alone leaves the reduction to DDP's own all-reduce: its total never changes."""
        manual = self.lightning_module is not None and not self.lightning_module.automatic_optimization
        return self.engine.reductions.measures_noise or manual or self._ddp_comm_wrapper is not None

    @override
    def _register_ddp_hooks(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        self._remove_parameter_hooks()
        engine = self.engine
        self._uses_comm_hook = self._comm_hook_needed()
        # under automatic optimization the one backward of the step passes `self.backward`, so the weight rides on
        # the loss (one scalar product) instead of on every bucket; under manual optimization the hook applies it.
        # DDP's own all-reduce averages over the ranks: n * b_i / B on the loss makes its mean the weighted mean.
        assert self.lightning_module is not None
        averaged_over = 1 if self._uses_comm_hook else self.world_size
        engine.reductions.reduce_with(self.lightning_module.automatic_optimization, averaged_over)
        if self._uses_comm_hook:
            # DDPStrategy registers comm hooks on CUDA only; on CPU (gloo) a hook would be silently ignored, and the
            # weighted all-reduce is what makes uneven batches correct, so register it on every device type.
            state, hook = engine.reductions.comm_hook()
            register_ddp_comm_hook(
                model=self.model, ddp_comm_state=state, ddp_comm_hook=hook, ddp_comm_wrapper=self._ddp_comm_wrapper
            )
        else:
            # DDP's own all-reduce, no Python per bucket: the loss carries n * b_i / B (DDP averages), and two
            # parameter hooks time the gradients
            self._readiness = GradientReadiness(self.model.parameters(), engine.reductions.gradient_ready)
        # DDP calls the LightningModule after its pre-forward work (buffer broadcast, a collective that waits for
        # slower ranks): that is where this rank's compute starts
        if self._forward_hook is not None:
            self._forward_hook.remove()
        self._forward_hook = self.model.module.register_forward_pre_hook(
            lambda module, args: engine.forward_started(inner=True)
        )
        warn_about_sync_batchnorm(self.model)

    def _remove_parameter_hooks(self) -> None:
        """Remove the timing hooks (a model wrapped again, or the fit's end)."""
        if self._readiness is not None:
            self._readiness.remove()
            self._readiness = None

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        # an accumulation micro-step runs under DDP's `no_sync`: no all-reduce, whichever path reduces
        reduces = getattr(self.model, "require_backward_grad_sync", True)
        try:
            with self.engine.backward(closure_loss, reduces, self.lightning_module.parameters) as weighted:
                loss = super().backward(weighted, optimizer, *args, **kwargs)
        except torch.cuda.OutOfMemoryError as error:
            self._out_of_memory(error)
        finally:
            if self._readiness is not None:
                self._readiness.backward_done()
        return loss

    @override
    def teardown(self) -> None:
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        self._remove_parameter_hooks()
        super().teardown()  # the mixin's: the loader goes

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        cls._register_names(strategy_registry, "cannikin", "DDP")


__all__ = ["CannikinStrategy"]
