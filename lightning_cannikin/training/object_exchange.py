"""A re-plan's Python objects across the ranks in one collective round where they fit, not two.

``torch.distributed``'s object collectives exchange each payload's size first and the bytes second: two rounds, each
a collective with a fixed cost (about a millisecond and a half where the ranks share cores, more than the bytes
themselves at a re-plan's sizes). Here every payload travels in a buffer of a fixed capacity behind an 8-byte length:
one round, and a second only for the part of a payload beyond the capacity, which every rank sees from the lengths
of the first round (so every rank calls the same collectives).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CAPACITY", "all_gather_objects", "broadcast_object"]

# bytes of a payload that travel in the first round: a step record pickles to about 75 bytes, so some 800 steps'
# records between two re-plans (more only after long routine gaps, which then pay a second round)
CAPACITY = 1 << 16
_HEADER = 8


def all_gather_objects(obj: Any, device: torch.device) -> list[Any]:
    """Every rank's ``obj``, in rank order (``torch.distributed`` initialised; ``device``: where the collective's
    tensors live, the process group's device)."""
    payload = pickle.dumps(obj)
    buffer = _packed(payload, device)
    first = [torch.empty_like(buffer) for _ in range(dist.get_world_size())]
    dist.all_gather(first, buffer)
    lengths = [_length(part) for part in first]
    heads = [
        bytes(part[_HEADER : _HEADER + min(n, CAPACITY)].cpu().numpy()) for part, n in zip(first, lengths, strict=True)
    ]
    rest = max(lengths) - CAPACITY
    if rest > 0:  # some payload did not fit: its remainder, padded to the longest, in a second round
        tail = torch.zeros(rest, dtype=torch.uint8, device=device)
        mine = payload[CAPACITY:]
        if mine:
            tail[: len(mine)] = _bytes_tensor(mine, device)
        tails = [torch.empty_like(tail) for _ in range(len(first))]
        dist.all_gather(tails, tail)
        heads = [
            head + bytes(t[: max(n - CAPACITY, 0)].cpu().numpy())
            for head, t, n in zip(heads, tails, lengths, strict=True)
        ]
    return [pickle.loads(head) for head in heads]


def broadcast_object(obj: Any, src: int, device: torch.device) -> Any:
    """Rank ``src``'s ``obj`` on every rank (``torch.distributed`` initialised)."""
    source = dist.get_rank() == src
    payload = pickle.dumps(obj) if source else b""
    buffer = _packed(payload, device)
    dist.broadcast(buffer, src)
    length = _length(buffer)
    data = bytes(buffer[_HEADER : _HEADER + min(length, CAPACITY)].cpu().numpy())
    if length > CAPACITY:  # the remainder in a second round: every rank read the same length
        tail = torch.zeros(length - CAPACITY, dtype=torch.uint8, device=device)
        if source:
            tail[:] = _bytes_tensor(payload[CAPACITY:], device)
        dist.broadcast(tail, src)
        data += bytes(tail.cpu().numpy())
    return obj if source else pickle.loads(data)


def _packed(payload: bytes, device: torch.device) -> torch.Tensor:
    buffer = torch.zeros(_HEADER + CAPACITY, dtype=torch.uint8, device=device)
    head = len(payload).to_bytes(_HEADER, "little") + payload[:CAPACITY]
    buffer[: len(head)] = _bytes_tensor(head, device)
    return buffer


def _bytes_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _length(buffer: torch.Tensor) -> int:
    return int.from_bytes(bytes(buffer[:_HEADER].cpu().numpy()), "little")
