"""The ``gpu-mix`` scenario of ``time_to_accuracy.py``: measured GPU costs, a task whose noise scale is far above B0.

Devices: three emulated GPUs whose per-sample and fixed costs are the linear fits (``ComputeModel.slope`` and
``.intercept``) of the measured single-GPU step times of one job in the GPU profiles the simulator reads
(:func:`lightning_cannikin.simulation.models.load_job`): Pollux's ResNet-18/CIFAR-10 job (``cifar10``) on an A100, an
RTX 2080 Ti and a T4, all scaled by one common factor. The fits ship as numbers (``FITTED_COSTS``) because the A100
and 2080 Ti traces come from the Sia artifact, which is unlicensed and only read locally; ``python
benchmarks/gpu_mix.py --check-costs`` refits them when those files are found. At small batches their fixed part
dominates (17-40 ms against 0.09-0.66 ms a sample), which is where a larger total batch pays.

Task: WordNet glosses -> the 45 lexicographer classes (117,659 texts from Debian's ``wordnet-base``), a bag of hashed
words (``EmbeddingBag``-style mean of 16-d embeddings, 263k parameters), SGD with momentum and a cosine decay run on
Cannikin's ``progress``. It was chosen by measuring the noise scale with the library's own estimator on single-process
runs at B0 = 96 (``python benchmarks/gpu_mix.py [wordnet|fashion-mnist]``, a cosine over 2 epochs there, over 4 and 6
in the first survey): Fashion-MNIST (an MLP) stayed below B0 for its first 30% and below 2 x B0 for about 70% of a run
to its plateau; these glosses start near 4 x B0 (375 at 24k samples) and pass 10 x B0 as the LR decays.
"""

from __future__ import annotations

import math
import re
import sys
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.varlen_data import read_wordnet_glosses
from lightning_cannikin.training.schedules import progress_lr_lambda

if TYPE_CHECKING:  # the simulator (scipy) is only imported by the optional check, never by the benchmark's path
    from lightning_cannikin.simulation.gpu_profiles import ProfileStore

VOCABULARY = 2**14  # hashed words; index 0 is padding
MAX_WORDS = 32
NUM_CLASSES = 45
JOB, GPUS = "cifar10", ("A100", "2080Ti", "T4")

# ``(slope_s, intercept_s, source)`` of each GPU: ``ComputeModel.slope`` (seconds a sample) and ``.intercept``
# (seconds a step) of ``load_job("cifar10", ("A100", "2080Ti", "T4")).compute[gpu]``, the linear fit of the job's
# single-GPU step time minus sync time. T4 from Pollux's shipped trace (placements.csv, placement "1", 11 batch
# sizes 32-1024); A100 (DGX-A100, 15 sizes 32-4096) and 2080Ti (11 sizes 32-1024) from the Sia artifact's seed
# cifar10.csv. Shipped as numbers so that a clean clone runs without the unlicensed Sia files;
# check_fitted_costs() refits them where those files are found.
FITTED_COSTS: dict[str, tuple[float, float, str]] = {
    "A100": (9.249419259766568e-05, 0.026476744928252895, "sia"),
    "2080Ti": (0.00026013780378796714, 0.03977529027258288, "sia"),
    "T4": (0.000664215745609092, 0.01723295081666728, "pollux"),
}


def load_wordnet(test_size: int = 10_000) -> tuple[TensorDataset, TensorDataset]:
    """``(train, test)``: hashed word ids (``MAX_WORDS``, 0-padded) of each gloss, and its lexicographer class."""
    texts, labels = read_wordnet_glosses()
    order = np.random.default_rng(0).permutation(len(texts))
    ids = torch.zeros(len(texts), MAX_WORDS, dtype=torch.long)
    for row, index in enumerate(order):
        words = re.findall(r"[a-z]+", texts[index].lower())[:MAX_WORDS] or ["<empty>"]
        ids[row, : len(words)] = torch.tensor([1 + zlib.crc32(w.encode()) % (VOCABULARY - 1) for w in words])
    y = torch.tensor([labels[i] for i in order])
    return TensorDataset(ids[test_size:], y[test_size:]), TensorDataset(ids[:test_size], y[:test_size])


class GlossClassifier(pl.LightningModule):
    """Mean of the words' embeddings, then a linear layer; SGD whose cosine decay runs on training progress.

    Args:
        lr: the learning rate tuned for the base batch.
        horizon: base-batch steps of progress over which the cosine decays to zero.

    """

    def __init__(self, lr: float = 1.5, horizon: float = 2243.0, dim: int = 16) -> None:
        super().__init__()
        self.lr, self.horizon = lr, horizon
        self.embedding = nn.Embedding(VOCABULARY, dim, padding_idx=0)
        self.head = nn.Linear(dim, NUM_CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids != 0).unsqueeze(-1).float()
        return self.head((self.embedding(ids) * mask).sum(1) / mask.sum(1).clamp(min=1.0))

    def training_step(self, batch, batch_idx):
        ids, y = batch
        return nn.functional.cross_entropy(self(ids), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

        def cosine(progress: float) -> float:
            return 0.5 * (1.0 + math.cos(math.pi * min(progress / self.horizon, 1.0)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, progress_lr_lambda(self.trainer, cosine))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def gpu_costs(scale: float) -> tuple[list[float], list[float], dict]:
    """``(per_sample_ms, fixed_ms, description)`` of the emulated devices: the shipped fits times ``scale``."""
    per_sample = [1000.0 * scale * FITTED_COSTS[g][0] for g in GPUS]
    fixed = [1000.0 * scale * FITTED_COSTS[g][1] for g in GPUS]
    sources = {g: FITTED_COSTS[g][2] for g in GPUS}
    return per_sample, fixed, {"job": JOB, "gpus": list(GPUS), "sources": sources, "scale": scale}


def check_fitted_costs(store: ProfileStore | None = None, rtol: float = 1e-6) -> list[str]:
    """Refit ``FITTED_COSTS`` from the traces that are present and compare.

    The T4 trace is shipped, so it is always checked; A100 and 2080Ti only where the Sia files are found.

    Args:
        store: where the profiles are (default: shipped data plus Sia when found).
        rtol: largest relative difference allowed on a slope or an intercept.

    Returns:
        The GPU types checked; the ones skipped are printed.

    Raises:
        AssertionError: a refitted number or source differs from the shipped one.

    """
    from lightning_cannikin.simulation.gpu_profiles import ProfileStore
    from lightning_cannikin.simulation.models import load_job

    store = store or ProfileStore()
    available = store.available_gpus(JOB)
    checked = [g for g in GPUS if available.get(g) == FITTED_COSTS[g][2]]
    skipped = [g for g in GPUS if g not in checked]
    if skipped:
        print(f"check_fitted_costs: no {'/'.join(skipped)} trace found (Sia files absent); skipped those.")
    if not checked:
        return []
    job = load_job(JOB, checked, store=store)
    wrong = []
    for gpu in checked:
        model, (slope, intercept, source) = job.compute[gpu], FITTED_COSTS[gpu]
        for name, fitted, shipped in (("slope", model.slope, slope), ("intercept", model.intercept, intercept)):
            if abs(fitted - shipped) > rtol * abs(shipped):
                wrong.append(f"{gpu} {name}: refitted {fitted!r}, shipped {shipped!r}")
        if model.profile.source != source:
            wrong.append(f"{gpu} source: refitted {model.profile.source!r}, shipped {source!r}")
    if wrong:
        raise AssertionError("FITTED_COSTS disagree with the traces: " + "; ".join(wrong))
    print(f"check_fitted_costs: {', '.join(checked)} agree with the traces within {rtol:g} relative.")
    return checked


def survey(
    task: str = "wordnet", epochs: int = 2, base_batch: int = 96, groups: int = 4
) -> list[tuple[int, float, float]]:
    """Single-process noise-scale path of a task at B0 (``groups`` equal groups per step, the library's estimator),
    SGD with momentum and a cosine over ``epochs``: ``"wordnet"`` (this scenario's) or ``"fashion-mnist"`` (an MLP
    784-256-128-10 at lr 0.1, the candidate it was compared with)."""
    from lightning_cannikin.core.noise_scale import NoiseScaleEstimator

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if task == "wordnet":
        train, test = load_wordnet()
        model, lr = GlossClassifier(), 1.5
    else:
        from examples.data import load_dataset

        train, test, _ = load_dataset("fashion-mnist")
        model = nn.Sequential(
            nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10)
        )
        lr = 0.1
    horizon = epochs * len(train) / base_batch
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    estimator, steps, path = NoiseScaleEstimator(base_batch), len(train) // base_batch, []
    for step in range(epochs * steps):
        if step % steps == 0:
            permutation = torch.randperm(len(train))
        index = permutation[(step % steps) * base_batch : (step % steps + 1) * base_batch]
        gradients = []
        for chunk in index.chunk(groups):
            model.zero_grad()
            nn.functional.cross_entropy(model(train.tensors[0][chunk]), train.tensors[1][chunk]).backward()
            gradients.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        mean = torch.stack(gradients).mean(0)
        estimator.update(
            [float(g.pow(2).sum()) for g in gradients], [len(index) // groups] * groups, float(mean @ mean)
        )
        offset = 0
        for p in model.parameters():
            p.grad.copy_(mean[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        for group in optimizer.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * min(step / horizon, 1.0)))
        optimizer.step()
        if (step + 1) % 250 == 0:
            with torch.no_grad():
                accuracy = float((model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean())
            path.append(((step + 1) * base_batch, float(estimator.noise_scale), accuracy))
            print(f"samples {path[-1][0]:7d}  noise scale {path[-1][1]:7.1f}  test accuracy {accuracy:.4f}", flush=True)
    return path


if __name__ == "__main__":
    if sys.argv[1:] == ["--check-costs"]:
        check_fitted_costs()
    else:
        survey(sys.argv[1] if len(sys.argv) > 1 else "wordnet")
