"""What :class:`~lightning_cannikin.CannikinStrategy` checks before it trains: the user's split, the training
loaders it can balance, the layers that blur its measurements, and a strategy that is not Cannikin's (Ray's own
included); with messages that name the fix."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from lightning.pytorch.utilities import rank_zero_warn

__all__ = [
    "MULTIPLE_LOADERS_ERROR",
    "NO_DISTRIBUTED_SAMPLER_ERROR",
    "from_ray",
    "validate_local_batch_sizes",
    "warn_about_fixed_total",
    "warn_about_sync_batchnorm",
    "wrong_strategy_error",
]

NO_DISTRIBUTED_SAMPLER_ERROR = (
    "`Trainer(use_distributed_sampler=False)` cannot be combined with CannikinStrategy: Cannikin must own the training"
    " sampler to split each global batch across the ranks (every rank reads the same dataset and takes its own slice"
    " of one shared permutation). Remove `use_distributed_sampler=False`; for datasets sharded by rank ahead of time,"
    " use `strategy='ddp'`."
)
MULTIPLE_LOADERS_ERROR = (
    "CannikinStrategy balances one training DataLoader, and this fit has several (a dict, list or CombinedLoader of"
    " loaders). Its weighted all-reduce gives the exact mean gradient only if every loader's batch is split in the"
    " same proportions, which integer batch sizes rarely allow. Combine the data sets into one map-style Dataset"
    " (`torch.utils.data.StackDataset` gives one sample of each per item, `ConcatDataset` mixes them) behind one"
    " DataLoader, or use `strategy='ddp'`."
)


def from_ray(obj: object) -> bool:
    """Whether ``obj`` is an instance of a class of Ray's (or of a subclass of one): recognised by the module, so that
    this package never imports Ray to ask (Ray is an optional extra)."""
    return any(cls.__module__.split(".")[0] == "ray" for cls in type(obj).__mro__)


def wrong_strategy_error(strategy: object) -> str:
    """What the Cannikin callback says to a fit whose strategy is not a Cannikin one (Ray's own get Ray's fix)."""
    name = type(strategy).__name__
    if from_ray(strategy):
        return (
            f"The Cannikin callback cannot balance Ray's {name}: its batches and all-reduce are plain DDP's. Use"
            " `strategy=CannikinRayStrategy()` (from lightning_cannikin) or `strategy='cannikin_ray'` with"
            " `plugins=[RayLightningEnvironment()]`; it passes `ray.train.lightning.prepare_trainer` too."
        )
    return f"The Cannikin callback needs `strategy='cannikin'` (a CannikinStrategy), got {name}."


def validate_local_batch_sizes(local_batch_sizes: Sequence[int] | None) -> tuple[int, ...] | None:
    """Check a user-given split early, with a message that names the parameter."""
    if local_batch_sizes is None:
        return None
    if isinstance(local_batch_sizes, (str, bytes)) or not isinstance(local_batch_sizes, Sequence):
        raise ValueError(
            f"`local_batch_sizes` must be a sequence of positive integers, one per rank, got {local_batch_sizes!r}."
        )
    sizes = tuple(local_batch_sizes)
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
        raise ValueError(
            f"`local_batch_sizes` must be positive integers, one per rank, got {list(sizes)}. Every rank needs at"
            " least one sample per step."
        )
    return sizes


def warn_about_fixed_total(fixed_sizes: Sequence[int], loader_batch_size: int, world_size: int) -> bool:
    """Warn (rank zero) when a fixed split's total differs from the DataLoader's ``batch_size x world_size``: the
    fixed split is what trains (the documented rule), and the learning rate is not rescaled for it."""
    fixed, loader_total = sum(fixed_sizes), loader_batch_size * world_size
    if fixed == loader_total:
        return False
    divisible = fixed % world_size == 0
    quiet = f"; to keep {fixed}, set the DataLoader's batch_size to {fixed // world_size}" if divisible else ""
    rank_zero_warn(
        f"`local_batch_sizes`={list(fixed_sizes)} train a global batch of {fixed} per step, not the DataLoader's"
        f" batch_size x world size = {loader_batch_size} x {world_size} = {loader_total}: a fixed split replaces the"
        f" DataLoader's batch_size, and the learning rate is not rescaled for it. To train {loader_total}, give sizes"
        f" that sum to it{quiet}."
    )
    return True


def warn_about_sync_batchnorm(module: torch.nn.Module) -> bool:
    """Warn (rank zero) when ``module`` has SyncBatchNorm layers: their collectives blur the speed measurement."""
    if not any(isinstance(m, torch.nn.SyncBatchNorm) for m in module.modules()):
        return False
    rank_zero_warn(
        "The model has SyncBatchNorm layers: their collectives make every rank wait for the slowest one inside forward"
        " and backward, so each rank's measured compute time is about the slowest rank's and Cannikin cannot tell the"
        " devices apart (the split stays close to where it is). Use BatchNorm, GroupNorm or LayerNorm to balance, or"
        " fix the split with `CannikinStrategy(local_batch_sizes=...)`."
    )
    return True
