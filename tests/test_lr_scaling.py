from __future__ import annotations

import itertools
import json
import math

import pytest

from lightning_cannikin.core.lr_scaling import RULES, Progress, lr_factor, validate_rule

B0 = 128
PHI = 1280.0  # AdaptDL's reference: grad_sqr 1, grad_var 10 per B0-batch
GAIN_512 = (10 + 1) / (10 / 4 + 1)  # AdaptDL's gain at scale 4


def test_rules() -> None:
    assert RULES == ("adascale", "sqrt", "linear", "none")


@pytest.mark.parametrize(
    ("rule", "adam", "expected"),
    [
        ("adascale", False, GAIN_512),
        ("adascale", True, math.sqrt(GAIN_512)),
        ("sqrt", False, 2.0),
        ("sqrt", True, 2.0),
        ("linear", False, 4.0),
        ("linear", True, 4.0),
        ("none", False, 1.0),
        ("none", True, 1.0),
    ],
)
def test_lr_factor_at_four_times_the_base_batch(rule: str, adam: bool, expected: float) -> None:
    assert lr_factor(rule, 512, B0, PHI, adam=adam) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("adam", [False, True])
def test_lr_factor_is_one_at_base_batch(rule: str, adam: bool) -> None:
    assert lr_factor(rule, B0, B0, PHI, adam=adam) == 1.0
    assert lr_factor(rule, B0, B0, None, adam=adam) == 1.0


def test_adascale_follows_the_noise_scale() -> None:
    # Pure noise: AdaScale is the linear rule; no noise: no scaling. Unknown noise: conservative 1.0.
    assert lr_factor("adascale", 512, B0, math.inf) == pytest.approx(4.0)
    assert lr_factor("adascale", 512, B0, math.inf, adam=True) == pytest.approx(2.0)
    assert lr_factor("adascale", 512, B0, 0.0) == pytest.approx(1.0)
    assert lr_factor("adascale", 512, B0, None) == 1.0
    assert lr_factor("adascale", 512, B0, None, adam=True) == 1.0
    factors = [lr_factor("adascale", b, B0, PHI) for b in (128, 256, 512, 1024, 2048)]
    assert all(a < b for a, b in itertools.pairwise(factors))
    assert all(f <= b / B0 for f, b in zip(factors, (128, 256, 512, 1024, 2048), strict=True))


def test_unknown_rule_names_the_option() -> None:
    with pytest.raises(ValueError, match="lr_scaling") as info:
        lr_factor("cubic", 512, B0, PHI)
    for rule in RULES:
        assert repr(rule) in str(info.value)
    assert "'cubic'" in str(info.value)
    with pytest.raises(ValueError, match="lr_scaling"):
        validate_rule(None)  # type: ignore[arg-type]


def test_validate_rule_normalises() -> None:
    assert validate_rule(" AdaScale ") == "adascale"
    assert validate_rule("none") == "none"


def test_lr_factor_rejects_bad_batch_sizes() -> None:
    with pytest.raises(ValueError, match="positive"):
        lr_factor("linear", 0, B0, PHI)


def test_progress_sums_gains_and_round_trips() -> None:
    progress = Progress()
    assert progress.value == 0.0
    progress.add(1.0)
    assert progress.add(GAIN_512) == pytest.approx(1.0 + GAIN_512)
    restored = Progress()
    restored.load_state_dict(json.loads(json.dumps(progress.state_dict())))
    assert restored.value == progress.value
    for bad in (-0.5, math.inf, float("nan")):
        with pytest.raises(ValueError, match="gain"):
            progress.add(bad)
    assert restored.value == progress.value  # rejected gains change nothing
