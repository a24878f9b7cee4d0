"""Squared gradient norms around the weighted all-reduce, for the gradient-noise-scale estimator.

Rides on the comm hook: each bucket's local squared norm is taken before it is weighted and reduced, the global one
from the reduced bucket. When the step's last bucket is launched, the per-rank local norms are exchanged with one
all-reduce of ``world_size`` floats, issued asynchronously next to the gradient's own, so the statistics cost no
extra synchronisation point.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lightning_cannikin.comm_hook import WeightedAllReduceState


class GradientNormObserver:
    """Collects ``Z_i = |g_i|^2`` for every rank and ``Y = |g|^2`` of the reduced gradient, once per optimizer step.

    Args:
        rank: this process's global rank.
        world_size: number of ranks.

    Attributes:
        optimizer: set it to an Adam-family optimizer to measure the noise of the *preconditioned* gradient
            ``g / (sqrt(v_hat) + eps)`` (AdaptDL's rule): that is the direction Adam actually steps in. Parameters
            without second-moment state yet (the first step) are measured raw.

    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.optimizer: torch.optim.Optimizer | None = None
        self._groups: dict[int, dict] | None = None
        self._reset()

    def _squared_norm(self, flat: torch.Tensor, bucket: dist.GradBucket) -> torch.Tensor:
        """``|flat|^2``, preconditioned per parameter by Adam's second moment when an optimizer is set."""
        flat = flat.detach().float()
        if self.optimizer is None:
            return flat.pow(2).sum()
        parameters = bucket.parameters()
        numels = [p.numel() for p in parameters]
        if sum(numels) != flat.numel():
            return flat.pow(2).sum()  # an unexpected bucket layout: fall back to the raw norm rather than guess
        total = flat.new_zeros(())
        for parameter, piece in zip(parameters, torch.split(flat, numels), strict=True):
            total = total + (piece / self._preconditioner(parameter).reshape(-1)).pow(2).sum()
        return total

    def _preconditioner(self, parameter: torch.Tensor) -> torch.Tensor:
        assert self.optimizer is not None
        state = self.optimizer.state.get(parameter, {})
        if "exp_avg_sq" not in state or "step" not in state:
            return torch.ones((), device=parameter.device)
        if self._groups is None:  # built once: a lookup per parameter per step must not scan every group
            self._groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        group = self._groups[id(parameter)]
        beta2, eps = group["betas"][1], group["eps"]
        step = float(state["step"])
        v_hat = state["exp_avg_sq"].float() / (1.0 - beta2**step)
        return v_hat.sqrt() + eps

    def _reset(self) -> None:
        self._local: torch.Tensor | None = None
        self._global: torch.Tensor | None = None
        self._exchange: torch.Tensor | None = None
        self._work: dist.Work | None = None

    def before_reduce(self, state: WeightedAllReduceState, bucket: dist.GradBucket) -> None:
        sqr = self._squared_norm(bucket.buffer(), bucket)
        self._local = sqr if self._local is None else self._local + sqr
        if bucket.is_last():
            exchange = torch.zeros(self.world_size, dtype=torch.float64, device=sqr.device)
            exchange[self.rank] = self._local
            self._exchange = exchange
            self._work = dist.all_reduce(exchange, group=state.process_group, async_op=True)

    def after_reduce(self, state: WeightedAllReduceState, bucket: dist.GradBucket, reduced: torch.Tensor) -> None:
        sqr = self._squared_norm(reduced, bucket)
        self._global = sqr if self._global is None else self._global + sqr

    def collect(self) -> tuple[list[float], float] | None:
        """``(Z per rank, Y)`` of the step just finished, or ``None`` if no gradient was reduced in it."""
        if self._work is None or self._exchange is None or self._global is None:
            self._reset()
            return None
        self._work.wait()
        local = self._exchange.tolist()
        global_sqr = float(self._global)
        self._reset()
        if not all(math.isfinite(z) for z in local) or not math.isfinite(global_sqr):
            return None  # an overflowing step (e.g. fp16) tells nothing about the noise
        return local, global_sqr
