"""Variable-length data through ``CannikinStrategy``: the declared loss normalisation's exact weights, the cost-aware
sampler (every sample once, equal step counts, exact resume), the emulator's per-token costs and the mismatch warning.

The multi-process fits run real ranks (CPU, gloo, forked); each records the samples it consumed and its final
parameters, and one process replays the same windows to check that the update is the exact one of the declared loss.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_cannikin import CannikinStrategy, EmulatedCluster
from lightning_cannikin.core.loss_normalisation import loss_weights
from lightning_cannikin.core.plan import Plan
from lightning_cannikin.core.step_record import StepRecord
from lightning_cannikin.training.data.cost_aware_sampler import (
    CostAwareBatchSampler,
    CostTimeFit,
    resolve_costs,
    with_time_models,
)
from lightning_cannikin.training.data.loader import rebuild_uneven
from lightning_cannikin.training.engine import BalancingEngine
from lightning_cannikin.training.frontends.lightning_hooks import BalancingCallback
from lightning_cannikin.training.measurement.grad_stats import FOLD_DELAY
from lightning_cannikin.training.measurement.loss_weights import step_weights
from tests.models import RecordingRegressor, accumulation_windows, quiet_trainer
from tests.test_adaptive import fit_recording_noise, squared_gradient_norm

MAX_LENGTH, DIM = 8, 3


class VarLenRegression(Dataset):
    """``(x, y, mask, index)``: sequences of 1..8 tokens (an 8x spread), padded, with a per-token linear target."""

    def __init__(self, num_samples: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(1, MAX_LENGTH + 1, (num_samples,), generator=generator).tolist()
        self.mask = (torch.arange(MAX_LENGTH)[None, :] < torch.tensor(self.lengths)[:, None]).float()
        self.x = torch.randn(num_samples, MAX_LENGTH, DIM, generator=generator) * self.mask[..., None]
        self.y = self.x @ torch.randn(DIM, 1, generator=generator) + 0.3 * torch.randn(
            num_samples, MAX_LENGTH, 1, generator=generator
        )

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index], self.mask[index], index


def varlen_loss(layer: nn.Module, x, y, mask, normalisation: str) -> torch.Tensor:
    """The loss a user writes: a mean or a sum over the batch's samples of each one's token mean, or the token mean."""
    errors = ((layer(x) - y) ** 2).squeeze(-1) * mask
    if normalisation == "count_mean":
        return errors.sum() / mask.sum()
    per_sample = errors.sum(1) / mask.sum(1)
    return per_sample.sum() if normalisation == "sample_sum" else per_sample.mean()


class VarLenRegressor(RecordingRegressor):
    """Records the indices each rank trained on, its final parameters and whether the mismatch warning fired."""

    def __init__(self, dataset, batch_size, record_dir, loss="sample_mean", lr=0.05) -> None:
        super().__init__(dataset, batch_size, record_dir, lr=lr)
        self.layer = nn.Linear(DIM, 1)  # per token
        self.loss = loss

    def training_step(self, batch, batch_idx):
        x, y, mask, index = batch
        self.steps.append(index.tolist())
        self.epochs.append(self.current_epoch)
        return varlen_loss(self.layer, x, y, mask, self.loss)

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True)

    def on_train_end(self) -> None:
        super().on_train_end()
        path = Path(self.record_dir, f"rank{self.global_rank}.json")
        record = json.loads(path.read_text())
        engine = self.trainer.strategy.engine
        balancing = [cb for cb in self.trainer.callbacks if isinstance(cb, BalancingCallback)]
        plan = engine.data.plan
        record.update(
            warned=engine._losses.warned,
            time_models=None if plan is None or plan.time_models is None else list(plan.time_models),
            mean_cost=getattr(engine.data.sampler, "mean_cost", None),
            slopes=[m.slope for m in balancing[0].speed_model.models()] if balancing and self.global_rank == 0 else [],
        )
        path.write_text(json.dumps(record))


def fit(
    tmp_path, normalisation, loss=None, devices=2, num_samples=40, batch_size=4, callbacks=(), trainer=None, **strategy
):
    torch.manual_seed(0)
    dataset = VarLenRegression(num_samples)
    model = VarLenRegressor(dataset, batch_size=batch_size, record_dir=str(tmp_path), loss=loss or normalisation)
    initial = copy.deepcopy(model.layer.state_dict())
    strategy = CannikinStrategy(loss_normalisation=normalisation, start_method="fork", **strategy)
    quiet_trainer(strategy, devices, callbacks, **(trainer or {})).fit(model)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(devices)]
    return dataset, initial, records


def replay(dataset, initial, records, accumulate, normalisation, lr=0.05, per_rank=False):
    """One process stepping SGD on the union of what the ranks consumed, one accumulation window at a time, with the
    declared loss over the whole window (``per_rank``: the mean of each rank's own loss, as a sample-count weighting
    of a token mean would do, to show the check is sharp)."""
    layer = nn.Linear(DIM, 1)
    layer.load_state_dict(initial)
    optimizer = torch.optim.SGD(layer.parameters(), lr=lr)
    for start, end in accumulation_windows(records, accumulate):
        optimizer.zero_grad()
        groups = [[i for s in r["steps"][start:end] for i in s] for r in records]
        if per_rank:
            losses = [varlen_loss(layer, *_tensors(dataset, g), normalisation) for g in groups]
            loss = torch.stack(losses).mean()
        else:
            loss = varlen_loss(layer, *_tensors(dataset, [i for g in groups for i in g]), normalisation)
        loss.backward()
        optimizer.step()
    return layer.state_dict()


def _tensors(dataset, index):
    index = torch.tensor(index)
    return dataset.x[index], dataset.y[index], dataset.mask[index]


def max_error(records, expected) -> float:
    return max(
        (torch.tensor(r["params"][name]) - value).abs().max().item()
        for r in records
        for name, value in expected.items()
    )


def test_sample_sum_on_an_uneven_split_with_accumulation_is_the_one_process_gradient(tmp_path):
    options = {"max_steps": 2, "accumulate_grad_batches": 2}
    dataset, initial, records = fit(tmp_path, "sample_sum", local_batch_sizes=[6, 2], trainer=options)
    assert [len(s) for s in records[0]["steps"]] == [6] * 4 and [len(s) for s in records[1]["steps"]] == [2] * 4
    assert max_error(records, replay(dataset, initial, records, 2, "sample_sum")) < 1e-6
    # today's sample-mean weights on a summed loss land elsewhere
    assert max_error(records, replay(dataset, initial, records, 2, "sample_sum", per_rank=True)) > 1e-3


def test_token_mean_with_known_lengths_is_exact_and_splits_by_cost(tmp_path):
    # `sample_costs` given: the sampler knows every sample's tokens (no collective), and splits each global batch by
    # them with the fixed split's 3:1 standing for the speeds; 40 samples in batches of 8 give windows of 2, 2 and 1
    options = {"max_epochs": 1, "accumulate_grad_batches": 2}
    dataset, initial, records = fit(
        tmp_path, "count_mean", local_batch_sizes=[6, 2], sample_costs="lengths", trainer=options
    )
    consumed = sorted(i for r in records for s in r["steps"] for i in s)
    assert consumed == list(range(40)), "every sample once"
    assert len(records[0]["steps"]) == len(records[1]["steps"]) == 5
    tokens = [[sum(dataset.lengths[i] for i in s) for s in r["steps"]] for r in records]
    # the fast rank holds about three quarters of each batch's tokens, whatever its sample count
    for fast, slow in zip(*tokens, strict=True):
        assert 0.6 < fast / (fast + slow) < 0.9, tokens
    assert any(len(s) != 6 for s in records[0]["steps"]), "the split follows the costs, not the counts"
    assert max_error(records, replay(dataset, initial, records, 2, "count_mean")) < 1e-6
    assert max_error(records, replay(dataset, initial, records, 2, "count_mean", per_rank=True)) > 1e-3


def test_token_mean_from_the_batch_is_exact_with_one_gather_per_step(tmp_path):
    options = {"max_steps": 3}
    units = {"batch_units": lambda batch: batch[2].sum()}
    dataset, initial, records = fit(tmp_path, "count_mean", local_batch_sizes=[5, 3], trainer=options, **units)
    assert max_error(records, replay(dataset, initial, records, 1, "count_mean")) < 1e-6
    assert max_error(records, replay(dataset, initial, records, 1, "count_mean", per_rank=True)) > 1e-3


def test_cost_aware_balancing_times_the_tokens_and_warns_about_a_summed_loss(tmp_path):
    # per-token costs 1:3 charged by the emulator; the loss is a sum over samples declared as the default mean
    per_token_ms = [1.0, 3.0]  # well above what a busy machine adds to a sleep
    emulator = EmulatedCluster(per_token_ms, fixed_ms=5.0, batch_cost=lambda batch: batch[2].sum().item())
    options = {"max_epochs": 3}
    _, _, records = fit(
        tmp_path,
        "sample_mean",
        loss="sample_sum",
        num_samples=640,
        batch_size=16,
        callbacks=[emulator],
        trainer=options,
        sample_costs="lengths",
    )
    for epoch in range(3):
        consumed = sorted(
            i for r in records for s, e in zip(r["steps"], r["epochs"], strict=True) if e == epoch for i in s
        )
        assert consumed == list(range(640)), f"epoch {epoch}: every sample once"
    assert len(records[0]["steps"]) == len(records[1]["steps"])
    assert records[0]["warned"], "a loss that grows with the local batch, declared a mean, is warned about"
    # the engine timed each rank over its tokens: its slopes per sample of average cost are the emulated per-token ones
    mean_cost = records[0]["mean_cost"]
    for slope, truth in zip(records[0]["slopes"], per_token_ms, strict=True):
        assert slope * 1000 / mean_cost == pytest.approx(truth, rel=0.25), records[0]["slopes"]
    # every rank splits by the same broadcast time models: each rank's own fit over its exact tokens
    models = records[0]["time_models"]
    assert models is not None and models == records[1]["time_models"]
    for (_, per_token), truth in zip(models, per_token_ms, strict=True):
        assert per_token * 1000 == pytest.approx(truth, rel=0.15), models


def _cost_loader(dataset, plan, rank):
    return rebuild_uneven(DataLoader(dataset, batch_size=4, shuffle=True), plan, rank, sample_costs="lengths")


def test_cost_aware_sampler_every_sample_once_equal_steps_and_exact_resume():
    dataset = VarLenRegression(203)
    plan = Plan((20, 10, 5))
    measured = Plan((20, 10, 5), time_models=((0.001, 0.002), (0.002, 0.004), (0.001, 0.008)))
    loaders = [_cost_loader(dataset, plan, rank) for rank in range(3)]
    batches = []
    for loader in loaders:
        sampler = loader.uneven_sampler
        assert isinstance(sampler, CostAwareBatchSampler)
        sampler.set_plan(measured, from_batch=2)  # a plan decided mid-epoch, with every rank's time model
        batches.append([batch[3].tolist() for batch in loader])
    assert len({len(b) for b in batches}) == 1, "equal step counts"
    assert sorted(i for b in batches for s in b for i in s) == list(range(203)), "every sample once"
    assert all(len(s) >= 1 for b in batches for s in b)
    # from the measured plan on, the predicted times are equal within a sample: rank 2 (4x slower) holds fewer tokens
    sampler = loaders[0].uneven_sampler
    for index in range(2, len(batches[0]) - 1):
        units = np.array(sampler.units_at(index))
        times = np.array([0.001, 0.002, 0.001]) + np.array([0.002, 0.004, 0.008]) * units / sampler.mean_cost
        assert times.max() - times.min() <= 0.008 * MAX_LENGTH / sampler.mean_cost + 1e-12, times
        assert units[0] > units[1] > units[2]
    # resume each rank after 4 batches from the loader's checkpoint: the same batches follow
    for rank in range(3):
        first = _cost_loader(dataset, plan, rank)
        first.uneven_sampler.set_plan(measured, from_batch=2)
        iterator = iter(first)
        head = [next(iterator)[3].tolist() for _ in range(4)]
        state = json.loads(json.dumps(first.state_dict()))  # through a checkpoint's serialisation
        resumed = _cost_loader(dataset, plan, rank)
        resumed.load_state_dict(state)
        assert head + [batch[3].tolist() for batch in resumed] == batches[rank]


@pytest.mark.parametrize("normalisation", ["sample_mean", "sample_sum", "count_mean"])
def test_step_weights_are_the_core_weights(normalisation):
    window, units = [(5, 2, 1), (4, 3, 2)], [(50.0, 9.0, 30.0), (12.0, 33.0, 7.0)]
    reference = loss_weights(normalisation, np.array(window).T, np.array(units).T, allreduce="sum")
    for rank in range(3):
        for micro in range(2):
            weights = step_weights(normalisation, window, units if normalisation == "count_mean" else None, rank, micro)
            assert weights.rank * weights.micro == pytest.approx(reference[rank, micro], rel=1e-12)
            assert weights.rank == pytest.approx(reference[rank].sum(), rel=1e-12)


def test_cost_time_fit_recovers_a_line_over_exact_costs_despite_a_hiccup():
    fit = CostTimeFit()
    rng = np.random.default_rng(0)
    records = []
    for step in range(40):
        cost = float(rng.integers(5, 60))  # a rank's tokens vary step to step under a cost-aware split
        fit.load(step, cost)
        seconds = 0.02 + 0.003 * cost + (0.5 if step == 17 else float(rng.normal(0.0, 0.0005)))
        records.append(StepRecord(step, 0, max(1, round(cost / 14.5)), seconds, seconds))
    assert fit.add(records[:3]) is None, "fewer than four steps"
    fixed, per_cost = fit.add(records[3:])
    assert fixed == pytest.approx(0.02, abs=0.002) and per_cost == pytest.approx(0.003, rel=0.03)
    assert with_time_models(None, [(fixed, per_cost)]) is None


def test_weights_and_bad_input():
    from tests.test_engine import TwoRanksSecond

    def engine(normalisation: str = "sample_mean") -> BalancingEngine:
        engine = BalancingEngine()
        engine.bind(TwoRanksSecond(), normalisation=normalisation)
        return engine

    summed = engine("sample_sum")
    summed.begin_step(0, batch=(0, (6, 2)))
    hook, _ = summed.reductions.comm_hook()
    assert hook.weight == 1.0 and hook.unit_scale == 2.0 and hook.global_scale == 8.0
    mean = engine()
    mean.begin_step(0, batch=(0, (6, 2)))
    hook, _ = mean.reductions.comm_hook()
    assert hook.weight == pytest.approx(0.25) and hook.unit_scale == 1.0
    with pytest.raises(ValueError, match="loss_normalisation"):
        CannikinStrategy(loss_normalisation="token_mean")
    with pytest.raises(ValueError, match="sample_costs"):
        CannikinStrategy(loss_normalisation="count_mean")
    with pytest.raises(ValueError, match="needs every micro-batch's count"):
        engine("count_mean").begin_step(0, batch=(0, (6, 2)))
    dataset = VarLenRegression(10)
    assert resolve_costs(lambda i: dataset.lengths[i], dataset).tolist() == dataset.lengths
    with pytest.raises(ValueError, match="10 samples"):
        resolve_costs([1.0] * 9, dataset)
    with pytest.raises(ValueError, match="non-negative"):
        resolve_costs([-1.0] * 10, dataset)
    with pytest.raises(ValueError, match="lengths"):
        resolve_costs("lengths", list(range(10)))


class SummedRegressor(RecordingRegressor):
    """The squared error summed over the batch's samples (``reduction="sum"``)."""

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.steps.append(index.tolist())
        self.epochs.append(self.current_epoch)
        return nn.functional.mse_loss(self.layer(x), y, reduction="sum")


@pytest.mark.parametrize("every", [1, 3], ids=["every-step", "one-in-3"])
def test_noise_statistics_of_a_declared_sum_are_those_of_its_mean(tmp_path, every):
    # the estimator needs every group's mean gradient and the global mean's: a sum's are its sample count times them
    dataset, initial, records, fed = fit_recording_noise(
        tmp_path,
        [20, 8, 4],
        SummedRegressor,
        noise_every=every,
        ddp_kwargs={"loss_normalisation": "sample_sum"},
        max_steps=1 + FOLD_DELAY * every,
    )
    ((local, group_sizes, global_sqr, _),) = fed  # step 0's, folded in at step FOLD_DELAY
    groups = [r["steps"][0] for r in records]
    assert group_sizes == [20, 8, 4]
    assert local == pytest.approx([squared_gradient_norm(dataset, initial, g) for g in groups], rel=1e-4)
    union = [i for g in groups for i in g]
    assert global_sqr == pytest.approx(squared_gradient_norm(dataset, initial, union), rel=1e-4)
