"""The noise statistics under FSDP2 (``strategy="cannikin_fsdp"``), read at its reduce-scatter, with no copy of the
gradient.

FSDP2 copies each parameter group's local (unsharded) gradient into one flat buffer and reduce-scatters it; the
strategy issues that reduce-scatter itself, through FSDP2's public custom-comm seam
(:class:`~lightning_cannikin.training.frontends.fsdp.TimedCollectives`). So:

- ``Z_i = |g_i|^2``, this rank's local gradient before the reduction, is the sum over the parameter groups of the
  squared norm of each reduce-scatter's input (one dot product per group, on the buffer FSDP2 built anyway). FSDP2
  reduce-scatters every accumulation micro-batch (the strategy does not keep unsharded gradients across them), so
  each input is that micro-batch's gradient alone: a group of its own, as on the DDP path.
- ``Y = |g|^2``, the reduced gradient of the whole window, is the sum over the ranks of each rank's squared norm of
  its gradient *shards* once the window's last backward has accumulated them. Each rank writes its part into the slot
  where the DDP path's rank zero writes the whole ``Y``: the exchange that sums the ``Z`` sums the parts too, so it
  needs no collective of its own and every rank still folds the same numbers.

The weights on the loss (``n * b_i / B`` for a sample mean, those of the declared normalisation otherwise, and a
micro-batch's share of its window), a declared sum's sample counts (on each group's gradient, and the window's on the
reduced one) and FSDP2's division before the reduce-scatter (fp16 gradients only) are divided out, so the statistics
are those of mean gradients with the same group sizes as on the DDP path
(:class:`~lightning_cannikin.training.measurement.grad_stats.GradientNormObserver`, whose exchange, fold and checkpoint
this reuses).

Adam-family optimizers: as on the DDP path, the noise is that of the preconditioned gradient
``g / (sqrt(v_hat) + eps)``, element by element. FSDP2 shards ``v_hat`` like the parameters, so on a measured step
each reduce-scatter first all-gathers its group's denominators (one layer's worth, as FSDP2 all-gathers the layer's
parameters in forward, into a buffer that then holds the preconditioned gradient for its norm and is freed): one
collective per layer on a measured step. ``Y`` needs only each rank's own shards.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_cannikin.training._lightning_compat import fsdp_predivide_factor, fsdp_sharded_parameters
from lightning_cannikin.training.measurement.comm_hook import WeightedAllReduceState
from lightning_cannikin.training.measurement.grad_norms import squared_norm
from lightning_cannikin.training.measurement.grad_stats import GradientNormObserver

__all__ = ["NoiseReduceScatter", "ShardedGradientNormObserver"]

Parameters = Callable[[], Sequence[tuple[torch.Tensor, int]]]  # a group's sharded parameters, padded shard sizes


class ShardedGradientNormObserver(GradientNormObserver):
    """``Z_j`` for every group (rank x micro-batch) from FSDP2's reduce-scatter inputs, and this rank's part of ``Y``
    from its gradient shards (see the module's docstring). The arguments are :class:`GradientNormObserver`'s."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._backward: torch.Tensor | None = None  # this backward's reduce-scatter inputs, squared and summed
        self.blocked: Callable[[float], None] | None = None  # told the host's wait in a collective (the step timer)

    def reduce_scatter_input(self, tensor: torch.Tensor, group: Any, parameters: Parameters | None = None) -> None:
        """A parameter group's local gradient, about to be reduce-scattered (before the collective: it may reuse it);
        ``parameters``: the group's, for Adam's preconditioner."""
        if not self.measuring:
            return
        tensor = tensor.detach()
        if self.optimizer is not None and parameters is not None:
            squared = self._preconditioned(tensor, group, parameters())
        else:
            squared = squared_norm(tensor)
        predivide = fsdp_predivide_factor(group, tensor.dtype, tensor.device.type)
        if predivide != 1.0:
            squared = squared * predivide**2
        self._backward = squared if self._backward is None else self._backward + squared

    def _denominator(self, parameter: torch.Tensor) -> torch.Tensor | None:
        """This rank's shard of ``sqrt(v_hat) + eps`` for ``parameter``, flat (``None`` before its first step)."""
        moment = self.norms.second_moment(parameter)
        if moment is None:
            return None
        second, correction, eps = moment
        return (_local_tensor(second).reshape(-1).float().sqrt() / correction).add_(eps)

    def _preconditioned(
        self, tensor: torch.Tensor, group: Any, parameters: Sequence[tuple[torch.Tensor, int]]
    ) -> torch.Tensor:
        """``|g / (sqrt(v_hat) + eps)|^2`` of a reduce-scatter's input: the group's denominators all-gathered into the
        input's layout (rank-major rows, each the ranks' padded shards in order; 1 where nothing was measured)."""
        row = torch.ones(sum(padded for _, padded in parameters), dtype=torch.float32, device=tensor.device)
        offset = 0
        for parameter, padded in parameters:
            denominator = self._denominator(parameter)
            if denominator is not None:
                row[offset : offset + denominator.numel()] = denominator
            offset += padded
        if row.numel() * dist.get_world_size(group) != tensor.numel():
            # some of the group's parameters got no gradient this step: the layout is unknown, the step not measured
            return torch.full((), math.nan, dtype=torch.float32, device=tensor.device)
        gathered = torch.empty(tensor.numel(), dtype=torch.float32, device=tensor.device)
        start = time.perf_counter()
        dist.all_gather_into_tensor(gathered, row, group=group)
        if self.blocked is not None:
            self.blocked(time.perf_counter() - start)
        return squared_norm(torch.div(tensor, gathered, out=gathered))

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
        squares = []
        for parameter in parameters:
            if parameter.grad is not None:
                shard = _local_tensor(parameter.grad).reshape(-1)
                denominator = self._denominator(parameter)
                squares.append(squared_norm(shard if denominator is None else shard.float() / denominator))
        part = torch.stack(squares).sum() if squares else torch.zeros(())
        # the reduced gradient over the global mean gradient (a declared sum's: the window's samples), as on DDP's path
        self._global = part / state.global_scale**2 if state.global_scale != 1.0 else part

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


def _local_tensor(gradient: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) gradient, as a plain tensor (no copy, no collective)."""
    local = getattr(gradient, "to_local", None)
    return (local() if local is not None else gradient).detach()


class NoiseReduceScatter:
    """One ``fully_shard``-ed module's reduce-scatter (an object FSDP2's custom-comm seam accepts): the noise observer
    sees its input, then ``reduce_scatter`` (the strategy's timed one) reduces it."""

    def __init__(self, reduce_scatter: Any, noise: ShardedGradientNormObserver, module: Any) -> None:
        self._reduce_scatter, self._noise = reduce_scatter, noise
        self._parameters = lambda: fsdp_sharded_parameters(module)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._reduce_scatter.allocate(size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, *args: Any, **kw: Any
    ) -> Any:
        self._noise.reduce_scatter_input(input_tensor, group, self._parameters)
        return self._reduce_scatter(output_tensor, input_tensor, group, *args, **kw)
