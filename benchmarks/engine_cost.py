"""The balancing engine's own CPU per step, alone on its thread: what the wall clock of a shared host cannot resolve.

Rank zero's :class:`~lightning_cannikin.training.engine.BalancingEngine` runs the step API a strategy calls (begin,
forward, loss, backward, optimizer step, end: re-plans included) for thousands of steps of a 3-rank heterogeneous
cluster. Each step's compute is a sleep of the emulated device's time (it costs no CPU, and the step timer reads it
as compute); the other two ranks' records are rank zero's with their own emulated times, as the gather would bring
them. The figure is thread CPU time per step (``time.thread_time``) of the default engine (``strategy="cannikin"``
alone: balancing, the ranks' change votes, the fits at re-plans) less that of the same loop with a fixed split (the
step's weights and timing only), the median over interleaved blocks. The emulated ranks answer the vote in-process,
so the vote's own collective is measured apart: the thread CPU of starting one asynchronous all-reduce of one number
on a gloo group of 3 forked ranks (:func:`vote_call_us`), a cost the engine pays every ``check_every_n_steps`` steps.
``benchmarks/overhead.py`` records both beside the full runs' figure as ``engine_alone_thread_cpu_us_per_step``.

    python benchmarks/engine_cost.py [--steps 1500] [--blocks 5]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_cannikin.core.speed_model import StepRecord
from lightning_cannikin.training.collective import StrategyCollective
from lightning_cannikin.training.data.sampler import UnevenBatchSampler
from lightning_cannikin.training.engine import BalancingEngine
from lightning_cannikin.training.settings import CannikinSettings

SLOPES_MS = (0.01, 0.02, 0.04)  # per sample on each emulated rank: rank zero is the fastest
FIXED_MS = 1.0
TAIL_S = 0.0005


class EmulatedRanks:
    """Rank zero of ``len(SLOPES_MS)`` ranks: every other rank reports rank zero's steps at its own emulated times."""

    rank, host_runs_ahead = 0, False

    def __init__(self) -> None:
        self.world_size = len(SLOPES_MS)
        self.sizes: dict[int, tuple[int, ...]] = {}  # every step's sizes, by the engine's step index

    def all_gather(self, obj: Any) -> list[Any]:
        records, yielded, _, cost = obj
        every = [obj]
        for rank in range(1, self.world_size):
            mine = []
            for r in records:
                b = self.sizes[r.step][rank]
                compute = compute_s(rank, b)
                mine.append(StepRecord(r.step, rank, b, compute, r.step_time, r.allreduce, r.exposed))
            every.append((mine, yielded, [], cost))
        return every

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def max_later(self, value: int) -> Any:
        return lambda: value


def compute_s(rank: int, batch: int) -> float:
    return (FIXED_MS + SLOPES_MS[rank] * batch) / 1000


def run_block(steps: int, fixed: bool, total: int = 96) -> float:
    """Thread CPU seconds per step of ``steps`` steps of rank zero's engine (``fixed``: a fixed even split)."""
    ranks = EmulatedRanks()
    engine = BalancingEngine(save_profile=False)
    engine.bind(ranks, fixed_split=fixed)
    plan = engine.controller.bounds.first_plan(total)
    sampler = UnevenBatchSampler(total * (steps + 1), rank=0, plan=plan, shuffle=False)
    engine.data.use_loader(plan, sampler)
    parameter = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    engine.start(optimizer)
    loss = torch.tensor(1.0)
    batches = iter(sampler)
    start = time.thread_time()
    for step in range(steps):
        next(batches)  # the loader draws the batch (the fixed split's loop does too)
        position = sampler.yielded - 1
        sizes = sampler.sizes_at(position)
        ranks.sizes[engine.controller.step] = sizes
        engine.begin_step(step, batch=(position, sizes))
        engine.forward_started()
        with engine.backward(loss, reduces=True, parameters=tuple):
            time.sleep(compute_s(0, sizes[0]))  # the device computes: no CPU of this thread
            engine.reductions.gradient_ready()  # DDP's parameter hooks: the first and the last gradient ready
            engine.reductions.gradient_ready()
        with engine.optimizer_step(optimizer):
            pass
        time.sleep(max(compute_s(r, b) for r, b in enumerate(sizes)) - compute_s(0, sizes[0]) + TAIL_S)
        engine.end_step()
    return (time.thread_time() - start) / steps


def _vote_calls(rank: int, world_size: int, port: int, calls: int, results: Any) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    # the engine's own vote: the strategy collective's maximum, started now and read a step later
    strategy = SimpleNamespace(global_rank=rank, world_size=world_size, root_device=torch.device("cpu"))
    collective = StrategyCollective(strategy)
    spent = 0.0
    for call in range(calls + 50):  # the first 50 warm the group up
        start = time.thread_time()
        read = collective.max_later(call % 2)
        if call >= 50:
            spent += time.thread_time() - start
        time.sleep(0.002)  # a step's compute runs beside the vote
        read()
    results.put(1e6 * spent / calls)
    dist.destroy_process_group()


def vote_call_us(world_size: int = 3, calls: int = 400, port: int = 29531) -> float:
    """The median over ranks of the thread CPU (us) that starting one vote costs on gloo
    (:meth:`~lightning_cannikin.training.collective.StrategyCollective.max_later`: an asynchronous all-reduce of one
    number)."""
    context = mp.get_context("fork")
    results = context.Queue()
    ranks = [context.Process(target=_vote_calls, args=(r, world_size, port, calls, results)) for r in range(world_size)]
    for process in ranks:
        process.start()
    costs = [results.get(timeout=120) for _ in ranks]
    for process in ranks:
        process.join()
    return statistics.median(costs)


def engine_alone(steps: int = 1500, blocks: int = 5) -> dict[str, Any]:
    """The default engine's thread CPU per step over the fixed split's, in microseconds, interleaved blocks."""
    default, fixed = [], []
    logging.getLogger("lightning.fabric.utilities.rank_zero").setLevel(logging.WARNING)  # no line per re-plan
    for _ in range(blocks):
        default.append(1e6 * run_block(steps, fixed=False))
        fixed.append(1e6 * run_block(steps, fixed=True))
    paired = [d - f for d, f in zip(default, fixed, strict=True)]
    return {
        "default_over_fixed_us_median": statistics.median(paired),
        "default_over_fixed_us": paired,
        "default_us": default,
        "fixed_us": fixed,
        "steps_per_block": steps,
        "ranks": len(SLOPES_MS),
        "vote_call_us": vote_call_us(len(SLOPES_MS)),
        "vote_every_n_steps": CannikinSettings().check_every_n_steps,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--blocks", type=int, default=5)
    args = parser.parse_args(argv)
    result = engine_alone(args.steps, args.blocks)
    paired = ", ".join(f"{x:.0f}" for x in result["default_over_fixed_us"])
    print(
        f"engine alone: default over fixed {result['default_over_fixed_us_median']:.1f} us per step"
        f" (blocks {paired}); fixed split alone {statistics.median(result['fixed_us']):.0f} us per step; a vote"
        f" {result['vote_call_us']:.0f} us to start, every {result['vote_every_n_steps']} steps"
    )


if __name__ == "__main__":
    main()
