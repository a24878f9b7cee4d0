"""Training data pipelines Cannikin cannot split are refused before training, with the fix in the message.

Each case is a real 2-rank fit (fork launcher, gloo): the error must come from every rank before any training batch,
so that no rank waits in a collective for another.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader, IterableDataset

from lightning_cannikin import CannikinStrategy
from tests.models import IndexedRegression, RecordingRegressor, quiet_trainer, read_records


class NoTrainingBatch(Callback):
    """Fails the fit differently if a training batch ever starts: the refusal must come first."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        raise AssertionError("a training batch started before the data pipeline was refused")


class LoaderRegressor(RecordingRegressor):
    """Trains on whatever ``make_loaders(dataset, batch_size)`` returns; a dict batch is read from its ``"a"`` entry."""

    def __init__(self, make_loaders, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.make_loaders = make_loaders

    def train_dataloader(self):
        return self.make_loaders(self.dataset, self.batch_size)

    def training_step(self, batch, batch_idx):
        return super().training_step(batch["a"] if isinstance(batch, dict) else batch, batch_idx)


def _fit(tmp_path, make_loaders, callbacks=(), **trainer_kwargs) -> None:
    torch.manual_seed(0)
    model = LoaderRegressor(make_loaders, IndexedRegression(96), batch_size=8, record_dir=str(tmp_path))
    trainer = quiet_trainer(CannikinStrategy(start_method="fork"), 2, callbacks, max_epochs=1, **trainer_kwargs)
    trainer.fit(model)


class ShuffledStream(IterableDataset):
    """A stream already split by node (Hugging Face's `split_dataset_by_node` leaves `_distributed` set)."""

    _distributed = (0, 2)

    def __iter__(self):
        yield from IndexedRegression(96)


class PrefetchingLoader(DataLoader):
    """A DataLoader subclass: its behaviour would be lost if Cannikin silently rebuilt it as a plain one."""


REFUSED = {
    "dict of loaders": (
        lambda ds, b: {"a": DataLoader(ds, batch_size=b), "b": DataLoader(ds, batch_size=2 * b)},
        "balances one training DataLoader.*StackDataset",
    ),
    "CombinedLoader": (
        lambda ds, b: CombinedLoader([DataLoader(ds, batch_size=b), DataLoader(ds, batch_size=b)], "max_size_cycle"),
        "balances one training DataLoader.*StackDataset",
    ),
    "DataLoader subclass": (
        lambda ds, b: PrefetchingLoader(ds, batch_size=b, shuffle=True),
        r"is a subclass \(PrefetchingLoader\).*plain `torch.utils.data.DataLoader`",
    ),
    "IterableDataset split by node": (
        lambda ds, b: DataLoader(ShuffledStream(), batch_size=b),
        "split across ranks with `split_dataset_by_node`",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_pipeline_cannikin_cannot_split_is_refused_before_training(tmp_path, case):
    make_loaders, message = REFUSED[case]
    with pytest.raises(Exception, match=message):
        _fit(tmp_path, make_loaders, [NoTrainingBatch()])


def test_use_distributed_sampler_false_is_refused_before_training(tmp_path):
    with pytest.raises(Exception, match=r"use_distributed_sampler=False.*must own the training sampler"):
        _fit(tmp_path, lambda ds, b: DataLoader(ds, batch_size=b), [NoTrainingBatch()], use_distributed_sampler=False)


def test_a_single_loader_in_a_dict_trains_on_every_sample_once(tmp_path):
    _fit(tmp_path, lambda ds, b: {"a": DataLoader(ds, batch_size=b, shuffle=True)})
    records = read_records(tmp_path, 2)
    seen = sorted(i for record in records for step in record["steps"] for i in step)
    assert seen == list(range(96))
    assert len(records[0]["steps"]) == len(records[1]["steps"]) == 6
