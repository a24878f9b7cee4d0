"""The time-to-accuracy benchmark's fixed-total oracle: how a total is pinned, the scenarios' costs, the gate."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from benchmarks.causal_lm import BLOCK, NOISE, RULE_SEED, VOCAB, CausalLM, second_order_text
from benchmarks.time_to_accuracy import (
    GATE,
    PER_SAMPLE_MS,
    PER_SAMPLE_ONLY_MS,
    configure,
    emulated_throughput,
    fixed_totals,
    goodput_share,
    oracle,
    oracle_rows,
    paired_ratio,
)
from lightning_cannikin.core.goodput import goodput
from lightning_cannikin.core.plan import BatchBounds, Plan
from lightning_cannikin.core.policy import PolicySettings, decide
from lightning_cannikin.core.speed_model import SpeedModel, SpeedModelSettings, StepRecord

SLOPES, FIXED = (0.0005, 0.001, 0.002), 0.020  # the fixed-cost scenario's devices, in seconds


def fitted_model() -> SpeedModel:
    """A speed model that has seen every rank at two batch sizes (identified), no warm-up to leave out."""
    model = SpeedModel(3, SpeedModelSettings(warmup_samples=0), BatchBounds.parse(None, 3))
    step = 0
    for sizes in ((32, 32, 32), (48, 32, 16), (40, 36, 20)):
        for _ in range(5):
            slowest = max(FIXED + s * b for s, b in zip(SLOPES, sizes, strict=True))
            model.add([StepRecord(step, r, b, FIXED + SLOPES[r] * b, slowest) for r, b in enumerate(sizes)])
            step += 1
    return model


def test_the_default_sweep_is_a_ladder_of_1_5x_steps_to_8_b0_and_totals_must_split_evenly() -> None:
    assert fixed_totals(None, 96, 3) == [96, 144, 216, 324, 486, 729]
    assert fixed_totals(None, 64, 2) == [64, 96, 144, 216, 324, 486]
    assert fixed_totals("384, 96,96", 96, 3) == [96, 384]
    assert fixed_totals("none", 96, 3) == []
    with pytest.raises(ValueError, match=r"\[100\]"):
        fixed_totals("96,100", 96, 3)


def test_a_fixed_run_keeps_its_total_and_scales_the_lr_from_b0() -> None:
    strategy, (callback,) = configure("fixed-384", 1024, 96)
    assert strategy == "cannikin_fork"
    assert callback.max_batch_size is None and callback.base_batch_size == 96 and callback.lr_scaling == "adascale"
    assert callback.options.track_noise_scale and callback.settings.noise_every_n_steps == 1
    model, pinned = fitted_model(), Plan((128, 128, 128))
    # no cap: the total stays at 384 whatever the noise scale says, and the gain is AdaScale's for 384 over 96
    for bounds in ((1.0, 2.0), (5000.0, 6000.0)):
        decision = decide(model, pinned, PolicySettings(max_batch_size=None), bounds, 96)
        assert decision.plan.total_batch_size == 384
    assert decide(model, pinned, PolicySettings(max_batch_size=None), (5000.0, 6000.0), 96).lr_factor > 3.0
    # why not a cap of 384 with base 96: a small noise scale shrinks the total toward B0
    capped = decide(model, pinned, PolicySettings(max_batch_size=384), (1.0, 2.0), 96)
    assert capped.plan.total_batch_size < 384


def test_per_sample_costs_leave_the_throughput_flat_so_b0_is_the_best_fixed_total() -> None:
    totals = [96, 192, 384, 768]
    flat = np.array(emulated_throughput(PER_SAMPLE_ONLY_MS, [0.0] * 3, totals))
    assert flat.max() / flat.min() < 1.02  # the split's integer rounding only
    rising = np.array(emulated_throughput(PER_SAMPLE_MS, [20.0] * 3, totals))
    assert np.all(np.diff(rising) > 0) and rising[-1] / rising[0] > 1.5  # fixed-cost: a larger total pays
    for phi in (10.0, 96.0, 1000.0, 3000.0):
        assert np.argmax(goodput(totals, np.array(totals) / flat, phi, 96)) == 0


def result(time: float | None, samples: int | None) -> dict:
    return {"time_to_target": time, "samples_to_target": samples}


def test_the_oracle_picks_the_fastest_total_that_always_reached_the_target() -> None:
    runs = {
        "fixed-96": [result(60.0, 90_000), result(62.0, 95_000), result(58.0, 85_000)],
        "fixed-192": [result(48.0, 95_000), result(50.0, 99_000), result(47.0, 92_000)],
        "fixed-384": [result(40.0, 150_000), result(None, None), result(41.0, 160_000)],  # missed once: no median
    }
    report = oracle(runs, [96, 192, 384], 49.0, [2000.0, 2560.0, 2954.0])
    assert [entry["median_time_to_target_s"] for entry in report["sweep"]] == [60.0, 48.0, None]
    assert report["sweep"][1]["median_samples_to_target"] == 95_000
    assert (report["best_fixed_total"], report["best_fixed_time_s"]) == (192, 48.0)
    assert report["cannikin_vs_best_fixed"] == pytest.approx(49.0 / 48.0)
    assert report["within_gate"] is True and GATE == 1.05
    text = "\n".join(oracle_rows(report, 96))
    assert "| 384 | n/a | 40.0, n/a, 41.0 | n/a | 2954 |" in text
    assert "best fixed total: 192 (48.0 s)" in text and "1.02x the time (within the 1.05x gate)" in text
    missed = oracle({"fixed-96": [result(None, None)]}, [96], 49.0, [2000.0])
    assert missed["best_fixed_total"] is None and missed["cannikin_vs_best_fixed"] is None
    assert "none reached the target" in "\n".join(oracle_rows(missed, 96))


def test_the_paired_ratio_is_the_geometric_mean_with_a_student_t_interval_on_the_logs() -> None:
    mine, theirs = [55.0, 45.0, 60.0, 50.0, 52.5], [50.0, 50.0, 50.0, 50.0, 50.0]
    logs = [math.log(a / b) for a, b in zip(mine, theirs, strict=True)]
    centre = sum(logs) / 5
    spread = math.sqrt(sum((v - centre) ** 2 for v in logs) / 4 / 5)
    t90 = 2.131847  # Student's t, 4 degrees of freedom, upper 5% (tables)
    result = paired_ratio(mine, theirs)
    assert result["geometric_mean"] == pytest.approx(math.exp(centre))
    assert (result["low"], result["high"]) == pytest.approx(
        (math.exp(centre - t90 * spread), math.exp(centre + t90 * spread)), rel=1e-5
    )
    assert result["repeats"] == 5 and result["per_repeat"] == pytest.approx([1.1, 0.9, 1.2, 1.0, 1.05])
    assert paired_ratio([50.0, None], [50.0, 50.0]) is None, "a repeat that missed the target has no ratio"
    assert paired_ratio([50.0], [50.0]) is None, "one repeat has no interval"


def test_the_goodput_share_weighs_each_interval_by_its_steps_at_the_reference_noise_scale() -> None:
    # two totals at 0.1 s and 0.15 s a step, B0 = 64, a noise scale of 1,000: goodput written out here as samples a
    # second times (phi + B0) / (phi + B); 128 is the best; 10 steps at 64 then 10 at 128
    totals, times = np.array([64, 128]), np.array([0.1, 0.15])

    def worth(b: int, t: float) -> float:
        return b / t * (1000.0 + 64) / (1000.0 + b)

    curve = [{"samples": 640, "total_batch_size": 64}, {"samples": 1920, "total_batch_size": 128}]
    reference = [(0.0, 1000.0), (5000.0, 1000.0)]
    expected = (10 * worth(64, 0.1) / worth(128, 0.15) + 10 * 1.0) / 20
    assert goodput_share(curve, reference, totals, times, 64) == pytest.approx(expected)
    assert goodput_share(curve, [], totals, times, 64) is None
    # at a noise scale of 10 the smaller total is the best and the larger one is worth less than it
    small = [(0.0, 10.0)]
    low = (10 * 1.0 + 10 * (128 / 0.15 * 74 / 138) / (64 / 0.1 * 74 / 74)) / 20
    assert goodput_share(curve, small, totals, times, 64) == pytest.approx(low)


def test_the_transformer_scenarios_text_follows_its_rule_and_its_model_is_causal() -> None:
    text = second_order_text(200, seed=0)
    tokens, following = text.tensors
    assert tokens.shape == following.shape == (200, BLOCK)
    assert torch.equal(tokens[:, 1:], following[:, :-1]), "the targets are the next tokens"
    stream = torch.cat([tokens.reshape(-1), following[-1, -1:]])
    rule = torch.randint(0, VOCAB, (VOCAB, VOCAB), generator=torch.Generator().manual_seed(RULE_SEED))
    kept = (stream[2:] == rule[stream[:-2], stream[1:-1]]).float().mean().item()
    # a random draw matches the rule one time in VOCAB: 1 - NOISE + NOISE / VOCAB = 0.806 expected
    assert abs(kept - (1 - NOISE + NOISE / VOCAB)) < 0.02, kept
    assert not torch.equal(second_order_text(20, seed=1).tensors[0], text.tensors[0][:20]), "another seed, other text"
    torch.manual_seed(0)
    model = CausalLM().eval()
    changed = tokens[:2].clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % VOCAB
    with torch.no_grad():
        before, after = model(tokens[:2]), model(changed)
    assert before.shape == (2, VOCAB, BLOCK)
    assert torch.allclose(before[..., :20], after[..., :20], atol=1e-6), "no position sees a later token"
    assert not torch.allclose(before[..., 20:], after[..., 20:]), "and the later ones do change"
