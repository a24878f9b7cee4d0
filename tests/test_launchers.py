"""Launching ``strategy="cannikin"`` the ways users do: torchrun across two "nodes", SLURM's srun, LightningCLI + YAML.

Every run is a real multi-process job on CPU (gloo) over the loopback address, in subprocesses with a hard timeout;
on timeout or failure every process they started (torchrun's workers included) is killed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 240.0  # per job; a healthy run takes 10-40 s on two cores
GRACE_S = 20.0  # after one process of a job fails, how long the others may take to notice before they are killed

# variables of launchers and cluster schedulers that must not leak from the test's own environment into the jobs
_LAUNCH_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "GROUP_WORLD_SIZE"}
_LAUNCH_VARS |= {"MASTER_ADDR", "MASTER_PORT", "KUBERNETES_PORT", "JSM_NAMESPACE_SIZE"}
_LAUNCH_PREFIXES = ("SLURM_", "TORCHELASTIC_", "LSB_", "PL_", "OMPI_", "PMI_")


@dataclass
class Finished:
    """One process of a job, after it ended."""

    returncode: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        return f"exit {self.returncode}\n--- stdout ---\n{self.stdout[-3000:]}\n--- stderr ---\n{self.stderr[-6000:]}"


def free_port() -> int:
    """A TCP port on the loopback address that was free a moment ago (bind to port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher or scheduler variables, plus ``extra``."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _LAUNCH_VARS and not key.startswith(_LAUNCH_PREFIXES)
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(parent, []).append(int(entry.name))
    return tree


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every descendant (torchrun starts its workers in new sessions)."""
    tree = _children()
    pending, found = [pid], []
    while pending:
        current = pending.pop()
        found.append(current)
        pending.extend(tree.get(current, []))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for child in found:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)


def run_job(
    commands: list[list[str]], envs: list[dict[str, str]], workdir: Path, timeout: float = TIMEOUT_S
) -> list[Finished]:
    """Start every command at once (each in its own session), wait for all, and kill everything on timeout/failure."""
    procs: list[subprocess.Popen] = []
    outputs: list[tuple[Path, Path]] = []
    try:
        for index, (command, env) in enumerate(zip(commands, envs, strict=True)):
            out, err = workdir / f"proc{index}.out", workdir / f"proc{index}.err"
            outputs.append((out, err))
            with out.open("wb") as stdout, err.open("wb") as stderr:
                procs.append(
                    subprocess.Popen(
                        command,
                        cwd=workdir,  # whatever a run writes into its working directory stays in tmp
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=stdout,
                        stderr=stderr,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout
        while any(proc.poll() is None for proc in procs):
            now = time.monotonic()
            if any(proc.returncode not in (None, 0) for proc in procs):
                deadline = min(deadline, now + GRACE_S)  # the others would wait for the failed rank forever
            if now > deadline:
                break
            time.sleep(0.2)
        # a job where one process failed is reported by its failure (the others were killed as a consequence)
        failed = any(proc.returncode not in (None, 0) for proc in procs)
        timed_out = not failed and any(proc.poll() is None for proc in procs)
    finally:
        for proc in procs:
            kill_tree(proc.pid)  # also reaps workers left behind by a launcher that exited
            proc.wait()
    results = [
        Finished(proc.returncode, out.read_text(errors="replace"), err.read_text(errors="replace"))
        for proc, (out, err) in zip(procs, outputs, strict=True)
    ]
    if timed_out:
        report = "\n".join(f"=== process {i}: {r.describe()}" for i, r in enumerate(results))
        pytest.fail(f"job did not finish within {timeout:.0f} s (killed)\n{report}")
    return results


def assert_all_succeeded(results: list[Finished]) -> None:
    for index, result in enumerate(results):
        assert result.returncode == 0, f"process {index} failed: {result.describe()}"


def final_split(stdout: str) -> list[int]:
    match = re.search(r"^final local batch sizes \[([\d, ]+)\]$", stdout, re.MULTILINE)
    assert match, f"no final split printed:\n{stdout}"
    return [int(b) for b in match.group(1).split(",")]


def test_torchrun_two_nodes(tmp_path: Path) -> None:
    """examples/torchrun_two_nodes.sh: two torchrun commands (node ranks 0 and 1) meet on loopback and balance."""
    port = free_port()
    listing = subprocess.run(
        ["bash", str(EXAMPLES / "torchrun_two_nodes.sh")],
        env=clean_env(DRY_RUN="1", MASTER_PORT=str(port), PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    commands = [shlex.split(line) for line in listing.stdout.splitlines() if line.strip()]
    assert len(commands) == 2
    for node_rank, command in enumerate(commands):
        flags = " ".join(command)
        assert f"--nnodes 2 --node_rank {node_rank} --nproc_per_node 1" in flags
        assert f"--master_addr 127.0.0.1 --master_port {port}" in flags
    results = run_job(commands, [clean_env(), clean_env()], tmp_path)
    assert_all_succeeded(results)
    node0, node1 = results[0].stdout, results[1].stdout
    assert "cluster_environment=TorchElasticEnvironment world_size=2 num_nodes=2" in node0
    assert "epoch 0: local batch sizes [32, 32]" in node0  # every rank starts with the DataLoader's batch_size
    assert "training finished" in node0
    assert "training finished" not in node1, "node 1's process must not be global rank 0"
    fast, slow = final_split(node0)  # node 0 is emulated 1x, node 1 3x slower per sample
    assert fast + slow == 64
    assert fast > slow, node0
    accuracy = float(re.search(r"test_accuracy=([\d.]+)", node0).group(1))
    assert accuracy > 0.5, node0


def test_slurm_environment(tmp_path: Path) -> None:
    """Two tasks with the variables srun sets (2 nodes x 1 task): Lightning picks SLURMEnvironment and ranks balance."""
    port = str(free_port())
    common = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "cannikin-test",  # "bash" or "interactive" would make Lightning ignore SLURM
        "SLURM_NTASKS": "2",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_NODELIST": "node[0-1]",
        "MASTER_ADDR": "127.0.0.1",  # set here, so Lightning does not resolve the first host of SLURM_NODELIST
        "MASTER_PORT": port,
    }
    envs = [clean_env(**common, SLURM_PROCID=str(rank), SLURM_LOCALID="0", SLURM_NODEID=str(rank)) for rank in (0, 1)]
    # rank 1 is the fast device here, so the balancer must move samples away from rank zero
    command = [sys.executable, str(EXAMPLES / "train_multinode.py"), "--num-nodes", "2", "--devices", "1"]
    command += ["--per-sample-ms", "3", "1"]
    results = run_job([command, command], envs, tmp_path)
    assert_all_succeeded(results)
    rank0 = results[0].stdout
    assert "cluster_environment=SLURMEnvironment world_size=2 num_nodes=2" in rank0
    assert "training finished" in rank0
    assert "training finished" not in results[1].stdout
    slow, fast = final_split(rank0)
    assert slow + fast == 64
    assert fast > slow, rank0
    accuracy = float(re.search(r"test_accuracy=([\d.]+)", rank0).group(1))
    assert accuracy > 0.5, rank0


def test_slurm_layout_mismatch_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """``devices`` that disagree with ``--ntasks-per-node`` stop ``fit`` before any process waits on another."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    import lightning_cannikin  # noqa: F401  (registers strategy="cannikin")

    for key in list(os.environ):
        if key in _LAUNCH_VARS or key.startswith(_LAUNCH_PREFIXES):
            monkeypatch.delenv(key)
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "cannikin-test", "SLURM_NTASKS": "2", "SLURM_NNODES": "2"}
    slurm |= {"SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    slurm |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # set through monkeypatch: undone after
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    trainer = pl.Trainer(strategy="cannikin", accelerator="cpu", num_nodes=2, devices=2, logger=False)
    assert type(trainer.strategy.cluster_environment).__name__ == "SLURMEnvironment"
    # Lightning checks the layout when it launches, before the process group exists
    with pytest.raises(ValueError, match="ntasks-per-node=1"):
        trainer.fit(BoringModel())


def test_lightning_cli_yaml(tmp_path: Path) -> None:
    """examples/train_cli.py with examples/cannikin_cli.yaml: registry strategy + callbacks from YAML train 2 ranks."""
    pytest.importorskip("jsonargparse")
    from lightning_utilities.core.imports import RequirementCache

    signatures = RequirementCache("jsonargparse[signatures]>=4.27.7")  # what LightningCLI itself checks
    if not signatures:
        pytest.skip(str(signatures))
    root_dir = tmp_path / "run"
    command = [sys.executable, str(EXAMPLES / "train_cli.py"), "fit", "--config", str(EXAMPLES / "cannikin_cli.yaml")]
    command += ["--trainer.max_epochs", "2", "--trainer.default_root_dir", str(root_dir)]
    (result,) = run_job([command], [clean_env()], tmp_path)
    assert_all_succeeded([result])
    out = result.stdout
    assert "strategy=CannikinStrategy world_size=2" in out
    callbacks = re.search(r"callbacks=\[(.*)\]", out).group(1)
    assert callbacks.count("'Cannikin'") == 1, "the YAML's callback must not get a default twin"
    assert "'EmulatedCluster'" in callbacks
    assert "cannikin replan_every_n_steps=10 local_batch_bounds=(4, 60) lr_scaling=adascale" in out
    fast, slow = final_split(out)  # rank 1 is emulated 3x slower per sample
    assert fast + slow == 64 and fast > slow, out
    assert slow >= 4 and fast <= 60, "local_batch_bounds from the YAML must hold"
    assert "training finished: epochs=2" in out
    assert "'val_acc'" in out
    (checkpoint,) = root_dir.glob("lightning_logs/version_0/checkpoints/*.ckpt")
    assert checkpoint.stat().st_size > 0
    assert (root_dir / "lightning_logs/version_0/config.yaml").exists()  # LightningCLI saved the resolved config


def test_shell_examples_parse() -> None:
    """The shell examples are valid bash, shellcheck-clean where shellcheck exists (.ci/examples runs them)."""
    for script in ("torchrun_two_nodes.sh", "slurm_job.sh"):
        path = EXAMPLES / script
        subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)
        if shutil.which("shellcheck"):  # optional: `apt-get install shellcheck`
            subprocess.run(["shellcheck", str(path)], check=True, timeout=60)
        assert "set -euo pipefail" in path.read_text()


_PROBE = """
import atexit, sys
import torch.distributed as dist
# registered before the strategy's hook, so it runs after it: what the interpreter's own teardown will find
atexit.register(lambda: print("group left at exit:", dist.is_initialized(), flush=True))
import lightning as L
import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning_cannikin import CannikinFabricStrategy
if sys.argv[1] == "trainer":
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    pl.Trainer(strategy="cannikin", accelerator="cpu", devices=1, max_steps=2, **quiet).fit(BoringModel())
else:
    L.Fabric(accelerator="cpu", devices=1, strategy=CannikinFabricStrategy()).launch()
print("group after the run:", dist.is_initialized(), flush=True)
"""


@pytest.mark.parametrize("frontend", ["trainer", "fabric"])
def test_a_run_ends_its_gloo_group_before_the_interpreter_exits(tmp_path: Path, frontend: str) -> None:
    # torch (2.13) aborts a process now and then when a gloo group is left to the interpreter's exit, and Lightning
    # ends its group at exit for NCCL only; the group stays usable until then (Lightning keeps it for trainer.test)
    (result,) = run_job([[sys.executable, "-c", _PROBE, frontend]], [clean_env()], tmp_path)
    assert_all_succeeded([result])
    assert "group after the run: True" in result.stdout, result.describe()
    assert "group left at exit: False" in result.stdout, result.describe()
