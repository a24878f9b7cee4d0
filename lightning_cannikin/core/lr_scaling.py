"""Learning-rate scaling rules for a total batch B that differs from the base batch B0.

- ``"adascale"``: the AdaScale gain ``r(B) = (phi + B0) / (phi + B) * B / B0``, which follows the measured noise
  scale: close to ``B / B0`` while noise dominates, close to 1 once the gradient signal dominates. Adam-family
  optimizers already normalise the update size, so they get ``sqrt(r(B))``, as in Pollux/AdaptDL.
- ``"sqrt"``: ``sqrt(B / B0)``; ``"linear"``: ``B / B0``; ``"none"``: 1.

The factor multiplies the learning rate only for the duration of ``optimizer.step()`` (the caller restores it), so
LR schedulers keep working. :class:`Progress` sums the gains: the number of B0-steps' worth of progress made, which
lets schedules run in scale-invariant steps.

Which family an optimizer is in is read from what it holds, not from its name (:func:`optimizer_family`, given the
names of its per-parameter state; the training side collects them): a running second moment ``exp_avg_sq`` makes it
Adam-family (the square root of the gain, the noise measured on the preconditioned gradient). Optimizers that
precondition by another running statistic (RMSprop's ``square_avg``, Adagrad's ``sum``, Adafactor's factored
``row_var``/``col_var``/``variance``, Adamax's ``exp_inf``) are neither: the gain AdaScale derives for SGD does not
hold for them and their preconditioner is not the one the noise statistics divide by, so ``"adascale"`` refuses
them (:func:`check_family`) and the fixed rules apply as given.

Adam's state at a change of total batch is kept as it is, by choice: ``exp_avg_sq`` averages the squared gradient,
whose noise part shrinks about as ``1 / B``, so after a larger total it overstates the second moment for about
``1 / (1 - beta2)`` steps and the steps are a little shorter than the new factor says: the cautious side, with no
reset that would throw away the curvature it has learnt (Pollux/AdaptDL keep it too).

Pure Python and numpy: no torch import is needed.
"""

from __future__ import annotations

import math

from lightning_cannikin.core.goodput import adascale_gain

__all__ = ["RULES", "Progress", "check_family", "lr_factor", "optimizer_family", "validate_rule"]

RULES: tuple[str, ...] = ("adascale", "sqrt", "linear", "none")


def validate_rule(rule: str) -> str:
    """Return ``rule`` lower-cased and stripped if it names a known rule.

    Raises:
        ValueError: naming the ``lr_scaling`` option and listing the valid values.

    """
    name = rule.strip().lower() if isinstance(rule, str) else rule
    if name not in RULES:
        raise ValueError(f"`lr_scaling` must be one of {', '.join(repr(r) for r in RULES)}; got {rule!r}.")
    return name


# per-parameter state that marks a preconditioner other than Adam's second moment
_OTHER_PRECONDITIONERS = {
    "square_avg": "RMSprop",
    "sum": "Adagrad",
    "row_var": "Adafactor",
    "col_var": "Adafactor",
    "variance": "Adafactor",
    "exp_inf": "Adamax",
}


def optimizer_family(state_keys: set[str] | frozenset[str]) -> str | None:
    """``"adam"``, ``"sgd"`` or the name of another preconditioner, from the names of an optimizer's per-parameter
    state; ``None`` while it holds none (before its first step)."""
    if not state_keys:
        return None
    if "exp_avg_sq" in state_keys:
        return "adam"
    for key, name in _OTHER_PRECONDITIONERS.items():
        if key in state_keys:
            return name
    return "sgd"


def check_family(family: str | None, rule: str, optimizer_name: str) -> None:
    """Refuse ``"adascale"`` for an optimizer that preconditions by a statistic other than Adam's second moment.

    Raises:
        ValueError: naming ``lr_scaling`` and the values that work.

    """
    if family in (None, "adam", "sgd") or validate_rule(rule) != "adascale":
        return
    raise ValueError(
        f"`lr_scaling='adascale'` cannot scale {optimizer_name}: it preconditions like {family} (not by Adam's"
        " second moment), for which neither AdaScale's gain nor the noise statistics hold. Pass"
        " `lr_scaling='sqrt'`, `'linear'` or `'none'` to Cannikin."
    )


def lr_factor(rule: str, batch_size: int, base_batch_size: int, noise_scale: float | None, adam: bool = False) -> float:
    """The multiplier for the base learning rate at total batch ``batch_size``.

    Args:
        rule: one of :data:`RULES`.
        batch_size: total batch B of the step.
        base_batch_size: B0, the batch the base learning rate was tuned for.
        noise_scale: ``phi`` in samples; used by ``"adascale"`` only. None (no statistics yet) gives 1.0: without a
            noise estimate the safe assumption is that a larger batch buys no extra progress per step.
        adam: whether the optimizer is Adam-family (:func:`optimizer_family` says ``"adam"``); takes the square root
            of the AdaScale gain. The fixed rules ignore it.

    Returns:
        The factor, 1.0 at B = B0 for every rule.

    """
    name = validate_rule(rule)
    if batch_size <= 0 or base_batch_size <= 0:
        raise ValueError(f"Batch sizes must be positive, got batch_size={batch_size}, base={base_batch_size}.")
    ratio = batch_size / base_batch_size
    if name == "none":
        return 1.0
    if name == "linear":
        return float(ratio)
    if name == "sqrt":
        return math.sqrt(ratio)
    if noise_scale is None:
        return 1.0
    gain = float(adascale_gain(noise_scale, batch_size, base_batch_size))
    return math.sqrt(gain) if adam else gain


class Progress:
    """Training progress in B0-steps: the running sum of AdaScale gains, one per optimizer step.

    Args:
        value: starting progress.

    """

    def __init__(self, value: float = 0.0) -> None:
        self._value = float(value)

    def add(self, gain: float) -> float:
        """Count one step worth ``gain`` B0-steps; return the new total.

        Raises:
            ValueError: when ``gain`` is negative or not finite (it would corrupt the total for good).

        """
        gain = float(gain)
        if not (math.isfinite(gain) and gain >= 0.0):
            raise ValueError(f"A step's gain must be finite and >= 0, got {gain}.")
        self._value += gain
        return self._value

    @property
    def value(self) -> float:
        """Progress so far, in B0-steps."""
        return self._value

    def state_dict(self) -> dict:
        """JSON-friendly state."""
        return {"progress": self._value}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._value = float(state_dict["progress"])
