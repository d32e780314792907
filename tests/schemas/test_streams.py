"""What a client reads (schemas/streams.py): per-token fields agree, masks and logprobs are consistent."""

import pytest

from schemas import SamplingMask, StreamChunk, TokenLogprob


def test_stream_chunk_per_token_fields_match_the_tokens():
    with pytest.raises(ValueError, match="1 entries for 2 tokens"):
        StreamChunk(request_id="r", seq=0, token_ids=[4, 5], from_draft=[True])


@pytest.mark.parametrize("kwargs, message", [
    ({"token_ids": [9, 3], "size": 2}, "sorted ascending"),
    ({"token_ids": [3, 3], "size": 2}, "sorted ascending"),
    ({"token_ids": [3, 9], "size": 1}, "size 1 is below the 2 ids"),
    ({"token_ids": [3], "size": 100, "all_tokens": True}, "carries no ids"),
])
def test_sampling_mask_must_be_consistent(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingMask(**kwargs)


def test_sampling_mask_reports_truncation_and_all():
    assert SamplingMask(token_ids=[1, 5], size=900).truncated
    assert not SamplingMask(token_ids=[1, 5], size=2).truncated
    everything = SamplingMask(all_tokens=True, size=4096)
    assert not everything.truncated and len(everything.token_ids) == 0


def test_token_logprob_allows_minus_inf_but_not_nan():
    assert TokenLogprob(token_id=1, logprob=float("-inf")).logprob == float("-inf")
    with pytest.raises(ValueError, match="must not be NaN"):
        TokenLogprob(token_id=1, logprob=float("nan"))


def test_token_logprob_pairs_top_entries():
    entry = TokenLogprob(token_id=1, logprob=-0.2, top_ids=[1, 7], top_logprobs=[-0.2, -1.9])
    assert entry.top == [(1, pytest.approx(-0.2)), (7, pytest.approx(-1.9))]
