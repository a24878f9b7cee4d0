"""LitData's ``StreamingDataset`` under ``strategy="cannikin"``: three gloo ranks (fork launcher) with uneven shares.

Each rank records the sample ids it trained on, step by step; the checks are on those ids (every sample once per
epoch, the same number of steps on every rank, a fresh order each epoch) and on the weights (the exact mean-gradient
update of one process over the same samples). Skipped without LitData (``pip install "lightning-cannikin[litdata]"``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

litdata = pytest.importorskip("litdata")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from litdata import StreamingDataLoader, StreamingDataset  # noqa: E402
from litdata.streaming.writer import BinaryWriter  # noqa: E402

from lightning_cannikin import Cannikin, CannikinStrategy, EmulatedCluster  # noqa: E402
from lightning_cannikin.core.plan import Plan  # noqa: E402
from tests.models import IndexedRegression, RecordingRegressor, read_records  # noqa: E402
from tests.test_core_distributed import max_error, replay  # noqa: E402

NUM_ITEMS, CHUNK_SIZE, SIZES = 101, 8, (2, 4, 8)  # plan 1:2:4; 101 = 7 x 14 + 3, a remainder of one item per rank
MID_PLAN = (8, 4, 2)  # put in force mid-epoch 1, from the first batch no rank has drawn: the runs of the stream move
SECOND_PLAN = (3, 3, 3)  # epoch 2: 101 = 11 x 9 + 2, fewer than the ranks, folded into the last full step


@pytest.fixture(scope="module")
def stream_dir(tmp_path_factory) -> Path:
    """``IndexedRegression(101)`` written as a LitData data set in chunks of 8 items: ``(x, y, index)`` each."""
    directory = tmp_path_factory.mktemp("stream")
    dataset = IndexedRegression(NUM_ITEMS)
    writer = BinaryWriter(str(directory), chunk_size=CHUNK_SIZE)
    for i in range(NUM_ITEMS):
        writer[i] = dataset[i]
    writer.done()
    writer.merge()
    return directory


class StreamingRegressor(RecordingRegressor):
    """The recording regressor, trained from the user's own ``StreamingDataset`` and ``StreamingDataLoader``."""

    def __init__(self, *args, stream_dir: str, workers=2, persistent=True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stream_dir, self.workers, self.persistent = stream_dir, workers, persistent

    def train_dataloader(self):
        workers = self.workers(self.global_rank) if callable(self.workers) else self.workers
        dataset = StreamingDataset(self.stream_dir, shuffle=True, seed=7)
        return StreamingDataLoader(
            dataset, batch_size=self.batch_size, num_workers=workers, persistent_workers=self.persistent and workers > 0
        )


class PlanAtEpochEnd(Callback):
    """Puts another plan in force from the next epoch (on ``ranks`` only: a plan the ranks disagree on)."""

    def __init__(self, sizes, ranks=None) -> None:
        self.sizes, self.ranks = sizes, ranks

    def on_train_epoch_end(self, trainer, pl_module):
        if self.ranks is None or trainer.global_rank in self.ranks:
            trainer.strategy.set_plan(Plan(self.sizes), from_batch=0)


class PlanMidEpoch(Callback):
    """After epoch 1's first step, puts ``MID_PLAN`` in force from the first global batch no rank has drawn yet (the
    loader's workers and Lightning draw ahead), as the balancing engine does; rank zero writes that batch's index."""

    def __init__(self, record_dir) -> None:
        self.record_dir = Path(record_dir)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch != 0 or batch_idx != 0:
            return
        every = [None] * trainer.world_size
        torch.distributed.all_gather_object(every, trainer.strategy.engine.data.batches_yielded)
        trainer.strategy.set_plan(Plan(MID_PLAN), from_batch=max(every))
        if trainer.global_rank == 0:
            (self.record_dir / "changed_at.json").write_text(json.dumps(max(every)))


def fit(record_dir, stream_dir, *, callbacks=(), ckpt_path=None, max_steps=-1, workers=2, **trainer_kwargs):
    torch.manual_seed(0)
    dataset = IndexedRegression(NUM_ITEMS)
    model = StreamingRegressor(
        dataset, batch_size=SIZES[0], record_dir=str(record_dir), stream_dir=str(stream_dir), workers=workers
    )
    initial = copy.deepcopy(model.layer.state_dict())
    trainer = pl.Trainer(
        strategy=CannikinStrategy(local_batch_sizes=SIZES, start_method="fork"),
        devices=3,
        accelerator="cpu",
        max_epochs=2,
        max_steps=max_steps,
        # Cannikin's callback fits Lightning's epoch length to the plan's (the split is fixed: it decides nothing)
        callbacks=[Cannikin(), PlanAtEpochEnd(SECOND_PLAN), *callbacks],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{"enable_checkpointing": False, **trainer_kwargs},
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return dataset, initial, read_records(record_dir, 3)


def epoch_steps(records, epoch):
    """Per rank, the id lists of its steps in ``epoch``."""
    return [[s for s, e in zip(r["steps"], r["epochs"], strict=True) if e == epoch] for r in records]


@pytest.mark.timeout(300)
def test_uneven_shares_every_item_once_exact_gradient_and_resume(tmp_path, stream_dir):
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    dataset, initial, records = fit(tmp_path / "a", stream_dir, callbacks=[PlanMidEpoch(tmp_path / "a")])
    changed = json.loads((tmp_path / "a" / "changed_at.json").read_text())
    assert 1 <= changed < 7, f"the mid-epoch plan came from batch {changed}, not within the epoch's 8"

    steps_per_epoch = []
    for epoch in (0, 1):
        per_rank = epoch_steps(records, epoch)
        # the ranks end the epoch on the same step
        assert len({len(steps) for steps in per_rank}) == 1, [len(steps) for steps in per_rank]
        steps_per_epoch.append(len(per_rank[0]))
        # every id exactly once, gathered across the ranks (epoch 1 with its plan changed mid-epoch)
        seen = sorted(i for steps in per_rank for step in steps for i in step)
        assert seen == list(range(NUM_ITEMS)), f"epoch {epoch}: lost or repeated items"
    # epoch 1: the first plan up to the change, then the new one (101 - 14 * changed items left); epoch 2: one plan
    first, second = epoch_steps(records, 0), epoch_steps(records, 1)
    for rank in range(3):
        assert [len(s) for s in first[rank][:changed]] == [SIZES[rank]] * changed
        assert [len(s) for s in first[rank][changed:-1]] == [MID_PLAN[rank]] * (len(first[rank]) - changed - 1)
        assert [len(s) for s in second[rank][:-1]] == [SECOND_PLAN[rank]] * (len(second[rank]) - 1)
    assert steps_per_epoch == [8, 11]  # the new plan keeps the total: 101 = 7 x 14 + 3 still
    assert [len(s[-1]) for s in first] == [1, 1, 1]  # the remainder: one item per rank
    assert [len(s[-1]) for s in second] == [4, 4, 3]  # 9 + 2 left, split 1:1:1
    # a fresh order in epoch 2 (the same items would be a coincidence of the shuffle: its seed is fixed)
    assert first[2][:3] != second[2][:3]

    # each step's update is one process's on the concatenated batch, the short final step included
    exact = replay(dataset, initial, records, accumulate=1)
    assert max_error(records, exact) < 1e-5
    assert max_error(records, replay(dataset, initial, records, accumulate=1, weighting="ddp")) > 1e-3

    # stop right after the step where the plan changed and check that step's update on its own; then resume through
    # Lightning's checkpoint there (only rank zero's loader state is saved), mid-epoch, on the new plan: the same steps
    stop = changed + 1
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=stop, save_top_k=-1)
    callbacks = [saver, PlanMidEpoch(tmp_path / "b")]
    _, _, first_part = fit(tmp_path / "b", stream_dir, callbacks=callbacks, max_steps=stop, enable_checkpointing=True)
    assert max_error(first_part, replay(dataset, initial, first_part, accumulate=1)) < 1e-5
    (checkpoint,) = sorted((tmp_path / "ckpt").glob(f"*step={stop}*.ckpt"))
    _, _, resumed = fit(tmp_path / "c", stream_dir, callbacks=[PlanMidEpoch(tmp_path / "c")], ckpt_path=str(checkpoint))
    for rank in range(3):
        assert first_part[rank]["steps"] == records[rank]["steps"][:stop]
        assert resumed[rank]["steps"] == records[rank]["steps"][stop:], f"rank {rank} resumed elsewhere"
        for name, value in records[rank]["params"].items():
            error = (torch.tensor(resumed[rank]["params"][name]) - torch.tensor(value)).abs().max().item()
            assert error < 1e-6, f"rank {rank}: {name} differs by {error} after resuming at step {stop}"


@pytest.mark.timeout(300)
def test_plans_the_balancing_engine_picks_keep_every_item_once(tmp_path, stream_dir):
    # the engine's own re-plans (mid-epoch too, its probes included) on an emulated 1x:2x:4x cluster, whatever they pick
    torch.manual_seed(0)
    model = StreamingRegressor(
        IndexedRegression(NUM_ITEMS), batch_size=2, record_dir=str(tmp_path), stream_dir=str(stream_dir)
    )
    trainer = pl.Trainer(
        strategy=CannikinStrategy(start_method="fork"),
        devices=3,
        accelerator="cpu",
        max_epochs=4,
        callbacks=[EmulatedCluster([1.0, 2.0, 4.0], fixed_ms=2.0)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    records = read_records(tmp_path, 3)
    for epoch in range(4):
        per_rank = epoch_steps(records, epoch)
        assert len({len(steps) for steps in per_rank}) == 1, f"epoch {epoch}: {[len(s) for s in per_rank]}"
        seen = sorted(i for steps in per_rank for step in steps for i in step)
        assert seen == list(range(NUM_ITEMS)), f"epoch {epoch}: lost or repeated items"
        if epoch == 0:  # the engine's probe after its warm-up steps alternates two splits within the first epoch
            splits = {tuple(len(steps[k]) for steps in per_rank) for k in range(len(per_rank[0]) - 1)}
            assert len(splits) > 1, f"no mid-epoch plan in epoch 1 to check (splits {splits})"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("plan", r"disagree.*plan: rank 0=\[\[0, \[3, 3, 3\]\]\], rank 1=\[\[0, \[2, 2, 2\]\]\]"),
        ("workers", r"disagree.*num_workers"),
    ],
)
def test_ranks_that_disagree_stop_with_a_clear_error(tmp_path, stream_dir, case, match):
    if case == "plan":  # rank 1 alone puts another plan in force for epoch 2
        kwargs = {"callbacks": [PlanAtEpochEnd((2, 2, 2), ranks={1})]}
    else:  # rank 1 builds its DataLoader with fewer workers
        kwargs = {"workers": lambda rank: 1 if rank == 1 else 2}
    with pytest.raises(Exception, match=match):
        fit(tmp_path, stream_dir, **kwargs)


def _dataset(stream_dir, **kwargs):
    return StreamingDataset(str(stream_dir), shuffle=True, **kwargs)


def _direct_io(dataset):
    dataset.window_direct_io = True
    return dataset


REFUSED = {
    "combined": (
        lambda d: StreamingDataLoader(litdata.CombinedStreamingDataset([_dataset(d), _dataset(d)]), batch_size=2),
        r"got a CombinedStreamingDataset.*Optimize the sources into one data set",
    ),
    "parallel": (
        lambda d: StreamingDataLoader(litdata.ParallelStreamingDataset([_dataset(d), _dataset(d)]), batch_size=2),
        r"got a ParallelStreamingDataset.*Optimize the sources into one data set",
    ),
    "window shuffle": (
        lambda d: StreamingDataLoader(_dataset(d), batch_size=2),  # built under LITDATA_POSIX_FAST=1
        r"`WindowShuffle`.*set `LITDATA_POSIX_FAST=0`.*pass `shuffle=False`",
    ),
    "direct-I/O windows": (
        # LitData accepts `window_direct_io=True` on NFS only; the flag is set after building on this disk
        lambda d: StreamingDataLoader(_direct_io(_dataset(d)), batch_size=2),
        r"`window_direct_io=True`.*Create the data set with `window_direct_io=False`",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_cannot_be_split_exactly_is_refused_before_the_ranks_start(stream_dir, monkeypatch, case):
    build, message = REFUSED[case]
    monkeypatch.setenv("LITDATA_POSIX_FAST", "1" if case == "window shuffle" else "0")
    model = StreamingRegressor(IndexedRegression(8), batch_size=2, record_dir="", stream_dir=str(stream_dir))
    trainer = pl.Trainer(
        strategy=CannikinStrategy(start_method="fork"), devices=3, accelerator="cpu", max_epochs=1, logger=False
    )
    # a ValueError here, not the fork launcher's ProcessRaisedException: raised before any rank started
    with pytest.raises(ValueError, match=message):
        trainer.fit(model, train_dataloaders=build(stream_dir))


def test_a_plan_mid_epoch_deals_the_items_left_and_never_moves_a_drawn_batch():
    from lightning_cannikin.training.data.streaming import StreamShareSampler

    chunks = [8] * 12 + [5]
    samplers = [StreamShareSampler(chunks, r, Plan(SIZES), num_workers=2, shuffle=True, seed=7) for r in range(3)]
    iterators = [iter(sampler) for sampler in samplers]
    drawn = [[next(iterator) for _ in range(3)] for iterator in iterators]
    for sampler in samplers:
        with pytest.raises(RuntimeError, match="comes too late: this rank has drawn 3 batches"):
            sampler.set_plan(Plan(MID_PLAN), from_batch=2)
        sampler.set_plan(Plan(MID_PLAN), from_batch=3)
    rest = [list(iterator) for iterator in iterators]
    assert [len(step) for step in rest[0][:-1]] == [MID_PLAN[0]] * (len(rest[0]) - 1)
    assert len({len(r) for r in rest}) == 1
    seen = sorted(i for per_rank in drawn + rest for step in per_rank for i in step)
    assert seen == list(range(sum(chunks)))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"stream": {"items": NUM_ITEMS, "seed": 7, "shuffle": True, "num_workers": 2}}, "Resume with the same"),
        ({"schedule": [[0, Plan((2, 4)).to_dict()]]}, r"ran on \[2\] ranks, this run has 3"),
    ],
)
def test_a_resume_that_cannot_continue_the_shares_is_refused(stream_dir, change, message):
    from lightning_cannikin.training.data.loader import kept_arguments
    from lightning_cannikin.training.data.streaming import rebuild_streaming

    user_loader = StreamingDataLoader(_dataset(stream_dir), batch_size=2)  # seed 42, no workers
    loader = rebuild_streaming(user_loader, Plan(SIZES), 0, kept_arguments(user_loader))
    state = {**loader.state_dict(), "batches_consumed": 3}
    loader.load_state_dict({**state, **change})
    with pytest.raises(ValueError, match=message):
        next(iter(loader))
    loader.load_state_dict(state)  # the same settings: it continues at global batch 3
    next(iter(loader))
    assert loader.pending_steps[0] == (3, SIZES)
