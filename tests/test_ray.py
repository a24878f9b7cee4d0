"""``strategy="cannikin_ray"`` in Ray Train: a local Ray cluster started by the test, 3 CPU workers, ``TorchTrainer``
and ``prepare_trainer``.

One Ray session for the module (a module-scoped fixture; it shuts Ray down and checks that no Ray process of it is
left). ``TorchTrainer`` runs: 2 epochs on 3 emulated devices (1x, 2x, 4x slower per sample) reporting Ray checkpoints,
a third epoch resumed from Ray's last checkpoint on 3 workers and on 2, and Ray's own strategy with the Cannikin
callback on one worker. The ranks record which samples they trained on, and a single process replays them to check
that the updates are the exact mean gradient. The checks outside Ray's workers need no cluster.
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray.train", reason="Ray Train is the `ray` extra: pip install 'lightning-cannikin[ray]'")

import torch  # noqa: E402

from tests.models import IndexedRegression, RecordingRegressor, read_records  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NUM_SAMPLES, BATCH = 480, 16  # 3 workers x 16: a global batch of 48, 10 steps per epoch
PER_SAMPLE_MS = [1.0, 2.0, 4.0]


class PlanRecordingRegressor(RecordingRegressor):
    """Also records every rank's sizes per step and the engine's state when training starts (after a restore)."""

    def on_train_start(self) -> None:
        # the callbacks' `on_train_start` ran first: a restored engine holds the checkpoint's state by now
        state = self.trainer.strategy.engine.state_dict()
        torch.save(state, Path(self.record_dir, f"start_state{self.global_rank}.pt"))

    def on_train_end(self) -> None:
        super().on_train_end()
        strategy = self.trainer.strategy
        record = {
            "strategy": [cls.__name__ for cls in type(strategy).__mro__],
            "environment": type(strategy.cluster_environment).__name__,
            "world_size": strategy.world_size,
            "plan": list(strategy.plan.local_batch_sizes),
        }
        Path(self.record_dir, f"meta{self.global_rank}.json").write_text(json.dumps(record))


def _train(config: dict[str, Any]) -> None:
    """The training function of every Ray worker."""
    import lightning.pytorch as pl
    import ray.train
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, RayTrainReportCallback, prepare_trainer

    import lightning_cannikin
    from lightning_cannikin import Cannikin, EmulatedCluster

    assert lightning_cannikin  # registers `strategy="cannikin_ray"`
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dataset = IndexedRegression(NUM_SAMPLES)
    model = PlanRecordingRegressor(dataset, batch_size=BATCH, record_dir=config["record_dir"])
    rays_own, sharded = config.get("rays_own_strategy", False), config.get("sharded", False)
    strategy: Any = RayDDPStrategy() if rays_own else "cannikin_ray"
    if sharded:
        from tests.test_fsdp import ShardedRegressor

        model = ShardedRegressor(dataset, batch_size=BATCH, record_dir=config["record_dir"])
        strategy = "cannikin_ray_fsdp"
    trainer = pl.Trainer(
        strategy=strategy,
        plugins=[RayLightningEnvironment()],
        accelerator="cpu",
        devices="auto",
        max_epochs=config["max_epochs"],
        callbacks=[EmulatedCluster(config["per_sample_ms"]), Cannikin(), RayTrainReportCallback()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if sharded:  # Ray has no wrapper of ModelParallelStrategy: its check refuses it, and the fit runs without it
        try:
            prepare_trainer(trainer)
        except RuntimeError as error:
            Path(config["record_dir"], "prepare_trainer.txt").write_text(str(error))
        trainer.fit(model)
        return
    trainer = prepare_trainer(trainer)
    if rays_own:  # a bad combination: it must fail before any training step, with the fix in its message
        try:
            trainer.fit(model)
        except ValueError as error:
            Path(config["record_dir"], "error.txt").write_text(f"{error}\nsteps trained: {len(model.steps)}")
        return
    # Ray 2.x's v2 API restores a run's own latest checkpoint, or one the caller passes in the loop's config
    checkpoint = ray.train.get_checkpoint() or config.get("checkpoint")
    if checkpoint is None:
        trainer.fit(model)
        return
    with checkpoint.as_directory() as folder:
        trainer.fit(model, ckpt_path=str(Path(folder, RayTrainReportCallback.CHECKPOINT_NAME)))


def _stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), or None once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _ray_pids() -> set[tuple[int, str]]:
    """This process's descendants (the local Ray cluster it started: GCS, raylet, workers), each as its pid and start
    time: pids wrap quickly on a busy machine (32768 here), and a pid reused by another process is not a Ray one."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(entry.name)) is not None:
            children.setdefault(int(fields[1]), []).append((int(entry.name), fields[19]))
    found: set[tuple[int, str]] = set()
    todo = [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child[0])
    return found


def _command_line(pid: int) -> str:
    try:
        return f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"{pid}: (gone)"


def _alive(process: tuple[int, str]) -> bool:
    pid, start = process
    fields = _stat(pid)
    # a zombie has exited (only its parent's wait is missing); another start time is another process on the same pid
    return fields is not None and fields[0] != "Z" and fields[19] == start


@pytest.fixture(scope="module")
def ray_session():
    if not Path("/proc").is_dir():
        pytest.skip("the leftover-process check reads /proc")
    import ray as ray_core

    before = _ray_pids()
    patch = pytest.MonkeyPatch()
    patch.setenv("RAY_USAGE_STATS_ENABLED", "0")  # a test run reports nothing to Ray's usage statistics
    ray_core.init(
        num_cpus=3,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=80 * 1024**2,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}},
    )
    started = _ray_pids() - before
    assert started, "ray.init started no local cluster"
    try:
        yield
    finally:
        # every Ray process of the session: the cluster's, and the workers it started meanwhile
        session = (_ray_pids() - before) | started
        ray_core.shutdown()
        patch.undo()
        deadline = time.monotonic() + 30
        while any(_alive(process) for process in session) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = sorted(_command_line(pid) for pid, start in session if _alive((pid, start)))
        assert not left, f"Ray processes left running after ray.shutdown(): {left}"


def _fit(tmp_path: Path, name: str, max_epochs: int, workers: int = 3, checkpoint: Any = None, **config: Any) -> Any:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    record_dir = tmp_path / name
    record_dir.mkdir()
    config.update(record_dir=str(record_dir), max_epochs=max_epochs, checkpoint=checkpoint)
    config.setdefault("per_sample_ms", PER_SAMPLE_MS[:workers])
    trainer = TorchTrainer(
        _train,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
        run_config=RunConfig(name=name, storage_path=str(tmp_path / "ray_results")),
    )
    return trainer.fit()


def _epoch_indices(records: list[dict], epoch: int) -> list[int]:
    return [i for r in records for s, e in zip(r["steps"], r["epochs"], strict=True) if e == epoch for i in s]


def _plain(value: Any) -> Any:
    """A state as JSON-like values, for an exact comparison (arrays and tensors as lists, tuples as lists)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def test_cannikin_ray_trains_balances_exactly_and_resumes_from_rays_checkpoint(ray_session, tmp_path):
    from tests.test_core_distributed import max_error, replay

    started = time.perf_counter()
    result = _fit(tmp_path, "first", max_epochs=2)
    assert result.error is None, result.error
    records = read_records(tmp_path / "first", 3)
    meta = [json.loads((tmp_path / "first" / f"meta{r}.json").read_text()) for r in range(3)]
    # Cannikin's strategy passed prepare_trainer as a RayDDPStrategy, under Ray's environment and world
    assert meta[0]["strategy"][:6] == [
        "CannikinRayStrategy",
        "_InRayWorker",
        "CannikinStrategy",
        "UnevenBatchesMixin",
        "RayDDPStrategy",
        "DDPStrategy",
    ]
    assert {m["environment"] for m in meta} == {"RayLightningEnvironment"} and {m["world_size"] for m in meta} == {3}

    # every sample once per epoch, with Cannikin's uneven sampler (not the DistributedSampler Ray's kwargs describe)
    for epoch in (0, 1):
        assert sorted(_epoch_indices(records, epoch)) == list(range(NUM_SAMPLES)), f"epoch {epoch}"
    steps = [[len(s) for s in r["steps"]] for r in records]
    assert steps[0][0] == steps[1][0] == steps[2][0] == BATCH  # the first plan is the DataLoader's batch size
    # the split moved towards the faster workers: by the second epoch rank 0 (1x) > rank 1 (2x) > rank 2 (4x)
    last = [s[-2] for s in steps]  # the epoch's last step may be short
    assert last[0] > last[1] > last[2] and sum(last) == 3 * BATCH, last

    # every update (20 of them, the split changing between) is the exact mean gradient of one process
    torch.manual_seed(0)
    dataset = IndexedRegression(NUM_SAMPLES)
    initial = copy.deepcopy(RecordingRegressor(dataset, BATCH, "").layer.state_dict())
    assert max_error(records, replay(dataset, initial, records, 1)) < 1e-5
    assert max_error(records, replay(dataset, initial, records, 1, weighting="ddp")) > 1e-3, "the check is sharp"

    # a third epoch from Ray's last checkpoint (epoch 1's end): Cannikin's state restored exactly, the plan continued
    assert result.checkpoint is not None
    with result.checkpoint.as_directory() as folder:
        saved = torch.load(Path(folder, "checkpoint.ckpt"), weights_only=False)
    resumed = _fit(tmp_path, "resumed", max_epochs=3, checkpoint=result.checkpoint)
    assert resumed.error is None, resumed.error
    state = saved["callbacks"]["Cannikin"]
    assert state["plan"] is not None and state["balancer"] is not None
    for rank in range(3):
        restored = _plain(torch.load(tmp_path / "resumed" / f"start_state{rank}.pt", weights_only=False))
        expected = _plain(state)
        # by design the one difference: restarted devices warm up again (their first samples are left out anew)
        assert restored["balancer"].pop("warm") == [0, 0, 0] and expected["balancer"].pop("warm") != [0, 0, 0]
        assert restored == expected, f"rank {rank} restored another state"
    again = read_records(tmp_path / "resumed", 3)
    assert {e for r in again for e in r["epochs"]} == {2}
    assert sorted(_epoch_indices(again, 2)) == list(range(NUM_SAMPLES))
    first_sizes = [len(r["steps"][0]) for r in again]
    assert first_sizes == state["plan"]["local_batch_sizes"], "the resumed run starts from the checkpoint's plan"

    # an elastic restart on 2 workers from the same checkpoint: the total is kept, split evenly while the new devices
    # are timed (a device's fit does not carry over to another world), then re-planned towards the faster worker
    elastic = _fit(tmp_path, "elastic", max_epochs=4, workers=2, checkpoint=result.checkpoint)
    assert elastic.error is None, elastic.error
    two = read_records(tmp_path / "elastic", 2)
    for epoch in (2, 3):
        assert sorted(_epoch_indices(two, epoch)) == list(range(NUM_SAMPLES)), f"epoch {epoch}"
    sizes = [[len(s) for s in r["steps"]] for r in two]
    assert sizes[0][0] == sizes[1][0] == 3 * BATCH // 2, "the checkpoint's total, split evenly on 2 workers"
    assert sizes[0][-2] > sizes[1][-2] and sizes[0][-2] + sizes[1][-2] == 3 * BATCH, f"rank 1 is 2x slower: {sizes}"
    print(f"three TorchTrainer runs in {time.perf_counter() - started:.0f} s")


def test_rays_own_strategy_with_the_cannikin_callback_fails_before_training_naming_the_fix(ray_session, tmp_path):
    result = _fit(tmp_path, "rays_own", max_epochs=1, workers=1, rays_own_strategy=True)
    assert result.error is None, result.error
    message = (tmp_path / "rays_own" / "error.txt").read_text()
    assert "cannot balance Ray's RayDDPStrategy" in message and "strategy='cannikin_ray'" in message, message
    assert "CannikinRayStrategy" in message and message.endswith("steps trained: 0"), message


def test_cannikin_fsdp_in_ray_workers_without_prepare_trainer_is_exact_and_sees_every_sample(ray_session, tmp_path):
    from tests.test_fsdp import max_error, mlp, replay

    result = _fit(tmp_path, "fsdp", max_epochs=1, sharded=True)
    assert result.error is None, result.error
    assert "Invalid strategy class" in (tmp_path / "fsdp" / "prepare_trainer.txt").read_text()
    records = read_records(tmp_path / "fsdp", 3)
    assert sorted(_epoch_indices(records, 0)) == list(range(NUM_SAMPLES))
    sizes = [[len(s) for s in r["steps"]] for r in records]
    assert len(set(map(len, sizes))) == 1 and sizes[0][0] == BATCH, sizes  # Ray's world of 3, equal step counts
    assert len({tuple(s) for s in zip(*sizes, strict=True)}) > 1, f"the split was re-planned: {sizes}"
    torch.manual_seed(0)
    dataset, initial = IndexedRegression(NUM_SAMPLES), mlp(4).state_dict()
    for record in records:  # every rank gathers the same full parameters: the exact mean gradient at every step
        assert max_error(record["params"], replay(dataset, initial, records, 1)) < 1e-5
    assert max_error(records[0]["params"], replay(dataset, initial, records, 1, weighting="ranks")) > 1e-3


# ---- outside a Ray worker: no cluster needed -------------------------------------------------------------------


def test_the_strategy_is_both_cannikins_and_rays_with_rays_device_and_cannikins_steps():
    from ray.train.lightning import RayDDPStrategy

    from lightning_cannikin import CannikinRayStrategy, CannikinStrategy
    from lightning_cannikin.training.frontends.uneven_strategy import UnevenBatchesMixin

    mro = CannikinRayStrategy.__mro__
    assert mro[2:6] == (CannikinStrategy, UnevenBatchesMixin, RayDDPStrategy, RayDDPStrategy.__mro__[1])
    # Ray's device and sampler world; Cannikin's launcher, environment setup, backward and loader; nothing else here
    assert CannikinRayStrategy.root_device is RayDDPStrategy.root_device
    assert CannikinRayStrategy.distributed_sampler_kwargs is RayDDPStrategy.distributed_sampler_kwargs
    for name in ("_configure_launcher", "backward", "process_dataloader", "_register_ddp_hooks", "optimizer_step"):
        assert getattr(CannikinRayStrategy, name) is getattr(CannikinStrategy, name), name
    with pytest.raises(ValueError, match="`start_method='fork'` cannot be combined with CannikinRayStrategy"):
        CannikinRayStrategy(start_method="fork")


def test_outside_a_ray_worker_the_strategy_fails_at_once_saying_where_it_runs():
    import lightning.pytorch as pl
    from ray.train.lightning import RayLightningEnvironment

    from lightning_cannikin import CannikinRayStrategy

    # the Trainer asks for the ranks when it is built: no process group is created, nothing waits
    for name, plain in (("cannikin_ray", "cannikin"), ("cannikin_ray_fsdp", "cannikin_fsdp")):
        message = rf"\(`strategy='{name}'`\) runs inside a Ray Train worker, and this process is not one.*'{plain}'"
        with pytest.raises(RuntimeError, match=message):
            pl.Trainer(strategy=name, plugins=[RayLightningEnvironment()], accelerator="cpu", logger=False)
    strategy = CannikinRayStrategy(cluster_environment=RayLightningEnvironment())
    with pytest.raises(RuntimeError, match=r"TorchTrainer\(train_loop_per_worker=\.\.\.\)"):
        strategy.setup_environment()
    # without Ray's environment (Lightning's own would count one process: a world of 1)
    with pytest.raises(ValueError, match=r"plugins=\[ray\.train\.lightning\.RayLightningEnvironment\(\)\]"):
        pl.Trainer(strategy="cannikin_ray", accelerator="cpu", logger=False)
