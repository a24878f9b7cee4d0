"""Loss weights per normalisation: gradient equality with one process, noise groups, the mismatch detector.

Ranks are simulated in one process: each "rank" backpropagates its weighted micro-batch losses into its own gradient
(accumulation sums them), the ranks' gradients are averaged as DDP's all-reduce does, and the result is compared with
one process's gradient of the global loss. No process group, so it runs in milliseconds; one real two-rank DDP run
over gloo (forked) checks the token-mean weights end to end.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torch import nn

from lightning_cannikin.core.loss_normalisation import (
    loss_scale_exponent,
    loss_weights,
    noise_groups,
    normalisation_mismatch,
)
from lightning_cannikin.core.noise_scale import pooled_moments

VOCAB, DIM = 11, 6


def _data(num_samples: int, seed: int = 0):
    """Token sequences of lengths 2..12 (a 6x spread), per-token targets."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 13, (num_samples,), generator=generator).tolist()
    tokens = [torch.randn(length, DIM, generator=generator, dtype=torch.float64) for length in lengths]
    targets = [torch.randint(0, VOCAB, (length,), generator=generator) for length in lengths]
    return tokens, targets


def _token_losses(model: nn.Module, tokens, targets, samples) -> list[torch.Tensor]:
    """Each sample's per-token cross-entropies."""
    return [nn.functional.cross_entropy(model(tokens[s]), targets[s], reduction="none") for s in samples]


def _group_loss(normalisation: str, per_token: list[torch.Tensor]) -> torch.Tensor:
    """The loss a user writes for one batch: the mean or sum of its samples' losses, or the mean over its tokens."""
    per_sample = torch.stack([t.mean() for t in per_token])
    if normalisation == "sample_mean":
        return per_sample.mean()
    if normalisation == "sample_sum":
        return per_sample.sum()
    return torch.cat(per_token).mean()


def _gradient(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return torch.cat([g.reshape(-1) for g in grads])


@pytest.mark.parametrize("normalisation", ["sample_mean", "sample_sum", "count_mean"])
@pytest.mark.parametrize("window", [[[5], [2], [1]], [[3, 4], [1, 2], [2, 1]]], ids=["uneven", "accumulation"])
@pytest.mark.parametrize("allreduce", ["mean", "sum"])
def test_weighted_ranks_reproduce_the_one_process_gradient(normalisation, window, allreduce):
    torch.manual_seed(0)
    model = nn.Linear(DIM, VOCAB).double()
    sizes = np.array(window)  # (ranks, micro-batches): samples per group
    tokens, targets = _data(int(sizes.sum()))
    # lay the groups out over the samples, rank-major
    bounds = np.concatenate([[0], np.cumsum(sizes.reshape(-1))]).reshape(-1)
    groups = [list(range(bounds[j], bounds[j + 1])) for j in range(sizes.size)]
    units = np.array([sum(len(targets[s]) for s in group) for group in groups]).reshape(sizes.shape)
    weights = loss_weights(normalisation, sizes, units, allreduce=allreduce)

    rank_gradients = []
    for rank in range(sizes.shape[0]):
        gradient = 0.0
        for micro in range(sizes.shape[1]):
            group = groups[rank * sizes.shape[1] + micro]
            loss = _group_loss(normalisation, _token_losses(model, tokens, targets, group))
            gradient = gradient + _gradient(model, weights[rank, micro] * loss)  # accumulation sums
        rank_gradients.append(gradient)
    reduced = torch.stack(rank_gradients).sum(0)
    if allreduce == "mean":
        reduced = reduced / sizes.shape[0]  # DDP's average

    everything = _token_losses(model, tokens, targets, range(int(sizes.sum())))
    expected = _gradient(model, _group_loss(normalisation, everything))
    assert torch.max(torch.abs(reduced - expected)).item() < 1e-6
    # the sample weighting every rank uses today is wrong for the other normalisations
    if normalisation != "sample_mean":
        today = loss_weights("sample_mean", sizes, allreduce=allreduce)
        assert not np.allclose(today, weights)


def test_weights_on_the_issue_example():
    # a split of [96, 32]: a sum needs n = 2 on both ranks, a mean 2 * b_i / B = [1.5, 0.5]
    np.testing.assert_allclose(loss_weights("sample_mean", [96, 32]).ravel(), [1.5, 0.5])
    np.testing.assert_allclose(loss_weights("sample_sum", [96, 32]).ravel(), [2.0, 2.0])
    np.testing.assert_allclose(loss_weights("count_mean", [96, 32], [1000, 3000]).ravel(), [0.5, 1.5])
    np.testing.assert_allclose(
        loss_weights("count_mean", [96, 32], [1000, 3000], allreduce="sum").ravel(), [0.25, 0.75]
    )


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="`normalisation`"):
        loss_weights("token_mean", [1, 2])
    with pytest.raises(ValueError, match="`unit_counts`"):
        loss_weights("count_mean", [1, 2])
    with pytest.raises(ValueError, match="`unit_counts`"):
        loss_weights("count_mean", [1, 2], [[1, 2]])
    with pytest.raises(ValueError, match="`allreduce`"):
        loss_weights("sample_mean", [1, 2], allreduce="max")
    with pytest.raises(ValueError, match="`sample_counts`"):
        loss_weights("sample_mean", [1, -2])
    with pytest.raises(ValueError, match="no samples"):
        loss_weights("sample_mean", [0, 0])


@pytest.mark.parametrize("normalisation", ["sample_mean", "sample_sum", "count_mean"])
def test_noise_groups_recover_the_global_mean_gradient(normalisation):
    """The factors turn the raw group gradients into means whose size-weighted sum is the factored global gradient."""
    rng = np.random.default_rng(0)
    sizes = np.array([[3, 4], [1, 2], [2, 1]])
    units = sizes * rng.integers(2, 9, size=sizes.shape)
    per_unit = [rng.normal(size=(int(u), 5)) for u in units.reshape(-1)]  # one gradient per unit (token)
    samples = [rng.normal(size=(int(b), 5)) for b in sizes.reshape(-1)]  # one gradient per sample
    if normalisation == "count_mean":
        raw = [g.mean(0) for g in per_unit]
        target = np.concatenate(per_unit).mean(0)
    else:
        raw = [g.mean(0) if normalisation == "sample_mean" else g.sum(0) for g in samples]
        pooled = np.concatenate(samples)
        target = pooled.mean(0) if normalisation == "sample_mean" else pooled.sum(0)
    groups = noise_groups(normalisation, sizes, units)
    means = [f * g for f, g in zip(groups.local_factors, raw, strict=True)]
    weights = groups.sizes / groups.sizes.sum()
    np.testing.assert_allclose(sum(w * m for w, m in zip(weights, means, strict=True)), groups.global_factor * target)
    expected_ratio = sizes.sum() / units.sum() if normalisation == "count_mean" else 1.0
    assert groups.samples_per_unit == pytest.approx(expected_ratio)


def test_token_mean_noise_scale_is_unbiased_with_token_sizes_and_biased_with_sample_sizes():
    """iid per-token gradients (known |G|^2 and per-token trace): group sizes in tokens estimate both without bias."""
    rng = np.random.default_rng(1)
    dim, mean = 8, np.full(8, 0.5)  # |G|^2 = 2.0, per-token tr(Sigma) = 8.0
    samples = np.array([6, 2, 3])
    tokens = np.array([90, 10, 20])  # samples of unequal length: tokens are not proportional to samples
    groups = noise_groups("count_mean", samples, tokens)
    by_tokens, by_samples = [], []
    for _ in range(4000):
        means = [mean + rng.normal(size=(int(t), dim)).mean(0) for t in tokens]
        global_mean = sum(t * m for t, m in zip(tokens, means, strict=True)) / tokens.sum()
        z = [float(m @ m) for m in means]
        y = float(global_mean @ global_mean)
        by_tokens.append(pooled_moments(z, groups.sizes, y))
        by_samples.append(pooled_moments(z, samples, y))
    grad_sqr, trace = np.mean(by_tokens, axis=0)
    assert grad_sqr == pytest.approx(2.0, abs=0.05)
    assert trace == pytest.approx(8.0, rel=0.05)
    # the noise scale in samples: 4 tokens (8 / 2) at 120 / 11 tokens a sample
    truth = 4.0 * samples.sum() / tokens.sum()
    assert trace / grad_sqr * groups.samples_per_unit == pytest.approx(truth, rel=0.05)
    wrong_sqr, wrong_trace = np.mean(by_samples, axis=0)
    assert wrong_trace / wrong_sqr > 1.5 * truth  # sample counts as group sizes: biased by the unequal lengths


def test_exponent_separates_sums_from_means_on_synthetic_losses():
    rng = np.random.default_rng(2)
    steps = 30
    sizes = np.column_stack([rng.integers(40, 100, steps), rng.integers(8, 40, steps)])
    trend = np.linspace(2.0, 0.5, steps)[:, None]  # the loss falls during training
    noise = np.exp(rng.normal(0, 0.1, sizes.shape))
    means = trend * noise
    sums = trend * sizes * noise
    assert abs(loss_scale_exponent(sizes, means)) < 0.2
    assert abs(loss_scale_exponent(sizes, sums) - 1.0) < 0.2
    assert normalisation_mismatch("sample_mean", sizes, means) is None
    assert normalisation_mismatch("sample_sum", sizes, sums) is None
    warning = normalisation_mismatch("sample_mean", sizes, sums)
    assert warning is not None and "sample_sum" in warning
    warning = normalisation_mismatch("sample_sum", sizes, means)
    assert warning is not None and "sample_mean" in warning


def test_mismatch_cannot_be_told_without_uneven_batches_or_positive_losses():
    sizes = np.full((20, 2), 32)
    assert loss_scale_exponent(sizes, np.ones((20, 2))) is None
    assert normalisation_mismatch("sample_mean", sizes, np.arange(1, 41).reshape(20, 2)) is None
    uneven = np.tile([64, 16], (20, 1))
    assert loss_scale_exponent(uneven, -np.ones((20, 2))) is None
    assert normalisation_mismatch("sample_mean", uneven[:3], uneven[:3] * 1.0) is None  # too few steps


def _ddp_rank(rank: int, world: int, store: str, out: str, groups, units) -> None:
    """One real rank: DDP over gloo, its token-mean loss times its weight, the averaged gradient saved."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(nn.Linear(DIM, VOCAB).double())
        tokens, targets = _data(sum(len(g) for g in groups))
        weight = loss_weights("count_mean", [len(g) for g in groups], units)[rank, 0]
        loss = _group_loss("count_mean", _token_losses(model, tokens, targets, groups[rank]))
        (weight * loss).backward()
        torch.save([p.grad for p in model.parameters()], f"{out}/rank{rank}.pt")
        # every rank done with its collectives, and the DDP reducer gone, before the group is torn down: a rank that
        # destroyed it while the other's reducer still held it aborted once in a CI run (SIGABRT in teardown)
        dist.barrier()
        del model
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_with_token_mean_weights_match_one_process(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(DIM, VOCAB).double()
    groups = [list(range(0, 6)), list(range(6, 8))]  # an uneven split of 8 samples
    tokens, targets = _data(8)
    units = [sum(len(targets[s]) for s in group) for group in groups]
    context = torch.multiprocessing.start_processes(
        _ddp_rank,
        args=(2, str(tmp_path / "store"), str(tmp_path), groups, units),
        nprocs=2,
        join=False,
        # spawn, not fork: a fork of a test process whose earlier tests left torch's or gloo's threads behind can
        # inherit a held lock and hang (it did once in a full CI run)
        start_method="spawn",
    )
    deadline = time.monotonic() + 60.0
    while not context.join(timeout=1.0):  # False while a rank is still running
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the two gloo ranks did not finish within 60 s")
    everything = _token_losses(model, tokens, targets, range(8))
    expected = _gradient(model, _group_loss("count_mean", everything))
    for rank in range(2):
        reduced = torch.cat([g.reshape(-1) for g in torch.load(tmp_path / f"rank{rank}.pt")])
        assert torch.max(torch.abs(reduced - expected)).item() < 1e-6
