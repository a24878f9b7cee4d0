"""The balancing engine driven step by step on synthetic gradient statistics of a known noise scale (no timing of
this machine enters a decision): what the tests of the adaptive total replay.

Every call a frontend makes (the step API: ``begin_step``, ``backward``, ``optimizer_step``, ``end_step``) runs over
a collective of one rank and an uneven sampler drawn one batch at a time, as a loader does; every step's statistics
(groups of the total in given shares, by default 5/8 and 3/8, from Gaussian per-sample gradients) reach the engine's
estimator as the exchange would; the step time is a known function of the total (``SpeedModel.predict`` is replaced
by the caller).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from lightning_cannikin import CannikinSettings
from lightning_cannikin.training.data.sampler import UnevenBatchSampler
from lightning_cannikin.training.engine import BalancingEngine, log_messages
from tests.test_engine import OneRank


@dataclass
class NoiseRun:
    """What one run did at each step: the total it ran, its LR factor, and the bounds held after it."""

    engine: BalancingEngine
    totals: list[int] = field(default_factory=list)
    factors: list[float] = field(default_factory=list)
    bounds: list[tuple[float, float] | None] = field(default_factory=list)
    estimates: list[float | None] = field(default_factory=list)  # the point estimate after each step
    precise: list[bool] = field(default_factory=list)  # both averages within 25% (one standard error) of themselves

    def first_growth(self) -> int | None:
        base = self.totals[0]
        return next((step for step, total in enumerate(self.totals) if total > base), None)


def run_engine(
    noise_scale: Callable[[int], float],
    steps: int,
    seed: int = 0,
    base: int = 64,
    cap: int | None = 1024,
    dim: int = 64,
    grad_sqr: Callable[[int], float] | None = None,
    lr_scaling: str = "adascale",
    shares: tuple[int, ...] = (5, 3),
    total: int | None = None,
    **settings: object,
) -> NoiseRun:
    """Drive an even-split ``BalancingEngine`` for ``steps`` steps on statistics whose true noise scale after ``step``
    steps is ``noise_scale(step)`` (``inf``: no signal) and whose ``|G|^2`` is ``grad_sqr(step)`` (default 1), from
    groups (ranks) that hold ``shares`` of every total (by default 5/8 and 3/8), starting at ``total`` (default the
    base batch; ``cap=None``: kept)."""
    rng = np.random.default_rng(seed)
    direction = np.ones(dim) / np.sqrt(dim)
    engine = BalancingEngine(
        max_batch_size=cap,
        lr_scaling=lr_scaling,
        base_batch_size=base,
        balance=False,
        settings=CannikinSettings(**settings),
    )
    engine.bind(OneRank())
    plan = engine.controller.bounds.first_plan(total or base)
    sampler = UnevenBatchSampler((cap or plan.total_batch_size) * (steps + 2), rank=0, plan=plan, shuffle=False)
    engine.data.use_loader(plan, sampler)
    engine.start()
    run, batches = NoiseRun(engine), iter(sampler)
    for step in range(steps):
        next(batches)  # the loader draws the next batch: a plan decided now starts after it
        position = sampler.yielded - 1
        sizes = sampler.sizes_at(position)
        engine.begin_step(step, batch=(position, sizes))
        engine.forward_started()
        with engine.backward(torch.tensor(1.0), reduces=True, parameters=tuple):
            engine.reductions.gradient_ready()
        total = sum(sizes)
        groups_b = np.asarray(shares, dtype=float) * total / sum(shares)
        phi = noise_scale(step)
        sqr = 1.0 if grad_sqr is None else grad_sqr(step)
        trace = phi * sqr if np.isfinite(phi) else 1.0
        mean = direction * np.sqrt(sqr if np.isfinite(phi) else 0.0)
        groups = mean + rng.standard_normal((len(shares), dim)) * np.sqrt(trace / dim / groups_b)[:, None]
        reduced = (groups_b[:, None] * groups).sum(axis=0) / total
        engine.controller.estimator.update((groups**2).sum(axis=1), groups_b, float(reduced @ reduced))
        log_messages(engine.controller.noise_folded())  # as the engine tells of the observer's fold
        run.totals.append(total)
        run.factors.append(engine.running.lr_factor)
        engine.end_step()
        run.bounds.append(engine.controller.noise.bounds)
        run.estimates.append(engine.controller.noise.estimate)
        run.precise.append(_precise(engine))
    return run


def _precise(engine: BalancingEngine, share: float = 0.25) -> bool:
    """Whether both averaged parts of the noise scale are known to within ``share`` of themselves (one standard error):
    the confidence a rule that waited for precision needed before it acted, or kept a gain."""
    estimator = engine.controller.estimator
    errors = estimator.standard_errors()
    if errors is None:
        return False
    sqr, var = estimator.grad_sqr, estimator.grad_var
    return sqr > 0 and var > 0 and errors[0] <= share * sqr and errors[1] <= share * var


def true_choice(
    step_time: Callable[[np.ndarray], np.ndarray], noise_scale: float, base: int, cap: int, totals: Sequence[int] = ()
):
    """``(best total, its goodput, goodput of every total as a dict)`` at the true noise scale, by brute force over
    ``totals`` (default: every total from ``base`` to ``cap``), written out from goodput's definition (samples a
    second, each worth ``(phi + B0) / (phi + B)`` of a sample at B0), not from the library's goodput."""
    totals = np.asarray(totals, dtype=np.int64) if len(totals) else np.arange(base, cap + 1)
    worth = np.ones(len(totals)) if np.isinf(noise_scale) else (noise_scale + base) / (noise_scale + totals)
    values = totals / np.asarray(step_time(totals), dtype=float) * worth
    best = int(np.argmax(values))
    return int(totals[best]), float(values[best]), dict(zip(totals.tolist(), values.tolist(), strict=True))
