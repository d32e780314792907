"""The verifier's forwards (gpu_worker/verifier/verifier_forwards.py): chunked prefill and rows
packed into shared padded forwards give the tokens and logprobs of one row alone."""

import numpy as np
import torch

from schemas.generation import LogprobOptions
from gpu_worker.verifier.verifier_forwards import pack_chunks
from tests.gpu_worker.verifier.verifier_steps import PROMPT, SAMPLED, hf_logprobs, new_verifier, one, run, vrow


def test_a_row_gives_the_same_tokens_and_logprobs_alone_and_in_a_mixed_batch(target, greedy_tokens):
    options = LogprobOptions(logprobs=3, logprob_token_ids=[1, 2], sampling_mask=True)
    greedy_row = vrow("g", PROMPT, drafts=greedy_tokens[:3], logprobs=options)
    sampled_row = vrow("s", PROMPT[:7], drafts=[4, 9], prompt_len=7, logprobs=options, **SAMPLED)
    alone = {**run(new_verifier(target), greedy_row), **run(new_verifier(target), sampled_row)}

    verifier = new_verifier(target)
    one(verifier, vrow("d", PROMPT[:9], prompt_len=9))  # a request already decoding
    long_prompt = (PROMPT * 5)[:60]
    together = run(verifier, vrow("long", long_prompt, prompt_len=60), sampled_row,
                   vrow("d", [7], cached_len=9, drafts=[3, 3], prompt_len=9, step=1), greedy_row)
    for request_id in ("g", "s"):
        (result, record), (result_b, record_b) = alone[request_id], together[request_id]
        assert result == result_b
        assert record.token_ids.tolist() == record_b.token_ids.tolist() == result.token_ids.tolist()
        assert record.masks == record_b.masks
        for name in ("token_logprobs", "top_logprobs", "requested_logprobs"):
            np.testing.assert_allclose(getattr(record.logprobs, name), getattr(record_b.logprobs, name), atol=1e-5)
        assert np.array_equal(record.logprobs.top_ids, record_b.logprobs.top_ids)


def test_prefill_in_chunks_equals_one_shot_prefill(target, greedy_tokens):
    options = LogprobOptions(logprobs=2, prompt_logprobs=4)
    one_shot, one_shot_record = one(new_verifier(target), vrow("a", PROMPT, drafts=greedy_tokens[:2],
                                                                logprobs=options))
    verifier = new_verifier(target, prefill_chunk=3)  # and chunks inside each step
    first, record = one(verifier, vrow("a", PROMPT[:4], emit=False, logprobs=options))
    assert len(first.token_ids) == 0 and record is None  # prompt logprobs wait for the last chunk
    one(verifier, vrow("a", PROMPT[4:9], cached_len=4, emit=False, logprobs=options, step=1))
    chunked, chunked_record = one(verifier, vrow("a", PROMPT[9:], cached_len=9, drafts=greedy_tokens[:2],
                                                 logprobs=options, step=2))
    assert chunked.token_ids.tolist() == one_shot.token_ids.tolist() == greedy_tokens[:3]
    assert chunked.num_accepted == one_shot.num_accepted == 2
    prompt, prompt_b = one_shot_record.prompt_logprobs, chunked_record.prompt_logprobs
    assert one_shot_record.prompt_offset == chunked_record.prompt_offset == 1 and prompt.n == len(PROMPT) - 1
    for name in ("token_logprobs", "top_logprobs"):
        np.testing.assert_allclose(getattr(prompt, name), getattr(prompt_b, name), atol=1e-5)
    assert np.array_equal(prompt.top_ids, prompt_b.top_ids) and np.array_equal(prompt.ranks, prompt_b.ranks)
    np.testing.assert_allclose(prompt.token_logprobs,
                               hf_logprobs(target, PROMPT)[torch.arange(len(PROMPT) - 1), PROMPT[1:]], atol=1e-4)


def test_one_row_with_a_draft_does_not_pad_a_batch_of_decode_rows():
    # (work, begin, end) chunks: 19 decode rows of one token and one row with a draft (2 tokens);
    # padded together they would cost 40 token rows for 20 real ones: the row gets its own forward
    decode = [(f"d{i}", 0, 1) for i in range(19)]
    groups = pack_chunks(decode + [("probe", 0, 2)])
    assert [len(g) for g in groups] == [19, 1] and groups[1] == [("probe", 0, 2)]
    # a little padding is still cheaper than another forward
    assert [len(g) for g in pack_chunks([("a", 0, 1), ("b", 0, 1), ("c", 0, 2)])] == [3]
    # prefill chunks of similar length share one forward; a short decode row never pads up to them
    groups = pack_chunks([("p1", 0, 40), ("p2", 0, 46), ("d", 0, 1)])
    assert [[c[0] for c in g] for g in groups] == [["d"], ["p1", "p2"]]
