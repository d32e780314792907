"""The verifier's side channel (gpu_worker/verifier/verifier_side_channel.py): prompt logprobs
across chunks, and processed logprobs of the penalised distribution."""

import numpy as np
import pytest
import torch

from schemas.generation import LogprobOptions
from tests.gpu_worker.verifier.verifier_steps import (PENALTIES, PROMPT, SAMPLED, generate, hf_logprobs, new_verifier,
                                                   one, penalised_reference, vrow)


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_prompt_logprobs_equal_the_logprobs_emitted_while_generating(target, greedy_tokens, mode):
    options = LogprobOptions(logprobs=3, prompt_logprobs=3, logprobs_mode=mode, logprob_token_ids=[0, 11])

    def drafts_for(history, k):
        position = len(history) - len(PROMPT)
        return greedy_tokens[position:position + k]

    tokens, records, _ = generate(new_verifier(target), "gen", PROMPT, 10, drafts_for, k=3, logprobs=options,
                                  **SAMPLED)
    emitted = [record.logprobs for record in records]
    generated = {name: np.concatenate([getattr(a, name) for a in emitted])[:10]
                 for name in ("token_logprobs", "top_ids", "top_logprobs", "requested_logprobs", "ranks")}
    assert np.isfinite(generated["token_logprobs"]).all()  # every emitted token is inside its K

    sequence = PROMPT + tokens
    _, scored = one(new_verifier(target), vrow("score", sequence, prompt_len=len(sequence), logprobs=options,
                                               **SAMPLED))
    prompt = scored.prompt_logprobs
    assert scored.prompt_offset == 1 and prompt.n == len(sequence) - 1
    rows = slice(len(PROMPT) - 1, None)  # prompt position p sits at row p - 1
    for name, values in generated.items():
        np.testing.assert_allclose(getattr(prompt, name)[rows], values, atol=1e-4)
    if mode == "processed":
        np.testing.assert_allclose(prompt.logz_k[rows], np.concatenate([a.logz_k for a in emitted])[:10], atol=1e-4)
    else:
        reference = hf_logprobs(target, sequence)[torch.arange(len(sequence) - 1), sequence[1:]]
        np.testing.assert_allclose(prompt.token_logprobs, reference, atol=1e-4)


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_processed_logprobs_are_those_of_the_penalised_distribution(target, mode):
    options = LogprobOptions(logprobs=3, logprob_token_ids=[11, 40], logprobs_mode=mode)
    # the biases make the (nearly uniform) tiny model favour three tokens, and the penalties
    # move the mass among them as they repeat, drafts included
    penalties = {**PENALTIES, "logit_bias": {11: 5.0, 40: 4.5, 3: 4.0}}
    favoured = [11, 40, 3]

    def drafts_for(history, k):
        return [favoured[(len(history) + i) % 3] for i in range(k)]

    tokens, records, steps = generate(new_verifier(target), "lp", PROMPT, 10, drafts_for, k=3, logprobs=options,
                                      temperature=0.9, seed=5, coupling="rejection", **penalties)  # the seed accepts
    assert steps < 9  # drafts were accepted: positions after them in a step counted them
    got = {name: np.concatenate([getattr(r.logprobs, name) for r in records])[:10]
           for name in ("token_logprobs", "top_ids", "top_logprobs", "requested_logprobs")}
    with torch.no_grad():
        logits = target.hf(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1:-1]  # (10, V)
    for i, token in enumerate(tokens):
        if mode == "raw":
            expected = logits[i].log_softmax(-1)  # the model's own, before any penalty
        else:  # no filter: K is the whole vocabulary and logz_k is 0
            expected = (penalised_reference(logits[i], PROMPT, tokens[:i], penalties) / 0.9).log_softmax(-1)
        np.testing.assert_allclose(got["token_logprobs"][i], expected[token], atol=1e-4)
        np.testing.assert_allclose(got["requested_logprobs"][i], expected[[11, 40]], atol=1e-4)
        top = expected.topk(3)
        np.testing.assert_allclose(got["top_logprobs"][i], top.values, atol=1e-4)
        assert got["top_ids"][i].tolist() == top.indices.tolist()
