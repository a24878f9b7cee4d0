"""Uneven local batches in a plain ``torch.distributed`` loop: no Lightning, the exact mean gradient.

    python examples/torch_distributed.py                      # starts 2 CPU processes itself (gloo)
    torchrun --nproc_per_node 2 examples/torch_distributed.py # or any launcher that sets RANK and WORLD_SIZE
    python examples/torch_distributed.py --smoke              # a quick check that it runs: 1 epoch, 256 samples

Rank r trains on ``--local-batch-sizes[r]`` samples per step (a fast device gets more), drawn by
``UnevenDistributedSampler`` from one permutation that every rank shares: every rank runs the same number of steps
and every sample is used once per epoch. Each rank's loss, a mean over its own samples, is multiplied by the world
size times its share of the step's samples (``sampler.weight(step)``, ``b_r / B``); DDP's own all-reduce averages
over the ranks, so the update is the exact mean gradient over the global batch, where DDP's plain average of the
ranks' mean losses would over-weight the small batches. (The library's strategies put the same weight on the loss.)

``import lightning_cannikin`` here imports neither Lightning nor anything but torch: the package is lazy.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_cannikin import UnevenDistributedSampler


def make_dataset(num_samples: int = 1000, dim: int = 8, seed: int = 0) -> TensorDataset:
    """``(x, y, index)`` of a seeded linear regression problem (the index lets a test audit the samples)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, dim, generator=generator)
    y = x @ torch.randn(dim, 1, generator=generator) + 0.1 * torch.randn(num_samples, 1, generator=generator)
    return TensorDataset(x, y, torch.arange(num_samples))


def train(rank: int, world_size: int, args: argparse.Namespace, store_port: int | None = None) -> None:
    if store_port is None:  # a launcher's rendezvous (MASTER_ADDR, MASTER_PORT)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    else:  # the store this script's own process keeps open until every rank is gone
        store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    torch.manual_seed(0)
    dataset = make_dataset(args.num_samples)
    model = DistributedDataParallel(nn.Linear(dataset.tensors[0].shape[1], 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    sampler = UnevenDistributedSampler(dataset, args.local_batch_sizes, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_sampler=sampler)
    steps: list[dict] = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for step, (x, y, index) in enumerate(loader):
            params = [p.detach().flatten().tolist() for p in model.parameters()]
            loss = nn.functional.mse_loss(model(x), y)  # the mean over this rank's samples
            # DDP averages the ranks' gradients: (1/n) sum_r n (b_r/B) grad_r = the mean over the global batch
            (loss * (world_size * sampler.weight(step))).backward()
            grads = [p.grad.flatten().tolist() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            steps.append({"epoch": epoch, "indices": index.tolist(), "params": params, "grads": grads})
    if args.record:
        Path(args.record, f"rank{rank}.json").write_text(json.dumps(steps))
    samples = sum(len(s["indices"]) for s in steps)
    summary = f"rank {rank}: {len(steps)} steps, {samples} samples, local batch {args.local_batch_sizes[rank]}"
    # One process prints every rank's line, in rank order: ranks that print at once share the pipe, and their
    # lines would run into each other.
    summaries: list[str | None] = [None] * world_size
    dist.all_gather_object(summaries, summary)
    if rank == 0:
        print("\n".join(str(line) for line in summaries), flush=True)
    # Free the DDP reducer (it holds the process group and its last futures) while the interpreter is fully
    # alive: gloo work still referenced at interpreter shutdown can abort the process after all the work is done.
    del model, optimizer, loss
    gc.collect()
    dist.barrier()  # no rank tears its process group down while another still talks to it
    dist.destroy_process_group()


def _spawned(rank: int, world_size: int, args: argparse.Namespace, store_port: int) -> None:
    train(rank, world_size, args, store_port)
    # A spawned worker's work is done and written; its interpreter shutdown can still abort ("terminate called without
    # an active exception": a gloo thread torn down by a C++ destructor), which spawn reports as a failed rank. Leave
    # without running those destructors.
    sys.stdout.flush()
    os._exit(0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local-batch-sizes", type=int, nargs="+", default=[48, 16], help="one per rank")
    parser.add_argument("--num-samples", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--record", metavar="DIR", help="write each rank's indices, parameters and gradients here")
    parser.add_argument("--smoke", action="store_true", help="1 epoch of 256 samples: a check that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.epochs, args.num_samples = 1, 256
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if "RANK" in os.environ:  # started by torchrun or another launcher
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    world_size = len(args.local_batch_sizes)
    # The rendezvous store lives in this process, as torchrun's does in its agent, not in rank 0: a rank that leaves
    # first must not take the store away from ranks still shutting down their process group.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    mp.spawn(_spawned, args=(world_size, args, store.port), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
