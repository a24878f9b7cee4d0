"""``UnevenDistributedSampler`` in a plain torch.distributed loop: equal batch counts, every sample once, exact mean."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from examples.torch_distributed import make_dataset
from lightning_cannikin import UnevenDistributedSampler

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("num_samples", "sizes", "drop_last"),
    [
        (1000, [48, 16], False),
        (101, [7, 5, 1], False),
        (101, [7, 5, 1], True),
        (64, [8, 8], False),
        (23, [3, 2], False),
    ],
)
def test_every_rank_gets_as_many_batches_and_every_sample_comes_once(num_samples, sizes, drop_last):
    samplers = [
        UnevenDistributedSampler(num_samples, sizes, rank=r, seed=3, drop_last=drop_last) for r in range(len(sizes))
    ]
    first_batches = []
    for epoch in (0, 1):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        batches = [list(sampler) for sampler in samplers]
        first_batches.append(batches[0][0])
        assert len({len(b) for b in batches}) == 1, "every rank must yield the same number of batches"
        assert all(len(b) == len(s) for b, s in zip(batches, samplers, strict=True))
        seen = sorted(i for rank_batches in batches for batch in rank_batches for i in batch)
        if drop_last:
            full = (num_samples // sum(sizes)) * sum(sizes)
            assert len(seen) == len(set(seen)) == full
        else:
            assert seen == list(range(num_samples)), "every sample exactly once per epoch"
        assert [len(b[0]) for b in batches] == sizes, "a full global batch follows the sizes"
        for step, per_rank in enumerate(zip(*batches, strict=True)):
            assert all(len(batch) >= 1 for batch in per_rank), "no rank steps on zero samples"
            weights = [s.weight(step) for s in samplers]
            assert sum(weights) == pytest.approx(1.0)
            assert weights == pytest.approx([len(b) / sum(map(len, per_rank)) for b in per_rank])
    assert first_batches[0] != first_batches[1], "set_epoch draws another permutation"


def test_new_sizes_apply_from_the_next_epoch_and_bad_input_is_refused():
    sampler = UnevenDistributedSampler(100, [10, 10], rank=0)
    sampler.set_local_batch_sizes([15, 5])
    assert sampler.local_batch_sizes == (15, 5) and len(next(iter(sampler))) == 15
    with pytest.raises(ValueError, match="Pass `rank=`"):
        UnevenDistributedSampler(100, [10, 10])
    with pytest.raises(ValueError, match="larger than the dataset"):
        UnevenDistributedSampler(10, [10, 10], rank=0)
    with pytest.raises(ValueError, match="positive integers"):
        UnevenDistributedSampler(100, [10, 0], rank=0)


def _mean_gradient(dataset, indices: list[int], params: list[list[float]]) -> torch.Tensor:
    """One process holding the whole global batch: the gradient of the mean loss over all of its samples."""
    x, y, _ = dataset.tensors
    layer = nn.Linear(x.shape[1], 1)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(params[0]).view_as(layer.weight))
        layer.bias.copy_(torch.tensor(params[1]).view_as(layer.bias))
    nn.functional.mse_loss(layer(x[indices]), y[indices]).backward()
    return torch.cat([layer.weight.grad.flatten(), layer.bias.grad.flatten()])


def test_the_example_loop_gives_the_exact_mean_gradient_over_every_sample_once(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "torch_distributed.py"), "--record", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 2 * 16  # 1000 samples in global batches of 64: 15 full + 1 of 40
    dataset = make_dataset(1000)
    for epoch in (0, 1):
        seen = sorted(i for rank in ranks for step in rank if step["epoch"] == epoch for i in step["indices"])
        assert seen == list(range(1000))
    worst_weighted = worst_plain = 0.0
    for step0, step1 in zip(*ranks, strict=True):
        assert step0["params"] == step1["params"], "the ranks' models must stay identical"
        reference = _mean_gradient(dataset, step0["indices"] + step1["indices"], step0["params"])
        reduced = torch.tensor([g for grad in step0["grads"] for g in grad])
        worst_weighted = max(worst_weighted, float((reduced - reference).abs().max()))
        # what DDP's plain average of the two ranks' mean gradients would have been
        plain = (
            _mean_gradient(dataset, step0["indices"], step0["params"])
            + _mean_gradient(dataset, step1["indices"], step0["params"])
        ) / 2
        worst_plain = max(worst_plain, float((plain - reference).abs().max()))
    assert worst_weighted < 1e-5, worst_weighted
    assert worst_plain > 100 * worst_weighted, "the check must be able to fail: an even average is off"


def test_a_probe_interleaved_with_the_split_it_left_alternates_then_stays():
    from lightning_cannikin.core.plan import Plan
    from lightning_cannikin.training.data.sampler import UnevenBatchSampler
    from lightning_cannikin.training.engine import BalancingEngine

    base, probe = Plan((16, 16)), Plan((24, 8))
    engine, sampler = BalancingEngine(), UnevenBatchSampler(640, 0, base)
    engine.data.use_loader(base, sampler)
    engine.data.set_plan(probe, from_batch=3, interleave=(base, 4))
    sizes = [sampler.sizes_at(q) for q in range(10)]
    assert sizes == [(16, 16)] * 3 + [(24, 8), (16, 16)] * 2 + [(24, 8)] * 3
    assert engine.data.plan == probe and len(sampler) == 20, "the same global batch: the epoch keeps its length"
    # a plan of another total is never interleaved (the epoch's length would change under the loader)
    engine.data.set_plan(Plan((40, 8)), from_batch=12, interleave=(probe, 4))
    assert [sampler.sizes_at(q) for q in range(11, 14)] == [(24, 8), (40, 8), (40, 8)]
