"""Splitting each global batch by the samples' costs (tokens) and the devices' speeds, not by sample counts.

The user names a cost per sample (``CannikinStrategy(sample_costs=...)``: a sequence indexed like the training dataset,
a function of the index, or ``"lengths"`` for the dataset's own ``lengths`` attribute). The global batches are laid
out as before (one shared permutation, the plan's global batch size, every sample once per epoch, equal step counts on
every rank); within each, :func:`~lightning_cannikin.core.cost_split.split_by_cost` assigns the samples to ranks so
that the predicted step times are equal. The times come with the plan (:attr:`Plan.time_models`, fitted over each
rank's summed cost and broadcast by rank zero), so every rank computes the same split from the same numbers, with no
collective. Before every device's speed is measured, the plan's own sample split stands for the speeds (a rank given
twice the samples is taken to be twice as fast) and the costs are balanced in that proportion.

A resume is exact: a split is a function of the permutation, the costs and the plan schedule, which the loader's
checkpoint already holds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from lightning_cannikin.core.cost_split import split_by_cost
from lightning_cannikin.core.plan import Plan
from lightning_cannikin.core.policy import Decision
from lightning_cannikin.core.timing import HALF_LIFE
from lightning_cannikin.training.data.sampler import UnevenBatchSampler

__all__ = ["CostAwareBatchSampler", "CostTimeFit", "SampleCosts", "resolve_costs", "with_time_models"]

SampleCosts = Sequence[float] | Callable[[int], float] | str
COST_HELP = (
    "Give `sample_costs` as a sequence with one non-negative cost (e.g. the token count) per sample of the training"
    " dataset, a function of the sample index, or 'lengths' for the dataset's own `lengths` attribute."
)


def resolve_costs(sample_costs: SampleCosts | None, dataset: Any) -> np.ndarray | None:
    """Every sample's cost as a float array indexed like ``dataset`` (``None``: no costs given).

    Raises:
        ValueError: a missing ``lengths`` attribute, a length that differs from the dataset's, or a cost that is
            negative or not finite.

    """
    if sample_costs is None:
        return None
    num_samples = len(dataset)
    if isinstance(sample_costs, str):
        if sample_costs != "lengths" or not hasattr(dataset, "lengths"):
            raise ValueError(f"`sample_costs={sample_costs!r}` names no `lengths` of the dataset. {COST_HELP}")
        sample_costs = dataset.lengths
    if callable(sample_costs):
        values = np.array([float(sample_costs(index)) for index in range(num_samples)], dtype=np.float64)
    else:
        values = np.asarray(sample_costs, dtype=np.float64).reshape(-1)
    if values.shape != (num_samples,):
        raise ValueError(f"`sample_costs` has {values.size} entries for {num_samples} samples. {COST_HELP}")
    if not np.all(np.isfinite(values)) or np.any(values < 0) or not values.sum() > 0:
        raise ValueError(f"`sample_costs` must be finite and non-negative, and not all zero. {COST_HELP}")
    return values


class CostAwareBatchSampler(UnevenBatchSampler):
    """An :class:`UnevenBatchSampler` whose global batches are split across ranks by cost and predicted time.

    Args:
        num_samples: length of the map-style dataset.
        rank: this process's global rank.
        plan: the plan in force from the first batch of the epoch on.
        costs: every sample's cost, indexed like the dataset (:func:`resolve_costs`).
        shuffle, seed, drop_last: as for :class:`UnevenBatchSampler`.

    """

    def __init__(
        self,
        num_samples: int,
        rank: int,
        plan: Plan,
        costs: np.ndarray,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(num_samples, rank, plan, shuffle=shuffle, seed=seed, drop_last=drop_last)
        if costs.shape != (num_samples,):
            raise ValueError(f"`costs` has {costs.size} entries for {num_samples} samples.")
        self.costs = costs
        # a "sample" of the speed model is a sample of average cost: its sizes and the planner's keep their meaning
        self.mean_cost = float(costs.mean())
        self._splits: dict[int, tuple[Any, np.ndarray]] = {}

    def split_at(self, batch_index: int) -> tuple[np.ndarray, np.ndarray]:
        """Global batch ``batch_index``'s samples (dataset indices, in permutation order) and the rank of each."""
        batch = self.layout()[batch_index]
        sizes = batch.local_batch_sizes
        if not sizes:  # an epoch begun on another world size: a batch it ran
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        samples = np.asarray(self._epoch_permutation()[batch.start : batch.start + sum(sizes)], dtype=np.int64)
        models = self.plan_at(batch_index).time_models
        key = (self.sampler.epoch, batch.start, sizes, models)
        cached = self._splits.get(batch_index)
        if cached is not None and cached[0] == key:
            return samples, cached[1]
        if models is None:
            # the plan's split stands for the speeds: a rank given twice the samples is taken to be twice as fast
            fixed, per_cost = np.zeros(len(sizes)), 1.0 / np.asarray(sizes, dtype=np.float64)
        else:
            fixed = np.array([model[0] for model in models])
            per_cost = np.array([model[1] for model in models])
        ranks = split_by_cost(self.costs[samples], fixed, per_cost).ranks
        self._splits[batch_index] = (key, ranks)
        return samples, ranks

    def sizes_at(self, batch_index: int) -> tuple[int, ...]:
        """Every rank's sample count in global batch ``batch_index`` (as the cost-aware split gives them)."""
        samples, ranks = self.split_at(batch_index)
        if samples.size == 0:
            return ()
        return tuple(int(c) for c in np.bincount(ranks, minlength=self.schedule[0].world_size))

    def units_at(self, batch_index: int) -> tuple[float, ...]:
        """Every rank's summed cost in global batch ``batch_index`` (a count mean's units, the time model's load)."""
        samples, ranks = self.split_at(batch_index)
        world_size = self.schedule[0].world_size
        return tuple(float(u) for u in np.bincount(ranks, weights=self.costs[samples], minlength=world_size))

    def load_of(self, units: float) -> int:
        """A rank's summed cost in samples of average cost: the size its step is timed at (at least 1)."""
        return max(1, round(units / self.mean_cost))

    def _rank_indices(self, batch_index: int) -> list[int]:
        samples, ranks = self.split_at(batch_index)
        return samples[ranks == self.rank].tolist()


class CostTimeFit:
    """One rank's compute time over its exact summed cost, ``seconds = fixed + per_cost * cost``, from its own steps.

    The speed model times a rank at its cost rounded to samples of average cost (its sizes stay samples); where a rank
    holds a few samples, that rounding is a large share of its load. This fit keeps the exact cost of every timed step
    (:meth:`load`), pairs it with the step's compute time when the records are read (:meth:`add`, at every re-plan)
    and fits a recency-weighted line, refitted once without the steps whose residual is more than three median
    absolute deviations (a hiccup): what the cost-aware split divides each batch by.

    Args:
        keep: steps kept.
        half_life: recency half-life, in steps.

    """

    def __init__(self, keep: int = 256, half_life: float = HALF_LIFE) -> None:
        self._pairs: deque[tuple[float, float]] = deque(maxlen=keep)
        self._loads: dict[int, float] = {}
        self.half_life = half_life

    def load(self, step: int, cost: float) -> None:
        """Step ``step`` of this rank held ``cost``."""
        self._loads[step] = float(cost)

    def add(self, records: Sequence[Any]) -> tuple[float, float] | None:
        """Pair the step records just read with their costs; returns the fit (``None``: none yet)."""
        for record in records:
            cost = self._loads.pop(record.step, None)
            if cost is not None and record.cost > 0:  # the time the speed model fits: input wait and compute
                self._pairs.append((cost, float(record.cost)))
        if records:  # steps the timer skipped are never read
            newest = max(record.step for record in records)
            self._loads = {step: cost for step, cost in self._loads.items() if step > newest}
        return self.fit()

    def state_dict(self) -> dict[str, Any]:
        """The pairs kept and the costs of the steps whose times are not read yet (plain values)."""
        return {"pairs": [list(pair) for pair in self._pairs], "loads": [[step, c] for step, c in self._loads.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pairs.clear()
        self._pairs.extend((float(cost), float(seconds)) for cost, seconds in state["pairs"])
        self._loads = {int(step): float(cost) for step, cost in state["loads"]}

    def fit(self) -> tuple[float, float] | None:
        """``(fixed seconds, seconds per unit of cost)``, or ``None`` before four steps of different costs."""
        if len(self._pairs) < 4:
            return None
        cost, seconds = (np.array(column) for column in zip(*self._pairs, strict=True))
        if float(np.ptp(cost)) <= 0:
            return None
        weights = 0.5 ** (np.arange(len(cost))[::-1] / self.half_life)
        line = np.polyfit(cost, seconds, 1, w=np.sqrt(weights))
        residual = np.abs(seconds - np.polyval(line, cost))
        kept = residual <= 3 * max(float(np.median(residual)), 1e-9)
        if kept.sum() >= 4 and float(np.ptp(cost[kept])) > 0:
            line = np.polyfit(cost[kept], seconds[kept], 1, w=np.sqrt(weights[kept]))
        slope, fixed = float(line[0]), float(line[1])
        if not slope > 0:
            return None
        return max(fixed, 0.0), slope


def with_time_models(decision: Decision | None, fits: Sequence[tuple[float, float] | None]) -> Decision | None:
    """Rank zero: the decision's plan carrying every rank's :class:`CostTimeFit` once every device's speed is measured
    and every rank has its fit (a probe keeps its sample split: its lever is what measures the slopes)."""
    if decision is None or not decision.identified or any(fit is None for fit in fits):
        return decision
    return replace(decision, plan=replace(decision.plan, time_models=tuple(fits)))  # type: ignore[arg-type]
