"""Gumbel-max coupling (gpu_worker/sampling/coupling.py): exact draws from the processed distribution,
keyed by (seed, position, token id) only, and the coupled acceptance rate."""

import torch

import pytest

from gpu_worker.sampling.coupling import _scores_argmax, _uniforms, gumbel_argmax, gumbel_noise, stream_keys
from gpu_worker.sampling.sampler import SamplingTensors, sample
from tests.gpu_worker.sampling.test_rejection import assert_counts_match


def processed(top_k=0, top_p=1.0, V=12, seed=3):
    logits = torch.randn(1, 1, V, generator=torch.Generator().manual_seed(seed))
    params = SamplingTensors.build([0.8], top_k=[top_k], top_p=[top_p])
    return sample(logits, params, torch.zeros(1, 1, dtype=torch.float64))[0].probs[0, 0]  # (V,)


def test_draws_follow_the_processed_distribution_with_filters():
    for top_k, top_p in ((0, 1.0), (5, 0.9)):
        probs = processed(top_k, top_p)
        rows = 12000
        draws = gumbel_argmax(probs.expand(rows, 1, -1), torch.arange(rows), torch.zeros(rows, 1, dtype=torch.long))
        assert_counts_match(draws.flatten(), probs)


def test_noise_is_keyed_by_seed_position_and_token_only():
    seeds, positions, ids = torch.tensor([7, 8]), torch.tensor([[3, 4], [3, 4]]), torch.arange(50)
    noise = gumbel_noise(seeds, positions, ids)
    assert torch.equal(noise[0, 1], gumbel_noise(seeds[:1], positions[:1, 1:], ids)[0, 0])  # batch, split
    assert torch.equal(noise[0, 0, 10:20], gumbel_noise(seeds[:1], positions[:1, :1], ids[10:20])[0, 0])  # columns
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0, 0], noise[0, 1])
    assert bool(torch.isfinite(noise).all())


def test_zero_mass_is_never_drawn_and_an_empty_row_is_minus_one():
    probs = torch.tensor([[[0.0, 0.5, 0.0, 0.5]], [[0.0, 0.0, 0.0, 0.0]]])
    draws = gumbel_argmax(probs, torch.tensor([1, 2]), torch.zeros(2, 1, dtype=torch.long))
    assert draws[0, 0].item() in (1, 3) and draws[1, 0].item() == -1


def test_coupled_proposals_are_accepted_within_the_known_bounds():
    """P(argmax(log q + G) == argmax(log p + G)) lies in [(1-TV)/(1+TV), 1-TV] (Daliri et al.)."""
    gen = torch.Generator().manual_seed(4)
    V, rows = 16, 20000
    target = (torch.randn(V, generator=gen) * 1.2).softmax(-1)
    draft = (target.log() + torch.randn(V, generator=gen) * 0.7).softmax(-1)
    seeds, positions = torch.arange(rows), torch.zeros(rows, 1, dtype=torch.long)
    accepted = (gumbel_argmax(draft.expand(rows, 1, V), seeds, positions)
                == gumbel_argmax(target.expand(rows, 1, V), seeds, positions)).double().mean().item()
    tv = 0.5 * (target - draft).abs().sum().item()
    slack = 4.5 * (0.25 / rows) ** 0.5
    assert (1 - tv) / (1 + tv) - slack <= accepted <= 1 - tv + slack


@pytest.mark.parametrize("candidates", [16, 2, 1])
def test_the_kernels_candidates_draw_what_scoring_every_token_draws(candidates):
    """gumbel_argmax scores a few tokens a row where the kernel serves (the exponential race),
    and the whole row where it cannot rule the others out (few candidates force that often):
    the draw is always argmax(log p + G) over all N, filtered rows and rows without mass included."""
    gen = torch.Generator().manual_seed(5)
    B, T, V = 4, 3, 5000
    for scale in (0.3, 1.0, 4.0, 30.0):
        probs = (torch.randn(B, T, V, generator=gen) * scale).softmax(-1)
        probs[0] = torch.where(probs[0] > probs[0].amax(-1, keepdim=True) * 1e-2, probs[0], 0.0)  # top-p-like
        probs[1, 0] = 0.0
        probs[1, 1] = 0.0
        probs[1, 1, 17] = 1.0
        seeds, positions = torch.randint(0, 2**40, (B,), generator=gen), torch.randint(0, 9000, (B, T), generator=gen)
        uniforms = _uniforms(stream_keys(seeds, positions).reshape(B * T, 1), torch.arange(V))
        full = _scores_argmax(probs.reshape(B * T, V), uniforms)[1]
        drawn = gumbel_argmax(probs, seeds, positions, candidates=candidates)
        assert torch.equal(drawn.flatten(), full) and drawn[1, 0] == -1 and drawn[1, 1] == 17
