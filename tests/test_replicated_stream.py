"""A plain ``IterableDataset`` under ``strategy="cannikin"``: every rank reads the whole stream and keeps its slice of
each global batch (three gloo ranks, fork launcher; no LitData needed)."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_cannikin import Cannikin, CannikinStrategy
from tests.models import IndexedRegression, RecordingRegressor, read_records
from tests.test_core_distributed import max_error, replay

NUM_ITEMS, SIZES = 101, (2, 4, 8)


class SeededStream(IterableDataset):
    """``IndexedRegression(101)`` in a seeded shuffled order per epoch, split across the DataLoader's workers as a
    stream must be (each worker its own items); ``by_rank``: an order that differs across ranks (a mistake)."""

    def __init__(self, by_rank: bool = False) -> None:
        self.data = IndexedRegression(NUM_ITEMS)
        self.epoch, self.by_rank = 0, by_rank

    def __iter__(self):
        seed = self.epoch
        if self.by_rank:
            seed += 100 * torch.distributed.get_rank()
        order = torch.randperm(NUM_ITEMS, generator=torch.Generator().manual_seed(seed)).tolist()
        worker = get_worker_info()
        if worker is not None:
            order = order[worker.id :: worker.num_workers]
        for i in order:
            yield self.data[i]


class StreamRegressor(RecordingRegressor):
    def __init__(self, *args, by_rank=False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stream = SeededStream(by_rank)

    def on_train_epoch_start(self) -> None:
        self.stream.epoch = self.current_epoch  # the stream's own epoch (Lightning sets samplers' only)

    def train_dataloader(self):
        return DataLoader(self.stream, batch_size=self.batch_size, num_workers=2)


def fit(record_dir, *, callbacks=(), ckpt_path=None, max_steps=-1, by_rank=False, **trainer_kwargs):
    torch.manual_seed(0)
    dataset = IndexedRegression(NUM_ITEMS)
    model = StreamRegressor(dataset, batch_size=SIZES[0], record_dir=str(record_dir), by_rank=by_rank)
    initial = copy.deepcopy(model.layer.state_dict())
    trainer = pl.Trainer(
        strategy=CannikinStrategy(local_batch_sizes=SIZES, start_method="fork"),
        devices=3,
        accelerator="cpu",
        max_epochs=2,
        max_steps=max_steps,
        callbacks=[Cannikin(), *callbacks],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{"enable_checkpointing": False, **trainer_kwargs},
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return dataset, initial, read_records(record_dir, 3)


def epoch_steps(records, epoch):
    return [[s for s, e in zip(r["steps"], r["epochs"], strict=True) if e == epoch] for r in records]


@pytest.mark.timeout(300)
def test_every_rank_reads_the_stream_and_keeps_its_slice(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    dataset, initial, records = fit(tmp_path / "a")
    for epoch in (0, 1):
        per_rank = epoch_steps(records, epoch)
        assert [len(steps) for steps in per_rank] == [8, 8, 8]  # 101 = 7 x 14 + 3: the same steps on every rank
        seen = sorted(i for steps in per_rank for step in steps for i in step)
        assert seen == list(range(NUM_ITEMS)), f"epoch {epoch}: lost or repeated items"
        for rank, steps in enumerate(per_rank):
            assert [len(s) for s in steps] == [SIZES[rank]] * 7 + [1]
    assert epoch_steps(records, 0)[0] != epoch_steps(records, 1)[0]  # the stream's own epoch order

    exact = replay(dataset, initial, records, accumulate=1)
    assert max_error(records, exact) < 1e-5
    assert max_error(records, replay(dataset, initial, records, accumulate=1, weighting="ddp")) > 1e-3

    # resume mid-epoch from rank zero's loader state: the stream is read past what was trained on
    stop = 5
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=stop, save_top_k=-1)
    fit(tmp_path / "b", callbacks=[saver], max_steps=stop, enable_checkpointing=True)
    (checkpoint,) = sorted((tmp_path / "ckpt").glob(f"*step={stop}*.ckpt"))
    _, _, resumed = fit(tmp_path / "c", ckpt_path=str(checkpoint))
    for rank in range(3):
        assert resumed[rank]["steps"] == records[rank]["steps"][stop:], f"rank {rank} resumed elsewhere"


@pytest.mark.timeout(300)
def test_a_stream_that_differs_across_ranks_stops_every_rank_with_a_clear_error(tmp_path):
    with pytest.raises(Exception, match=r"different first global batches.*same items in the same order"):
        fit(tmp_path, by_rank=True)


def split_by_node(urls):
    return urls


def identity(urls):
    return urls


class NodeSplit(IterableDataset):
    def __init__(self, **attributes) -> None:
        self.__dict__.update(attributes)

    def __iter__(self):
        yield from IndexedRegression(8)


@pytest.mark.parametrize(
    ("attributes", "message"),
    [
        ({"_distributed": object()}, r"split across ranks with `split_dataset_by_node`.*pass the unsplit stream"),
        ({"nodesplitter": lambda urls: urls[1::3]}, r"has a `nodesplitter`.*Build it with `nodesplitter=None`"),
        ({"pipeline": [list, split_by_node]}, r"has a `split_by_node` stage.*Split by node with an identity"),
    ],
)
def test_a_stream_split_by_node_is_refused_before_the_ranks_start(attributes, message):
    # stand-ins (neither library is installed here): Hugging Face's `split_dataset_by_node` leaves `_distributed` set;
    # WebDataset's older ShardList keeps its `nodesplitter` (identity without one), its pipelines the stage
    trainer = pl.Trainer(
        strategy=CannikinStrategy(start_method="fork"), devices=3, accelerator="cpu", max_epochs=1, logger=False
    )
    model = StreamRegressor(IndexedRegression(8), batch_size=2, record_dir="")
    with pytest.raises(ValueError, match=message):
        trainer.fit(model, train_dataloaders=DataLoader(NodeSplit(**attributes), batch_size=2))


def test_a_stream_that_does_not_split_by_node_is_taken():
    from lightning_cannikin.training.data.stream_checks import check_replicable

    for attributes in ({"nodesplitter": identity}, {"nodesplitter": None}, {"pipeline": [list, identity]}, {}):
        assert check_replicable(DataLoader(NodeSplit(**attributes), batch_size=2)) == (False, 0)
