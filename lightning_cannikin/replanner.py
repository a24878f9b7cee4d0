"""The next plan from the fitted models: the total batch (goodput, at epoch ends) and its split (OptPerf).

Pure: numpy and the project's maths modules only (no torch, no Lightning). The callback calls :func:`next_plan` on
rank zero and broadcasts the result.
"""

from __future__ import annotations

import numpy as np

from lightning_cannikin.balancer import SplitBalancer
from lightning_cannikin.goodput import candidate_batch_sizes, choose_batch_size
from lightning_cannikin.plan import Plan
from lightning_cannikin.planner import even_split


def choose_global_batch(
    balancer: SplitBalancer,
    current: Plan,
    noise_scale: float,
    base_batch_size: int,
    max_batch_size: int,
    balance: bool = True,
    margin: float = 0.05,
) -> int:
    """The global batch (samples per micro-step) with the best predicted goodput, or the current one.

    Candidates run from the base batch to ``max_batch_size`` (both per optimizer step, so divided by the accumulation
    steps), within the sum of the per-rank bounds. With ``balance=False`` each candidate is timed at an even split,
    which is what an even-split adaptive system (AdaptDL) would run.
    """
    accumulation = current.accumulation_steps
    n = current.world_size
    lower = max(-(-base_batch_size // accumulation), sum(balancer.lower), n)
    upper = max_batch_size // accumulation
    if balancer.upper is not None:
        upper = min(upper, sum(balancer.upper))
    if upper < lower:
        return current.global_batch_size
    candidates = candidate_batch_sizes(lower, upper)

    def timed(globals_: np.ndarray) -> np.ndarray:
        if balance:
            return balancer.optperf(globals_)
        return np.array([balancer.predict(even_split(int(g), n)) for g in globals_])

    # Keeping the total batch means running it at its best split (re-splitting is free), not at the current split:
    # a stale split must not credit a change of total batch with the gain of re-balancing.
    kept_time = float(timed(np.array([current.global_batch_size]))[0])
    choice = choose_batch_size(
        candidates * accumulation,
        timed(candidates) * accumulation,
        noise_scale,
        base_batch_size,
        current.total_batch_size,
        kept_time * accumulation,
        margin=margin,
    )
    return choice.next_batch_size // accumulation


def next_plan(
    balancer: SplitBalancer,
    current: Plan,
    noise_scale: float | None = None,
    base_batch_size: int | None = None,
    max_batch_size: int | None = None,
    balance: bool = True,
    margin: float = 0.05,
) -> Plan:
    """The plan to adopt next.

    Args:
        balancer: the fitted per-rank models (must be ``ready``).
        current: the plan in force.
        noise_scale: the gradient noise scale; ``None`` (no statistics) keeps the total batch.
        base_batch_size: B0, the batch the learning rate was tuned for.
        max_batch_size: the largest total batch to consider; ``None`` keeps the total batch.
        balance: split by the fitted speeds (OptPerf); ``False`` splits evenly.
        margin: relative goodput gain required to change the total batch.

    While some rank's slope is not yet identified (one batch size seen), a balancing plan perturbs the current split
    instead, so that every rank runs a new batch size and the next re-plan can measure it; the total batch waits.
    An even split never probes: like AdaptDL, it chooses the total batch from the one-size prior (half the step time
    as intercept) until a change of total batch measures the slope.
    """
    global_batch = current.global_batch_size
    adapt = max_batch_size is not None and noise_scale is not None and base_batch_size is not None
    if adapt and (balancer.identified or not balance):
        global_batch = choose_global_batch(
            balancer,
            current,
            noise_scale,
            base_batch_size,
            max_batch_size,
            balance,
            margin,  # type: ignore[arg-type]
        )
    if balance and not balancer.identified:
        # a slope guessed from one batch size can be far off (AdaptDL's prior puts half the time in the intercept):
        # rather than act on it, move every rank a little from where it is, so the next re-plan measures slopes
        sizes = balancer.probe(current.local_batch_sizes)
    elif balance:
        sizes = balancer.plan_split(global_batch).local_batch_sizes
    else:
        sizes = even_split(global_batch, current.world_size)
    return current.with_sizes(sizes, predicted_step_time=balancer.predict(sizes))
