"""A Lightning Fabric loop with ``CannikinFabricStrategy``: 2 CPU ranks (fork, gloo), an emulated 1x:3x cluster.

One fit checks it all: every rank runs the same number of steps, every sample comes once per epoch, every step's
gradient is the exact mean over the global batch (recomputed here in one process), and the split moves towards the
faster rank.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_cannikin import CannikinFabricStrategy, CannikinSettings
from tests.models import IndexedRegression

NUM_SAMPLES = 200
EPOCHS = 3
PER_SAMPLE_S = (0.001, 0.003)  # rank 1 is 3x slower


def _setup(fabric: L.Fabric, strategy: CannikinFabricStrategy) -> tuple:
    """A linear model, SGD and the uneven loader of batch 12 per rank, set up by Fabric."""
    torch.manual_seed(0)
    dataset = IndexedRegression(NUM_SAMPLES)
    model = nn.Linear(dataset.x.shape[1], 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    loader = strategy.uneven_dataloader(DataLoader(dataset, batch_size=12, shuffle=True))
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=False)
    return model, optimizer, loader


def _train(fabric: L.Fabric, strategy: CannikinFabricStrategy, out: Path) -> None:
    model, optimizer, loader = _setup(fabric, strategy)
    steps = []
    for epoch in range(EPOCHS):
        for x, y, index in loader:
            params = [p.detach().flatten().tolist() for p in model.parameters()]
            with strategy.step() as sizes:
                loss = nn.functional.mse_loss(model(x), y)
                time.sleep(0.002 + PER_SAMPLE_S[fabric.global_rank] * len(index))  # the emulated device
                fabric.backward(loss)
            grads = [p.grad.flatten().tolist() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            steps.append(
                {"epoch": epoch, "indices": index.tolist(), "sizes": list(sizes), "params": params, "grads": grads}
            )
    hook_calls = strategy.engine.reductions.comm_hook()[0].calls
    record = {"steps": steps, "plan": list(strategy.plan.local_batch_sizes), "hook_calls": hook_calls}
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(record))


def _mean_gradient(dataset: IndexedRegression, indices: list[int], params: list[list[float]]) -> torch.Tensor:
    layer = nn.Linear(dataset.x.shape[1], 1)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(params[0]).view_as(layer.weight))
        layer.bias.copy_(torch.tensor(params[1]).view_as(layer.bias))
    nn.functional.mse_loss(layer(dataset.x[indices]), dataset.y[indices]).backward()
    return torch.cat([layer.weight.grad.flatten(), layer.bias.grad.flatten()])


def test_a_fabric_loop_gets_uneven_batches_the_exact_mean_gradient_and_a_balanced_split(tmp_path):
    strategy = CannikinFabricStrategy(start_method="fork", settings=CannikinSettings(warmup_steps=4))
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch(_train, strategy, tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    steps0, steps1 = ranks[0]["steps"], ranks[1]["steps"]
    assert len(steps0) == len(steps1) > 0, "every rank runs the same number of steps"
    assert ranks[0]["hook_calls"] >= len(steps0), "the weighted all-reduce ran on CPU"
    for epoch in range(EPOCHS):
        seen = sorted(i for steps in (steps0, steps1) for s in steps if s["epoch"] == epoch for i in s["indices"])
        assert seen == list(range(NUM_SAMPLES)), f"epoch {epoch}: every sample exactly once"
    dataset = IndexedRegression(NUM_SAMPLES)
    uneven = worst = 0
    for step0, step1 in zip(steps0, steps1, strict=True):
        assert step0["sizes"] == step1["sizes"] == [len(step0["indices"]), len(step1["indices"])]
        uneven += step0["sizes"][0] != step0["sizes"][1]
        reference = _mean_gradient(dataset, step0["indices"] + step1["indices"], step0["params"])
        for step in (step0, step1):
            reduced = torch.tensor([g for grad in step["grads"] for g in grad])
            worst = max(worst, float((reduced - reference).abs().max()))
    assert uneven > len(steps0) // 2, "most steps ran an uneven split"
    assert worst < 1e-5, worst
    plan = ranks[0]["plan"]
    assert ranks[1]["plan"] == plan and sum(plan) == 24
    assert plan[0] >= 15, f"rank 0 is 3x faster (optimum about 17-18 of 24): {plan}"


def test_the_fabric_example_balances_its_emulated_cluster(capfd):
    from examples.fabric_loop import main

    main(["--epochs", "2", "--per-sample-ms", "1", "3"])
    out = capfd.readouterr().out
    final = re.search(r"final local batch sizes \[(\d+), (\d+)\]", out)
    assert final is not None, out[-2000:]
    assert int(final.group(1)) + int(final.group(2)) == 64 and int(final.group(1)) > 40, out[-2000:]
    assert float(re.search(r"test_accuracy=([\d.]+)", out).group(1)) > 0.3, out[-2000:]


def _train_accumulating(fabric: L.Fabric, strategy: CannikinFabricStrategy, out: Path) -> None:
    model, optimizer, loader = _setup(fabric, strategy)
    windows, window, params = [], [], None
    for _ in range(2):
        for position, (x, y, index) in enumerate(loader):
            last = position % 2 == 1 or position == len(loader) - 1  # the epoch's last window may be one batch
            if not window:
                params = [p.detach().flatten().tolist() for p in model.parameters()]
            with fabric.no_backward_sync(model, enabled=not last), strategy.step():
                loss = nn.functional.mse_loss(model(x), y) / 2  # divided by the accumulation, as Lightning does
                time.sleep(0.002 + PER_SAMPLE_S[fabric.global_rank] * len(index))
                fabric.backward(loss)
            window.append(index.tolist())
            if last:
                grads = [p.grad.flatten().tolist() for p in model.parameters()]
                optimizer.step()
                optimizer.zero_grad()
                windows.append({"indices": window, "params": params, "grads": grads})
                window = []
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps({"windows": windows}))


def test_a_fabric_loop_accumulating_gets_the_exact_mean_gradient_of_each_window(tmp_path):
    strategy = CannikinFabricStrategy(start_method="fork", accumulate_grad_batches=2, settings=CannikinSettings(4))
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch(_train_accumulating, strategy, tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text())["windows"] for r in range(2)]
    dataset = IndexedRegression(NUM_SAMPLES)
    assert len(ranks[0]) == len(ranks[1]) == 2 * 5, "4 windows of 2 batches and the epoch's last batch, twice"
    uneven = worst = 0
    for window0, window1 in zip(*ranks, strict=True):
        indices = [i for batch in window0["indices"] + window1["indices"] for i in batch]
        uneven += len(window0["indices"][0]) != len(window1["indices"][0])
        reference = _mean_gradient(dataset, indices, window0["params"])
        for window in (window0, window1):
            reduced = torch.tensor([g for grad in window["grads"] for g in grad])
            worst = max(worst, float((reduced - reference).abs().max()))
    assert uneven > 0, "the split became uneven: the weights had something to weigh"
    assert worst < 1e-5, worst


def _noisy_dataset() -> IndexedRegression:
    """A noisy problem (a large noise scale), the same on every call."""
    torch.manual_seed(0)
    dataset = IndexedRegression(480, seed=3)
    dataset.y += 3.0 * torch.randn_like(dataset.y)
    return dataset


def _train_adapting(fabric: L.Fabric, strategy: CannikinFabricStrategy, out: Path) -> None:
    dataset = _noisy_dataset()
    model = nn.Linear(dataset.x.shape[1], 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    loader = strategy.uneven_dataloader(DataLoader(dataset, batch_size=8, shuffle=True))
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=False)
    steps = []
    for epoch in range(4):
        for x, y, index in loader:
            params = [p.detach().flatten().tolist() for p in model.parameters()]
            with strategy.step() as sizes:
                loss = nn.functional.mse_loss(model(x), y)
                time.sleep(0.015 + (0.0002, 0.0006)[fabric.global_rank] * len(index))  # a large fixed cost per step
                fabric.backward(loss)
            grads = [p.grad.flatten().tolist() for p in model.parameters()]
            lrs: list[float] = []

            def read_lr(lrs: list[float] = lrs) -> None:  # called inside optimizer.step(): the LR the step ran at
                lrs.append(optimizer.param_groups[0]["lr"])

            optimizer.step(closure=read_lr)
            optimizer.zero_grad()
            record = {"epoch": epoch, "indices": index.tolist(), "sizes": list(sizes), "lr": lrs[0]}
            steps.append({**record, "params": params, "grads": grads, "factor": strategy.engine.running.lr_factor})
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(steps))


def test_a_fabric_loop_adapts_its_total_batch_for_goodput(tmp_path):
    settings = CannikinSettings(
        warmup_steps=4, min_noise_updates=5, noise_bound_sigmas=0, noise_every_n_steps=1, adapt_every_n_steps=None
    )
    strategy = CannikinFabricStrategy(start_method="fork", max_batch_size=128, settings=settings)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch(_train_adapting, strategy, tmp_path)
    steps0, steps1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert len(steps0) == len(steps1)
    totals = [sum(step["sizes"]) for step in steps0]
    assert totals[0] == 16 and max(totals) > 16, f"the total batch never grew: {totals}"
    for epoch in range(4):
        seen = sorted(i for steps in (steps0, steps1) for s in steps if s["epoch"] == epoch for i in s["indices"])
        assert seen == list(range(480)), f"epoch {epoch}: every sample exactly once"
    dataset = _noisy_dataset()
    worst = 0.0
    for step0, step1 in zip(steps0, steps1, strict=True):
        assert step0["lr"] == step1["lr"] == pytest.approx(0.01 * step0["factor"], rel=1e-12)
        reference = _mean_gradient(dataset, step0["indices"] + step1["indices"], step0["params"])
        for step in (step0, step1):
            reduced = torch.tensor([g for grad in step["grads"] for g in grad])
            worst = max(worst, float((reduced - reference).abs().max()))
    assert worst < 1e-5, worst
    assert len({step["factor"] for step in steps0}) > 1, "the learning rate followed the total and the noise scale"
