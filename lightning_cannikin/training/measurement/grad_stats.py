"""Squared gradient norms around the weighted all-reduce, exchanged across the ranks, for the noise-scale estimator.

On a measured step (every step, or one in ``measure_every``, which the engine sets step by step through
``cadence``) this rank's local squared norm is taken before the reduction and the global one (on rank zero) after
it, through the comm hook, bucket by bucket (:mod:`~lightning_cannikin.training.measurement.grad_norms` computes them,
fused). With gradient accumulation every micro-batch is a group of its own. Each
measured step's groups go in a block of ``world_size x micro-batches + 2`` floats; every ``exchange_every`` measured
steps the waiting blocks are exchanged with one all-reduce, issued asynchronously at the end of a step. Steps in
this paragraph and below are measured steps.

Every rank folds the statistics into its own estimator, so the learning-rate factor follows the noise scale with no
collective of its own. For the ranks to agree *bitwise* (heterogeneous GPUs may round a squared norm differently),
every input comes through the exchange: ``Z_j`` in their slots, and in two more slots of each block, written by rank
zero alone (``x + 0 + ... + 0`` is exact), ``Y`` of the step before and the GradScaler's scale of the step.

Nothing waits for an exchange in the step that issues it: it is read when the next one is issued (on CUDA from
pinned host memory it was copied to, asynchronously, behind the collective), long after the device got there.
``Y`` of a step arrives with the next step's block, so with one step per exchange a step's statistics reach the
estimator at the end of the step :data:`FOLD_DELAY` later; with ``exchange_every = k``, between ``k + 1`` and ``2k``
steps later. The numbers are the same either way.

Mixed precision: with a ``GradScaler`` (``16-mixed``) the gradients carry the scale of their step, so every norm is
divided by that scale squared; a step after which the scale backed off (the scaler found inf or NaN gradients and
skipped the step) is left out. ``bf16-mixed`` has no scaler: nothing to undo.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_cannikin.core.noise_scale import NoiseScaleEstimator
from lightning_cannikin.training._lightning_compat import scaler_scale
from lightning_cannikin.training.measurement.comm_hook import WeightedAllReduceState
from lightning_cannikin.training.measurement.grad_norms import GradientNorms
from lightning_cannikin.training.measurement.host_transfer import HostTransfer, PinnedTransfer

__all__ = ["FOLD_DELAY", "GradientNormObserver"]

READ_LAG = 1  # exchanges left unread when a step ends: the newest one is read a step later
FOLD_DELAY = READ_LAG + 1  # a step's statistics reach the estimator at the end of the step this many steps later


class GradientNormObserver:
    """Collects ``Z_j = |g_j|^2`` for every group (rank x micro-batch) and ``Y = |g|^2`` of the reduced gradient.

    Args:
        rank: this process's global rank.
        world_size: number of ranks.
        transfer: how an exchange reaches the host (default: by the exchange's device).
        exchange_every: optimizer steps whose statistics go in one exchange. Each step's numbers are the same; they
            arrive later (between ``exchange_every + 1`` and ``2 x exchange_every`` steps after their step) and the
            collective is paid once per exchange. On gloo a collective of a few floats costs about a millisecond of
            CPU and wall time; on NCCL tens of microseconds.
        measure_every: measure one optimizer step in this many (:meth:`start_step`; ``cadence``, where set, overrides
            it step by step); on the others the hook only reduces.

    Attributes:
        measuring: whether the step in progress is measured (set before its first backward; a step not measured
            computes no norm and leaves no block).
        scaler: the ``GradScaler`` of ``16-mixed`` training (``None`` without one).
        cadence: a callable giving ``measure_every`` at the start of each optimizer step (``None``: the fixed value),
            the same on every rank; a measured step weighs as the steps it stands for.
        pending: the newest step whose norms were read, waiting for its ``Y``: ``(Z, sizes, scale, weight)``.

    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        transfer: HostTransfer | PinnedTransfer | None = None,
        exchange_every: int = 1,
        measure_every: int = 1,
    ) -> None:
        # positive integers: CannikinSettings checks them (``noise_exchange_every``, ``noise_every_n_steps``)
        self.exchange_every = exchange_every
        self.measure_every = measure_every
        self.rank = rank
        self.world_size = world_size
        self.norms = GradientNorms()
        self.measuring = True
        self.scaler: Any = None
        self.cadence: Callable[[], int] | None = None
        self._weight = 1  # the steps the step in progress stands for
        self._started: int | None = None  # the optimizer step started last (micro-batches repeat it)
        self._last_measured: int | None = None
        self._transfer = transfer
        # rank zero's Y of the last step (each rank's part, sharded), for the next exchange
        self._last_global: torch.Tensor | float | None = None
        self.pending: tuple[list[float], list[int], float, int] | None = None
        # issued exchanges not folded yet, oldest first: [transfer handle or read values, layout, read?], the layout
        # one (values, sizes) pair per step in it
        self._in_flight: deque[list[Any]] = deque()
        # steps waiting for the next exchange: this rank's block, or the summed values a checkpoint brought back
        self._unsent: list[tuple[torch.Tensor | list[float], list[int] | None, int]] = []
        self._snapshot: tuple[Any, torch.Tensor] | None = None  # a checkpoint's copy of them, being summed
        self._group: Any = None
        self._reset_step()

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """Set it to an Adam-family optimizer to measure the noise of the *preconditioned* gradient
        ``g / (sqrt(v_hat) + eps)`` (AdaptDL's rule): that is the direction Adam actually steps in."""
        return self.norms.optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        self.norms.optimizer = optimizer

    def _reset_step(self) -> None:
        self._micro: list[torch.Tensor] = []  # this rank's finished micro-batches of the window
        self._local: torch.Tensor | None = None  # the window's last micro-batch, summed over buckets
        self._global: torch.Tensor | None = None
        self._block: torch.Tensor | None = None  # this step's part of the next exchange

    def start_step(self, step: int) -> None:
        """Optimizer step ``step`` (counted over the fit, as a resumed fit counts it) is about to start."""
        if step == self._started:
            return  # another micro-batch of the same optimizer step
        self._started = step
        every = self.measure_every if self.cadence is None else self.cadence()
        self.measuring = step % every == 0
        if self.measuring:
            # it stands for the steps since the last measured one, so a change of cadence weighs every step once
            last = self._last_measured
            self._weight = step - last if last is not None and step > last else every
            self._last_measured = step

    def after_micro_step(self, parameters: Iterable[torch.Tensor], weight: float) -> None:
        """Record a micro-batch that ended without a reduction (accumulation); ``weight`` is its share of the sum."""
        if not self.measuring:
            return
        squared = self.norms.micro_batch(list(parameters), weight)
        if squared is not None:
            self._micro.append(squared)

    def before_reduce(self, state: WeightedAllReduceState, bucket: dist.GradBucket) -> None:
        if not self.measuring:
            return
        sqr = self.norms.bucket(bucket.buffer(), bucket.parameters, state.local_scale, subtract_previous=True)
        self._local = sqr if self._local is None else self._local + sqr
        if bucket.is_last():
            self._close_block(state)

    def _close_block(self, state: WeightedAllReduceState) -> None:
        """This rank's last gradient of the step is measured: build the step's part of the next exchange."""
        local = self._local
        assert local is not None
        groups = torch.stack([*self._micro, local]) if self._micro else local.reshape(1)
        count = groups.numel()
        exchange = torch.zeros(self.world_size * count + 2, dtype=torch.float64, device=groups.device)
        exchange[self.rank * count : (self.rank + 1) * count] = groups  # to float64 in the same copy
        last = self._last_global
        if self.rank == 0:
            exchange[-2] = math.nan if last is None else last
            # the scale this step's gradients carry (the scaler updates it only after the step)
            exchange[-1] = scaler_scale(self.scaler) if self.scaler is not None else 1.0
        elif last is not None:  # sharded, every rank adds its shards' part of the last step's Y (DDP's have none)
            exchange[-2] = last
        self._block, self._group = exchange, state.process_group

    def after_reduce(self, state: WeightedAllReduceState, bucket: dist.GradBucket, reduced: torch.Tensor) -> None:
        if self.rank != 0 or not self.measuring:
            return  # the other ranks receive rank zero's Y through the exchange
        sqr = self.norms.bucket(reduced, bucket.parameters, state.global_scale, subtract_previous=False)
        self._global = sqr if self._global is None else self._global + sqr

    def fold_into(self, estimator: NoiseScaleEstimator, window: Sequence[Sequence[int]]) -> bool:
        """End the optimizer step: keep its exchange in flight, and fold every step whose inputs have all arrived.

        Every rank calls it at every optimizer step, and every rank's estimator receives the same numbers.

        Args:
            estimator: where the statistics go (every rank has one).
            window: every rank's sample count in each micro-batch of the step's accumulation window.

        Returns:
            Whether the estimator changed.

        """
        block = self._block
        if block is not None:  # a step not measured leaves the last Y for the next block
            self._last_global = self._global  # None on a rank without Y (DDP's ranks but zero)
        self._reset_step()
        self.norms.new_window()
        if block is None:  # not measured, or no gradient was reduced
            return False
        # groups are rank-major, as they were exchanged: rank 0's micro-batches first
        sizes = [micro[rank] for rank in range(self.world_size) for micro in window] if window else None
        self._unsent.append((block, sizes, self._weight))
        if len(self._unsent) >= self.exchange_every:
            self._send()
        updated = False
        while len(self._in_flight) > READ_LAG:
            updated = self._fold(estimator, self._in_flight.popleft()) or updated
        return updated

    def _send(self) -> None:
        """Issue the steps waiting for an exchange as one all-reduce; nothing waits for it."""
        blocks, self._unsent = self._unsent, []
        live = [block for block, _, _ in blocks if isinstance(block, torch.Tensor)]
        handle: Any = []
        if live:
            exchange = live[0] if len(live) == 1 else torch.cat(live)
            work = dist.all_reduce(exchange, group=self._group, async_op=True)
            if self._transfer is None:
                self._transfer = PinnedTransfer() if exchange.is_cuda else HostTransfer()
            handle = self._transfer.start(exchange, work)
        # per step: its count of floats, its sizes, its summed values when a checkpoint already had them, its weight
        layout = [
            (block.numel(), sizes, None, weight)
            if isinstance(block, torch.Tensor)
            else (len(block), sizes, list(block), weight)
            for block, sizes, weight in blocks
        ]
        self._in_flight.append([handle, layout, not live])

    def _fold(self, estimator: NoiseScaleEstimator, entry: list[Any]) -> bool:
        """Read one exchange and fold its steps in order."""
        handle, layout, read = entry
        values = handle if read else self._transfer.read(handle)
        updated, offset = False, 0
        for count, sizes, known, weight in layout:
            if known is None:
                known, offset = values[offset : offset + count], offset + count
            updated = self._fold_step(estimator, known, sizes, weight) or updated
        return updated

    def snapshot_waiting(self) -> None:
        """Start summing a copy of the steps still waiting for their exchange (a checkpoint needs every rank's numbers;
        the exchange itself stays where it was, so saving a checkpoint changes nothing). Every rank calls it at the
        same step; :meth:`state_dict` calls it when nobody did."""
        live = [block for block, _, _ in self._unsent if isinstance(block, torch.Tensor)]
        if live and self._snapshot is None:
            copy = torch.cat(live)
            self._snapshot = (dist.all_reduce(copy, group=self._group, async_op=True), copy)

    def _fold_step(
        self, estimator: NoiseScaleEstimator, values: list[float], sizes: list[int] | None, weight: int
    ) -> bool:
        """One step's block: its ``Y`` and scale complete the pending step, its ``Z`` become the pending step (which
        stands for ``weight`` optimizer steps)."""
        *local, previous_global, scale = values
        ready, self.pending = self.pending, None
        if sizes:
            self.pending = (local, sizes, scale, weight)
        if ready is None:
            return False
        ready_local, ready_sizes, ready_scale, ready_weight = ready
        if scale < ready_scale:
            return False  # the scale backed off after that step: the scaler skipped it
        inverse = 1.0 / ready_scale**2
        global_sqr = previous_global * inverse
        ready_local = [z * inverse for z in ready_local]
        if not math.isfinite(global_sqr) or not all(math.isfinite(z) for z in ready_local):
            return False  # nothing to pair, or an overflowing step (e.g. fp16): it tells nothing about the noise
        return estimator.update(ready_local, ready_sizes, global_sqr, ready_weight)

    def state_dict(self) -> dict:
        """The statistics in flight, read now (a checkpoint may wait for the device), for exact resumes.

        Steps not exchanged yet are exchanged first (their numbers are on every rank only then): every rank calls it,
        as Lightning's ``save_checkpoint`` does.
        """
        self.snapshot_waiting()
        unsent, summed = [], []
        if self._snapshot is not None:
            work, copy = self._snapshot
            if work is not None:
                work.wait()
            summed, self._snapshot = copy.tolist(), None
        for block, sizes, weight in self._unsent:
            if isinstance(block, torch.Tensor):
                block, summed = summed[: block.numel()], summed[block.numel() :]
            unsent.append([list(block), sizes, weight])
        for entry in self._in_flight:
            if not entry[2]:
                entry[0], entry[2] = self._transfer.read(entry[0]), True
        last = self._last_global
        return {
            "pending": self.pending,
            "last_global": float(last) if last is not None else None,
            "in_flight": [[values, [list(step) for step in layout]] for values, layout, _ in self._in_flight],
            "unsent": unsent,
        }

    def load_state_dict(self, state: dict) -> None:
        pending = state["pending"]
        if pending is None:
            self.pending = None
        else:
            local, sizes, scale, weight = pending
            self.pending = (list(local), _sizes(sizes), float(scale), int(weight))
        last = state["last_global"]
        # rank zero carries the whole Y (sharded: summed over the shards); the other ranks' parts still sum to it
        self._last_global = last if self.rank == 0 or last is None else 0.0
        self._in_flight = deque(
            [list(values), [_step(step) for step in layout], True] for values, layout in state["in_flight"]
        )
        self._unsent = [(list(values), _sizes(sizes), int(weight)) for values, sizes, weight in state["unsent"]]
        self._snapshot = None


def _sizes(sizes: Any) -> list[int] | None:
    return None if sizes is None else [int(b) for b in sizes]


def _step(step: Any) -> tuple[int, list[int] | None, list[float] | None, int]:
    """One step of an exchange from a checkpoint: ``[count, sizes, known values or None, weight]``."""
    count, sizes, known, weight = step
    return int(count), _sizes(sizes), known, int(weight)
