import math

import pytest
import torch

from gpu_worker.sampling.logprobs import emitted_positions, gather_logprobs, token_logprobs
from gpu_worker.sampling.rejection import rejection_sample
from gpu_worker.sampling.sampler import (
    STREAM_ACCEPT,
    STREAM_RESIDUAL,
    STREAM_TARGET,
    SamplingInputError,
    SamplingTensors,
    make_uniforms,
    sample,
)

B, T, V = 6, 4, 40
PARAMS = SamplingTensors.build(
    [1.0, 0.0, 0.7, 1.3, 0.9, 1.0],
    top_k=[0, 0, 5, 0, 12, 0],
    top_p=[1.0, 1.0, 1.0, 0.8, 0.9, 1.0],
    min_p=[0.0, 0.0, 0.0, 0.0, 0.0, 0.05],
)


def sampled_batch(seed=0):
    logits = torch.randn(B, T, V, generator=torch.Generator().manual_seed(seed)) * 2
    positions = torch.arange(T).expand(B, T)
    processed, token_ids = sample(logits, PARAMS, make_uniforms(torch.arange(B), positions, STREAM_TARGET))
    return logits, processed, token_ids


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_raw_logprobs_are_log_softmax_and_top_n_in_mode(mode):
    logits, processed, token_ids = sampled_batch()
    rows, cols, lp = gather_logprobs(logits, token_ids, PARAMS, processed, mode=mode, top_n=3)
    reference = logits.log_softmax(-1)[rows, cols]  # (N, V)
    assert torch.allclose(lp.raw_logprobs, reference.gather(1, token_ids[rows, cols][:, None]).squeeze(1), atol=1e-5)
    if mode == "raw":
        assert torch.allclose(lp.top_logprobs, reference.topk(3).values, atol=1e-5)
        assert torch.equal(lp.top_ids, reference.topk(3).indices)
    else:
        # processed top-n: the most probable ids of the sampled distribution, -1 beyond |K|
        probs = processed.probs[rows, cols]
        finite = lp.top_ids >= 0
        assert torch.allclose(lp.top_logprobs[finite].exp(), probs.gather(1, lp.top_ids.clamp_min(0))[finite], atol=1e-5)
        assert torch.equal(finite.sum(-1), processed.num_candidates[rows, cols].clamp_max(3))


def test_processed_logprobs_are_the_sampled_distribution_normalised_once():
    logits, processed, token_ids = sampled_batch(1)
    all_ids = torch.arange(V).expand(B, T, V).reshape(B * T, V)
    rows = torch.arange(B).repeat_interleave(T)
    lp = token_logprobs(
        logits.reshape(B * T, V), token_ids.flatten(), PARAMS.temperature[rows],
        processed.candidate_ids.reshape(B * T, -1), processed.num_candidates.flatten(),
        mode="processed", requested_ids=all_ids,
    )
    requested = lp.requested_logprobs  # (B*T, V): processed logprob of every id
    in_k = processed.probs.reshape(B * T, V) > 0
    assert torch.allclose(requested.logsumexp(-1), torch.zeros(B * T), atol=1e-5)  # sums to 1 over K
    assert bool((requested[~in_k] == -math.inf).all())
    assert torch.allclose(requested[in_k].exp(), processed.probs.reshape(B * T, V)[in_k], atol=1e-5)
    # identity: processed = log_softmax(logits / temperature) - logZ_K on K
    temperature = torch.where(PARAMS.temperature == 0, 1.0, PARAMS.temperature)[rows]
    scaled = (logits.reshape(B * T, V) / temperature[:, None]).log_softmax(-1)
    assert torch.allclose(requested[in_k], (scaled - lp.logz_k[:, None])[in_k], atol=1e-5)
    assert torch.allclose(lp.processed_logprobs, requested.gather(1, token_ids.flatten()[:, None]).squeeze(1))


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_a_rows_logprobs_do_not_depend_on_the_rows_emitted_beside_it(mode):
    """Each row's values bit for bit the same alone and beside a row whose candidate set is of
    another size (a vocabulary of 4,096; top-k from 3 to 931, top-p 0.9,
    greedy, everything), as a verify step's rows and a scoring prefill's positions are grouped
    differently. (A logsumexp over the listed candidates would not be: its length is the
    batch's largest K, and torch's sum groups terms by the length.)"""
    vocab, top_k = 4096, [0, 3, 13, 29, 50, 77, 131, 260, 517, 931, 0, 0]
    rows = len(top_k)
    params = SamplingTensors.build([0.8] * (rows - 2) + [0.0, 1.0], top_k=top_k,
                                   top_p=[0.9] + [1.0] * (rows - 1), min_p=[0.0] * rows)
    logits = torch.randn(rows, 1, vocab, generator=torch.Generator().manual_seed(2)) * 4
    processed, token_ids = sample(logits, params, make_uniforms(torch.arange(rows), torch.zeros(rows, 1, dtype=torch.long),
                                                               STREAM_TARGET))
    requested = torch.arange(0, vocab, 97).expand(rows, -1)

    def run(index):
        return token_logprobs(logits[index, 0], token_ids[index, 0], params.temperature[index],
                              processed.candidate_ids[index, 0], processed.num_candidates[index, 0],
                              mode=mode, top_n=3, requested_ids=requested[index])

    alone = [run(torch.tensor([n])) for n in range(rows)]
    for n in range(rows):
        for other in range(rows):
            pair = run(torch.tensor([n, other]))
            for field in ("raw_logprobs", "processed_logprobs", "top_logprobs", "requested_logprobs", "logz_k"):
                assert torch.equal(getattr(pair, field)[0], getattr(alone[n], field)[0]), (field, n, other)


def test_k_holds_its_ids_when_a_wide_row_beside_it_pads_the_candidate_ids():
    """A scoring pass's positions are ranked together: a row whose K passes the first rank window
    pads the others' candidate_ids (with id 0) past their ranks. Id 0 in a small K stays in K,
    so the position's processed logprobs are those it has alone, bit for bit (they were not:
    the padding's writes undid K's, and the first token a prefill emitted disagreed with the
    scoring of the same position)."""
    vocab = 1024
    logits = torch.full((2, vocab), -10.0)
    logits[0] = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 0.1  # flat: K passes 256 ids
    logits[1, 5], logits[1, 0], logits[1, 9] = 3.0, 2.5, 2.0  # K = {5, 0, 9}: id 0 inside it
    params = SamplingTensors.build([0.8, 0.8], top_p=[0.99, 0.9])
    token_ids = torch.tensor([[7, 5]])

    def scored(index):
        return gather_logprobs(logits[None, index], token_ids[:, index], params.index(index),
                               mode="processed", top_n=3, requested_ids=torch.tensor([[0, 5, 9]] * len(index)),
                               mask_cap=8)[2]

    together, alone = scored(torch.tensor([0, 1])), scored(torch.tensor([1]))
    assert int(together.num_candidates[0]) > 256 and together.num_candidates[1].item() == 3
    for field in ("processed_logprobs", "top_logprobs", "requested_logprobs", "logz_k", "candidate_ids"):
        assert torch.equal(getattr(together, field)[1:, :getattr(alone, field).shape[-1]] if field == "candidate_ids"
                           else getattr(together, field)[1:], getattr(alone, field)), field
    assert together.requested_logprobs[1].isfinite().all()  # id 0 in K


def test_greedy_rows_report_the_point_mass_they_sampled_from():
    logits = torch.tensor([[[0.0, 2.0, 1.0, 2.0]]])
    params = SamplingTensors.build([0.0])
    processed, token_ids = sample(logits, params, torch.zeros(1, 1, dtype=torch.float64))
    _, _, lp = gather_logprobs(logits, token_ids, params, processed, mode="processed", top_n=2)
    raw = logits[0, 0].log_softmax(-1)
    assert token_ids.tolist() == [[1]]
    assert lp.processed_logprobs.tolist() == [0.0]
    assert torch.allclose(lp.logz_k, raw[1:2])
    assert lp.top_ids.tolist() == [[1, -1]]
    assert lp.candidate_ids.tolist() == [[1]] and lp.num_candidates.tolist() == [1]


def test_mask_is_sorted_ids_capped_at_the_most_probable_with_truncation_flag():
    logits = torch.tensor([[[5.0, 1.0, 4.0, 0.0, 3.0, 2.0]]])
    params = SamplingTensors.build([1.0], top_k=[4])
    processed, token_ids = sample(logits, params, torch.full((1, 1), 0.5, dtype=torch.float64))
    _, _, capped = gather_logprobs(logits, token_ids, params, processed, mask_cap=3)
    assert capped.candidate_ids.tolist() == [[0, 2, 4]]
    assert capped.num_candidates.tolist() == [4] and capped.candidates_truncated.tolist() == [True]
    _, _, full = gather_logprobs(logits, token_ids, params, processed, mask_cap=10)
    assert full.candidate_ids.tolist() == [[0, 2, 4, 5]] and full.candidates_truncated.tolist() == [False]


def test_unfiltered_rows_have_the_whole_vocabulary_as_k():
    logits, processed, token_ids = sampled_batch(2)
    rows, cols, lp = gather_logprobs(logits, token_ids, PARAMS, processed)
    unfiltered = rows == 0
    assert bool(lp.candidates_all[unfiltered].all()) and not bool(lp.candidates_all[~unfiltered].any())
    assert bool((lp.candidate_ids[unfiltered] == -1).all())
    assert torch.allclose(lp.logz_k[unfiltered], torch.zeros(int(unfiltered.sum())))
    assert bool((lp.logz_k[~unfiltered] <= 1e-6).all())


def test_prompt_logprobs_use_the_same_path_as_sampled_positions():
    logits, processed, token_ids = sampled_batch(3)
    options = dict(mode="processed", top_n=4, requested_ids=torch.tensor([[0, 7]]).expand(B * T, 2), mask_cap=8)
    _, _, sampled = gather_logprobs(logits, token_ids, PARAMS, processed, **options)
    _, _, prompt = gather_logprobs(logits, token_ids, PARAMS, None, **options)
    for field in ("processed_logprobs", "raw_logprobs", "logz_k", "top_logprobs", "requested_logprobs"):
        assert torch.allclose(getattr(prompt, field), getattr(sampled, field), atol=1e-6), field
    for field in ("top_ids", "candidate_ids", "num_candidates", "candidates_truncated", "candidates_all"):
        assert torch.equal(getattr(prompt, field), getattr(sampled, field)), field


def test_speculative_logprobs_equal_a_plain_pass_over_the_emitted_sequence():
    # the verify step: sample all positions, reject, then logprobs only where tokens were emitted
    logits, processed, target_token_ids = sampled_batch(4)
    K = T - 1
    drafts = target_token_ids[:, :K].clone()
    drafts[::2, 1] = (drafts[::2, 1] + 1) % V  # some rows disagree at slot 1
    positions = torch.arange(K).expand(B, K)
    result = rejection_sample(
        drafts, torch.full((B,), K), None, processed.probs, target_token_ids, PARAMS.greedy,
        uniforms=make_uniforms(torch.arange(B), positions, STREAM_ACCEPT),
        residual_uniforms=make_uniforms(torch.arange(B), positions, STREAM_RESIDUAL),
    )
    rows, cols, lp = gather_logprobs(logits, result.token_ids, PARAMS, processed, mode="processed")
    assert torch.equal(rows, torch.arange(B).repeat_interleave(result.num_accepted + 1))
    plain = processed.probs[rows, cols].gather(1, result.token_ids[rows, cols][:, None]).squeeze(1)
    assert torch.allclose(lp.processed_logprobs.exp(), plain, atol=1e-5)
    assert torch.allclose(lp.raw_logprobs, logits.log_softmax(-1)[rows, cols].gather(1, result.token_ids[rows, cols][:, None]).squeeze(1), atol=1e-5)


def test_emitted_positions_are_row_major():
    rows, cols = emitted_positions(torch.tensor([[5, 6, -1], [7, -1, -1]]))
    assert rows.tolist() == [0, 0, 1] and cols.tolist() == [0, 1, 0]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mode="logits"), "unknown logprobs mode"),
        (dict(top_n=99), "top_n"),
        (dict(requested_ids=torch.tensor([[50]])), "requested_ids"),
        (dict(mask_cap=0), "mask_cap"),
    ],
)
def test_bad_options_fail_naming_the_field(kwargs, match):
    with pytest.raises(SamplingInputError, match=match):
        token_logprobs(torch.zeros(1, 4), torch.tensor([1]), torch.ones(1), torch.tensor([[0]]), torch.tensor([4]), **kwargs)
