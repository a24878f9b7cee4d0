"""Squared gradient norms for the noise statistics, with fused kernels and nothing read back to the host.

A bucket's gradients lie end to end in one flat buffer, so its squared norm is one vector norm. Accumulation (a
micro-batch is the difference of the accumulated gradients before and after it) and Adam's preconditioner (the
gradient divided by ``sqrt(v_hat) + eps``) need the parameters apart: ``torch._foreach_*`` ops over the bucket's
pieces then do it in a few kernels. Every result is a 0-d float32 tensor on the gradients' device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from lightning_cannikin.training._lightning_compat import (
    foreach_add_,
    foreach_copy_,
    foreach_div,
    foreach_div_,
    foreach_norm,
    foreach_sqrt,
    foreach_sub,
)

__all__ = ["GradientNorms", "squared_norm"]


def squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """``|x|^2`` as a 0-d float32 tensor: one dot product of a float32 vector with itself (a single pass), or a
    float32-accumulated norm for other dtypes."""
    if tensor.dtype == torch.float32:
        flat = tensor.reshape(-1)
        return torch.dot(flat, flat)
    return torch.linalg.vector_norm(tensor, dtype=torch.float32).square()


def _with_gradients(parameters: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The parameters that have a gradient, and their gradients, flat."""
    params = [p for p in parameters if p.grad is not None]
    return params, [p.grad.detach().reshape(-1) for p in params]


class GradientNorms:
    """Squared norms of buckets and of accumulation micro-batches."""

    def __init__(self) -> None:
        self._optimizer: torch.optim.Optimizer | None = None
        self._groups: dict[int, dict] = {}
        # the accumulated gradient after the window's last micro-batch, flat, by parameter (buffers reused)
        self._previous: dict[int, torch.Tensor] = {}
        self._previous_valid = False

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """An Adam-family optimizer to precondition by (``None``: raw gradients). Parameters without second moments yet
        (the first step) are measured raw."""
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        self._optimizer = optimizer
        # built once: a lookup per parameter per step must not scan every group
        self._groups = {id(p): g for g in optimizer.param_groups for p in g["params"]} if optimizer else {}

    def second_moment(self, parameter: torch.Tensor) -> tuple[torch.Tensor, float, float] | None:
        """Adam's ``(v, sqrt(1 - beta2^t), eps)`` for ``parameter``, whose denominator is ``sqrt(v) / sqrt(1 - beta2^t)
        + eps`` (``None`` without an optimizer, or before the parameter's first step)."""
        state = self._optimizer.state.get(parameter) if self._optimizer is not None else None
        if not state or "exp_avg_sq" not in state or "step" not in state:
            return None
        group = self._groups[id(parameter)]
        return state["exp_avg_sq"], math.sqrt(1.0 - group["betas"][1] ** float(state["step"])), group["eps"]

    def new_window(self) -> None:
        """An optimizer step ended: the next micro-batch starts from zero."""
        self._previous_valid = False

    def micro_batch(self, parameters: Sequence[torch.Tensor], weight: float) -> torch.Tensor | None:
        """``|g_k|^2`` of the micro-batch that just ended without a reduction; ``weight`` is its share of the sum."""
        params, grads = _with_gradients(parameters)
        if not params:
            return None
        pieces = self._minus_previous(params, grads) if self._previous_valid else grads
        squared = self._squared(params, pieces, weight)
        buffers = [self._previous.get(id(p)) for p in params]
        if all(b is not None and b.shape == g.shape for b, g in zip(buffers, grads, strict=True)):
            foreach_copy_(buffers, grads)
        else:
            self._previous = {id(p): g.clone() for p, g in zip(params, grads, strict=True)}
        self._previous_valid = True
        return squared

    def bucket(
        self,
        flat: torch.Tensor,
        bucket_parameters: Callable[[], Sequence[torch.Tensor]],
        weight: float,
        subtract_previous: bool,
    ) -> torch.Tensor:
        """``|bucket|^2 / weight^2``, less what earlier micro-batches of the window put in it when asked.

        ``bucket_parameters`` lists the bucket's parameters in buffer order; it is called only when they are needed
        apart (accumulation, Adam).
        """
        flat = flat.detach()
        previous = subtract_previous and self._previous_valid
        if not previous and self.optimizer is None:
            return squared_norm(flat) / weight**2
        parameters = bucket_parameters()
        numels = [p.numel() for p in parameters]
        if sum(numels) != flat.numel():
            # an unexpected bucket layout: measure it whole and raw rather than guess
            return squared_norm(flat) / weight**2
        pieces = list(torch.split(flat, numels))
        if previous:
            pieces = self._minus_previous(parameters, pieces)
        return self._squared(parameters, pieces, weight)

    def _minus_previous(self, parameters: Sequence[torch.Tensor], pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        previous = [self._previous.get(id(p)) for p in parameters]
        if all(prev is not None for prev in previous):
            return list(foreach_sub(pieces, previous))
        return [piece if prev is None else piece - prev for piece, prev in zip(pieces, previous, strict=True)]

    def _squared(self, parameters: Sequence[torch.Tensor], pieces: list[torch.Tensor], weight: float) -> torch.Tensor:
        pieces = [piece if piece.dtype == torch.float32 else piece.float() for piece in pieces]
        if self.optimizer is not None:
            pieces = self._preconditioned(parameters, pieces)
        if pieces[0].device.type == "cpu":  # a dot product is one vectorized pass, about twice as fast as a norm
            squared = torch.stack([squared_norm(piece) for piece in pieces]).sum()
        else:  # one kernel for every piece
            squared = torch.stack(foreach_norm(pieces)).square().sum()
        return squared if weight == 1.0 else squared / weight**2

    def _preconditioned(self, parameters: Sequence[torch.Tensor], pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        chosen, second_moments, corrections, eps = [], [], [], []
        for index, parameter in enumerate(parameters):
            moment = self.second_moment(parameter)
            if moment is not None:
                chosen.append(index)
                second_moments.append(moment[0].reshape(-1).float())
                corrections.append(moment[1])
                eps.append(moment[2])
        if not chosen:
            return pieces
        # sqrt(v / (1 - beta2^t)) + eps, for all of them at once
        denominators = foreach_sqrt(second_moments)
        foreach_div_(denominators, corrections)
        foreach_add_(denominators, eps)
        scaled = foreach_div([pieces[i] for i in chosen], denominators)
        out = list(pieces)
        for index, piece in zip(chosen, scaled, strict=True):
            out[index] = piece
        return out
