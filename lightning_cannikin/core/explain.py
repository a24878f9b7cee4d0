"""What a re-plan decided and why, in words (rank zero's info line) and in numbers (the ``cannikin/decision/*`` values).

The numbers are the decision's own (:class:`~lightning_cannikin.core.policy.Decision`): the best total's predicted
goodput gain against ``adapt_margin``, the best split's predicted step-time gain against the split margin. A total
that stays while ``max_batch_size`` is set is then explained, not silent.
"""

from __future__ import annotations

import math

from lightning_cannikin.core.plan import Plan
from lightning_cannikin.core.policy import Decision, PolicySettings, StepTimeModel, margin_over_jitter

__all__ = ["decision_values", "explain", "missed_prediction"]


def explain(step: int, decision: Decision, current: Plan, policy: PolicySettings) -> str:
    """One line: the split and the total decided at ``step`` against ``current``, each with its reason."""
    plan, sizes = decision.plan, list(decision.plan.local_batch_sizes)
    before = list(current.local_batch_sizes)
    if not decision.identified and policy.balance:
        split = f"probing {before} -> {sizes} (every device timed at a second batch size before balancing)"
    else:
        moved = f"{before} -> {sizes}" if sizes != before else f"{sizes} kept"
        gain = decision.split_gain
        if gain is None:
            split = f"split {moved}"
        else:
            margin = policy.split_margin if decision.split_margin is None else decision.split_margin
            side = "above" if gain > margin else "within"
            jitter = " (the devices' step-time jitter)" if margin > policy.split_margin else ""
            split = (
                f"split {moved} (the best split is predicted {_percent(gain)} faster than the kept one, {side} the"
                f" {_percent(margin)} split margin{jitter})"
            )
    line = f"Cannikin: step {step}: {split}"
    total, previous = plan.total_batch_size, current.total_batch_size
    if decision.best_total is not None and decision.total_gain is not None:
        verdict = f"{previous} -> {total}" if total != previous else f"{total} kept"
        side = "above" if decision.total_gain > policy.margin else "under"
        line += (
            f"; total batch {verdict} (the best total over the noise bounds, {decision.best_total}, is predicted to"
            f" raise the share of the best goodput it is sure of by {_percent(decision.total_gain)}, {side} the"
            f" {_percent(policy.margin)} adapt margin"
        )
        if decision.total_gain > policy.margin and previous < total < decision.best_total:
            line += "; no further than evidence_reach times the largest batch each rank has run, timed before going on"
        line += ")"
    elif policy.max_batch_size is not None:
        line += f"; total batch {total} not reconsidered (mid-epoch, or no bounds on the noise scale yet)"
    predicted = plan.predicted_step_time
    if predicted is not None:
        line += f"; predicted step {1000 * predicted:.1f} ms"
    return line + f", lr factor {decision.lr_factor:.3g}"


def missed_prediction(step: int, plan: Plan, model: StepTimeModel, margin: float) -> str | None:
    """One line where the step time predicted for ``plan`` when it was adopted and the speed ``model``'s prediction for
    it now, refit on the steps run there, differ by more than ``margin`` (relative, or the model's own jitter where
    that is larger), else ``None``: a move rested on an extrapolation the timings since have not borne out."""
    predicted = plan.predicted_step_time
    refit = float(model.predict(plan.local_batch_sizes, plan.accumulation_steps))
    if predicted is None or predicted <= 0 or not math.isfinite(refit):
        return None
    miss, margin = refit / predicted - 1.0, margin_over_jitter(model, margin)
    if abs(miss) <= margin:
        return None
    return (
        f"Cannikin: by step {step} the plan {list(plan.local_batch_sizes)} (total {plan.total_batch_size}),"
        f" predicted at {1000 * predicted:.1f} ms a step, is timed at {1000 * refit:.1f} ms by the speed model refit"
        " on its steps"
        f" ({'+' if miss > 0 else ''}{_percent(miss)}, beyond the {_percent(margin)} margin); the next decision rests"
        " on these timings."
    )


def decision_values(decision: Decision, policy: PolicySettings) -> dict[str, float]:
    """The decision's numbers under ``cannikin/decision/*`` (what was not weighed, or is not finite, is left out)."""
    values = {
        "cannikin/decision/split_gain": decision.split_gain,
        "cannikin/decision/total_gain": decision.total_gain,
        "cannikin/decision/best_total_batch_size": decision.best_total,
    }
    found = {name: float(value) for name, value in values.items() if value is not None and math.isfinite(value)}
    if "cannikin/decision/split_gain" in found:
        found["cannikin/decision/split_margin"] = float(policy.split_margin)
    if "cannikin/decision/total_gain" in found:
        found["cannikin/decision/adapt_margin"] = float(policy.margin)
    return found


def _percent(value: float) -> str:
    return f"{100 * value:.1f}%"
