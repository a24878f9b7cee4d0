"""A rank's whole step in the split, on CPU: the input pipeline's cost and the optimizer step's, both outside the
device's compute span.

The emulated hosts sleep in the training DataLoader's ``collate_fn`` (no workers: in series with the step), the
emulated optimizers before ``optimizer.step()`` (after the all-reduce: in series with the rank's next step). Each split
is judged against the best split under the emulated costs, found by brute force over every split, independently of
the planner.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from torch import nn
from torch.utils.data import DataLoader

from lightning_cannikin import CannikinStrategy, EmulatedCluster
from lightning_cannikin.core.speed_model import SpeedModel, SpeedModelSettings
from lightning_cannikin.core.step_record import StepRecord
from lightning_cannikin.simulation.emulated_devices import EmulatedDevices
from lightning_cannikin.training.emulator import loop_meets_each_step
from lightning_cannikin.training.frontends.lightning_hooks import BalancingCallback
from tests.models import IndexedRegression, quiet_trainer

TOTAL = 96


def every_split(total: int, ranks: int = 3) -> np.ndarray:
    """Every split of ``total`` over three ranks with at least one sample each."""
    assert ranks == 3
    return np.array([(a, b, total - a - b) for a in range(1, total - 1) for b in range(1, total - a)])


def own_ms(devices: EmulatedDevices, rank: int, batch: int, whole: bool = True, meet: bool = False) -> float:
    """A rank's emulated share of a step: its host's input, its device, its optimizer step, one after another
    (``whole=False``: its device alone). ``meet``: the ranks meet after the optimizer steps (Lightning's loop at each
    step's start), so every rank waits for the slowest one's."""
    device = devices.clean_ms(rank, batch)
    optimizer = max(devices.optimizer_ms_of(r) for r in range(3)) if meet else devices.optimizer_ms_of(rank)
    return devices.host_ms(rank, batch) + device + optimizer if whole else device


def emulated_ms(devices: EmulatedDevices, split, meet: bool = False) -> float:
    """The slowest rank's emulated step."""
    return max(own_ms(devices, r, b, meet=meet) for r, b in enumerate(split))


def best_split(
    devices: EmulatedDevices, total: int, with_host: bool = True, meet: bool = False
) -> tuple[tuple[int, ...], float]:
    """The split with the least emulated step time (``with_host=False``: by the devices alone), by brute force."""
    splits = every_split(total)
    times = [max(own_ms(devices, r, b, with_host, meet) for r, b in enumerate(split)) for split in splits]
    best = int(np.argmin(times))
    return tuple(int(b) for b in splits[best]), emulated_ms(devices, splits[best], meet)


# -- the speed model alone: records with an input wait --------------------------------------------------------------


def records_of(devices: EmulatedDevices, splits, host_measured: bool = True, meet: bool = False) -> list[StepRecord]:
    """Three ranks' records of steps at ``splits``, each step's reduction 2 ms; ``meet``: the ranks meet between the
    optimizer steps and the next input (Lightning's loop), where the quicker ones wait for the slowest (``gap``)."""
    records = []
    for step, split in enumerate(splits):
        compute = [devices.clean_ms(r, b) / 1000 for r, b in enumerate(split)]
        host = [devices.host_ms(r, b) / 1000 for r, b in enumerate(split)]
        after = [devices.optimizer_ms_of(r) / 1000 for r in range(len(split))]
        waits = [max(after) - a if meet else 0.0 for a in after]
        # the ranks' own shares up to the reduction: after the meeting, the input and compute; else the optimizer too
        ready = [h + c + (0.0 if meet else a) for h, c, a in zip(host, compute, after, strict=True)]
        for r, b in enumerate(split):
            # an epoch's first step every tenth: its input wait is not measured
            waited = host[r] if host_measured and step % 10 else None
            # batch start to end: to the reduction, then its optimizer (counted in `ready` already where none meet)
            step_time = max(ready) + 0.002 - host[r] + (after[r] if meet else 0.0)
            record = StepRecord(step, r, int(b), compute[r], step_time, 0.002, 0.002, host=waited, after=after[r])
            records.append(dataclasses.replace(record, gap=waits[r] if step % 10 else None))
    return records


@pytest.mark.parametrize(
    ("device_ms", "host_ms", "optimizer_ms"),
    [
        ([1.0, 1.0, 1.0], [0.25, 1.0, 2.0], 1.0),
        ([0.5, 1.0, 2.0], [1.0, 1.0, 1.0], 1.0),
        ([0.5, 1.0, 2.0], [2.0, 0.5, 0.1], 1.0),
        ([1.0, 1.0, 1.0], 0.0, [0.0, 10.0, 30.0]),
        ([0.5, 1.0, 2.0], 0.5, [5.0, 10.0, 20.0]),
    ],
)
def test_the_model_splits_the_whole_step_as_brute_force_does(device_ms, host_ms, optimizer_ms):
    devices = EmulatedDevices(device_ms, 5.0, host_per_sample_ms=host_ms, optimizer_ms=optimizer_ms)
    model = SpeedModel(3, SpeedModelSettings(warmup_samples=0))
    model.add(records_of(devices, [(32, 32, 32), (40, 30, 26), (26, 34, 36)] * 10))
    plan = model.plan_split(TOTAL)
    _, best = best_split(devices, TOTAL)
    assert emulated_ms(devices, plan.local_batch_sizes) <= 1.01 * best, plan
    assert plan.predicted_step_time * 1000 == pytest.approx(best, rel=0.05)


@pytest.mark.parametrize("meet", [False, True])
def test_where_the_ranks_meet_after_the_optimizer_steps_they_no_longer_move_the_split(meet):
    # the same optimizer steps of 0, 10 and 30 ms: in series with each rank's next step they move the split to
    # (45, 35, 16); where the loop makes the ranks meet after them, every rank waits for the 30 ms and the best split
    # is the devices' (even here): each rank's measured time from its reduction to its next input is then the same
    devices = EmulatedDevices(1.0, 5.0, optimizer_ms=[0.0, 10.0, 30.0])
    model = SpeedModel(3, SpeedModelSettings(warmup_samples=0))
    model.add(records_of(devices, [(32, 32, 32), (40, 30, 26), (26, 34, 36)] * 10, meet=meet))
    plan = model.plan_split(TOTAL).local_batch_sizes
    best, best_ms = best_split(devices, TOTAL, meet=meet)
    assert emulated_ms(devices, plan, meet) <= 1.01 * best_ms, (plan, best)
    assert (plan[0] - plan[2] > 20) is not meet, plan


@pytest.mark.parametrize("micro_steps", [1, 2, 4])
def test_an_accumulation_window_pays_its_optimizer_steps_once(micro_steps):
    # per rank, a window of k micro-steps costs k (its input and compute), then its optimizer step once: the best split
    # weighs the optimizer steps less the more micro-steps share them
    devices = EmulatedDevices(1.0, 5.0, optimizer_ms=[0.0, 10.0, 30.0])
    records, step = [], 0
    for split in [(32, 32, 32), (40, 30, 26), (26, 34, 36)] * 10:
        for micro in range(micro_steps):
            last = micro == micro_steps - 1  # the optimizer's micro-step: it reduces, then the optimizer runs
            compute = [devices.clean_ms(r, b) / 1000 for r, b in enumerate(split)]
            after = [devices.optimizer_ms_of(r) / 1000 if last else 0.0005 for r in range(3)]
            for r, b in enumerate(split):
                reduced = 0.002 if last else None
                step_time = max(map(sum, zip(compute, after, strict=True))) + (0.002 if last else 0.0)
                record = StepRecord(step, r, b, compute[r], step_time, reduced, reduced, host=0.0, after=after[r])
                records.append(dataclasses.replace(record, gap=0.0))
            step += 1
    model = SpeedModel(3, SpeedModelSettings(warmup_samples=0))
    model.add(records)

    def window_ms(split) -> float:
        return max(micro_steps * devices.clean_ms(r, b) + devices.optimizer_ms_of(r) for r, b in enumerate(split))

    best = min(window_ms(split) for split in every_split(TOTAL))
    plan = model.plan_split(TOTAL)
    assert window_ms(plan.local_batch_sizes) <= 1.01 * best, (plan, best)
    predicted = model.predict(plan.local_batch_sizes, micro_steps)
    assert predicted * 1000 == pytest.approx(window_ms(plan.local_batch_sizes), rel=0.05)


def test_without_the_input_wait_the_model_splits_by_the_devices_alone():
    # the same records, the wait not measured: the old split by the device span, a control for the test above
    devices = EmulatedDevices([0.5, 1.0, 2.0], 5.0, host_per_sample_ms=1.0)
    model = SpeedModel(3, SpeedModelSettings(warmup_samples=0))
    model.add(records_of(devices, [(32, 32, 32), (40, 30, 26), (26, 34, 36)] * 10, host_measured=False))
    device_only, _ = best_split(devices, TOTAL, with_host=False)
    assert np.abs(np.subtract(model.plan_split(TOTAL).local_batch_sizes, device_only)).max() <= 1


# -- end to end: Lightning, three ranks, the hosts' cost in the collate function ------------------------------------


class Regressor(pl.LightningModule):
    def __init__(self, loader: DataLoader) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.loader = loader

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return self.loader


class DumpPlan(Callback):
    """Rank zero writes the plan in force and its records' input waits when training ends."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            cannikin = next(cb for cb in trainer.callbacks if isinstance(cb, BalancingCallback))
            self.path.write_text(json.dumps({"plan": list(cannikin.plan.local_batch_sizes)}))


def balance_with_hosts(
    tmp_path,
    device_ms,
    host_ms,
    epochs: int = 6,
    workers: int = 0,
    optimizer_ms: float | list[float] = 0.0,
    accumulation: int = 1,
) -> tuple[int, ...]:
    torch.manual_seed(0)
    cluster = EmulatedCluster(device_ms, 5.0, host_per_sample_ms=host_ms, optimizer_ms=optimizer_ms)
    loader = DataLoader(
        IndexedRegression(960 * accumulation),
        batch_size=TOTAL // 3,
        shuffle=True,
        collate_fn=cluster.collate_fn(),
        num_workers=workers,
        persistent_workers=workers > 0,
    )
    out = tmp_path / "plan.json"
    callbacks = [cluster, DumpPlan(out)]
    strategy = CannikinStrategy(start_method="fork")
    trainer = quiet_trainer(strategy, 3, callbacks, max_epochs=epochs, accumulate_grad_batches=accumulation)
    trainer.fit(Regressor(loader))
    return tuple(json.loads(out.read_text())["plan"])


def test_unequal_hosts_with_equal_devices_move_the_split(tmp_path):
    devices = EmulatedDevices(1.0, 5.0, host_per_sample_ms=[0.25, 1.0, 2.0])
    plan = balance_with_hosts(tmp_path, 1.0, [0.25, 1.0, 2.0])
    best, best_ms = best_split(devices, TOTAL)  # (47, 29, 20): the even split costs 1.4x as much
    assert plan[0] > plan[1] > plan[2] and sum(plan) == TOTAL, plan
    assert emulated_ms(devices, plan) <= 1.05 * best_ms, (plan, best)


def test_equal_hosts_with_unequal_devices_split_less_skewed_than_by_the_devices(tmp_path):
    devices = EmulatedDevices([0.5, 1.0, 2.0], 5.0, host_per_sample_ms=1.0)
    plan = balance_with_hosts(tmp_path, [0.5, 1.0, 2.0], 1.0)
    device_only, device_only_ms = best_split(devices, TOTAL, with_host=False)  # (55, 27, 14)
    device_only_ms = emulated_ms(devices, device_only)  # 1.26x the optimum, with the hosts' cost counted
    best, best_ms = best_split(devices, TOTAL)  # (43, 32, 21)
    assert plan[0] < device_only[0] and plan[2] > device_only[2], (plan, device_only)
    assert emulated_ms(devices, plan) <= 1.05 * best_ms, (plan, best, device_only_ms / best_ms)


def test_input_that_workers_hide_costs_nothing(tmp_path):
    # the same equal hosts, now in two loader workers per rank that keep ahead of the step (the fastest rank's batch
    # takes its worker 55 ms, two workers deliver one every 28 ms, its step lasts 33 ms): the device waits for
    # nothing, so the split is the devices' alone, not the one the hosts' cost in series would give
    devices = EmulatedDevices([0.5, 1.0, 2.0], 5.0)
    plan = balance_with_hosts(tmp_path, [0.5, 1.0, 2.0], 1.0, workers=2)
    device_only, best_ms = best_split(devices, TOTAL)  # (55, 27, 14); in series: (43, 32, 21)
    assert plan[0] > 48 and plan[2] < 18, (plan, device_only)
    assert emulated_ms(devices, plan) <= 1.05 * best_ms, (plan, device_only)


OPTIMIZER_MS = (0.0, 10.0, 30.0)


def with_loop(loop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """How the ranks meet between the steps: ``"none"`` (Lightning before 2.5.2, a Fabric loop), ``"barrier"`` (every
    rank waits for every other) or ``"lightning"`` (this Lightning's own: from 2.5.2 it broadcasts from rank zero at
    each step's start, its SIGTERM check; skipped where it does not)."""
    if loop == "lightning":
        if not loop_meets_each_step():
            pytest.skip("this Lightning's loop does not broadcast at each step")
        return
    meeting = (lambda self: None) if loop == "none" else (lambda self: torch.distributed.barrier())
    monkeypatch.setattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor", meeting, raising=False)


def lead_ms(loop: str, rank: int) -> float:
    """When ``rank`` can start its next input after the reduction: its own optimizer step where the ranks do not
    meet, the slowest one's at a barrier; at gloo's broadcast from rank zero, rank zero sends once every rank is there
    and another rank receives once rank zero and itself are."""
    if loop == "none":
        return OPTIMIZER_MS[rank]
    if loop == "barrier" or rank == 0:
        return max(OPTIMIZER_MS)
    return max(OPTIMIZER_MS[rank], OPTIMIZER_MS[0])


@pytest.mark.parametrize("loop", ["none", "barrier", "lightning"])
def test_unequal_optimizer_steps_cost_what_the_loop_makes_them_cost(tmp_path, monkeypatch, loop):
    # the optimizer steps run after the all-reduce, outside the compute span, and each rank starts its next input when
    # the loop lets it: at once without a meeting (a rank slower in its optimizer step gets fewer samples: best
    # (45, 35, 16), the even split 1.33x its time), all together at a barrier (the even split is the best), or as
    # Lightning's broadcast from rank zero releases it (rank 1 first: best (25, 45, 25))
    with_loop(loop, monkeypatch)
    devices = EmulatedDevices(1.0, 5.0)
    plan = balance_with_hosts(tmp_path, 1.0, 0.0, optimizer_ms=list(OPTIMIZER_MS))

    def step_ms(split) -> float:
        return max(lead_ms(loop, r) + devices.clean_ms(r, b) for r, b in enumerate(split))

    best = min(every_split(TOTAL), key=step_ms)
    assert sum(plan) == TOTAL and step_ms(plan) <= 1.05 * step_ms(best), (plan, tuple(best))
    if loop == "none":
        assert plan[0] > plan[1] > plan[2], plan


@pytest.mark.parametrize("loop", ["none", "barrier"])
def test_four_micro_steps_weigh_the_optimizer_steps_once_a_window(tmp_path, monkeypatch, loop):
    # a window of 4 micro-steps: without a meeting a rank costs 4 (b + 5) + its optimizer step (best (35, 33, 28) at
    # 162 ms; the optimizer steps taken as equal, the even split, 178; charged to every micro-step, (45, 35, 16), 200);
    # at a barrier every micro-step starts together, the first after the slowest optimizer step
    with_loop(loop, monkeypatch)
    devices = EmulatedDevices(1.0, 5.0)
    plan = balance_with_hosts(tmp_path, 1.0, 0.0, optimizer_ms=list(OPTIMIZER_MS), accumulation=4)

    def window_ms(split) -> float:
        if loop == "none":
            return max(4 * devices.clean_ms(r, b) + OPTIMIZER_MS[r] for r, b in enumerate(split))
        return max(OPTIMIZER_MS) + 4 * max(devices.clean_ms(r, b) for r, b in enumerate(split))

    best = min(every_split(TOTAL), key=window_ms)
    assert sum(plan) == TOTAL and window_ms(plan) <= 1.05 * window_ms(best), (plan, tuple(best))


def test_the_optimizer_steps_survive_a_checkpoint_and_an_older_one_loads():
    devices = EmulatedDevices(1.0, 5.0, optimizer_ms=[0.0, 10.0, 30.0])
    model = SpeedModel(3, SpeedModelSettings(warmup_samples=0))
    model.add(records_of(devices, [(32, 32, 32), (40, 30, 26), (26, 34, 36)] * 10))
    state = json.loads(json.dumps(model.state_dict()))
    restored = SpeedModel(3, SpeedModelSettings(warmup_samples=0))
    restored.load_state_dict(state)
    assert restored.after_offsets() == pytest.approx([0.0, 0.010, 0.030])
    assert restored.plan_split(TOTAL).local_batch_sizes == model.plan_split(TOTAL).local_batch_sizes
    older = SpeedModel(3, SpeedModelSettings(warmup_samples=0))
    older.load_state_dict({key: value for key, value in state.items() if key != "afters"})  # saved before `after`
    assert older.after_offsets() == pytest.approx([0.0, 0.0, 0.0])
