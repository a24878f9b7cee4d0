"""Squared gradient norms around the weighted all-reduce, for the gradient-noise-scale estimator.

Rides on the comm hook: each bucket's local squared norm is taken before it is weighted and reduced, the global one
from the reduced bucket. With gradient accumulation every micro-batch is a group of its own: its gradient is the
difference of the accumulated gradients before and after it, rescaled by its weight in the sum. When the step's last
bucket is launched, the groups' norms are exchanged with one all-reduce of ``world_size x micro-batches`` floats,
issued asynchronously next to the gradient's own, so the statistics add no synchronisation point.

Every rank folds the statistics into its own estimator, so the learning-rate factor can follow the noise scale at
every step with no collective of its own. For the ranks to agree *bitwise* (heterogeneous GPUs may round a squared
norm differently), every input comes through the exchange: ``Z_j`` in their slots, and ``Y`` as rank zero measured it,
sent one step late in one extra slot. A step's statistics are therefore folded in at the next step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from lightning_cannikin.core.noise_scale import NoiseScaleEstimator
from lightning_cannikin.training.comm_hook import WeightedAllReduceState


class GradientNormObserver:
    """Collects ``Z_j = |g_j|^2`` for every group (rank x micro-batch) and ``Y = |g|^2`` of the reduced gradient.

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
        # rank zero's Y of the last step, sent with the next exchange; the last step's exchanged Z and group sizes
        self._last_global: float | None = None
        self.pending: tuple[list[float], list[int]] | None = None
        self._reset()

    def _reset(self) -> None:
        self._micro: list[torch.Tensor] = []  # this rank's finished micro-batches of the window
        self._previous: dict[int, torch.Tensor] = {}  # accumulated gradient after the last micro-batch, by param id
        self._local: torch.Tensor | None = None  # the window's last micro-batch, summed over buckets
        self._global: torch.Tensor | None = None
        self._exchange: torch.Tensor | None = None
        self._work: dist.Work | None = None

    def after_micro_step(self, parameters: Iterable[torch.Tensor], weight: float) -> None:
        """Record a micro-batch that ended without a reduction (accumulation); ``weight`` is its share of the sum."""
        total: torch.Tensor | None = None
        for parameter in parameters:
            if parameter.grad is None:
                continue
            grad = parameter.grad.detach()
            sqr = self._micro_squared(parameter, grad.reshape(-1), weight)
            total = sqr if total is None else total + sqr
            self._previous[id(parameter)] = grad.clone()
        if total is not None:
            self._micro.append(total)

    def before_reduce(self, state: WeightedAllReduceState, bucket: dist.GradBucket) -> None:
        sqr = self._bucket_squared(bucket.buffer(), bucket, state.micro_weight, subtract_previous=True)
        self._local = sqr if self._local is None else self._local + sqr
        if bucket.is_last():
            groups = [*self._micro, self._local]
            exchange = torch.zeros(self.world_size * len(groups) + 1, dtype=torch.float64, device=sqr.device)
            exchange[self.rank * len(groups) : (self.rank + 1) * len(groups)] = torch.stack(groups).double()
            if self.rank == 0:  # x + 0 + ... + 0 is exact: every rank receives rank zero's very bits
                exchange[-1] = math.nan if self._last_global is None else self._last_global
            self._exchange = exchange
            self._work = dist.all_reduce(exchange, group=state.process_group, async_op=True)

    def after_reduce(self, state: WeightedAllReduceState, bucket: dist.GradBucket, reduced: torch.Tensor) -> None:
        sqr = self._bucket_squared(reduced, bucket, 1.0, subtract_previous=False)
        self._global = sqr if self._global is None else self._global + sqr

    def collect(self) -> tuple[list[float], float, float] | None:
        """``(Z per group, this rank's Y, rank zero's Y of the step before)`` of the optimizer step just finished,
        or ``None`` if no gradient was reduced in it (``nan`` marks a Y not known).

        Groups are ordered rank-major: rank 0's micro-batches, then rank 1's, and so on.
        """
        if self._work is None or self._exchange is None or self._global is None:
            return None
        self._work.wait()
        *local, previous_global = self._exchange.tolist()
        global_sqr = float(self._global)
        self._reset()
        self._last_global = global_sqr
        return local, global_sqr, previous_global

    def fold_into(self, estimator: NoiseScaleEstimator, window: Sequence[Sequence[int]]) -> bool:
        """Collect the step's norms and fold the *previous* step's into ``estimator``; every rank calls it and every
        rank's estimator receives the same numbers.

        Args:
            estimator: where the statistics go (every rank has one).
            window: every rank's sample count in each micro-batch of the step's accumulation window.

        Returns:
            Whether the estimator changed.

        """
        statistics = self.collect()
        if statistics is None:
            self.pending = None
            return False
        local, _, previous_global = statistics
        ready, self.pending = self.pending, None
        if window:
            # groups are rank-major, as they were exchanged: rank 0's micro-batches first
            self.pending = (local, [micro[rank] for rank in range(self.world_size) for micro in window])
        if ready is None or not math.isfinite(previous_global) or not all(math.isfinite(z) for z in ready[0]):
            return False  # nothing to pair, or an overflowing step (e.g. fp16): it tells nothing about the noise
        return estimator.update(ready[0], ready[1], previous_global)

    def state_dict(self) -> dict:
        """The statistics in flight (the last step's, whose Y comes with the next exchange), for exact resumes."""
        return {"pending": self.pending, "last_global": self._last_global}

    def load_state_dict(self, state: dict) -> None:
        pending = state.get("pending")
        self.pending = None if pending is None else (list(pending[0]), [int(b) for b in pending[1]])
        self._last_global = state.get("last_global")

    def _bucket_squared(
        self, flat: torch.Tensor, bucket: dist.GradBucket, weight: float, subtract_previous: bool
    ) -> torch.Tensor:
        flat = flat.detach()
        parameters = bucket.parameters()
        numels = [p.numel() for p in parameters]
        if sum(numels) != flat.numel():
            # an unexpected bucket layout: measure it whole and raw rather than guess
            return flat.float().pow(2).sum() / weight**2
        total = flat.new_zeros((), dtype=torch.float32)
        for parameter, piece in zip(parameters, torch.split(flat, numels), strict=True):
            if subtract_previous:
                total = total + self._micro_squared(parameter, piece, weight)
            else:
                total = total + self._preconditioned(parameter, piece.float()).pow(2).sum()
        return total

    def _micro_squared(self, parameter: torch.Tensor, accumulated: torch.Tensor, weight: float) -> torch.Tensor:
        """``|g_k|^2`` of one micro-batch: what it added to the accumulated gradient, over its weight in the sum."""
        previous = self._previous.get(id(parameter))
        delta = accumulated.float() if previous is None else accumulated.float() - previous.reshape(-1).float()
        return (self._preconditioned(parameter, delta) / weight).pow(2).sum()

    def _preconditioned(self, parameter: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        if self.optimizer is None:
            return flat
        state = self.optimizer.state.get(parameter, {})
        if "exp_avg_sq" not in state or "step" not in state:
            return flat
        if self._groups is None:  # built once: a lookup per parameter per step must not scan every group
            self._groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        group = self._groups[id(parameter)]
        beta2, eps = group["betas"][1], group["eps"]
        v_hat = state["exp_avg_sq"].float().reshape(-1) / (1.0 - beta2 ** float(state["step"]))
        return flat / (v_hat.sqrt() + eps)
