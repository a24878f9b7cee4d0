"""The smallest local batch a model trains on: layers whose statistics come from the rank's own samples (BatchNorm)
need more than one sample, so the planner's default lower bound follows them."""

from __future__ import annotations

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info  # Lightning's and Fabric's

from lightning_cannikin.core.plan import BatchBounds

__all__ = ["BATCH_STATISTICS_SMALLEST", "smallest_local_batch"]

# the smallest local batch every BatchNorm accepts in training: its statistics need more than one value per channel,
# and a (batch, features) input holds one per sample
BATCH_STATISTICS_SMALLEST = 2


def smallest_local_batch(module: torch.nn.Module | None, local_batch_bounds: object = None) -> int:
    """The smallest local batch ``module`` trains on: 2 where it has batch-statistics layers (BatchNorm of any kind,
    whose statistics come from this rank's samples alone), else 1. A lower bound in ``local_batch_bounds`` wins.

    A fast device beside a much slower one would otherwise be planned one sample, and the fit would die in the slow
    rank's forward (``Expected more than 1 value per channel when training``). SyncBatchNorm pools its statistics over
    every rank and accepts one sample: it needs no floor. Says why on rank zero, once per call.
    """
    if module is None or BatchBounds.gives_lower(local_batch_bounds):
        return 1
    # torch's base class of every BatchNorm (1d/2d/3d and the lazy ones); SyncBatchNorm derives from it too
    names = sorted(
        {
            type(m).__name__
            for m in module.modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(m, torch.nn.SyncBatchNorm)
        }
    )
    if not names:
        return 1
    rank_zero_info(
        f"Cannikin: the model has {', '.join(names)} layers, whose statistics need at least"
        f" {BATCH_STATISTICS_SMALLEST} samples on a rank in training, so no rank's local batch goes below"
        f" {BATCH_STATISTICS_SMALLEST}. To choose the lower bound yourself, set"
        " `Cannikin(local_batch_bounds=(lower, upper))`."
    )
    return BATCH_STATISTICS_SMALLEST
