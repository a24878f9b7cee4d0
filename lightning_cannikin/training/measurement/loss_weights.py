"""A declared loss normalisation applied by the strategy: each step's weights, and the check that the loss matches it.

The weights are :func:`~lightning_cannikin.core.loss_normalisation.loss_weights`' (exact for a mean over samples, a
sum over samples, or a mean over a per-sample count such as tokens), split into what the all-reduce carries for the
rank (:attr:`StepWeights.rank`) and what each accumulation micro-batch's loss carries within it
(:attr:`StepWeights.micro`). :class:`LossScaleCheck` keeps each step's local loss beside every rank's batch size, and
rank zero warns once when the losses behave like another normalisation than the declared one
(:func:`~lightning_cannikin.core.loss_normalisation.normalisation_mismatch`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_cannikin.core.loss_normalisation import (
    NORMALISATIONS,
    loss_weights,
    noise_groups,
    normalisation_mismatch,
)

__all__ = ["LossScaleCheck", "StepWeights", "WindowWeights", "check_normalisation", "every_ranks_units", "step_weights"]


def check_normalisation(normalisation: str) -> str:
    """``normalisation`` if it is one the strategy knows, else a clear error."""
    if normalisation not in NORMALISATIONS:
        raise ValueError(
            f"`loss_normalisation` must be one of {NORMALISATIONS}, got {normalisation!r}: 'sample_mean' for a loss"
            " averaged over the batch's samples, 'sample_sum' for a sum over them, 'count_mean' for a mean over a"
            " per-sample count such as tokens (give the counts as `sample_costs` or `batch_units`)."
        )
    return normalisation


@dataclass(frozen=True)
class StepWeights:
    """One micro-batch's weights under a summing all-reduce.

    Attributes:
        rank: what this rank's accumulated gradient is multiplied by before the ranks sum (``b_i / B`` for a sample
            mean).
        micro: this micro-batch's share of the rank's accumulated gradient (1 without accumulation).
        unit_scale: the micro-batch's gradient over its mean gradient (its sample count for a sum, else 1): the noise
            statistics divide it out.
        noise_sizes: every group's size in samples, rank-major (a count mean's units in samples' worth, so the noise
            scale stays in samples).
        global_scale: the reduced gradient over the global mean gradient (the window's samples for a sum, else 1).

    """

    rank: float
    micro: float
    unit_scale: float
    noise_sizes: tuple[tuple[float, ...], ...]
    global_scale: float = 1.0


class WindowWeights:
    """Each step's weights for the exact mean over the accumulation window it belongs to: computed here and nowhere
    else, and kept while the steps repeat the last one's sizes (most do).

    The rank's weight is its share of the window's samples (or of the declared normalisation's units). When
    micro-batches within the window differ in size (the epoch's last, partial batch), each micro-batch's loss is
    rescaled so that the rank's accumulated gradient is still the mean over its own samples.
    """

    def __init__(self, normalisation: str = "sample_mean") -> None:
        self.normalisation = check_normalisation(normalisation)
        self._key: tuple | None = None
        self._weights: StepWeights | None = None

    def of_step(
        self,
        sampler: Any,
        position: int,
        sizes: tuple[int, ...],
        rank: int,
        accumulation: int = 1,
        end: int = -1,
        units: tuple[float, ...] | None = None,
    ) -> StepWeights:
        """The weights of global batch ``position`` (every rank's ``sizes``) on ``rank``; ``sampler``: the uneven
        sampler that laid out the epoch (the window's other micro-batches); ``end``: where the window is closed early
        (``-1``: the epoch's end); ``units``: every rank's count this step, for a count mean the sampler cannot
        give."""
        indices = [position]
        if accumulation > 1 and sampler is not None:
            first = (position // accumulation) * accumulation
            last = len(sampler) if end < 0 else min(end, len(sampler))
            last = min(first + accumulation, last)
            # an epoch resumed on another world size has placeholders (no sizes) for the batches it did not run
            indices = [q for q in range(first, max(last, position + 1)) if q == position or sampler.sizes_at(q)]
        window = [sizes if q == position else sampler.sizes_at(q) for q in indices]
        window_units, micro = self._window_units(sampler, indices, units), indices.index(position)
        key = (tuple(window), rank, micro) if window_units is None else None
        if key is not None and key == self._key and self._weights is not None:
            return self._weights
        weights = step_weights(self.normalisation, window, window_units, rank, micro)
        self._key, self._weights = key, weights
        return weights

    def _window_units(
        self, sampler: Any, indices: list[int], units: tuple[float, ...] | None
    ) -> list[tuple[float, ...]] | None:
        """Every rank's units in each micro-batch of the window, for a count mean: from the sampler when it knows every
        sample's count (no collective), else this step's all-gathered ``units`` (one micro-batch per step only)."""
        if self.normalisation != "count_mean":
            return None
        units_at = getattr(sampler, "units_at", None)
        if units_at is not None:
            return [units_at(q) for q in indices]
        if units is None or len(indices) > 1:
            raise ValueError(
                "`loss_normalisation='count_mean'` needs every micro-batch's count: give the strategy `sample_costs`"
                " (the sampler then knows every sample's count, with gradient accumulation too) or `batch_units` (a"
                " function of the local batch, all-gathered each step; without gradient accumulation)."
            )
        return [units]


def step_weights(
    normalisation: str,
    window: Sequence[Sequence[int]],
    units: Sequence[Sequence[float]] | None,
    rank: int,
    micro_index: int,
) -> StepWeights:
    """The weights of micro-batch ``micro_index`` of an accumulation ``window`` on ``rank``.

    Args:
        normalisation: the declared normalisation.
        window: every rank's sample count in each micro-batch of the window (micro-batch-major).
        units: the same shape, every group's count (tokens) for ``"count_mean"``; ``None`` otherwise.
        rank: this rank.
        micro_index: the micro-batch's index within the window.

    """
    if normalisation == "sample_mean":  # the default, every step: loss_weights' row for it in plain Python (~5 us)
        rank_samples = sum(micro[rank] for micro in window)
        total = sum(sum(micro) for micro in window)
        noise = tuple(tuple(float(b) for b in micro) for micro in window)
        return StepWeights(rank_samples / total, window[micro_index][rank] / rank_samples, 1.0, noise)
    samples = np.asarray(window, dtype=np.float64).T  # (n, K)
    unit_array = None if units is None else np.asarray(units, dtype=np.float64).T
    weights = loss_weights(normalisation, samples, unit_array, allreduce="sum")
    rank_weight = float(weights[rank].sum())
    micro = float(weights[rank, micro_index]) / rank_weight if rank_weight > 0 else 0.0
    # the noise groups: a count mean's in units (in samples' worth); a window with no units falls back to samples
    counted = normalisation != "count_mean" or (unit_array is not None and unit_array.sum() > 0)
    groups = noise_groups(normalisation if counted else "sample_mean", samples, unit_array)
    sizes = groups.sizes.reshape(samples.shape) * groups.samples_per_unit
    summed = normalisation == "sample_sum"
    unit_scale, global_scale = (float(samples[rank, micro_index]), float(samples.sum())) if summed else (1.0, 1.0)
    noise_sizes = tuple(tuple(float(s) for s in column) for column in sizes.T)
    return StepWeights(rank_weight, micro, unit_scale, noise_sizes, global_scale)


def every_ranks_units(units: float, device: torch.device) -> tuple[float, ...]:
    """Every rank's count (tokens) in the step in progress, in rank order: one all-gather of one number per rank (a
    count mean whose counts the sampler does not know)."""
    if not (dist.is_available() and dist.is_initialized()):
        return (units,)
    mine = torch.tensor([units], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return tuple(float(value) for value in torch.cat(every).tolist())


class LossScaleCheck:
    """Each step's local loss beside every rank's batch size; rank zero judges them against the declared normalisation.

    The losses stay on the device until :meth:`take` (called where the ranks already gather their step timings), so
    recording costs no synchronisation. The warning is given once per fit.
    """

    def __init__(self, normalisation: str = "sample_mean", keep: int = 64) -> None:
        self.normalisation = normalisation
        self._steps: deque[tuple[tuple[int, ...], torch.Tensor]] = deque(maxlen=keep)
        self._rows: deque[tuple[tuple[int, ...], list[float]]] = deque(maxlen=256)  # rank zero's evidence
        self.warned = False

    def record(self, sizes: tuple[int, ...] | None, loss: torch.Tensor) -> None:
        """This rank's loss of a micro-batch whose ranks held ``sizes`` (the loss as ``training_step`` gave it)."""
        if sizes is not None and not self.warned:
            self._steps.append((tuple(sizes), loss.detach()))  # reshaped at :meth:`take`, once for all of them

    def take(self) -> list[tuple[tuple[int, ...], float]]:
        """The recorded steps as numbers (this rank's part of the gather), and forget them."""
        steps, self._steps = list(self._steps), deque(maxlen=self._steps.maxlen)
        if not steps:
            return []
        values = torch.stack([loss.float().reshape(()) for _, loss in steps]).tolist()
        return [(sizes, value) for (sizes, _), value in zip(steps, values, strict=True)]

    def judge(self, gathered: Sequence[Any]) -> str | None:
        """Rank zero: every rank's :meth:`take`, in rank order; warns once on a mismatch and returns the message."""
        if self.warned or not gathered:
            return None
        # the k-th entry of every rank belongs to the same micro-batch: the ranks step in lockstep
        for entries in zip(*gathered, strict=False):
            sizes = entries[0][0]
            if len(sizes) == len(entries) and all(entry[0] == sizes for entry in entries):
                self._rows.append((sizes, [value for _, value in entries]))
        rows = list(self._rows)
        message = normalisation_mismatch(self.normalisation, [s for s, _ in rows], [v for _, v in rows])
        if message is not None:
            self.warned = True
            rank_zero_warn(f"Cannikin: {message}")
        return message
