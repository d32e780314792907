import math

import pytest
import torch

from gpu_worker.sampling.rejection import rejection_sample
from gpu_worker.sampling.sampler import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_RESIDUAL,
    STREAM_TARGET,
    Penalties,
    SamplingInputError,
    SamplingTensors,
    add_tokens,
    make_uniforms,
    penalise,
    process_logits,
    sample,
    sample_from_probs,
    scale_logits,
    select_candidates,
    splitmix64,
)

MASK64 = (1 << 64) - 1


def splitmix64_reference(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def logits_from_probs(probs, rows=1, positions=1):
    """[rows, positions, V] logits whose softmax is exactly `probs` (powers of two stay exact)."""
    return torch.tensor(probs).log().expand(rows, positions, -1).contiguous()


def positions_for(rows, steps):
    return torch.arange(steps).expand(rows, steps).contiguous()


# --- counter-based uniforms ---------------------------------------------------------------


def test_torchs_float32_cumsum_is_the_float64_running_sum_rounded():
    """The sampler's masses (top-p's, the inverse CDF's) are float64 running sums rounded to
    float32 (sampler.py, step 4) by torch's CPU cumsum of float32; a torch whose cumsum kept a
    float32 accumulator would move top-p's cut and the draws, and fails here first."""
    g = torch.Generator().manual_seed(0)
    for V in (100, 8192, 49152):
        probs = torch.rand(16, V, generator=g).softmax(-1) * torch.rand(16, 1, generator=g)
        assert torch.equal(probs.cumsum(-1), probs.double().cumsum(-1).float())


def test_splitmix64_matches_published_first_output_and_reference():
    assert splitmix64(torch.tensor([0])).item() & MASK64 == 0xE220A8397B1DCDAF
    xs = [1, 12345, (1 << 63) - 1, -1, -(1 << 63), 0x0123456789ABCDEF]
    got = splitmix64(torch.tensor(xs)).tolist()
    assert [g & MASK64 for g in got] == [splitmix64_reference(x & MASK64) for x in xs]


def test_uniforms_depend_only_on_seed_stream_and_position():
    seeds = torch.tensor([7, 8, 9])
    u = make_uniforms(seeds, positions_for(3, 6), STREAM_TARGET)
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    alone = make_uniforms(torch.tensor([8]), torch.tensor([[3, 4, 5]]), STREAM_TARGET)
    assert torch.equal(alone[0], u[1, 3:])
    streams = [make_uniforms(seeds, positions_for(3, 6), s) for s in (STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL)]
    for other in streams:
        assert not bool((other == u).any())


def test_uniforms_look_uniform():
    u = make_uniforms(torch.arange(200), positions_for(200, 100), STREAM_TARGET).flatten()
    counts = torch.histc(u.float(), bins=10, min=0, max=1)
    expected = u.numel() / 10
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 40  # 9 degrees of freedom: p < 1e-5 beyond 40


# --- greedy -------------------------------------------------------------------------------


def test_greedy_is_argmax_with_lowest_id_on_ties_and_one_hot_probs():
    logits = torch.tensor([[[1.0, 3.0, 3.0, 0.0], [5.0, 1.0, 2.0, 5.0]]])
    params = SamplingTensors.build([0.0], top_k=[2], top_p=[0.5])
    processed, token_ids = sample(logits, params, torch.zeros(1, 2, dtype=torch.float64))
    assert token_ids.tolist() == [[1, 0]]
    assert processed.probs.tolist() == [[[0, 1, 0, 0], [1, 0, 0, 0]]]
    assert processed.num_candidates.tolist() == [[1, 1]]
    assert processed.candidate_ids[..., 0].tolist() == [[1, 0]]


# --- filters, worked by hand --------------------------------------------------------------


@pytest.mark.parametrize(
    "top_k, top_p, min_p, expected_k",
    [
        (2, 1.0, 0.0, [0, 1]),
        (0, 0.75, 0.0, [0, 1]),  # mass before rank 2 is exactly 0.75: not < 0.75
        (0, 0.76, 0.0, [0, 1, 2]),
        (0, 1.0, 0.3, [0, 1]),  # keep prob >= 0.3 * 0.5
        (0, 1.0, 0.25, [0, 1, 2, 3]),
        (3, 0.7, 0.0, [0, 1]),
        (0, 1.0, 0.0, None),  # no filter: K is the whole vocabulary
    ],
)
def test_filters_keep_the_hand_worked_candidate_set(top_k, top_p, min_p, expected_k):
    logits = logits_from_probs([0.5, 0.25, 0.125, 0.125])
    params = SamplingTensors.build([1.0], top_k=[top_k], top_p=[top_p], min_p=[min_p])
    processed = process_logits(logits, params)
    n = processed.num_candidates[0, 0].item()
    if expected_k is None:
        assert n == 4
        assert torch.allclose(processed.probs[0, 0], torch.tensor([0.5, 0.25, 0.125, 0.125]))
        return
    assert sorted(processed.candidate_ids[0, 0, :n].tolist()) == expected_k
    probs = torch.zeros(4)
    probs[expected_k] = torch.tensor([0.5, 0.25, 0.125, 0.125])[expected_k]
    assert torch.allclose(processed.probs[0, 0], probs / probs.sum())


@pytest.mark.parametrize("window, wide_window", [(4, 4), (4, 64), (64, 200)])
def test_ranking_a_window_gives_the_candidates_of_ranking_everything(window, wide_window):
    """select_candidates ranks only the largest logits where K ends inside them, the rest again
    in a wider window, then whole: K, its order and the masks are those of a sort of all V, for
    top-k inside and past the windows, top-p, min-p, greedy and unfiltered rows side by side,
    bf16-rounded logits (ties, the windows' edges among them) and -inf ones."""
    gen = torch.Generator().manual_seed(11)
    B, T, V = 6, 3, 500
    settings = dict(temperature=[0.0, 0.8, 1.0, 1.3, 0.7, 1.0], top_k=[0, 0, 3, 200, 0, 0],
                    top_p=[1.0, 0.9, 1.0, 0.95, 0.5, 1.0], min_p=[0.0, 0.0, 0.0, 0.0, 0.05, 0.0])
    params = SamplingTensors.build(**settings)
    for scale in (0.5, 3.0, 12.0):
        logits = (torch.randn(B, T, V, generator=gen) * scale).bfloat16().float()
        logits[1, 2, 100:] = float("-inf")
        logits[4, 0] = logits[4, 0].round()  # a few distinct values, each tied many times
        scaled = scale_logits(logits, params.temperature)
        ids, num, in_k = select_candidates(scaled, params, window=window, wide_window=wide_window)
        all_ids, all_num, all_in_k = select_candidates(scaled, params, window=V)
        assert torch.equal(num, all_num) and torch.equal(in_k, all_in_k)
        for b in range(B):
            for t in range(T):
                n = int(num[b, t])  # V: K is everything, the ids are not read
                assert n == V or torch.equal(ids[b, t, :n], all_ids[b, t, :n])


def test_top_p_works_on_the_renormalised_top_k_distribution():
    # top-2 of [0.4, 0.3, 0.2, 0.1] renormalises to [4/7, 3/7]; 4/7 >= 0.5 so top_p drops rank 1
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1])
    processed = process_logits(logits, SamplingTensors.build([1.0], top_k=[2], top_p=[0.5]))
    assert processed.num_candidates.item() == 1
    assert processed.probs[0, 0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_tie_at_top_k_boundary_keeps_lower_ids():
    logits = torch.tensor([[[1.0, 2.0, 2.0, 2.0, 0.0]]])
    processed = process_logits(logits, SamplingTensors.build([1.0], top_k=[2]))
    assert processed.candidate_ids[0, 0, :2].tolist() == [1, 2]
    assert processed.probs[0, 0].tolist() == [0.0, 0.5, 0.5, 0.0, 0.0]


def test_temperature_scales_logits_before_softmax():
    logits = torch.tensor([[[1.0, 2.0, 0.5]]])
    processed = process_logits(logits, SamplingTensors.build([0.5]))
    assert torch.allclose(processed.probs[0, 0], (logits[0, 0] / 0.5).softmax(-1))


# --- drawing ------------------------------------------------------------------------------


def test_sample_from_probs_never_picks_zero_mass_ids():
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0], [0.0] * 6, [0.0, 0.0, 0.0, 0.0, 0.0, 1e-30]])
    top = torch.tensor([1 - 2.0**-53] * 3, dtype=torch.float64)
    assert sample_from_probs(probs, top).tolist() == [3, -1, 5]
    bottom = torch.zeros(3, dtype=torch.float64)
    assert sample_from_probs(probs, bottom).tolist() == [1, -1, 5]


@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.8, 0.0), (6, 0.9, 0.05)])
def test_sampled_tokens_follow_the_processed_distribution(top_k, top_p, min_p):
    rows, V = 12000, 12
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3)).expand(rows, 1, V).contiguous()
    params = SamplingTensors.build([0.8] * rows, top_k=[top_k] * rows, top_p=[top_p] * rows, min_p=[min_p] * rows)
    uniforms = make_uniforms(torch.arange(rows), torch.zeros(rows, 1, dtype=torch.int64), STREAM_TARGET)
    processed, token_ids = sample(logits, params, uniforms)
    expected = processed.probs[0, 0].double() * rows
    counts = torch.bincount(token_ids.flatten(), minlength=V).double()
    assert bool((counts[expected == 0] == 0).all())
    z = (counts - expected) / (expected * (1 - expected / rows)).sqrt().clamp_min(1e-9)
    assert float(z[expected > 0].abs().max()) < 4.5


# --- determinism --------------------------------------------------------------------------


def test_row_draws_do_not_depend_on_batch_or_step_split():
    V, T = 50, 6
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(8, T, V, generator=gen)
    seeds = torch.arange(100, 108)
    params = SamplingTensors.build(
        [0.9, 0.0, 1.3, 0.7, 1.0, 0.5, 2.0, 1.1],
        top_k=[0, 0, 7, 0, 20, 0, 3, 0],
        top_p=[1.0, 1.0, 1.0, 0.9, 1.0, 0.6, 1.0, 1.0],
        min_p=[0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0],
    )
    batch = sample(logits, params, make_uniforms(seeds, positions_for(8, T), STREAM_TARGET))[1]

    row = 3
    alone = SamplingTensors.build([0.7], top_p=[0.9])
    whole = sample(logits[row : row + 1], alone, make_uniforms(seeds[row : row + 1], positions_for(1, T), STREAM_TARGET))[1]
    assert torch.equal(whole[0], batch[row])
    first = sample(logits[row : row + 1, :2], alone, make_uniforms(seeds[row : row + 1], torch.tensor([[0, 1]]), STREAM_TARGET))[1]
    rest_positions = torch.arange(2, T)[None]
    rest = sample(logits[row : row + 1, 2:], alone, make_uniforms(seeds[row : row + 1], rest_positions, STREAM_TARGET))[1]
    assert torch.equal(torch.cat([first, rest], 1)[0], batch[row])


# --- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=[-1.0]), "temperature"),
        (dict(temperature=[math.inf]), "temperature"),
        (dict(temperature=[1.0], top_p=[0.0]), "top_p"),
        (dict(temperature=[1.0], min_p=[1.5]), "min_p"),
        (dict(temperature=[1.0], top_k=[-2]), "top_k"),
    ],
)
def test_bad_params_fail_naming_the_field(kwargs, match):
    with pytest.raises(SamplingInputError, match=match):
        SamplingTensors.build(**kwargs)


def test_nan_logits_and_bad_uniforms_fail_fast():
    params = SamplingTensors.build([1.0])
    logits = torch.tensor([[[0.0, float("nan"), 1.0]]])
    with pytest.raises(SamplingInputError, match="logits"):
        process_logits(logits, params)
    with pytest.raises(SamplingInputError, match="uniforms"):
        sample(torch.zeros(1, 1, 3), params, torch.zeros(1, 1))


# --- logit_bias and penalties -------------------------------------------------------------


def penalties_of(rows, V, output, prompt=(), bias=None, repetition=1.0, frequency=0.0, presence=0.0):
    """The same Penalties for `rows` rows: output [n] or [rows, n] ids (-1 = none), prompt ids,
    bias {id: value}."""
    output = torch.as_tensor(output, dtype=torch.int64)
    output = output.expand(rows, output.shape[-1]) if output.dim() == 1 else output
    counts = torch.zeros(rows, V).scatter_add_(1, output.clamp_min(0), (output >= 0).float())
    seen = counts > 0
    seen[:, list(prompt)] = True
    dense = torch.zeros(V)
    for token, value in (bias or {}).items():
        dense[token] = value
    return Penalties(dense.expand(rows, V).contiguous(), counts, seen, torch.full((rows,), repetition),
                     torch.full((rows,), frequency), torch.full((rows,), presence))


def test_penalise_follows_the_openai_and_vllm_definitions_worked_by_hand():
    logits = torch.tensor([[[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]]])
    # prompt [0]; output [1, 3, 3]; bias +1.5 on 4, -0.5 on 3
    penalties = Penalties.build(6, torch.tensor([0, 1, 3, 3]), 1, bias_ids=[4, 3], bias_values=[1.5, -0.5],
                                repetition=2.0, frequency=0.5, presence=0.25)
    # bias, then repetition on seen {0, 1, 3} (divide positive, multiply negative), then
    # frequency * count and presence * (count > 0) for the output counts {1: 1, 3: 2}
    expected = [2.0 / 2, -1.0 * 2 - 0.5 - 0.25, 0.5, 2.5 / 2 - 1.0 - 0.25, -0.5, 1.0]
    assert torch.equal(penalise(logits, penalties), torch.tensor([[expected]]))


def test_penalties_that_are_off_leave_the_logits_bit_for_bit():
    logits = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(2))
    on = penalties_of(1, 50, [3, 3, 7], prompt=[1], bias={5: 2.0}, repetition=1.3, frequency=0.4, presence=0.2)
    off = penalties_of(2, 50, [3, 3, 7], prompt=[1])
    mixed = Penalties.cat([on, off])
    out = penalise(logits, mixed, torch.tensor([[1, 2, 3], [4, 5, -1], [6, 6, 6]]))
    assert torch.equal(out[1:], logits[1:])
    assert not torch.equal(out[0], logits[0])


def test_each_verified_position_counts_the_drafts_before_it():
    V, K = 30, 4
    logits = torch.randn(2, K + 1, V, generator=torch.Generator().manual_seed(4))
    drafts = torch.tensor([[3, 3, 9, 3], [5, 8, -1, -1]])  # the second row has two drafts
    start = penalties_of(2, V, [3, 1], prompt=[0, 9], bias={2: -1.0}, repetition=1.5, frequency=0.7, presence=0.3)
    together = penalise(logits, start, drafts)
    penalties = start
    for t in range(K + 1):  # one position at a time, the drafts before it appended as output
        assert torch.equal(together[:, t], penalise(logits[:, t:t + 1], penalties)[:, 0])
        if t < K:
            penalties = add_tokens(penalties, drafts[:, t])


@pytest.mark.parametrize("name, kwargs", [
    ("repetition_penalty", dict(repetition=0.0)),
    ("repetition_penalty", dict(repetition=math.inf)),
    ("frequency_penalty", dict(frequency=math.nan)),
    ("presence_penalty", dict(presence=-math.inf)),
    ("logit_bias", dict(bias_ids=[1], bias_values=[math.nan])),
    ("logit_bias", dict(bias_ids=[7], bias_values=[1.0])),  # outside the vocabulary
])
def test_bad_penalties_fail_naming_the_row_sampling_field(name, kwargs):
    with pytest.raises(SamplingInputError) as caught:
        Penalties.build(5, torch.tensor([1, 2]), 1, **kwargs)
    assert caught.value.field == name


# Speculation with penalties against plain decoding, on a 3-token sequence: the target's logits
# are the same at every context, so only the penalties make position t depend on the tokens
# before it, and a sampler that ignored this step's drafts there would get the law wrong.
PV, PK, PROWS = 4, 2, 24000
PENALTIES = dict(prompt=[0], bias={1: 0.7}, repetition=1.6, frequency=0.9, presence=0.6)


def penalised_probs(base, output, rows):
    """process_logits of position len(output) after `output` [rows, n] (plain decoding): [rows, V]."""
    penalties = penalties_of(rows, PV, output, **PENALTIES)
    return process_logits(penalise(base[:, output.shape[1]:output.shape[1] + 1], penalties),
                          SamplingTensors.build([0.9] * rows)).probs[:, 0]


def test_sampled_output_with_penalties_under_speculation_has_plain_decodings_law():
    from tests.gpu_worker.sampling.test_rejection import assert_counts_match

    gen = torch.Generator().manual_seed(12)
    base = (torch.randn(1, PK + 1, PV, generator=gen) * 1.2).expand(PROWS, -1, -1)  # (R, K+1, V)
    draft_probs = (torch.randn(PK, PV, generator=gen) * 1.5).softmax(-1)
    seeds, positions = torch.arange(PROWS), torch.arange(PK + 1).expand(PROWS, -1)

    # one speculative step: K drafts from the draft, verified against the penalised target
    drafts = torch.stack([torch.multinomial(draft_probs[i], PROWS, replacement=True, generator=gen)
                          for i in range(PK)], 1)
    params = SamplingTensors.build([0.9] * PROWS)
    start = penalties_of(PROWS, PV, [], **PENALTIES)
    processed, target_ids = sample(penalise(base, start, drafts), params,
                                   make_uniforms(seeds, positions, STREAM_TARGET))
    result = rejection_sample(drafts, torch.full((PROWS,), PK), draft_probs.expand(PROWS, -1, -1), processed.probs,
                              target_ids, params.greedy, uniforms=make_uniforms(seeds, positions[:, :PK], STREAM_ACCEPT),
                              residual_uniforms=make_uniforms(seeds, positions[:, :PK], STREAM_RESIDUAL))
    assert result.num_accepted.float().mean() > 0.3  # the drafts matter
    # then plain decoding up to 3 tokens, each position penalised by the output before it
    tokens = result.token_ids
    for t in range(1, PK + 1):
        missing = tokens[:, t] < 0
        probs = penalised_probs(base[missing], tokens[missing, :t], int(missing.sum()))
        tokens[missing, t] = torch.multinomial(probs, 1, generator=gen)[:, 0]

    # the exact law of plain decoding, sequence by sequence
    law = torch.zeros(PV ** 3, dtype=torch.float64)
    for a in range(PV):
        for b in range(PV):
            for c in range(PV):
                output = torch.tensor([[a, b, c]])
                p = [penalised_probs(base[:1], output[:, :t], 1)[0, output[0, t]] for t in range(3)]
                law[(a * PV + b) * PV + c] = float(p[0]) * float(p[1]) * float(p[2])
    assert abs(float(law.sum()) - 1) < 1e-5
    assert_counts_match((tokens[:, 0] * PV + tokens[:, 1]) * PV + tokens[:, 2], law)
