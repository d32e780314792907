import pytest
import torch

from gpu_worker.sampling.rejection import map_draft_probs_to_target, proposal_to_draft_probs, rejection_sample
from gpu_worker.sampling.sampler import (
    STREAM_ACCEPT,
    STREAM_RESIDUAL,
    SamplingInputError,
    SamplingTensors,
    make_uniforms,
    sample,
)


def ids(rows):
    return torch.tensor(rows, dtype=torch.int64)


def f64(rows):
    return torch.tensor(rows, dtype=torch.float64)


def uniform_target(B, K, V):
    return torch.full((B, K + 1, V), 1.0 / V)


# --- greedy -------------------------------------------------------------------------------


def test_greedy_all_match_emits_drafts_and_bonus():
    result = rejection_sample(
        ids([[1, 2, 3]]), ids([3]), None, uniform_target(1, 3, 8), ids([[1, 2, 3, 7]]), torch.tensor([True])
    )
    assert result.token_ids.tolist() == [[1, 2, 3, 7]]
    assert result.num_accepted.tolist() == [3]


def test_greedy_early_mismatch_emits_verifier_token_and_stops():
    result = rejection_sample(
        ids([[1, 2, 3]]), ids([3]), None, uniform_target(1, 3, 8), ids([[1, 5, 3, 7]]), torch.tensor([True])
    )
    assert result.token_ids.tolist() == [[1, 5, -1, -1]]
    assert result.num_accepted.tolist() == [1]


def test_empty_drafts_emit_the_target_token_for_greedy_and_sampled_rows():
    result = rejection_sample(
        ids([[-1, -1], [-1, -1]]),
        ids([0, 0]),
        None,
        uniform_target(2, 2, 8),
        ids([[4, -1, -1], [6, 1, 2]]),
        torch.tensor([True, False]),
        uniforms=f64([[0.5, 0.5]] * 2),
        residual_uniforms=f64([[0.5, 0.5]] * 2),
    )
    assert result.token_ids.tolist() == [[4, -1, -1], [6, -1, -1]]
    assert result.num_accepted.tolist() == [0, 0]


def test_mixed_greedy_and_sampled_rows_in_one_batch():
    # row 0 greedy, mismatch at slot 1; row 1 sampled, accepts both (u * p < q); row 2 sampled,
    # rejects slot 0 (0.9 * 1 >= 0.25) and draws the residual q with id 2 zeroed
    V = 4
    target_probs = torch.tensor([[0.25, 0.25, 0.25, 0.25]]).expand(3, 3, V).contiguous()
    result = rejection_sample(
        ids([[1, 2], [3, 0], [2, 1]]),
        ids([2, 2, 2]),
        None,
        target_probs,
        ids([[1, 0, 3], [0, 0, 1], [2, 2, 2]]),
        torch.tensor([True, False, False]),
        uniforms=f64([[0.0, 0.0], [0.1, 0.2], [0.9, 0.0]]),
        residual_uniforms=f64([[0.0, 0.0], [0.0, 0.0], [0.7, 0.0]]),
    )
    # residual of row 2 is [0.25, 0.25, 0, 0.25]: cdf [.25, .5, .5, .75], 0.7 * 0.75 = 0.525 -> id 3
    assert result.token_ids.tolist() == [[1, 0, -1], [3, 0, 1], [3, -1, -1]]
    assert result.num_accepted.tolist() == [1, 2, 0]


def test_sampled_draft_equal_to_verifier_token_is_still_rejected():
    # draft 2 == t_1 = 2, but u * p(2) = 0.5 * 0.9 = 0.45 >= q(2) = 0.3: rejected
    draft_probs = torch.tensor([[[0.05, 0.05, 0.9, 0.0]]])
    target_probs = torch.tensor([[[0.2, 0.2, 0.3, 0.3], [0.25, 0.25, 0.25, 0.25]]])
    result = rejection_sample(
        ids([[2]]),
        ids([1]),
        draft_probs,
        target_probs,
        ids([[2, 0]]),
        torch.tensor([False]),
        uniforms=f64([[0.5]]),
        residual_uniforms=f64([[0.99]]),
    )
    # residual max(q - p, 0) = [0.15, 0.15, 0, 0.3]: u = 0.99 lands on id 3, never on 2
    assert result.token_ids.tolist() == [[3, -1]]
    assert result.num_accepted.tolist() == [0]


def test_bonus_is_the_target_samplers_own_draw():
    # all accepted (u = 0); bonus = target_token_ids at slot num_draft, not the argmax of q
    target_probs = torch.tensor([[[0.1, 0.9], [0.1, 0.9], [0.9, 0.1]]])
    result = rejection_sample(
        ids([[1, -1]]), ids([1]), None, target_probs, ids([[1, 0, 1]]), torch.tensor([False]),
        uniforms=f64([[0.0, 0.0]]), residual_uniforms=f64([[0.0, 0.0]]),
    )
    assert result.token_ids.tolist() == [[1, 0, -1]]
    assert result.num_accepted.tolist() == [1]


def test_zero_mass_residual_falls_back_to_verifier_token_and_is_flagged():
    # inconsistent input: draft_probs = 2 * target_probs, so max(q - p, 0) is all zero
    target_probs = torch.tensor([[[0.25] * 4, [0.25] * 4]])
    result = rejection_sample(
        ids([[1]]), ids([1]), 2 * target_probs[:, :1], target_probs, ids([[3, 0]]), torch.tensor([False]),
        uniforms=f64([[0.9]]), residual_uniforms=f64([[0.5]]),
    )
    assert result.token_ids.tolist() == [[3, -1]]
    assert result.residual_fallback.tolist() == [True]
    assert result.num_residual_fallbacks == 1


# --- statistics ---------------------------------------------------------------------------

ROWS, K, V = 20000, 2, 8


def draw(probs, generator):
    """One id per row from probs [R, V]."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def run_speculation(target_probs, draft_probs, generator, point_mass_draft=None):
    """target_probs [K+1, V], draft_probs [K, V] shared by every row; returns RejectionResult."""
    if point_mass_draft is None:
        drafts = torch.stack([draw(draft_probs[i].expand(ROWS, V), generator) for i in range(K)], 1)
        row_draft_probs = draft_probs.expand(ROWS, K, V)
    else:
        drafts = torch.tensor(point_mass_draft).expand(ROWS, K).contiguous()
        row_draft_probs = None
    targets = torch.stack([draw(target_probs[i].expand(ROWS, V), generator) for i in range(K + 1)], 1)
    return rejection_sample(
        drafts, torch.full((ROWS,), K), row_draft_probs, target_probs.expand(ROWS, K + 1, V), targets,
        torch.zeros(ROWS, dtype=torch.bool), generator,
    )


def assert_counts_match(tokens, probs, sigmas=4.5):
    """Every bucket of the histogram of tokens [N] within `sigmas` of N * probs [V]."""
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * n
    assert bool((counts[expected == 0] == 0).all()), (counts, expected)
    z = (counts - expected) / (expected * (1 - probs.double())).sqrt().clamp_min(1e-9)
    assert float(z[expected > 0].abs().max()) < sigmas, (counts, expected)


def distributions(seed, filtered=False, masked=False):
    """Target and draft laws; masked: the target's logits restricted per position as a grammar
    does (gpu_worker/verifier/verifier_grammar.py, -inf outside the allowed tokens), the draft not."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, K + 1, V, generator=gen) * 1.5
    if masked:
        allowed = torch.rand(1, K + 1, V, generator=gen) < 0.5
        allowed[..., 0] = True
        logits = logits.masked_fill(~allowed, float("-inf"))
    params = SamplingTensors.build([1.0], top_k=[5 if filtered else 0], top_p=[0.85 if filtered else 1.0])
    target_probs = sample(logits, params, torch.zeros(1, K + 1, dtype=torch.float64))[0].probs[0]
    draft_probs = (torch.randn(K, V, generator=gen) * 1.5).softmax(-1)
    return target_probs, draft_probs, gen


@pytest.mark.parametrize("filtered,masked", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("proposal", ["dense", "point_mass"])
def test_emitted_tokens_follow_the_target_distribution(proposal, filtered, masked):
    target_probs, draft_probs, gen = distributions(21, filtered, masked)
    # a point-mass draft on the second most likely target token: accepted sometimes, not always
    point_mass = target_probs[:K].argsort(-1, descending=True)[:, 1].tolist() if proposal == "point_mass" else None
    result = run_speculation(target_probs, draft_probs, gen, point_mass)
    assert_counts_match(result.token_ids[:, 0], target_probs[0])
    # given slot 0 was an accepted draft, slot 1 is a fresh draw from q_2
    second = result.token_ids[result.num_accepted >= 1, 1]
    assert_counts_match(second, target_probs[1])
    assert result.num_residual_fallbacks == 0


@pytest.mark.parametrize("proposal", ["dense", "point_mass"])
def test_accepted_count_matches_products_of_acceptance_rates(proposal):
    target_probs, draft_probs, gen = distributions(5)
    if proposal == "point_mass":
        point_mass = [int(draft_probs[i].argmax()) for i in range(K)]
        draft_probs = torch.nn.functional.one_hot(torch.tensor(point_mass), V).float()
    else:
        point_mass = None
    result = run_speculation(target_probs, draft_probs, gen, point_mass)
    alpha = torch.minimum(draft_probs, target_probs[:K]).sum(-1).double()  # (K,)
    at_least = torch.cat([torch.ones(1, dtype=torch.float64), alpha.cumprod(0)])  # P(accepted >= j)
    expected = at_least - torch.cat([at_least[1:], torch.zeros(1, dtype=torch.float64)])
    assert_counts_match(result.num_accepted, expected)


# --- counter-based determinism ------------------------------------------------------------


def test_row_result_does_not_depend_on_batch_when_uniforms_come_from_seeds():
    gen = torch.Generator().manual_seed(8)
    B, V_ = 8, 16
    target_probs = torch.rand(B, K + 1, V_, generator=gen).softmax(-1)
    draft_probs = torch.rand(B, K, V_, generator=gen).softmax(-1)
    drafts = torch.randint(0, V_, (B, K), generator=gen)
    targets = torch.randint(0, V_, (B, K + 1), generator=gen)
    seeds, positions = torch.arange(40, 48), torch.arange(10, 10 + K).expand(B, K)
    greedy = torch.tensor([False, True] * 4)

    def run(rows):
        return rejection_sample(
            drafts[rows], torch.full((len(rows),), K), draft_probs[rows], target_probs[rows], targets[rows], greedy[rows],
            uniforms=make_uniforms(seeds[rows], positions[rows], STREAM_ACCEPT),
            residual_uniforms=make_uniforms(seeds[rows], positions[rows], STREAM_RESIDUAL),
        )

    batch = run(list(range(B)))
    for row in (0, 5):
        assert torch.equal(run([row]).token_ids[0], batch.token_ids[row])


# --- proposals and d2t --------------------------------------------------------------------


def test_d2t_scatter_add_keeps_mass_of_many_to_one_maps():
    draft_probs = torch.tensor([[[0.1, 0.2, 0.3, 0.4]], [[0.25, 0.25, 0.25, 0.25]]])
    d2t = ids([5, 2, 5, 0])
    mapped = map_draft_probs_to_target(draft_probs, d2t, 6)
    assert mapped.shape == (2, 1, 6)
    assert torch.allclose(mapped[0, 0], torch.tensor([0.4, 0.0, 0.2, 0.0, 0.0, 0.4]))
    assert torch.allclose(mapped.sum(-1), draft_probs.sum(-1))


def test_random_d2t_conserves_every_rows_mass():
    gen = torch.Generator().manual_seed(2)
    draft_probs = torch.rand(6, 3, 40, generator=gen).softmax(-1)
    mapped = map_draft_probs_to_target(draft_probs, torch.randint(0, 12, (40,), generator=gen), 100)
    assert torch.allclose(mapped.sum(-1), torch.ones(6, 3))


def test_proposal_kinds_decode_to_target_space():
    drafts = ids([[2, 0]])
    assert proposal_to_draft_probs("point_mass", drafts, 5) is None
    sparse = proposal_to_draft_probs(
        "sparse", drafts, 5, sparse_ids=ids([[[2, 4, -1], [0, 1, 3]]]), sparse_probs=torch.tensor([[[0.7, 0.3, 0.0], [0.5, 0.25, 0.25]]])
    )
    assert torch.allclose(sparse, torch.tensor([[[0.0, 0.0, 0.7, 0.0, 0.3], [0.5, 0.25, 0.0, 0.25, 0.0]]]))
    dense_draft = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    dense = proposal_to_draft_probs("dense", drafts, 5, dense_probs=dense_draft, d2t=ids([2, 0, 2]))
    assert torch.allclose(dense, torch.tensor([[[0.5, 0.0, 0.5, 0.0, 0.0], [0.3, 0.0, 0.7, 0.0, 0.0]]]))
    mapped_sparse = proposal_to_draft_probs(
        "sparse", drafts, 5, sparse_ids=ids([[[0, 2], [1, -1]]]), sparse_probs=torch.tensor([[[0.6, 0.4], [1.0, 0.0]]]), d2t=ids([2, 0, 2])
    )
    assert torch.allclose(mapped_sparse, torch.tensor([[[0.0, 0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]]]))


# --- bad input ----------------------------------------------------------------------------


def good_args():
    return dict(
        draft_token_ids=ids([[1, 2]]),
        num_draft=ids([2]),
        draft_probs=torch.full((1, 2, 4), 0.25),
        target_probs=torch.full((1, 3, 4), 0.25),
        target_token_ids=ids([[1, 2, 3]]),
        greedy=torch.tensor([False]),
    )


@pytest.mark.parametrize(
    "name, value, match",
    [
        ("target_probs", torch.full((1, 2, 4), 0.25), "target_probs"),
        ("draft_probs", torch.full((1, 2, 5), 0.2), "draft_probs"),
        ("draft_token_ids", ids([[1, 4]]), "draft_token_ids.*out of range"),
        ("target_token_ids", ids([[1, -1, 3]]), "target_token_ids.*out of range"),
        ("num_draft", ids([3]), "num_draft"),
        ("greedy", torch.tensor([0]), "greedy"),
        ("target_probs", torch.tensor([[[0.25, float("nan"), 0.25, 0.25]] * 3]), "target_probs.*NaN"),
        ("draft_probs", torch.tensor([[[0.5, -0.25, 0.5, 0.25]] * 2]), "draft_probs.*negative"),
    ],
)
def test_invalid_inputs_fail_fast_naming_the_argument(name, value, match):
    args = good_args() | {name: value}
    with pytest.raises(SamplingInputError, match=match):
        rejection_sample(**args)


def test_good_args_are_accepted():
    assert rejection_sample(**good_args()).token_ids.shape == (1, 3)


def test_unknown_proposal_kind_and_bad_sparse_input_fail_fast():
    with pytest.raises(SamplingInputError, match="unknown proposal kind 'beam'"):
        proposal_to_draft_probs("beam", ids([[1]]), 4)
    with pytest.raises(SamplingInputError, match="sparse_ids.*out of range"):
        proposal_to_draft_probs("sparse", ids([[1]]), 4, sparse_ids=ids([[[9]]]), sparse_probs=torch.ones(1, 1, 1))
    with pytest.raises(SamplingInputError, match="d2t.*out of range"):
        map_draft_probs_to_target(torch.ones(1, 1, 2), ids([0, 7]), 4)

