"""A short training run on the installed wheel: 2 CPU ranks (fork), an emulated 1x:3x cluster, a CSV logger.

Run by ``.ci/wheel_check`` with ``python -I`` from outside the source tree; argv[1] is the virtual environment.
"""

import json
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_cannikin
from lightning_cannikin import Cannikin, CannikinSettings, EmulatedCluster

venv = Path(sys.argv[1]).resolve()
assert Path(lightning_cannikin.__file__).resolve().is_relative_to(venv), lightning_cannikin.__file__


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class FinalPlan(pl.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            self.path.write_text(json.dumps(list(trainer.strategy.plan.local_batch_sizes)))


torch.manual_seed(0)
x = torch.randn(384, 4)
data = TensorDataset(x, x @ torch.randn(4, 1))
out = Path(tempfile.mkdtemp())
trainer = pl.Trainer(
    strategy="cannikin_fork",
    accelerator="cpu",
    devices=2,
    max_epochs=2,
    logger=CSVLogger(out, name="run"),
    callbacks=[
        EmulatedCluster([1.0, 3.0], fixed_ms=2.0),
        Cannikin(settings=CannikinSettings(warmup_steps=4)),
        FinalPlan(out / "plan.json"),
    ],
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(Regression(), DataLoader(data, batch_size=16, shuffle=True))
plan = json.loads((out / "plan.json").read_text())
assert sum(plan) == 32 and plan[0] > plan[1], f"rank 0 is 3x faster and should get more: {plan}"
profile = out / "run" / "version_0" / "cannikin_profile.json"
assert profile.is_file(), f"no profile in the logger's run folder: {sorted(p.name for p in out.rglob('*'))}"
print(f"training on the installed wheel: final split {plan}, profile in {profile.parent.relative_to(out)}")
