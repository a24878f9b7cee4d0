"""What the noise statistics cost the host per step: thread CPU time, measured side by side in one process.

One rank of DDP (gloo, one thread) trains the 784-256-256-10 MLP of ``benchmarks/overhead.py`` (0.27 M parameters)
and, with ``--wide``, a 784-2048-2048-10 one (5.8 M) on random data, in interleaved blocks of three variants:

- ``ddp``: DDP's own C++ all-reduce (what balancing alone runs);
- ``hook``: Cannikin's Python comm hook with the step timer observing every bucket and the noise observer attached
  but not measuring (an adaptive run's step once the bounds settle the total);
- ``measured``: the same with the noise statistics measured and exchanged on every step (an adaptive run's step
  while the bounds may still prove a move).

Thread CPU time (``time.thread_time``) of the whole step is taken, so a busy machine's other work does not enter it;
the report gives each variant's median over the blocks, the extra CPU of ``hook`` and ``measured`` over ``ddp`` per
step in microseconds (the median over the blocks of the difference within each block), and that extra as a share of
a 50 ms step (a small GPU step). On a GPU the norms' arithmetic runs on the device: its host cost is their launches.
Forward and backward are in every variant alike; their own cost cancels in the differences.

    python benchmarks/noise_capture_cost.py [--blocks 15] [--steps 40] [--wide]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_cannikin.core.noise_scale import NoiseScaleEstimator
from lightning_cannikin.training.measurement.comm_hook import WeightedAllReduceState, weighted_allreduce_hook
from lightning_cannikin.training.measurement.grad_stats import GradientNormObserver
from lightning_cannikin.training.measurement.step_timer import step_timer_for

RESULTS = Path(__file__).parent / "results"
VARIANTS = ("ddp", "hook", "measured")
STEP_S = 0.050  # the step the share is given against


def model(wide: bool) -> nn.Module:
    width = 2048 if wide else 256
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


class Variant:
    """One DDP model and what runs around its steps."""

    def __init__(self, name: str, wide: bool, batch: int) -> None:
        self.name, self.batch = name, batch
        self.ddp = DistributedDataParallel(model(wide))
        self.optimizer = torch.optim.SGD(self.ddp.parameters(), lr=0.01)
        # automatic optimization: the weight rides on the loss, the hook only sums (as the strategy sets it)
        self.state = WeightedAllReduceState(weight=1.0, weight_in_loss=True)
        self.timer = step_timer_for(torch.device("cpu"))
        self.observer = GradientNormObserver(0, 1, measure_every=2)
        self.estimator = NoiseScaleEstimator(batch)
        if name != "ddp":
            self.state.observers = [self.timer, self.observer]
            self.ddp.register_comm_hook(self.state, weighted_allreduce_hook)
        self.x, self.y = torch.randn(batch, 784), torch.randint(0, 10, (batch,))
        self.step = 0

    def run(self, steps: int) -> float:
        """Thread CPU seconds per step over ``steps`` steps."""
        start = time.thread_time()
        for _ in range(steps):
            self.observer.start_step(0 if self.name == "measured" else 1)  # step 1 of one in two: not measured
            self.timer.start()
            self.timer.forward_start()
            loss = nn.functional.cross_entropy(self.ddp(self.x), self.y)
            self.timer.will_reduce(True)
            loss.backward()
            self.timer.backward_done()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.name != "ddp":
                self.observer.fold_into(self.estimator, [[self.batch]])
            self.timer.finish(self.step, 0, self.batch)
            self.timer.records()
            self.step += 1
        return (time.thread_time() - start) / steps


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--wide", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    store = tempfile.mktemp()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        variants = {name: Variant(name, args.wide, args.batch) for name in VARIANTS}
        for variant in variants.values():
            variant.run(args.steps)  # warm-up: DDP's first iterations rebuild buckets
        cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.blocks):
            for name, variant in variants.items():  # interleaved: load and frequency changes hit all alike
                cpu[name].append(variant.run(args.steps))
    finally:
        dist.destroy_process_group()
    medians = {name: statistics.median(values) for name, values in cpu.items()}
    # paired within each block (the same few seconds of the machine), then the median over the blocks
    extra = {
        name: 1e6 * statistics.median(v - d for v, d in zip(cpu[name], cpu["ddp"], strict=True))
        for name in ("hook", "measured")
    }
    report = {
        "model": "784-2048-2048-10" if args.wide else "784-256-256-10",
        "batch": args.batch,
        "blocks": args.blocks,
        "steps_per_block": args.steps,
        "thread_cpu_us_per_step_median": {name: 1e6 * value for name, value in medians.items()},
        "extra_thread_cpu_us_per_step": extra,
        "extra_share_of_50ms_step": {name: us * 1e-6 / STEP_S for name, us in extra.items()},
        "per_block_us": {name: [1e6 * v for v in values] for name, values in cpu.items()},
    }
    out = args.out or RESULTS / ("noise_capture_cost_wide" if args.wide else "noise_capture_cost")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    for name in VARIANTS:
        line = f"{name:9s} {1e6 * medians[name]:8.0f} us thread CPU per step"
        if name in extra:
            line += f"  (+{extra[name]:.0f} us over ddp: {100 * extra[name] * 1e-6 / STEP_S:.2f}% of a 50 ms step)"
        print(line)
    print(f"saved {out.with_suffix('.json')}")
    return report


if __name__ == "__main__":
    main()
