"""The noise statistics under FSDP2 (``strategy="cannikin_fsdp"``), read at its reduce-scatter, with no gradient copy.

FSDP2 copies each parameter group's local (unsharded) gradient into one flat buffer and reduce-scatters it; the
strategy issues that reduce-scatter itself, through FSDP2's public custom-comm seam
(:class:`~lightning_cannikin.training.fsdp.TimedCollectives`). So:

- ``Z_i = |g_i|^2``, this rank's local gradient before the reduction, is the sum over the parameter groups of the
  squared norm of each reduce-scatter's input (one dot product per group, on the buffer FSDP2 built anyway). FSDP2
  reduce-scatters every accumulation micro-batch (the strategy does not keep unsharded gradients across them), so
  each input is that micro-batch's gradient alone: a group of its own, as on the DDP path.
- ``Y = |g|^2``, the reduced gradient of the whole window, is the sum over the ranks of each rank's squared norm of
  its gradient *shards* once the window's last backward has accumulated them. Each rank writes its part into the slot
  where the DDP path's rank zero writes the whole ``Y``: the exchange that sums the ``Z`` sums the parts too, so no
  collective is added and every rank still folds the same numbers.

The weights on the loss (``n * b_i / B``, and a micro-batch's share of its window) and FSDP2's division before the
reduce-scatter (fp16 gradients only) are divided out, so the statistics are those of per-sample-mean gradients, as
on the DDP path (:class:`~lightning_cannikin.training.grad_stats.GradientNormObserver`, whose exchange, fold and
checkpoint this reuses).

Adam-family optimizers are refused: the DDP path measures the noise of Adam's preconditioned gradient
``g_i / (sqrt(v_hat) + eps)``, and every element of the local gradient needs its own second moment, which FSDP2
shards across the ranks: rank ``i`` holds ``v_hat`` for ``1/n`` of ``g_i``'s elements. ``Z_i`` would need the other
ranks' second moments, an all-gather as large as the parameters on every measured step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from lightning_cannikin.training._lightning_compat import fsdp_predivide_factor
from lightning_cannikin.training.comm_hook import WeightedAllReduceState
from lightning_cannikin.training.grad_norms import squared_norm
from lightning_cannikin.training.grad_stats import GradientNormObserver

__all__ = ["ADAM_UNDER_FSDP_ERROR", "ShardedGradientNormObserver"]

ADAM_UNDER_FSDP_ERROR = (
    "The noise scale (needed by `max_batch_size`, by AdaScale with `base_batch_size`, and by `track_noise_scale`) of"
    " an Adam-family optimizer is not measured under `strategy='cannikin_fsdp'`: it is the noise of Adam's"
    " preconditioned gradient, and each rank's local gradient would need every element's second moment, which FSDP"
    " shards across the ranks (an all-gather as large as the model on every measured step). Use an SGD-family"
    " optimizer, drop `max_batch_size` (and `base_batch_size`, or pass `lr_scaling='none'`) to balance alone, or use"
    " `strategy='cannikin'` (DDP)."
)


class ShardedGradientNormObserver(GradientNormObserver):
    """``Z_j`` for every group (rank x micro-batch) from FSDP2's reduce-scatter inputs, and this rank's part of ``Y``
    from its gradient shards (see the module's docstring). The arguments are :class:`GradientNormObserver`'s."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._backward: torch.Tensor | None = None  # this backward's reduce-scatter inputs, squared and summed

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """Always ``None``: the noise of Adam's preconditioned gradient is not measured under FSDP (setting one
        raises, on every rank alike)."""
        return None

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is not None:
            raise ValueError(ADAM_UNDER_FSDP_ERROR)

    def reduce_scatter_input(self, tensor: torch.Tensor, group: Any) -> None:
        """A parameter group's local gradient, about to be reduce-scattered (before the collective: it may reuse it)."""
        if not self.measuring:
            return
        squared = squared_norm(tensor.detach())
        predivide = fsdp_predivide_factor(group, tensor.dtype, tensor.device.type)
        if predivide != 1.0:
            squared = squared * predivide**2
        self._backward = squared if self._backward is None else self._backward + squared

    def _local_of_backward(self, weight: float) -> torch.Tensor:
        """``|g|^2`` of the backward that just ended (zero on a rank whose parameters got no gradient), with what the
        loss carried beyond its mean (``weight``) divided out."""
        squared, self._backward = self._backward, None
        if squared is None:
            squared = torch.zeros((), dtype=torch.float32)
        return squared / weight**2

    def after_micro_step(self, parameters: Iterable[torch.Tensor], weight: float) -> None:
        """An accumulation micro-batch ended: FSDP2 reduce-scattered it, and its inputs were its gradient alone."""
        if self.measuring:
            self._micro.append(self._local_of_backward(weight))

    def reduced(self, state: WeightedAllReduceState, parameters: Iterable[torch.Tensor]) -> None:
        """The window's reducing backward ended: its ``Z`` closes the step's block, and ``parameters`` hold the
        window's reduced gradient shards (this rank's part of ``Y``)."""
        if not self.measuring:
            return
        self._local = self._local_of_backward(state.local_scale)
        if self._micro:  # a rank's groups share one device for the exchange
            self._micro = [z.to(self._local.device) for z in self._micro]
        self._close_block(state)
        shards = [_local_tensor(p.grad) for p in parameters if p.grad is not None]
        part = torch.stack([squared_norm(s) for s in shards]).sum() if shards else torch.zeros(())
        self._global = part

    def _close_block(self, state: WeightedAllReduceState) -> None:
        super()._close_block(state)
        if self.rank != 0 and self._block is not None:  # every rank adds its shards' part of the last step's Y
            self._block[-2] = 0.0 if self._last_global is None else self._last_global

    def fold_into(self, estimator: Any, window: Any) -> bool:
        part = self._global if self._block is not None else None
        updated = super().fold_into(estimator, window)
        if part is not None:
            self._last_global = part  # every rank's part (the base keeps rank zero's whole Y)
        return updated

    def state_dict(self) -> dict:
        """As :meth:`GradientNormObserver.state_dict`, with the last step's ``Y`` summed over the shards (a checkpoint
        holds rank zero's copy). Every rank calls it, as Lightning's ``save_checkpoint`` does."""
        state = super().state_dict()
        last = self._last_global
        if last is not None:
            nccl = dist.get_backend(self._group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
            total = torch.tensor([float(last)], dtype=torch.float64, device=device)
            dist.all_reduce(total, group=self._group)
            state["last_global"] = float(total.item())
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.rank != 0 and self._last_global is not None:
            self._last_global = 0.0  # rank zero carries the whole Y: the parts still sum to it


def _local_tensor(gradient: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) gradient, as a plain tensor (no copy, no collective)."""
    local = getattr(gradient, "to_local", None)
    return (local() if local is not None else gradient).detach()
