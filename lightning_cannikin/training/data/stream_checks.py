"""Which streamed training loaders Cannikin can split exactly, told before any process is launched.

LitData's ``StreamingDataset`` is split into exact uneven shares (:mod:`lightning_cannikin.training.data.streaming`),
any other ``IterableDataset`` is read whole by every rank (:mod:`lightning_cannikin.training.data.replicated_stream`);
what neither can split exactly is refused here with the fix. Nothing here imports LitData unless a data set from it is
given.
"""

from __future__ import annotations

from torch.utils.data import DataLoader

__all__ = ["check_replicable", "check_streaming", "is_litdata", "is_litdata_loader"]


def is_litdata(dataset: object) -> bool:
    """Whether ``dataset`` is one of LitData's data sets (read off its class's module: LitData is not imported)."""
    return any(cls.__module__.split(".")[0] == "litdata" for cls in type(dataset).__mro__)


def is_litdata_loader(dataloader: object) -> bool:
    """Whether ``dataloader`` is LitData's ``StreamingDataLoader`` (or another loader class of LitData's)."""
    return type(dataloader).__module__.split(".")[0] == "litdata"


def check_streaming(dataloader: DataLoader) -> tuple[bool, int]:
    """Refuse a LitData training loader Cannikin cannot split exactly, with the fix; returns ``(shuffle, seed)``.

    Cheap (no data is read), so the launching process runs it before it spawns.

    Raises:
        ValueError: for combined or parallel streaming data sets, a window shuffle, or direct-I/O windows.

    """
    from litdata import StreamingDataset

    dataset = dataloader.dataset
    if not isinstance(dataset, StreamingDataset):
        # CombinedStreamingDataset and ParallelStreamingDataset draw from several data sets at rates of their own
        raise ValueError(
            f"Cannikin splits one LitData `StreamingDataset` unevenly across ranks; got a {type(dataset).__name__}."
            " Combined and parallel streaming data sets mix several streams at their own rates, which cannot be cut"
            " into exact per-rank shares. Optimize the sources into one data set (`litdata.optimize` or"
            " `litdata.merge_datasets`), or use `strategy='ddp'`."
        )
    posix = getattr(dataset, "posix_fast", None)
    if dataset.shuffle and posix is not None and posix.window_shuffle:
        raise ValueError(
            "This `StreamingDataset` would shuffle with LitData's `WindowShuffle` (POSIX-fast reads on a parallel file"
            " system, or `LITDATA_POSIX_FAST=1`), whose sliding window assumes every rank reads an equal stripe."
            " Cannikin shuffles the uneven shares itself: set `LITDATA_POSIX_FAST=0` before creating the data set, pass"
            " `shuffle=False`, or use `strategy='ddp'`."
        )
    if getattr(dataset, "window_direct_io", False):
        raise ValueError(
            "A `StreamingDataset` with `window_direct_io=True` reads whole windows only, but Cannikin reads each rank's"
            " share item by item. Create the data set with `window_direct_io=False`, or use `strategy='ddp'`."
        )
    return bool(dataset.shuffle), int(dataset.seed)


def check_replicable(dataloader: DataLoader) -> tuple[bool, int]:
    """Refuse an ``IterableDataset`` loader whose stream is already split across ranks, with the fix; returns
    ``(shuffle, seed)`` (the stream shuffles itself: ``(False, 0)``). Cheap: runs before the ranks start.

    Raises:
        ValueError: for a stream split by node (Hugging Face ``split_dataset_by_node``, a ``nodesplitter``).

    """
    dataset = dataloader.dataset
    name = type(dataset).__name__
    if getattr(dataset, "_distributed", None) is not None:  # Hugging Face `datasets.distributed.split_dataset_by_node`
        raise ValueError(
            f"The training stream ({name}) was split across ranks with `split_dataset_by_node`. Cannikin gives every"
            " rank its uneven slice of each global batch itself: pass the unsplit stream, or use `strategy='ddp'`."
        )
    # WebDataset and the like: a `nodesplitter` kept as an attribute (an identity one splits nothing) or a stage
    splitter = getattr(dataset, "nodesplitter", None)
    if splitter is not None and _name(splitter) != "identity":
        raise ValueError(
            f"The training stream ({name}) has a `nodesplitter`: it splits its shards across ranks evenly, and how"
            " many samples each shard holds is unknown. Build it with `nodesplitter=None` (Cannikin gives every rank"
            " its uneven slice of each global batch), convert it to LitData (`litdata.optimize`), or use"
            " `strategy='ddp'`."
        )
    if any(_name(stage) == "split_by_node" for stage in getattr(dataset, "pipeline", None) or []):
        raise ValueError(
            f"The training stream ({name}) has a `split_by_node` stage: it splits its shards across ranks evenly, and"
            " how many samples each shard holds is unknown. Split by node with an identity instead (WebDataset:"
            " `nodesplitter=lambda urls: urls`; Cannikin gives every rank its uneven slice of each global batch),"
            " convert it to LitData (`litdata.optimize`), or use `strategy='ddp'`."
        )
    return False, 0


def _name(function: object) -> str:
    """A function's name, or a ``functools.partial``'s function's."""
    return str(getattr(function, "__name__", None) or getattr(getattr(function, "func", None), "__name__", ""))
