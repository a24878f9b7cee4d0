"""A re-plan's objects across real gloo ranks in one round where they fit: the same objects as torch.distributed's own
object collectives, payloads of every size around the capacity included (fork, in-process under pytest)."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_cannikin.training.object_exchange import CAPACITY, all_gather_objects, broadcast_object

SIZES = (0, 10, CAPACITY - 20, CAPACITY + 5, 3 * CAPACITY)


def _ranks(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    try:
        device, rounds = torch.device("cpu"), []
        for size in SIZES:
            mine = {"rank": rank, "blob": bytes([rank]) * (size * (rank + 1) // 3)}
            reference: list = [None] * 3
            dist.all_gather_object(reference, mine)
            assert all_gather_objects(mine, device) == reference, size
            sent = {"blob": b"z" * size, "from": 1} if rank == 1 else None
            assert broadcast_object(sent, 1, device) == {"blob": b"z" * size, "from": 1}, size
            rounds.append(size)
        if rank == 0:
            with open(out, "w") as f:
                f.write(",".join(map(str, rounds)))
    finally:
        dist.destroy_process_group()


def test_objects_of_every_size_reach_every_rank_as_torch_distributed_gives_them(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "done"
    mp.start_processes(_ranks, args=(port, str(out)), nprocs=3, start_method="fork")
    assert out.read_text() == ",".join(map(str, SIZES)), "every size, checked on every rank"
