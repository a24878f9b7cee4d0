"""Which loader a user's training DataLoader becomes: map-style data through the uneven (or cost-aware) sampler, a
LitData stream through its own shares, any other stream read whole by every rank."""

from __future__ import annotations

from torch.utils.data import DataLoader, IterableDataset

from lightning_cannikin.core.plan import Plan
from lightning_cannikin.training.data.cost_aware_sampler import SampleCosts
from lightning_cannikin.training.data.loader import UnevenDataLoader, kept_arguments, rebuild_uneven
from lightning_cannikin.training.data.replicated_stream import rebuild_replicated
from lightning_cannikin.training.data.stream_checks import is_litdata
from lightning_cannikin.training.data.streaming import rebuild_streaming

__all__ = ["rebuild_training_loader"]


def rebuild_training_loader(
    dataloader: DataLoader, plan: Plan, rank: int, world_size: int, sample_costs: SampleCosts | None = None
) -> UnevenDataLoader:
    """``dataloader`` rebuilt so that this ``rank`` takes its share of every global batch of ``plan``.

    Raises:
        ValueError: ``sample_costs`` on a stream, or a stream other than LitData's with accumulation.

    """
    if is_litdata(dataloader.dataset):  # a stream: its own shares (the items left re-dealt at a mid-epoch plan)
        if sample_costs is not None:
            raise ValueError(
                "`sample_costs` splits map-style data by each sample's cost; a streaming data set is split by"
                " count. Drop `sample_costs` (use `batch_units` for a count mean), or use a map-style dataset."
            )
        return rebuild_streaming(dataloader, plan, rank, kept_arguments(dataloader))
    if isinstance(dataloader.dataset, IterableDataset):  # any other stream: every rank reads it whole
        if sample_costs is not None or plan.accumulation_steps > 1:
            raise ValueError(
                "An IterableDataset other than LitData's is read whole by every rank, which learns each global"
                " batch's sizes only as it reads it: it supports neither `sample_costs` nor"
                f" `accumulate_grad_batches` > 1 (got {plan.accumulation_steps}). Drop them, or stream with"
                " LitData's `StreamingDataset`."
            )
        return rebuild_replicated(dataloader, plan, rank, world_size)
    return rebuild_uneven(dataloader, plan, rank, sample_costs=sample_costs)
