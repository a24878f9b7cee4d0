"""Variable-length data under ``strategy="cannikin_fsdp"``: the declared loss normalisation's exact weights through
FSDP2's averaging reduce-scatter, the cost-aware sampler, and the noise statistics of the declared loss's means.

CPU, gloo, fork launcher in-process (as ``tests/test_fsdp.py``). Each rank records the samples it consumed, the full
parameters (gathered from the shards) and what its noise estimator was fed; one process replays the same windows in
float64 to check the update and the statistics.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from lightning_cannikin import (
    Cannikin,
    CannikinModelParallelStrategy,
    CannikinSettings,
    CannikinStrategy,
    EmulatedCluster,
)
from tests.models import accumulation_windows, quiet_trainer
from tests.test_fsdp import RecordNoiseInputs, full_params
from tests.test_varlen_training import DIM, VarLenRegression, VarLenRegressor, max_error, replay, varlen_loss

LR = 0.05


class ShardedVarLenRegressor(VarLenRegressor):
    """The per-token linear model sharded with ``fully_shard``; records its full parameters and its sampler's kind."""

    def configure_model(self) -> None:
        fully_shard(self.layer, mesh=self.device_mesh["data_parallel"])

    def on_train_end(self) -> None:
        record = {
            "steps": self.steps,
            "epochs": self.epochs,
            "params": full_params(self.layer),
            "sampler": type(self.trainer.strategy.engine.data.sampler).__name__,
        }
        Path(self.record_dir, f"rank{self.global_rank}.json").write_text(json.dumps(record))


def consumed_in(records: list[dict], epoch: int) -> list[int]:
    """Every sample index the ranks trained on in ``epoch``, sorted."""
    return sorted(i for r in records for s, e in zip(r["steps"], r["epochs"], strict=True) if e == epoch for i in s)


def mean_of(normalisation: str) -> str:
    """The mean the noise statistics are taken of: a declared sum's is the mean over the same samples."""
    return "sample_mean" if normalisation == "sample_sum" else normalisation


def replay_statistics(dataset, initial, records, accumulate, normalisation):
    """One process, float64: each window's ``[Z per group (rank-major), sizes, Y]`` of the declared loss's means (a
    count mean's group sizes in samples' worth of units), then the SGD step the ranks took on the declared loss."""
    layer = nn.Linear(DIM, 1).double()
    layer.load_state_dict(initial)
    optimizer = torch.optim.SGD(layer.parameters(), lr=LR)
    x, y, mask = dataset.x.double(), dataset.y.double(), dataset.mask.double()

    def squared_gradient(indices, loss):
        layer.zero_grad()
        rows = torch.tensor(indices)
        varlen_loss(layer, x[rows], y[rows], mask[rows], loss).backward()
        return sum(p.grad.square().sum().item() for p in layer.parameters())

    windows = []
    for start, end in accumulation_windows(records, accumulate):
        groups = [r["steps"][k] for r in records for k in range(start, end)]
        union = [i for g in groups for i in g]
        local = [squared_gradient(g, mean_of(normalisation)) for g in groups]
        sizes = [float(len(g)) for g in groups]
        if normalisation == "count_mean":
            units = [float(sum(dataset.lengths[i] for i in g)) for g in groups]
            sizes = [u * len(union) / sum(units) for u in units]
        windows.append([local, sizes, squared_gradient(union, mean_of(normalisation))])
        layer.zero_grad()
        rows = torch.tensor(union)
        varlen_loss(layer, x[rows], y[rows], mask[rows], normalisation).backward()
        optimizer.step()  # the declared loss's gradient is what the ranks stepped on
    return windows


# the three ways a count reaches the weights; the first two accumulate (two micro-batches, windows cut at the epoch)
CASES = {
    "sample_sum": ({"local_batch_sizes": [6, 2]}, {"max_steps": 4, "accumulate_grad_batches": 2}),
    "count_mean_costs": (
        {"local_batch_sizes": [6, 2], "sample_costs": "lengths"},
        {"max_epochs": 2, "accumulate_grad_batches": 2},
    ),
    "count_mean_units": ({"local_batch_sizes": [5, 3], "batch_units": lambda batch: batch[2].sum()}, {"max_steps": 3}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_declared_normalisations_are_exact_under_sharding_with_their_noise_statistics(tmp_path, case):
    normalisation = "sample_sum" if case == "sample_sum" else "count_mean"
    strategy_options, trainer_options = CASES[case]
    accumulate = trainer_options.get("accumulate_grad_batches", 1)
    torch.manual_seed(0)
    dataset = VarLenRegression(40)  # 40 samples in global batches of 8: five per epoch
    model = ShardedVarLenRegressor(dataset, batch_size=4, record_dir=str(tmp_path), loss=normalisation, lr=LR)
    initial = copy.deepcopy(model.layer.state_dict())
    settings = CannikinSettings(track_noise_scale=True, noise_every_n_steps=1, noise_exchange_every=1)
    callbacks = [Cannikin(lr_scaling="none", settings=settings), RecordNoiseInputs(tmp_path)]
    strategy = CannikinModelParallelStrategy(loss_normalisation=normalisation, start_method="fork", **strategy_options)
    quiet_trainer(strategy, 2, callbacks, **trainer_options).fit(model)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    # the update is the one process's on the declared loss over each window; the sample-count weighting of the same
    # per-rank losses (what the weights of a sample mean would give) lands elsewhere
    assert max_error(records, replay(dataset, initial, records, accumulate, normalisation, lr=LR)) < 1e-6
    per_rank = replay(dataset, initial, records, accumulate, normalisation, lr=LR, per_rank=True)
    assert max_error(records, per_rank) > 1e-3

    if case == "count_mean_costs":  # cost-aware splitting under FSDP2
        assert records[0]["sampler"] == records[1]["sampler"] == "CostAwareBatchSampler"
        assert len(records[0]["steps"]) == len(records[1]["steps"]) == 10, "equal step counts, 5 per epoch"
        for epoch in (0, 1):
            assert consumed_in(records, epoch) == list(range(40)), f"epoch {epoch} did not see every sample once"
        tokens = [[sum(dataset.lengths[i] for i in s) for s in r["steps"]] for r in records]
        for fast, slow in zip(*tokens, strict=True):  # the fixed split's 3:1 stands for the speeds, in tokens
            assert 0.6 < fast / (fast + slow) < 0.9, tokens
        assert any(len(s) != 6 for s in records[0]["steps"]), "the split follows the costs, not the counts"

    # the estimator is fed the statistics of the declared loss's means, with the group sizes the DDP path uses; each
    # step's arrive two steps later
    fed = [json.loads((tmp_path / f"fed{r}.json").read_text()) for r in range(2)]
    assert fed[0] == fed[1], "the ranks' estimators were fed different numbers"
    expected = replay_statistics(dataset, initial, records, accumulate, normalisation)
    assert len(fed[0]) == len(expected) - 2 >= 1
    for step, (got, want) in enumerate(zip(fed[0], expected, strict=False)):
        local, sizes, global_sqr, steps = got
        assert steps == 1 and sizes == pytest.approx(want[1], rel=1e-12), f"sizes of step {step}"
        assert local == pytest.approx(want[0], rel=1e-6), f"Z of step {step}"
        assert global_sqr == pytest.approx(want[2], rel=1e-6), f"Y of step {step}"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"loss_normalisation": "count_mean"}, "needs each sample's count: give `sample_costs`"),
        ({"loss_normalisation": "token_mean"}, "`loss_normalisation` must be one of"),
    ],
)
def test_a_bad_normalisation_is_refused_at_construction_as_under_ddp(options, message):
    errors = []
    for strategy_class in (CannikinStrategy, CannikinModelParallelStrategy):
        with pytest.raises(ValueError, match=message) as error:
            strategy_class(start_method="fork", **options)
        errors.append(str(error.value))
    assert errors[0] == errors[1], "the same error under both strategies"
    assert not dist.is_initialized(), "no process group was used"


class WarnedVarLenRegressor(ShardedVarLenRegressor):
    """Also records whether the mismatch warning fired and every rank's time model over its tokens."""

    def on_train_end(self) -> None:
        super().on_train_end()
        path = Path(self.record_dir, f"rank{self.global_rank}.json")
        record = json.loads(path.read_text())
        engine = self.trainer.strategy.engine
        models = engine.data.plan.time_models
        record.update(warned=engine._losses.warned, time_models=None if models is None else list(models))
        path.write_text(json.dumps(record))


def test_cost_aware_balancing_under_sharding_every_sample_once_and_a_summed_loss_is_warned_about(tmp_path):
    # per-token costs 1:3 charged by the emulator; the loss is a sum over samples declared as the default mean
    per_token_ms = [1.0, 3.0]  # well above what a busy machine adds to a sleep
    emulator = EmulatedCluster(per_token_ms, fixed_ms=5.0, batch_cost=lambda batch: batch[2].sum().item())
    torch.manual_seed(0)
    model = WarnedVarLenRegressor(VarLenRegression(640), batch_size=16, record_dir=str(tmp_path), loss="sample_sum")
    strategy = CannikinModelParallelStrategy(sample_costs="lengths", start_method="fork")
    quiet_trainer(strategy, 2, [emulator], max_epochs=3).fit(model)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert records[0]["sampler"] == "CostAwareBatchSampler"
    assert len(records[0]["steps"]) == len(records[1]["steps"]), "equal step counts"
    for epoch in range(3):
        assert consumed_in(records, epoch) == list(range(640)), f"epoch {epoch}: every sample once"
    assert records[0]["warned"], "a loss that grows with the local batch, declared a mean, is warned about"
    # every rank splits by the same broadcast time models: each rank's own fit over its exact tokens
    models = records[0]["time_models"]
    assert models is not None and models == records[1]["time_models"]
    for (_, per_token), truth in zip(models, per_token_ms, strict=True):
        assert per_token * 1000 == pytest.approx(truth, rel=0.15), models
