"""Logprob formatting (services/postprocessor/logprob_format.py) alone: raw values pass through,
processed ones are normalised by the candidate set, padding is dropped, and the prompt's entries
land at their positions."""

import math

import numpy as np
import pytest

from schemas.arrays import PAD_TOKEN_ID
from schemas.commits import LogprobArrays, SideChannelRecord
from schemas.config import TINY_TARGET
from schemas.generation import LogprobOptions
from schemas.streams import SamplingMask
from services.postprocessor.logprob_format import format_logprobs, prompt_logprobs, token_extras, wants_token_logprobs
from text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_TARGET)


def arrays(n: int, *, logz_k=None) -> LogprobArrays:
    """Position i: token logprob -(i + 1) / 10; top ids 10 + i, 20 + i and a padding slot; requested -2."""
    top_ids = np.array([[10 + i, 20 + i, PAD_TOKEN_ID] for i in range(n)], np.int32).reshape(n, 3)
    top = np.array([[-0.1, -1.0, -math.inf]] * n, np.float32).reshape(n, 3)
    return LogprobArrays(token_logprobs=-(np.arange(n, dtype=np.float32) + 1) / 10, top_ids=top_ids,
                         top_logprobs=top, requested_logprobs=np.full((n, 1), -2.0, np.float32),
                         ranks=np.arange(1, n + 1, dtype=np.int32), logz_k=logz_k)


def test_raw_values_pass_through_and_padding_is_dropped(tokenizer):
    [first, second] = format_logprobs(arrays(2), [10, 21], mode="raw", top_n=5, requested_ids=[3], tokenizer=tokenizer)
    assert (first.token_id, first.logprob, first.rank) == (10, pytest.approx(-0.1), 1)
    assert first.token == tokenizer.decode([10])
    assert first.top == [(10, pytest.approx(-0.1)), (20, pytest.approx(-1.0))]  # the padding slot is gone
    assert second.top_ids.tolist() == [11, 21] and second.requested_logprobs.tolist() == [-2.0]


def test_processed_values_subtract_logz_k_and_are_minus_inf_outside_a_full_mask(tokenizer):
    logz_k = np.array([-0.05], np.float32)
    mask = SamplingMask(token_ids=[10, 30], size=2)
    [entry] = format_logprobs(arrays(1, logz_k=logz_k), [10], mode="processed", top_n=2, requested_ids=[30],
                              tokenizer=tokenizer, masks=[mask])
    assert entry.logprob == pytest.approx(-0.1 + 0.05)
    assert entry.top_logprobs[0] == pytest.approx(-0.05) and entry.top_logprobs[1] == -math.inf  # 20 is outside K
    assert entry.requested_logprobs[0] == pytest.approx(-2.0 + 0.05)  # 30 is in K
    [truncated] = format_logprobs(arrays(1, logz_k=logz_k), [10], mode="processed", top_n=2, requested_ids=[],
                                  tokenizer=tokenizer, masks=[SamplingMask(token_ids=[10], size=5)])
    assert truncated.top_logprobs[1] == pytest.approx(-1.0 + 0.05)  # a truncated mask does not list K in full


def test_token_extras_give_what_was_asked_and_nothing_without_a_record(tokenizer):
    record = SideChannelRecord(request_id="r", batch_id=1, step=0, verifier_id="v0", token_ids=[10, 21],
                               logprobs=arrays(2), masks=[SamplingMask(all_tokens=True, size=9)] * 2)
    token_ids = np.array([10], np.int32)  # the commit kept one of the two
    masks_only = token_extras(LogprobOptions(sampling_mask=True), record, token_ids, tokenizer)
    assert list(masks_only) == ["sampling_masks"] and len(masks_only["sampling_masks"]) == 1
    both = token_extras(LogprobOptions(logprobs=1, sampling_mask=True), record, token_ids, tokenizer)
    assert [entry.token_id for entry in both["logprobs"]] == [10] and len(both["logprobs"][0].top_ids) == 1
    assert token_extras(LogprobOptions(logprobs=1), None, token_ids, tokenizer) == {}
    assert token_extras(LogprobOptions(), record, token_ids, tokenizer) == {}
    assert wants_token_logprobs(LogprobOptions(logprob_token_ids=[4])) and not wants_token_logprobs(LogprobOptions())


def test_prompt_entries_land_at_their_positions_from_every_chunk(tokenizer):
    prompt = np.array([1, 10, 11, 12, 13], np.int32)
    chunks = [SideChannelRecord(request_id="r", batch_id=b, step=0, verifier_id="v0", prompt_logprobs=arrays(n),
                                prompt_offset=offset) for b, (offset, n) in enumerate([(0, 3), (3, 2)])]
    entries = prompt_logprobs(LogprobOptions(prompt_logprobs=1), chunks, prompt, tokenizer)
    assert entries[0] is None  # the first prompt token has no context
    assert [entry.token_id for entry in entries[1:]] == [10, 11, 12, 13]
    assert [round(entry.logprob, 2) for entry in entries[1:]] == [-0.2, -0.3, -0.1, -0.2]  # rows 1, 2 then 0, 1
    assert prompt_logprobs(LogprobOptions(prompt_logprobs=1), chunks[1:], prompt, tokenizer)[1] is None
