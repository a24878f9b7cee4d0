"""Real, offline data sets and small models for the examples and benchmarks.

scikit-learn ships the digits images inside its wheel (no download). Fashion-MNIST comes from Debian's
``dataset-fashion-mnist`` package when it is installed (``apt-get install dataset-fashion-mnist``).
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
# the samples a smoke run (`--smoke`: a check that an example runs, as CI's `.ci/examples` does) trains and tests on
SMOKE_SAMPLES = 384


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as handle:
        data = handle.read()
    ndim = data[3]
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def fashion_mnist_available() -> bool:
    return (FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").exists()


def load_dataset(name: str, seed: int = 0) -> tuple[TensorDataset, TensorDataset, tuple[int, ...]]:
    """``(train, test, image_shape)`` as float tensors in [0, 1] with integer labels."""
    if name == "digits":
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        x = digits.images.astype(np.float32) / 16.0
        x_train, x_test, y_train, y_test = train_test_split(
            x, digits.target, test_size=0.2, random_state=seed, stratify=digits.target
        )
        shape = (1, 8, 8)
    elif name == "fashion-mnist":
        if not fashion_mnist_available():
            raise FileNotFoundError(
                f"Fashion-MNIST not found in {FASHION_MNIST_DIR}; install it with"
                " `apt-get install dataset-fashion-mnist` or use `--data digits`."
            )
        x_train = _read_idx(FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").astype(np.float32) / 255.0
        y_train = _read_idx(FASHION_MNIST_DIR / "train-labels-idx1-ubyte.gz")
        x_test = _read_idx(FASHION_MNIST_DIR / "t10k-images-idx3-ubyte.gz").astype(np.float32) / 255.0
        y_test = _read_idx(FASHION_MNIST_DIR / "t10k-labels-idx1-ubyte.gz")
        shape = (1, 28, 28)
    else:
        raise ValueError(f"Unknown data set {name!r}; choose 'digits' or 'fashion-mnist'.")

    def tensors(x: np.ndarray, y: np.ndarray) -> TensorDataset:
        return TensorDataset(torch.from_numpy(np.ascontiguousarray(x)).reshape(-1, *shape), torch.from_numpy(y).long())

    return tensors(x_train, y_train), tensors(x_test, y_test), shape


def smoke_subset(dataset: TensorDataset, samples: int = SMOKE_SAMPLES) -> TensorDataset:
    """The first ``samples`` of ``dataset``: what a smoke run uses, so that every step of an example runs in seconds."""
    return TensorDataset(*(tensor[:samples] for tensor in dataset.tensors))


class ImageClassifier(pl.LightningModule):
    """A small CNN: two convolution + pooling stages and a two-layer head.

    An ordinary LightningModule: nothing in it is specific to Cannikin.
    """

    def __init__(self, image_shape: tuple[int, ...] = (1, 8, 8), lr: float = 0.05, num_classes: int = 10) -> None:
        super().__init__()
        self.save_hyperparameters()
        channels, height, width = image_shape
        self.net = nn.Sequential(
            nn.Conv2d(channels, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * (height // 4) * (width // 4), 64),
            nn.ReLU(),
            nn.Linear(64, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


@torch.no_grad()
def accuracy(model: nn.Module, dataset: TensorDataset, batch_size: int = 1024, num_classes: int = 10) -> float:
    """Top-1 accuracy of ``model`` on all of ``dataset`` (one process, no sampler padding)."""
    model.eval()
    # one process evaluates the whole set: no sync with the other ranks (which are not evaluating, and would hang)
    metric = MulticlassAccuracy(num_classes, average="micro", sync_on_compute=False)
    for x, y in DataLoader(dataset, batch_size=batch_size):
        metric.update(model(x), y)
    return float(metric.compute())
