"""The verifier's drafts (gpu_worker/verifier/verifier_drafts.py): greedy acceptance and rejection,
speculative decoding equal to plain decoding, and logit_bias and penalties at every verify
position."""

import pytest
import torch
from tests.gpu_worker.verifier.verifier_steps import (PENALTIES, PROMPT, V, generate, new_verifier, one,
                                                   penalised_reference, vrow)


def test_drafts_equal_to_the_greedy_continuation_are_all_accepted_plus_bonus(target, greedy_tokens):
    verifier = new_verifier(target)
    result, _ = one(verifier, vrow("a", PROMPT, drafts=greedy_tokens[:4]))
    assert result.token_ids.tolist() == greedy_tokens[:5]
    assert (result.num_draft, result.num_accepted) == (4, 4)
    # the bonus token is emitted, not cached: the slot holds the prompt and the 4 accepted drafts
    assert int(verifier.cache.lengths[verifier.requests[("sched-test", "a")].slot]) == len(PROMPT) + 4


def test_wrong_draft_is_rejected_at_the_first_mismatch(target, greedy_tokens):
    verifier = new_verifier(target)
    wrong = (greedy_tokens[2] + 1) % V
    result, _ = one(verifier, vrow("a", PROMPT, drafts=[*greedy_tokens[:2], wrong, greedy_tokens[3]]))
    assert result.token_ids.tolist() == greedy_tokens[:3]  # two accepted, then the target's own token
    assert (result.num_draft, result.num_accepted) == (4, 2)
    assert int(verifier.cache.lengths[verifier.requests[("sched-test", "a")].slot]) == len(PROMPT) + 2


def test_speculative_decoding_equals_plain_decoding_token_by_token(target, greedy_tokens):
    def drafts_for(history, k):  # right drafts with every third one wrong
        position = len(history) - len(PROMPT)
        right = greedy_tokens[position:position + k]
        return [t if (position + i) % 3 else (t + 7) % V for i, t in enumerate(right)]

    rng_state = torch.get_rng_state()
    tokens, _, steps = generate(new_verifier(target), "spec", PROMPT, 16, drafts_for, k=4)
    assert tokens == greedy_tokens
    assert steps < 16
    assert torch.equal(torch.get_rng_state(), rng_state)  # the global RNG is never touched


def test_greedy_with_penalties_is_the_argmax_of_the_penalised_logits_at_any_k(target, greedy_tokens,
                                                                             penalised_tokens):
    assert penalised_tokens != greedy_tokens  # the penalties change the output
    with torch.no_grad():  # the first token: the argmax of the penalised logits, worked out here
        logits = target.hf(torch.tensor([PROMPT])).logits[0, -1]
    assert penalised_tokens[0] == int(penalised_reference(logits, PROMPT, []).argmax())

    def drafts_for(history, k):  # the penalised continuation with every third draft wrong
        position = len(history) - len(PROMPT)
        right = penalised_tokens[position:position + k]
        return [t if (position + i) % 3 else (t + 7) % V for i, t in enumerate(right)]

    tokens, _, steps = generate(new_verifier(target), "spec", PROMPT, 16, drafts_for, k=4, **PENALTIES)
    assert tokens == penalised_tokens
    assert steps < 16  # drafts were accepted, so later positions counted them


def test_a_migrated_request_rebuilds_its_counts_from_the_history(target, penalised_tokens):
    verifier = new_verifier(target)
    history = PROMPT + penalised_tokens[:6]
    for step in range(6):  # a fresh verifier re-prefills the history, then decodes
        cached_len = 0 if step == 0 else len(history) - 1
        result, _ = one(verifier, vrow("moved", history[cached_len:], cached_len, step=step, **PENALTIES))
        history += result.token_ids.tolist()
    assert history[len(PROMPT):] == penalised_tokens[:12]


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=99)])
def test_logit_bias_of_minus_100_bans_a_token_and_plus_100_forces_it(target, greedy_tokens, sampling):
    banned = sorted(set(greedy_tokens))
    tokens, _, steps = generate(new_verifier(target), "ban", PROMPT, 20, lambda history, k: banned[:k], k=3,
                                logit_bias={t: -100.0 for t in banned}, **sampling)
    assert not set(tokens) & set(banned)
    assert steps == 20  # every draft (a banned token) was rejected
    tokens, _, steps = generate(new_verifier(target), "force", PROMPT, 20, lambda history, k: [7] * k, k=3,
                                logit_bias={7: 100.0}, **sampling)
    assert tokens == [7] * 20 and steps == 5  # and every draft of it accepted
