"""What a fit's arguments already show cannot train fails in the launching process, before any rank is started.

No test here starts a process: Lightning's process start (``torch.multiprocessing.start_processes`` for fork and
spawn, ``_call_children_scripts`` for popen) is replaced by one that fails the test, so each error is shown to come
from the launching process, before anything was spawned.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch.utils.data import DataLoader, IterableDataset, Sampler

from lightning_cannikin import Cannikin, CannikinModelParallelStrategy, CannikinStrategy
from lightning_cannikin.training.frontends import launch_checks
from tests.models import IndexedRegression, quiet_trainer


class Spawned(Exception):
    """Raised where Lightning would have started the ranks."""


@pytest.fixture(autouse=True)
def no_spawn(monkeypatch):
    def refuse(*args, **kwargs):
        raise Spawned("a process was started")

    monkeypatch.setattr(torch.multiprocessing, "start_processes", refuse)
    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", refuse)


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Stream(IterableDataset):
    """A stream already split across ranks (WebDataset keeps its `nodesplitter`): every rank reading the whole stream
    and keeping its slice would be wrong."""

    nodesplitter = staticmethod(lambda urls: urls)

    def __iter__(self):
        yield from IndexedRegression(32)


class EveryOther(Sampler):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))

    def __len__(self) -> int:
        return self.n // 2


class LoaderSubclass(DataLoader):
    pass


DATA = IndexedRegression(64)

# case: (loader, callbacks, trainer arguments, the error's message)
REFUSED = {
    "max_batch_size below the initial total": (
        DataLoader(DATA, batch_size=8),
        [Cannikin(max_batch_size=12)],
        {},
        r"`max_batch_size`=12 is smaller than the initial total batch of 16",
    ),
    "lower bounds above the batch": (
        DataLoader(DATA, batch_size=8),
        [Cannikin(local_batch_bounds=(10, None))],
        {},
        r"lower bounds \[10, 10\] need at least 20 samples.*Raise the DataLoader `batch_size` to at least 10, or"
        r" lower the lower bounds",
    ),
    "upper bounds below the batch": (
        DataLoader(DATA, batch_size=8),
        [Cannikin(local_batch_bounds=(2, [5, 2]))],
        {},
        r"upper bounds \[5, 2\] hold at most 7 samples.*Lower the DataLoader `batch_size` to at most 3, or raise the"
        r" upper bounds",
    ),
    "IterableDataset split by node": (DataLoader(Stream(), batch_size=8), [], {}, "has a `nodesplitter`"),
    "custom sampler": (
        DataLoader(DATA, batch_size=8, sampler=EveryOther(64)),
        [],
        {},
        r"custom sampler \(EveryOther\)",
    ),
    "use_distributed_sampler=False": (
        DataLoader(DATA, batch_size=8),
        [],
        {"use_distributed_sampler": False},
        r"use_distributed_sampler=False.*must own the training sampler",
    ),
    "DataLoader subclass": (DataLoader(DATA, batch_size=8), [], {}, None),  # replaced below (a fresh subclass)
    "dataset smaller than one global batch": (
        DataLoader(IndexedRegression(12), batch_size=8),
        [],
        {},
        "larger than the training dataset",
    ),
}
REFUSED["DataLoader subclass"] = (LoaderSubclass(DATA, batch_size=8), [], {}, r"is a subclass \(LoaderSubclass\)")


STRATEGIES = {"ddp": CannikinStrategy, "fsdp": CannikinModelParallelStrategy}


@pytest.mark.parametrize("kind", sorted(STRATEGIES))
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_each_check_fails_in_the_launching_process_with_fork(case, kind):
    loader, callbacks, trainer_kwargs, message = REFUSED[case]
    strategy = STRATEGIES[kind](start_method="fork")
    trainer = quiet_trainer(strategy, 2, callbacks, max_epochs=1, **trainer_kwargs)
    with pytest.raises(ValueError, match=message):
        trainer.fit(Regressor(), train_dataloaders=loader)


@pytest.mark.parametrize("name", ["cannikin", "cannikin_fsdp"])
@pytest.mark.parametrize("case", ["max_batch_size below the initial total", "custom sampler"])
def test_the_popen_launcher_checks_before_it_starts_the_children(case, name):
    loader, callbacks, trainer_kwargs, message = REFUSED[case]
    trainer = quiet_trainer(name, 2, callbacks, max_epochs=1, **trainer_kwargs)
    with pytest.raises(ValueError, match=message):
        trainer.fit(Regressor(), train_dataloaders=loader)


def test_a_fixed_split_is_checked_against_max_batch_size_without_a_loader():
    # the loader comes from the model, which is not built here; the fixed split alone gives the total
    class ModelLoader(Regressor):
        def train_dataloader(self):
            raise AssertionError("the launching process must not build the model's loader")

    strategy = CannikinStrategy(local_batch_sizes=[12, 6], start_method="fork")
    trainer = quiet_trainer(strategy, 2, [Cannikin(max_batch_size=16)], max_epochs=1)
    with pytest.raises(ValueError, match=r"`max_batch_size`=16 is smaller than the initial total batch of 18"):
        trainer.fit(ModelLoader())


@pytest.mark.parametrize("kind", sorted(STRATEGIES))
def test_a_valid_fit_reaches_the_launcher_and_a_resume_leaves_the_plan_to_the_checkpoint(kind):
    strategy = STRATEGIES[kind](start_method="fork")
    trainer = quiet_trainer(strategy, 2, [Cannikin(max_batch_size=16)], max_epochs=1)
    with pytest.raises(Spawned):
        trainer.fit(Regressor(), train_dataloaders=DataLoader(DATA, batch_size=8))
    # a checkpoint's plan replaces the first plan: the ranks check it, not the launching process
    trainer = quiet_trainer(CannikinStrategy(start_method="fork"), 2, [Cannikin(max_batch_size=12)], max_epochs=1)
    with pytest.raises(Spawned):
        trainer.fit(Regressor(), train_dataloaders=DataLoader(DATA, batch_size=8), ckpt_path="any.ckpt")


def test_one_device_gets_a_note_that_there_is_nothing_to_balance(monkeypatch):
    notes = []
    monkeypatch.setattr(launch_checks, "rank_zero_info", notes.append)
    trainer = quiet_trainer("cannikin", 1, max_epochs=1)
    with pytest.raises(ValueError, match="nodesplitter"):  # stops the fit right after the note, before training
        trainer.fit(Regressor(), train_dataloaders=DataLoader(Stream(), batch_size=8))
    assert notes == [launch_checks.SINGLE_DEVICE_NOTE]
    assert "no split to balance" in notes[0]
    notes.clear()
    trainer = quiet_trainer(CannikinStrategy(start_method="fork"), 2, max_epochs=1)
    with pytest.raises(ValueError, match="nodesplitter"):
        trainer.fit(Regressor(), train_dataloaders=DataLoader(Stream(), batch_size=8))
    assert notes == []
