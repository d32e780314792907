"""The verifier's feature buffer (gpu_worker/verifier/verifier_features.py) on the tiny target: the
features a verifier returns are the target's own hidden states whatever the split, asking for
them changes no token or logprob, and a block is capped at MAX_FEATURE_BLOCK_BYTES."""

import torch

import gpu_worker.verifier.verifier_features as verifier_features
from schemas.generation import LogprobOptions
from tests.gpu_worker.drafter.test_eagle_drafter import (PROMPT, SHORT_PROMPT, hidden_states, new_verifier, prefill,
                                                       rows_of, verify)


def test_features_are_the_targets_hidden_states_whatever_the_split(tiny_target_model):
    verifier = new_verifier()
    history, block = prefill(verifier, "r", PROMPT)  # three prefill chunks of 16
    assert (block.start, block.shape) == (0, [len(PROMPT), 192])
    drafts = [7, 8, 9]
    result, _ = verify(verifier, "r", history, len(PROMPT), drafts, features_from=len(PROMPT) - 2, step=1)
    n = result.num_accepted
    full = history + result.token_ids.tolist()
    assert result.features.start == len(PROMPT) - 2 and result.features.end == len(history) + n
    reference = hidden_states(tiny_target_model, full)
    assert torch.equal(rows_of(block), reference[:len(PROMPT)])
    assert torch.equal(rows_of(result.features), reference[len(PROMPT) - 2:len(history) + n])
    assert verifier.model_ids["hidden_size"] == "192"


def test_asking_for_features_changes_no_token_or_logprob():
    options = dict(logprobs=LogprobOptions(logprobs=3, prompt_logprobs=2), postprocessor_id="post-test")
    runs = []
    for features_from in (None, 0):
        verifier = new_verifier()
        first, first_records = verify(verifier, "r", PROMPT, 0, features_from=features_from, **options)
        history = PROMPT + first.token_ids.tolist()
        second, second_records = verify(verifier, "r", history, len(PROMPT), [5, 6], features_from=features_from,
                                        step=1, **options)
        runs.append((first, second, first_records + second_records))
    (a1, a2, a_records), (b1, b2, b_records) = runs
    assert a1.features is None and b1.features is not None
    assert a1.model_copy(update={"features": None}) == b1.model_copy(update={"features": None})
    assert a2.model_copy(update={"features": None}) == b2.model_copy(update={"features": None})
    assert a_records == b_records


def test_a_block_is_capped_and_the_rest_asked_next(monkeypatch):
    monkeypatch.setattr(verifier_features, "MAX_FEATURE_BLOCK_BYTES", 2 * 192 * 10)
    verifier = new_verifier()
    _, block = prefill(verifier, "r", SHORT_PROMPT + SHORT_PROMPT)
    assert (block.start, block.shape[0]) == (0, 10)
    result, _ = verify(verifier, "r", SHORT_PROMPT + SHORT_PROMPT, 18, features_from=10, step=1, emit=False)
    assert (result.features.start, result.features.end) == (10, 18)
