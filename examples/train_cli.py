"""LightningCLI with Cannikin configured from YAML: the strategy by its registry name, the callbacks by class path.

    python examples/train_cli.py fit --config examples/cannikin_cli.yaml
    python examples/train_cli.py fit --config examples/cannikin_cli.yaml --trainer.max_epochs 2 --data.batch_size 64
    python examples/train_cli.py fit --print_config            # every option, with its default
    python examples/train_cli.py fit --config examples/cannikin_cli.yaml --data.smoke true --trainer.max_epochs 2
                                                               # a quick check that it runs, on a slice of the data

Needs ``jsonargparse[signatures]`` (``pip install "lightning[pytorch-extra]"`` brings it). ``import lightning_cannikin``
below registers ``strategy: cannikin``; the YAML names ``lightning_cannikin.Cannikin`` and
``lightning_cannikin.EmulatedCluster`` with their ``init_args``. With Lightning's default (popen) launcher the script is
re-executed once per extra device with the same arguments, so every rank parses the same configuration.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning_cannikin  # noqa: F401  (registers strategy="cannikin")
from examples.data import ImageClassifier, load_dataset, smoke_subset
from lightning_cannikin import Cannikin

IMAGE_SHAPES: dict[str, tuple[int, ...]] = {"digits": (1, 8, 8), "fashion-mnist": (1, 28, 28)}


class DigitsClassifier(ImageClassifier):
    """The example CNN plus a validation step: the loss, averaged over ranks at epoch end, and the accuracy as a
    torchmetrics metric, which counts the correct predictions of every rank (exact, whatever each rank's share)."""

    def __init__(self, image_shape: tuple[int, ...] = (1, 8, 8), lr: float = 0.05, num_classes: int = 10) -> None:
        super().__init__(image_shape, lr, num_classes)
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.val_acc.update(logits, y)
        self.log("val_acc", self.val_acc, prog_bar=True)


class ImageDataModule(pl.LightningDataModule):
    """scikit-learn's digits (shipped in its wheel) or Fashion-MNIST from Debian's package; test split for validation.

    Args:
        data: ``"digits"`` or ``"fashion-mnist"``.
        batch_size: the per-device batch of Lightning's convention (initial total batch = batch_size x world size).
        seed: seed of the train/test split.
        num_workers: DataLoader workers (Cannikin keeps them when it rebuilds the training loader).
        smoke: train and validate on a slice of the data (a quick check that the configuration runs).

    """

    def __init__(
        self, data: str = "digits", batch_size: int = 32, seed: int = 0, num_workers: int = 0, smoke: bool = False
    ) -> None:
        super().__init__()
        if data not in IMAGE_SHAPES:
            raise ValueError(f"`data` must be one of {sorted(IMAGE_SHAPES)}, got {data!r}.")
        self.data = data
        self.batch_size = batch_size
        self.seed = seed
        self.num_workers = num_workers
        self.smoke = smoke
        self.image_shape = IMAGE_SHAPES[data]
        self.train: TensorDataset | None = None
        self.test: TensorDataset | None = None

    def setup(self, stage: str) -> None:
        if self.train is None:
            self.train, self.test, _ = load_dataset(self.data, seed=self.seed)
            if self.smoke:
                self.train, self.test = smoke_subset(self.train), smoke_subset(self.test)

    def train_dataloader(self) -> DataLoader:
        assert self.train is not None
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        assert self.test is not None
        return DataLoader(self.test, batch_size=256, num_workers=self.num_workers)


class CannikinCLI(LightningCLI):
    """LightningCLI whose model takes its input shape from the data module."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.image_shape", "model.image_shape", apply_on="instantiate")


def report(trainer: pl.Trainer) -> None:
    """On rank zero: what the YAML built and how training ended (the marker lines the launcher test reads)."""
    if not trainer.is_global_zero:
        return
    cannikins = [cb for cb in trainer.callbacks if isinstance(cb, Cannikin)]
    print(
        f"strategy={type(trainer.strategy).__name__} world_size={trainer.world_size}"
        f" cluster_environment={type(trainer.strategy.cluster_environment).__name__}"
        f" callbacks={[type(cb).__name__ for cb in trainer.callbacks]}",
        flush=True,
    )
    for cb in cannikins:
        print(
            f"cannikin replan_every_n_steps={cb.replan_every_n_steps} local_batch_bounds={cb.local_batch_bounds}"
            f" lr_scaling={cb.lr_scaling}",
            flush=True,
        )
    plan = getattr(trainer.strategy, "plan", None)
    if plan is not None:
        print(f"final local batch sizes {list(plan.local_batch_sizes)}", flush=True)
    metrics = {name: round(float(value), 4) for name, value in trainer.callback_metrics.items()}
    print(f"training finished: epochs={trainer.current_epoch} metrics={metrics}", flush=True)


def main() -> None:
    torch.set_num_threads(1)  # several ranks share a couple of cores
    cli = CannikinCLI(DigitsClassifier, ImageDataModule, save_config_kwargs={"overwrite": True})
    if cli.subcommand == "fit":
        report(cli.trainer)


if __name__ == "__main__":
    main()
