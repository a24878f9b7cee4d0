"""gpu_shares' step decomposition (a known broadcast wait and a known input are reported as those) and its MPS guard
(a daemon that does not answer is skipped within its bound, and the run goes on time-sliced)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from benchmarks import gpu_shares
from benchmarks.gpu_shares import SMOKE, FetchTimedLoader, Mps, SyntheticLoop, probe_client, synthetic_result
from benchmarks.shortfall import PARTS, decompose

ROOT = Path(__file__).resolve().parent.parent


def test_a_known_broadcast_wait_and_input_are_reported_as_exactly_those() -> None:
    # Cannikin's loop waits 12 ms at the broadcast (DDP's 4) and 2.5 ms for its input (DDP's 0.3): different numbers,
    # so parts swapped or merged cannot pass
    loop = SyntheticLoop(broadcast_ms=(4.0, 12.0), input_ms=(0.3, 2.5), allreduce_ms=(6.0, 6.0))
    result = synthetic_result(loop=loop)
    shortfall = result["summary"]["compute"]["shortfall"]
    path = shortfall["path_ms"]
    assert path["cannikin"]["broadcast"] == pytest.approx(12.0) and path["ddp"]["broadcast"] == pytest.approx(4.0)
    assert path["cannikin"]["input"] == pytest.approx(2.5) and path["ddp"]["input"] == pytest.approx(0.3)
    assert path["cannikin"]["optimizer"] == pytest.approx(max(loop.optimizer_ms))  # the last rank at the broadcast
    assert path["cannikin"]["other"] == pytest.approx(loop.pre_ms)
    assert shortfall["fixed_ms"] == pytest.approx({"allreduce": 6.0, "broadcast": 4.0, "optimizer": 2.2})
    # each part's ratio points: Cannikin's excess less the ideal's share of DDP's, over DDP's cycle
    ddp_cycle, ideal = shortfall["cycle_ms"]["ddp"], shortfall["ideal_ratio"]
    points = shortfall["contributions"]
    assert points["broadcast"] == pytest.approx((12.0 - 4.0) / ddp_cycle)
    assert points["input"] == pytest.approx((2.5 - ideal * 0.3) / ddp_cycle)
    assert ideal + sum(points.values()) == pytest.approx(shortfall["measured_ratio"])
    assert shortfall["cause"] == "broadcast"
    assert "12.00 ms" in shortfall["cause_line"] and "4.00 ms" in shortfall["cause_line"]
    # with the input the larger cost, the input is named instead
    slow_input = synthetic_result(loop=SyntheticLoop(broadcast_ms=(4.0, 5.0), input_ms=(0.3, 9.0)))
    assert slow_input["summary"]["compute"]["shortfall"]["cause"] == "input"


def test_the_ideal_holds_the_fixed_costs_and_a_missing_rank_gives_none() -> None:
    lines = [(0.1, 0.0), (0.2, 0.0)]  # ms a sample: T* = 30 / 15 = 2 ms for 30 samples, T_even = 3 ms
    row = {"batch": 15, "compute_ms": 3.0, "host_ms": 0.0, "gap_ms": 1.0, "exposed_ms": 0.5, "after_ms": 0.5}
    rows = {"ddp": [row | {"exposed_ms": 2.0, "cycle_ms": 6.5}, row | {"cycle_ms": 5.0}], "cannikin": [row, row]}
    rows["cannikin"] = [r | {"cycle_ms": 5.0, "batch": 20 - 10 * i} for i, r in enumerate(rows["cannikin"])]
    result = decompose(rows, lines, 30)
    assert result is not None
    assert result["ideal_ratio_lines"] == pytest.approx(2 / 3)
    assert result["ideal_ratio"] == pytest.approx((2 + 2) / (3 + 2))  # fixed: 0.5 + 1 + 0.5 ms
    assert set(result["contributions"]) == set(PARTS)
    rows["cannikin"][1] = rows["cannikin"][1] | {"gap_ms": None}
    assert decompose(rows, lines, 30) is None


class _SlowFetch(Dataset):
    """Every batch takes ``fetch_s`` to fetch (in the training process: no workers)."""

    def __init__(self, fetch_s: float) -> None:
        self.fetch_s = fetch_s
        self.x = torch.randn(64, 4)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.x[index].sum(0, keepdim=True)

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        time.sleep(self.fetch_s)
        return [self[i] for i in indices]


def test_a_real_loop_times_the_input_from_the_loaders_fetch_and_the_wait_before_it_as_the_gap() -> None:
    """A one-process Lightning fit whose loader takes 40 ms a batch and whose loop waits 20 ms between a step's end and
    the next fetch (where Lightning's broadcast waits): host is the 40, gap the 20. Marked at the batch's end, as
    before, the 20 would land in host and gap would be about 0."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    fetch_s, wait_s = 0.040, 0.020

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class WaitBetweenSteps(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            time.sleep(wait_s)  # after the timer's step end (listed after it), before the loop's next fetch

    spans = gpu_shares.spans_callback(torch.device("cpu"), world=1)
    loader = FetchTimedLoader(_SlowFetch(fetch_s), batch_size=8)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        callbacks=[spans, WaitBetweenSteps()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(), loader)
    assert spans.fetch_hooked
    steady = gpu_shares.step_medians(spans.records, spans.epoch_of, spans.sizes_of)["steady"]
    assert fetch_s * 1e3 - 1 <= steady["host_ms"] < fetch_s * 1e3 + 15, steady
    assert wait_s * 1e3 - 1 <= steady["gap_ms"] < wait_s * 1e3 + 15, steady
    # the cycle is each step's gap + input + step, and its median: the parts' medians add up to it within the jitter
    # of a loaded host (they need not add up exactly: 62.79 against 62.87 ms once here)
    assert abs(steady["cycle_ms"] - (steady["host_ms"] + steady["gap_ms"] + steady["step_ms"])) < 2.0, steady


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_an_mps_daemon_that_hangs_at_its_start_is_skipped_within_its_bound(tmp_path: Path) -> None:
    control = _script(tmp_path / "control", "exec sleep 60\n")  # `-d` never returns
    started = time.monotonic()
    mps = Mps.start(control, start_timeout=2.0)
    assert time.monotonic() - started < 10.0
    assert not mps.active and not mps.started and mps.sharing == "time-sliced"
    assert "did not return in 2 s" in mps.note


def test_a_probe_that_does_not_answer_is_asked_to_end_before_it_is_killed(tmp_path: Path) -> None:
    ended = tmp_path / "ended"
    polite = ["bash", "-c", f"trap 'echo yes > {ended}; exit 3' TERM; sleep 60 & wait"]
    started = time.monotonic()
    ok, why = probe_client(polite, timeout=1.0, share=15)
    assert not ok and "no answer in 1 s" in why and ended.read_text().strip() == "yes"
    deaf = ["bash", "-c", "trap '' TERM; sleep 60 & wait"]  # SIGTERM ignored: killed after the grace
    ok, _ = probe_client(deaf, timeout=1.0, share=15)
    assert not ok and time.monotonic() - started < 1.0 + 1.0 + 2 * gpu_shares.CLIENT_TERM_GRACE_S + 5.0


@pytest.mark.skipif(not Path("/proc/self/comm").exists(), reason="finds the daemon in /proc")
def test_a_daemon_whose_clients_do_not_answer_is_stopped_even_when_it_ignores_quit(tmp_path: Path, monkeypatch) -> None:
    # named as the real one, so that it is found (and stopped) the same way: a daemon that starts, then ignores quit
    body = (
        'if [ "$1" = -d ]; then "$0" serve </dev/null >/dev/null 2>&1 & exit 0; fi\n'
        'if [ "$1" = serve ]; then trap "" TERM; while true; do sleep 0.2; done; fi\n'
        "exec sleep 60\n"  # the client's `quit`: never answered
    )
    control = _script(tmp_path / "nvidia-cuda-mps-control", body)
    monkeypatch.setattr(gpu_shares, "MPS_QUIT_TIMEOUT_S", 1.0)
    if gpu_shares.mps_daemon_running():
        pytest.skip("an MPS daemon runs on this machine: not touched")
    try:
        started = time.monotonic()
        mps = Mps.start(control, start_timeout=5.0, probe=["sleep", "60"], probe_timeout=1.0)
        assert time.monotonic() - started < 20.0
        assert not mps.active and not mps.started and mps.sharing == "time-sliced"
        assert "a client did not work under it (no answer in 1 s)" in mps.note
        assert not gpu_shares.mps_daemon_running(), "the daemon started here outlived its skip"
    finally:
        for pid in gpu_shares.mps_daemon_pids():  # only the fake started above can be here
            os.kill(pid, 9)


def test_a_run_whose_mps_hangs_goes_on_time_sliced(tmp_path: Path) -> None:
    control = _script(tmp_path / "control", "exec sleep 60\n")
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_shares.py"), "--smoke", "--out", str(tmp_path)]
    command += ["--logs", str(tmp_path / "logs"), "--workloads", "compute", "--mps-control", control]
    done = subprocess.run(
        [*command, "--mps-timeout", "2"], cwd=ROOT, capture_output=True, text=True, timeout=SMOKE.run_timeout * 3
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_shares.json").read_text())
    assert result["sharing"] == "time-sliced" and result["mps"]["seconds"] < 5.0
    assert result["summary"]["compute"]["pairs"] == 1 and result["summary"]["compute"]["shortfall"] is not None
    ranks = result["runs"][0]["ranks"]
    assert all(rank["input_from"] == "the loader's fetch" for rank in ranks)
