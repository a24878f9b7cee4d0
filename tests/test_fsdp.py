"""``strategy="cannikin_fsdp"`` (FSDP2 through Lightning's ModelParallelStrategy) on CPU/gloo, fork launcher in-process.

The ranks record which samples they consumed and the full parameters (gathered from the shards); the test replays the
same samples in one process to check that the sharded result is the exact mean-gradient update.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.distributed.fsdp import fully_shard

from lightning_cannikin import Cannikin, CannikinModelParallelStrategy, CannikinSettings, EmulatedCluster
from lightning_cannikin.training import engine as engine_module
from lightning_cannikin.training.frontends.lightning_hooks import BalancingCallback
from tests.models import IndexedRegression, RecordingRegressor, quiet_trainer, read_records, record_estimator_inputs
from tests.test_mid_epoch_total import known_step_times, noisy_dataset, total_changing_cannikin


def mlp(dim: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(dim, 8), nn.Tanh(), nn.Linear(8, 1))


def full_params(module: nn.Module) -> dict[str, list]:
    """Every parameter whole (a collective on sharded ones: every rank calls it)."""
    state = module.state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).tolist() for k, v in state.items()}


class ShardedRegressor(RecordingRegressor):
    """A two-layer MLP sharded per layer; records the parameters after the first optimizer step and at the end."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.layer = mlp(self.dataset.x.shape[1])
        self.first_step: dict | None = None
        self.momentum = 0.0

    def configure_optimizers(self):
        # momentum: Lightning 2.6 cannot load a full-state checkpoint of an optimizer without state (plain SGD's)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.layer:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.layer, mesh=mesh)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.first_step is None and self.trainer.global_step == 1:
            self.first_step = {"steps": len(self.steps), "params": full_params(self.layer)}

    def on_train_end(self) -> None:
        record = {"steps": self.steps, "epochs": self.epochs, "params": full_params(self.layer)}
        record["first_step"] = self.first_step
        Path(self.record_dir, f"rank{self.global_rank}.json").write_text(json.dumps(record))


class AdamRegressor(ShardedRegressor):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def fit_sharded(
    tmp_path, sizes=None, num_samples=100, batch_size=None, callbacks=(), strategy=None, model_class=None, **trainer
):
    dataset = IndexedRegression(num_samples)
    model_class = model_class or ShardedRegressor
    model = model_class(dataset, batch_size=batch_size or sizes[0], record_dir=str(tmp_path))
    initial = copy.deepcopy(model.layer.state_dict())
    strategy = strategy or CannikinModelParallelStrategy(local_batch_sizes=sizes, start_method="fork")
    devices = len(sizes) if sizes else trainer.pop("devices")
    quiet_trainer(strategy, devices, callbacks, **trainer).fit(model)
    return dataset, initial, model


def replay(dataset, initial, records, accumulate, windows=None, weighting="exact"):
    """SGD in one process on the union of what the ranks consumed, window by window (``windows``: only the first
    few); ``weighting="ranks"`` is plain data parallelism's mean of per-rank means (to show the check is sharp)."""
    net = mlp(dataset.x.shape[1])
    net.load_state_dict(initial)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    steps, epochs = records[0]["steps"], records[0]["epochs"]
    start, done = 0, 0
    while start < len(steps) and (windows is None or done < windows):
        end = start  # `accumulate` steps, cut short at an epoch's end as Lightning does
        while end < len(steps) and end - start < accumulate and epochs[end] == epochs[start]:
            end += 1
        optimizer.zero_grad()
        groups = [[i for r in records for s in r["steps"][start:end] for i in s]]
        if weighting == "ranks":
            groups = [[i for s in r["steps"][start:end] for i in s] for r in records]
        losses = [nn.functional.mse_loss(net(dataset.x[torch.tensor(g)]), dataset.y[torch.tensor(g)]) for g in groups]
        torch.stack(losses).mean().backward()
        optimizer.step()
        start, done = end, done + 1
    return net.state_dict()


def max_error(params: dict, expected: dict) -> float:
    return max((torch.tensor(params[name]) - value).abs().max().item() for name, value in expected.items())


def test_one_sharded_step_equals_one_process_on_the_concatenated_uneven_batch(tmp_path):
    dataset, initial, _ = fit_sharded(tmp_path, [24, 8], num_samples=200, max_steps=1)
    records = read_records(tmp_path, 2)
    assert [[len(s) for s in r["steps"]] for r in records] == [[24], [8]]
    for record in records:  # every rank gathers the same full parameters
        assert max_error(record["params"], replay(dataset, initial, records, 1)) < 1e-6
    # the check is sharp: the mean of per-rank means (FSDP's plain average of uneven batches) lands elsewhere
    assert max_error(records[0]["params"], replay(dataset, initial, records, 1, weighting="ranks")) > 1e-3


def test_three_ranks_accumulating_exact_every_sample_once_and_equal_step_counts(tmp_path):
    sizes, num_samples = [20, 10, 3], 150
    dataset, initial, _ = fit_sharded(tmp_path, sizes, num_samples, accumulate_grad_batches=2, max_epochs=2)
    records = read_records(tmp_path, 3)
    # equal step counts: every rank ran the same number of steps, each of its own size (the last batch partial)
    assert len({len(r["steps"]) for r in records}) == 1
    for epoch in (0, 1):
        consumed = [i for r in records for s, e in zip(r["steps"], r["epochs"], strict=True) if e == epoch for i in s]
        assert sorted(consumed) == list(range(num_samples)), f"epoch {epoch} did not see every sample exactly once"
    first = records[0]["first_step"]
    assert first["steps"] == 2, "the first optimizer step closes a window of two micro-batches"
    assert max_error(first["params"], replay(dataset, initial, records, 2, windows=1)) < 1e-6
    assert max_error(first["params"], replay(dataset, initial, records, 2, windows=1, weighting="ranks")) > 1e-4
    assert max_error(records[0]["params"], replay(dataset, initial, records, 2)) < 1e-5


class DumpPlan(Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            balancer = next(cb for cb in trainer.callbacks if isinstance(cb, BalancingCallback))
            slopes = [m.slope for m in balancer.speed_model.models()]
            self.path.write_text(json.dumps({"plan": list(balancer.plan.local_batch_sizes), "slopes": slopes}))


def test_the_split_moves_toward_the_faster_rank_on_an_emulated_cluster(tmp_path):
    out = tmp_path / "plan.json"
    # per-sample costs well above what a busy machine adds to a step (a few ms), so the fitted slopes are the devices'
    callbacks = [EmulatedCluster([3.0, 9.0], fixed_ms=5.0), DumpPlan(out)]
    strategy = CannikinModelParallelStrategy(start_method="fork")  # adds the balancing callback itself
    options = {"devices": 2, "max_epochs": 3}
    fit_sharded(tmp_path, batch_size=32, num_samples=640, callbacks=callbacks, strategy=strategy, **options)
    result = json.loads(out.read_text())
    # equal intercepts, slopes 1:3: the optimum gives rank 0 three quarters of the 64 samples
    assert sum(result["plan"]) == 64, result
    assert abs(result["plan"][0] - 48) <= 0.1 * 48, result
    for slope, truth in zip(result["slopes"], [3.0, 9.0], strict=True):
        assert slope * 1000 == pytest.approx(truth, rel=0.25), result


# ---- bad settings fail before any collective, with the fix in the message ----------------------------------------


def test_tensor_parallelism_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2.*Leave `tensor_parallel_size` unset"):
        CannikinModelParallelStrategy(tensor_parallel_size=2)


def test_a_data_parallel_size_other_than_the_world_size_is_refused_before_launching():
    strategy = CannikinModelParallelStrategy(data_parallel_size=1, start_method="fork")
    with pytest.raises(ValueError, match=r"data_parallel_size=1.*must equal the world size .2.*Leave it unset"):
        quiet_trainer(strategy, 2)


def test_a_split_of_the_wrong_length_is_refused_before_launching():
    with pytest.raises(ValueError, match="`local_batch_sizes` has 3 entries but the world size is 2"):
        quiet_trainer(CannikinModelParallelStrategy(local_batch_sizes=[4, 4, 4], start_method="fork"), 2)


@pytest.mark.parametrize(
    ("cannikin", "message"),
    [
        (
            Cannikin(local_batch_bounds=(1, [4, 4])),
            "upper bounds \\[4, 4\\] hold at most 8 .*initial global batch of 32.*raise the upper bounds",
        ),
    ],
)
def test_settings_it_cannot_honour_fail_on_every_rank_with_the_fix(tmp_path, cannikin, message):
    strategy = CannikinModelParallelStrategy(start_method="fork")
    # the fork launcher re-raises a rank's ValueError wrapped, with its text; no rank is left waiting
    with pytest.raises(Exception, match=f"ValueError: .*{message}"):
        fit_sharded(tmp_path, batch_size=16, callbacks=[cannikin], strategy=strategy, devices=2, max_steps=1)


# ---- checkpoints: the plan and the engine's state survive Lightning's sharded and full-state checkpoints ----------


class SaveAt(Callback):
    """Saves a checkpoint after training step ``step`` and has rank zero dump the engine's state beside it; on a
    resumed fit, dumps the engine's state once training starts (after the balancing callback restored it)."""

    def __init__(self, path: Path, step: int | None) -> None:
        self.path, self.step = path, step

    def _dump(self, trainer, name: str) -> None:
        balancer = next(cb for cb in trainer.callbacks if isinstance(cb, BalancingCallback))
        # every rank takes it, as a checkpoint does (the noise observer's state sums what the ranks hold)
        state = {"engine": balancer.engine.state_dict(), "plan": list(balancer.plan.local_batch_sizes)}
        if trainer.is_global_zero:
            Path(self.path.parent, name).write_text(json.dumps(state))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.step is not None and trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            self._dump(trainer, "saved.json")

    def on_train_start(self, trainer, pl_module):
        if self.step is None:
            self._dump(trainer, "restored.json")


@pytest.mark.parametrize("distributed", [True, False], ids=["sharded", "full_state"])
def test_a_checkpoint_restores_the_plan_and_the_engine_exactly_and_the_epoch_continues(tmp_path, distributed):
    num_samples, path = 480, tmp_path / "resume.ckpt"
    runs = [tmp_path / "first", tmp_path / "second"]
    for run, step in zip(runs, (12, None), strict=True):
        run.mkdir()
        strategy = CannikinModelParallelStrategy(save_distributed_checkpoint=distributed, start_method="fork")
        balancer = Cannikin(settings=CannikinSettings(warmup_steps=4))
        callbacks = [EmulatedCluster([1.0, 2.0], fixed_ms=2.0), balancer, SaveAt(path, step)]
        options = {"devices": 2, "max_epochs": 1, "max_steps": 12 if step else -1}
        model = ShardedRegressor(IndexedRegression(num_samples), batch_size=16, record_dir=str(run))
        model.momentum = 0.9
        quiet_trainer(strategy, callbacks=callbacks, **options).fit(model, ckpt_path=None if step else str(path))
    assert path.is_dir() == distributed
    saved, restored = (json.loads((tmp_path / name).read_text()) for name in ("saved.json", "restored.json"))
    assert saved["engine"]["history"], "the first fit re-planned before the checkpoint"
    # a resumed run's devices warm up again (SpeedModel.restarted): their warm-up counts restart, by design
    assert restored["engine"]["balancer"].pop("warm") == [0, 0]
    saved["engine"]["balancer"].pop("warm")
    assert restored == saved
    # the resumed epoch continues where the checkpoint left it: every sample once over the two fits
    consumed = [i for run in runs for r in read_records(run, 2) for s in r["steps"] for i in s]
    assert sorted(consumed) == list(range(num_samples))


class Unsharded(ShardedRegressor):
    def configure_model(self) -> None:
        pass  # no fully_shard: no gradient would be reduced


def test_a_model_without_fully_shard_is_refused_at_setup(tmp_path):
    model = Unsharded(IndexedRegression(64), batch_size=8, record_dir=str(tmp_path))
    trainer = quiet_trainer(CannikinModelParallelStrategy(start_method="fork"), 2, max_steps=1)
    with pytest.raises(Exception, match=r"ValueError: .*found no module sharded with `fully_shard`.*configure_model"):
        trainer.fit(model)


# ---- noise statistics under sharding: the adaptive total works under FSDP2 ---------------------------------------


class RecordNoiseInputs(Callback):
    """Every rank writes what its noise estimator was fed, ``[Z per group, sizes, Y, steps]`` per update."""

    def __init__(self, path: Path) -> None:
        self.path, self.fed = path, []

    def on_train_start(self, trainer, pl_module):
        record_estimator_inputs(trainer, self.fed)

    def on_train_end(self, trainer, pl_module):
        Path(self.path, f"fed{trainer.global_rank}.json").write_text(json.dumps(self.fed))


def replay_statistics(dataset, initial, records, accumulate, momentum=0.0, adam=False):
    """One process, in float64: each window's ``Z`` per group (rank-major: a rank's micro-batches in order), sizes and
    ``Y`` of the exact mean gradient, then the step the ranks took (SGD at lr 0.1, or Adam at 0.01, whose gradients
    are divided by ``sqrt(v_hat) + eps`` once it holds a second moment)."""
    net = mlp(dataset.x.shape[1]).double()
    net.load_state_dict(initial)
    x, y = dataset.x.double(), dataset.y.double()
    params = list(net.parameters())
    optimizer = torch.optim.Adam(params, lr=0.01) if adam else torch.optim.SGD(params, lr=0.1, momentum=momentum)

    def gradient(indices):
        net.zero_grad()
        rows = torch.tensor(indices)
        nn.functional.mse_loss(net(x[rows]), y[rows]).backward()
        pieces = []
        for p in params:
            state = optimizer.state.get(p)
            if adam and state:
                correction = (1 - 0.999 ** float(state["step"])) ** 0.5
                pieces.append(p.grad / (state["exp_avg_sq"].sqrt() / correction + 1e-8))
            else:
                pieces.append(p.grad)
        return torch.cat([piece.reshape(-1) for piece in pieces])

    steps, epochs, start, windows = records[0]["steps"], records[0]["epochs"], 0, []
    while start < len(steps):
        end = start
        while end < len(steps) and end - start < accumulate and epochs[end] == epochs[start]:
            end += 1
        groups = [r["steps"][k] for r in records for k in range(start, end)]
        local = [gradient(g).square().sum().item() for g in groups]
        whole = gradient([i for g in groups for i in g])
        windows.append([local, [len(g) for g in groups], whole.square().sum().item()])
        optimizer.step()  # the gradient of the window's exact mean is still in .grad (as it is, not preconditioned)
        start = end
    return windows


@pytest.mark.parametrize("adam", [False, True], ids=["sgd", "adam"])
def test_sharded_noise_statistics_equal_one_process_on_uneven_accumulated_batches(tmp_path, adam):
    # three ranks, uneven 20:10:3, two micro-batches per step; 150 samples: the epoch's third window has one. Adam: the
    # statistics of its preconditioned gradient (from the second step on), its second moments sharded over the ranks
    cannikin = Cannikin(
        lr_scaling="none",
        settings=CannikinSettings(track_noise_scale=True, noise_every_n_steps=1, noise_exchange_every=1),
    )
    recorder = RecordNoiseInputs(tmp_path)
    sizes = [20, 10, 3]
    model_class = AdamRegressor if adam else ShardedRegressor
    options = {"model_class": model_class, "accumulate_grad_batches": 2, "max_steps": 6}
    dataset, initial, _ = fit_sharded(tmp_path, sizes, 150, callbacks=[cannikin, recorder], **options)
    records = read_records(tmp_path, 3)
    fed = [json.loads((tmp_path / f"fed{r}.json").read_text()) for r in range(3)]
    assert fed[0] == fed[1] == fed[2], "the ranks' estimators were fed different numbers"
    expected = replay_statistics(dataset, initial, records, 2, adam=adam)
    assert len(fed[0]) == 4, "six steps: the statistics of the first four arrive (two steps later each)"
    assert [len(step[1]) for step in fed[0]] == [6, 6, 3, 6], "3 ranks x 2 micro-batches; the epoch's last window 1"
    # Adam divides each element by its own earlier magnitude: the tiny ones, which float32 computes with a larger
    # relative error than one process in float64, weigh as much as the large ones (within 2e-6 here); a statistic of
    # the raw gradient, a missing weight or a denominator out of place is off by far more
    tolerance = 1e-5 if adam else 1e-6
    for step, (got, want) in enumerate(zip(fed[0], expected, strict=False)):
        local, group_sizes, global_sqr, steps = got
        assert group_sizes == want[1] and steps == 1
        assert local == pytest.approx(want[0], rel=tolerance), f"Z of step {step}"
        assert global_sqr == pytest.approx(want[2], rel=tolerance), f"Y of step {step}"


class LearningRates(ShardedRegressor):
    """Also writes the learning rate each optimizer step ran with."""

    def on_before_optimizer_step(self, optimizer):
        self.__dict__.setdefault("stepped", []).append(optimizer.param_groups[0]["lr"])

    def on_train_end(self):
        super().on_train_end()
        Path(self.record_dir, f"lrs{self.global_rank}.json").write_text(json.dumps(self.stepped))


def test_the_adaptive_total_changes_on_the_sharded_estimate_with_its_learning_rate(tmp_path, monkeypatch):
    # noise dominates (labels of pure noise) and the step time is a known function of the split (the ranks are forked:
    # they see the patch), so the total grows from 16 to `max_batch_size` 48 on the noise scale alone
    known_step_times(monkeypatch)
    model = LearningRates(noisy_dataset(480), batch_size=8, record_dir=str(tmp_path), lr=0.01)
    cannikin = total_changing_cannikin(lr_scaling="linear", base_batch_size=8)
    callbacks = [cannikin, EmulatedCluster([0.1, 0.1], fixed_ms=20.0), RecordNoiseInputs(tmp_path)]
    strategy = CannikinModelParallelStrategy(start_method="fork")
    quiet_trainer(strategy, 2, callbacks, max_epochs=1).fit(model)
    records = read_records(tmp_path, 2)
    totals = [len(a) + len(b) for a, b in zip(records[0]["steps"], records[1]["steps"], strict=True)][:-1]
    assert totals[0] == 16 and 48 in totals, f"the total did not change on the estimate: {totals}"
    fed = [json.loads((tmp_path / f"fed{r}.json").read_text()) for r in range(2)]
    assert fed[0] == fed[1] and len(fed[0]) >= 3, "the ranks' estimators were fed the same numbers"
    # every step ran at the learning-rate factor of the plan it ran ("linear": lr x total / B0)
    lrs = [json.loads((tmp_path / f"lrs{r}.json").read_text()) for r in range(2)]
    assert lrs[0] == lrs[1]
    assert lrs[0][: len(totals)] == pytest.approx([0.01 * total / 8 for total in totals], rel=1e-12)


@pytest.mark.parametrize("distributed", [True, False], ids=["sharded", "full_state"])
def test_a_checkpoint_of_three_ranks_resumes_on_two_with_its_total_and_noise_statistics(
    tmp_path, monkeypatch, distributed
):
    told = tmp_path / "told.txt"  # the forked ranks inherit the patched module: rank zero's message lands here
    monkeypatch.setattr(engine_module, "rank_zero_info", lambda text: told.open("a").write(text + "\n"))
    num_samples, path = 480, tmp_path / "resume.ckpt"
    dataset = IndexedRegression(num_samples)
    runs = [tmp_path / "first", tmp_path / "second"]
    settings = CannikinSettings(
        warmup_steps=4, track_noise_scale=True, noise_every_n_steps=1, noise_exchange_every=1, noise_bound_sigmas=0
    )
    for run, devices, step in zip(runs, (3, 2), (12, None), strict=True):
        run.mkdir()
        strategy = CannikinModelParallelStrategy(save_distributed_checkpoint=distributed, start_method="fork")
        cannikin = Cannikin(lr_scaling="none", settings=settings)
        callbacks = [EmulatedCluster([1.0, 2.0, 2.0][:devices], fixed_ms=2.0), cannikin, SaveAt(path, step)]
        callbacks.append(RecordNoiseInputs(run))
        model = ShardedRegressor(dataset, batch_size=8, record_dir=str(run))
        model.momentum = 0.9
        if step:
            initial = copy.deepcopy(model.layer.state_dict())
        options = {"max_epochs": 1, "max_steps": 12 if step else -1}
        quiet_trainer(strategy, devices, callbacks, **options).fit(model, ckpt_path=None if step else str(path))
    saved, restored = (json.loads((tmp_path / name).read_text()) for name in ("saved.json", "restored.json"))
    assert "resuming a 3-rank run on 2 ranks" in told.read_text()
    # the global batch of 24 is kept, split across two ranks; the speed models restart (the devices changed)
    assert sum(saved["plan"]) == sum(restored["plan"]) == 24 and len(restored["plan"]) == 2
    assert restored["engine"]["replanner"]["identified"] is False and restored["engine"]["balancer"]["world_size"] == 2
    assert restored["engine"]["estimator"] == saved["engine"]["estimator"]
    assert restored["engine"]["progress"] == saved["engine"]["progress"]
    # the interrupted epoch continues on two ranks: every sample once over the two fits
    first, second = read_records(runs[0], 3), read_records(runs[1], 2)
    assert sorted(i for r in first + second for s in r["steps"] for i in s) == list(range(num_samples))
    # the noise statistics in flight at the checkpoint reach the resumed estimator: the last two steps of three ranks,
    # the last one's Y summed over its three shards at the save, each as one process computes it. Twelve float32 steps
    # with momentum drift from the float64 replay by about 1e-6 (the first steps agree within 1e-7); a Y of one shard,
    # or of every rank's copy, would be off by a third or by twice
    expected = replay_statistics(dataset, initial, first, 1, momentum=0.9)
    fed = [json.loads((run / "fed0.json").read_text()) for run in runs]
    assert len(fed[0]) == 10 and [len(step[1]) for step in fed[1][:3]] == [3, 3, 2]
    for got, want in zip(fed[0] + fed[1][:2], expected, strict=True):
        assert got[1] == want[1]
        assert got[0] == pytest.approx(want[0], rel=1e-5) and got[2] == pytest.approx(want[2], rel=1e-5)
