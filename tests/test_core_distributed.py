"""Multi-process behaviour of ``CannikinStrategy`` on CPU/gloo (fork launcher, in-process under pytest).

Each fit runs real ranks; the ranks record exactly which samples they consumed, and the test replays the same samples
in one process to check that the distributed result is the exact mean-gradient update.
"""

from __future__ import annotations

import copy
import time

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_cannikin import CannikinStrategy, EmulatedCluster
from tests.models import IndexedRegression, ManualRegressor, RecordingRegressor, accumulation_windows, read_records


def fit_forked(
    tmp_path, sizes, num_samples=100, accumulate=1, max_steps=-1, max_epochs=1, callbacks=(), module=None, **strategy
):
    torch.manual_seed(0)
    dataset = IndexedRegression(num_samples)
    model = (module or RecordingRegressor)(dataset, batch_size=sizes[0], record_dir=str(tmp_path))
    initial = copy.deepcopy(model.layer.state_dict())
    trainer = pl.Trainer(
        strategy=CannikinStrategy(local_batch_sizes=sizes, start_method="fork", **strategy),
        devices=len(sizes),
        accelerator="cpu",
        max_steps=max_steps,
        max_epochs=max_epochs,
        accumulate_grad_batches=accumulate,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    return dataset, initial, read_records(tmp_path, len(sizes))


def replay(dataset, initial, records, accumulate, lr=0.1, weighting="exact"):
    """One process stepping SGD on the union of what the ranks consumed, window by window.

    ``weighting="exact"`` is the mean over every sample of the window; ``"ddp"`` is plain DDP's mean of per-rank means
    (used to show the test can tell the two apart).
    """
    layer = nn.Linear(dataset.x.shape[1], 1)
    layer.load_state_dict(initial)
    optimizer = torch.optim.SGD(layer.parameters(), lr=lr)
    for start, end in accumulation_windows(records, accumulate):
        optimizer.zero_grad()
        if weighting == "exact":
            index = torch.tensor([i for r in records for s in r["steps"][start:end] for i in s])
            loss = nn.functional.mse_loss(layer(dataset.x[index]), dataset.y[index])
        else:
            losses = []
            for r in records:
                index = torch.tensor([i for s in r["steps"][start:end] for i in s])
                losses.append(nn.functional.mse_loss(layer(dataset.x[index]), dataset.y[index]))
            loss = torch.stack(losses).mean()
        loss.backward()
        optimizer.step()
    return layer.state_dict()


def max_error(records, expected) -> float:
    errors = [
        (torch.tensor(r["params"][name]) - value).abs().max().item()
        for r in records
        for name, value in expected.items()
    ]
    return max(errors)


@pytest.mark.parametrize(
    ("sizes", "accumulate"),
    [([24, 8], 1), ([40, 20, 4], 1), ([24, 8], 2), ([40, 20, 4], 2)],
)
def test_one_step_equals_single_process_on_consumed_samples(tmp_path, sizes, accumulate):
    dataset, initial, records = fit_forked(tmp_path, sizes, num_samples=200, accumulate=accumulate, max_steps=1)
    assert [len(s) for s in records[0]["steps"]] == [sizes[0]] * accumulate
    for rank, record in enumerate(records):
        assert [len(s) for s in record["steps"]] == [sizes[rank]] * accumulate
        # no bucket observer and automatic optimization: DDP's own all-reduce of loss-weighted gradients, no hook
        assert record["hook_calls"] == 0
    exact = replay(dataset, initial, records, accumulate)
    assert max_error(records, exact) < 1e-5
    # the check is sharp: plain DDP's mean of per-rank means lands measurably elsewhere
    assert max_error(records, replay(dataset, initial, records, accumulate, weighting="ddp")) > 1e-3


def test_manual_optimization_is_weighted_exactly(tmp_path):
    # under automatic optimization the weight rides on the loss; under manual optimization the hook applies it
    dataset, initial, records = fit_forked(tmp_path, [40, 20, 4], num_samples=128, max_epochs=1, module=ManualRegressor)
    assert len(records[0]["steps"]) == 2
    assert all(r["hook_calls"] >= 1 for r in records), "the weighted comm hook runs, on CPU/gloo too"
    assert max_error(records, replay(dataset, initial, records, 1)) < 1e-5
    assert max_error(records, replay(dataset, initial, records, 1, weighting="ddp")) > 1e-3


@pytest.mark.parametrize(
    ("sizes", "num_samples", "accumulate"),
    [
        ([24, 8], 103, 1),  # 3 full global batches + 7 split 5:2
        ([24, 8], 65, 2),  # 2 full + 1 left over, folded into the last batch; short final window
        ([40, 20, 4], 150, 2),  # 2 full + 22 split across three ranks
    ],
)
def test_every_sample_once_per_epoch_and_exact_updates(tmp_path, sizes, num_samples, accumulate):
    dataset, initial, records = fit_forked(
        tmp_path, sizes, num_samples=num_samples, accumulate=accumulate, max_epochs=2
    )
    for epoch in (0, 1):
        consumed = [i for r in records for s, e in zip(r["steps"], r["epochs"], strict=True) if e == epoch for i in s]
        assert sorted(consumed) == list(range(num_samples)), f"epoch {epoch} did not see every sample exactly once"
    step_counts = {len(r["steps"]) for r in records}
    assert len(step_counts) == 1, f"ranks ran different numbers of steps: {step_counts}"
    assert all(len(s) >= 1 for r in records for s in r["steps"]), "no rank may run an empty step"
    # the two epochs use different permutations (shuffle is on)
    first = [s for s, e in zip(records[0]["steps"], records[0]["epochs"], strict=True) if e == 0]
    second = [s for s, e in zip(records[0]["steps"], records[0]["epochs"], strict=True) if e == 1]
    assert first != second
    assert max_error(records, replay(dataset, initial, records, accumulate)) < 1e-5


def test_emulated_cluster_sleeps_per_rank_and_batch(tmp_path):
    emulator = EmulatedCluster(per_sample_ms=[1.0, 3.0], fixed_ms=5.0)
    assert emulator.delay_ms(0, 24) == pytest.approx(29.0)
    assert emulator.delay_ms(1, 8) == pytest.approx(29.0)
    started = time.perf_counter()
    fit_forked(tmp_path, [24, 8], num_samples=96, max_steps=3, callbacks=[emulator])
    # three steps of at least 29 ms each on both ranks (lower bound only: the machine may be slower, never faster)
    assert time.perf_counter() - started > 3 * 0.029


def test_total_batch_larger_than_dataset_fails_fast(tmp_path):
    started = time.perf_counter()
    with pytest.raises(Exception, match="larger than the training dataset"):
        fit_forked(tmp_path, [16, 8], num_samples=20)
    assert time.perf_counter() - started < 30


def test_emulator_with_wrong_length_fails_fast(tmp_path):
    started = time.perf_counter()
    with pytest.raises(Exception, match="`per_sample_ms` has 3 entries but the world size is 2"):
        fit_forked(tmp_path, [8, 8], num_samples=64, callbacks=[EmulatedCluster(per_sample_ms=[1.0, 2.0, 3.0])])
    assert time.perf_counter() - started < 30
