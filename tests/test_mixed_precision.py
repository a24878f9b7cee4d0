"""Mixed precision on CPU with real ranks: ``bf16-mixed`` trains exactly and measures the noise, and under
``16-mixed`` (Lightning's ``MixedPrecision`` plugin with a CPU ``GradScaler``) the noise statistics are divided by
the scale of their step and the steps the scaler skipped are left out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_cannikin import Cannikin, CannikinSettings, CannikinStrategy
from lightning_cannikin.training.measurement.grad_stats import FOLD_DELAY
from tests.models import IndexedRegression, RecordingRegressor, quiet_trainer, read_records, record_estimator_inputs


class RecordNoiseAndScale(Callback):
    """What rank zero's estimator is fed, and the GradScaler's scale before and after every step."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.fed: list = []
        self.scales: list[tuple[float, float]] = []

    def on_train_start(self, trainer, pl_module):
        record_estimator_inputs(trainer, self.fed)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = self._scale(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.scales.append((self._before, self._scale(trainer)))

    @staticmethod
    def _scale(trainer) -> float:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        return float(scaler.get_scale()) if scaler is not None else 1.0

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            self.out.write_text(json.dumps({"fed": self.fed, "scales": self.scales}))


# every step measured, one step per exchange
EVERY_STEP = CannikinSettings(track_noise_scale=True, noise_exchange_every=1, noise_every_n_steps=1)


def fit(tmp_path, max_steps, **trainer_kwargs):
    torch.manual_seed(0)
    dataset = IndexedRegression(256)
    model = RecordingRegressor(dataset, batch_size=8, record_dir=str(tmp_path))
    initial = {k: v.clone() for k, v in model.layer.state_dict().items()}
    out = tmp_path / "noise.json"
    trainer = quiet_trainer(
        CannikinStrategy(local_batch_sizes=[24, 8], start_method="fork"),
        2,
        [Cannikin(settings=EVERY_STEP), RecordNoiseAndScale(out)],  # FOLD_DELAY holds
        max_steps=max_steps,
        **trainer_kwargs,
    )
    trainer.fit(model)
    return dataset, initial, read_records(tmp_path, 2), json.loads(out.read_text())


def replay(dataset, initial, records, dtype, skipped):
    """One process under the same autocast: per step the groups' and the union's squared gradient norms (unscaled),
    then SGD on the union's mean gradient unless the scaler skipped the step; returns the norms and final parameters."""
    layer = nn.Linear(dataset.x.shape[1], 1)
    layer.load_state_dict(initial)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)

    def gradient(index):
        layer.zero_grad()
        index = torch.tensor(index)
        with torch.autocast("cpu", dtype=dtype):
            prediction = layer(dataset.x[index])
        nn.functional.mse_loss(prediction.float(), dataset.y[index]).backward()
        return [p.grad.clone() for p in layer.parameters()]

    norms = []
    for step, is_skipped in enumerate(skipped):
        groups = [r["steps"][step] for r in records]
        local = [sum(float(g.pow(2).sum()) for g in gradient(index)) for index in groups]
        union = gradient([i for index in groups for i in index])
        norms.append((local, sum(float(g.pow(2).sum()) for g in union)))
        if not is_skipped:
            optimizer.step()
    return norms, layer.state_dict()


def test_bf16_mixed_trains_exactly_and_measures_the_noise(tmp_path):
    steps = 3 + FOLD_DELAY  # the last FOLD_DELAY steps' statistics are still in flight when training ends
    dataset, initial, records, result = fit(tmp_path, max_steps=steps, precision="bf16-mixed")
    norms, final = replay(dataset, initial, records, torch.bfloat16, [False] * steps)
    assert len(result["fed"]) == 3
    for (local, sizes, global_sqr, _), (expected_local, expected_global) in zip(result["fed"], norms[:3], strict=True):
        assert sizes == [24, 8]
        assert local == pytest.approx(expected_local, rel=2e-2)
        assert global_sqr == pytest.approx(expected_global, rel=2e-2)
    for name, value in final.items():
        assert torch.tensor(records[0]["params"][name]) == pytest.approx(value, abs=1e-2)


def test_16_mixed_statistics_are_unscaled_and_skip_what_the_scaler_skipped(tmp_path):
    # a scale so large that the first fp16 backward passes overflow: the scaler skips them and backs off
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**17)
    dataset, initial, records, result = fit(
        tmp_path, max_steps=8, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    )
    skipped = [after < before for before, after in result["scales"]]
    assert any(skipped) and not all(skipped), f"the test needs skipped and taken steps: {result['scales']}"
    norms, final = replay(dataset, initial, records, torch.float16, skipped)
    # the statistics of the steps whose FOLD_DELAY successors ran, less those the scaler skipped
    folded = len(norms) - FOLD_DELAY
    taken = [n for n, s in zip(norms[:folded], skipped[:folded], strict=True) if not s]
    assert len(result["fed"]) == len(taken), "a step the scaler skipped must not reach the estimator"
    for (local, _, global_sqr, _), (expected_local, expected_global) in zip(result["fed"], taken, strict=True):
        # without the division these would be larger by the scale squared (2^30 and more)
        assert local == pytest.approx(expected_local, rel=2e-2)
        assert global_sqr == pytest.approx(expected_global, rel=2e-2)
    for name, value in final.items():
        assert torch.tensor(records[0]["params"][name]) == pytest.approx(value, abs=1e-2)
