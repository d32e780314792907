"""The side-channel join (services/postprocessor/side_channel_join.py) alone: what is buffered, which
record a commit gets, and every record it drops, with the counter it counts in."""

import numpy as np

from schemas.commits import Commit, LogprobArrays, SideChannelRecord
from schemas.generation import LogprobOptions
from schemas.streams import SamplingMask
from services.postprocessor.side_channel_join import (MAX_RECORDS_PER_REQUEST, DroppedRecord, EarlyRecords,
                                                 RequestRecords, record_fits)


def arrays(n: int) -> LogprobArrays:
    return LogprobArrays(token_logprobs=np.full(n, -0.5, np.float32), top_ids=np.zeros((n, 1), np.int32),
                         top_logprobs=np.full((n, 1), -0.5, np.float32),
                         requested_logprobs=np.zeros((n, 0), np.float32))


def record(batch_id: int, token_ids=(5, 6), *, request_id="r1", prompt_offset=None, prompt_n=0, masks=None):
    prompt = {} if prompt_offset is None else {"prompt_logprobs": arrays(prompt_n), "prompt_offset": prompt_offset}
    return SideChannelRecord(request_id=request_id, batch_id=batch_id, step=0, verifier_id="v0",
                             token_ids=list(token_ids), logprobs=arrays(len(token_ids)) if token_ids else None,
                             masks=masks, **prompt)


def commit(batch_id: int, token_ids=(5, 6), *, seq=1, expect=True, logprobs=LogprobOptions(logprobs=1), **fields):
    return Commit(request_id="r1", batch_id=batch_id, step=seq, seq=seq, scheduler_id="s0", client_inbox="_INBOX.c",
                  token_ids=list(token_ids), expect_side_channel=expect, logprobs=logprobs, **fields)


def kinds(dropped: list[DroppedRecord]) -> list[tuple[int, str, str | None]]:
    return [(drop.record.batch_id, drop.counter, drop.event) for drop in dropped]


# ---------------------------------------------------------------------------------------------
# early records


def test_early_records_are_taken_by_the_first_commit_once():
    early = EarlyRecords()
    assert early.add(record(1), now=0.0) == [] and early.add(record(2), now=0.1) == []
    assert kinds(early.add(record(1), now=0.2)) == [(1, "duplicate_records", None)]
    assert len(early) == 2
    assert [r.batch_id for r, _ in early.take("r1")] == [1, 2] and len(early) == 0 and early.take("r1") == []


def test_early_records_are_bounded_and_expire():
    early = EarlyRecords(limit=2)
    early.add(record(1, request_id="a"), now=0.0)
    early.add(record(2, request_id="b"), now=1.0)
    assert kinds(early.add(record(3, request_id="c"), now=2.0)) == [(1, "unjoined_records", "early_record_evicted")]
    assert kinds(early.expire(now=11.5, ttl_s=10.0)) == [(2, "unjoined_records", "early_record_expired")]
    assert len(early) == 1 and list(early.by_request) == ["c"]


# ---------------------------------------------------------------------------------------------
# one request's records


def test_a_record_waits_for_its_commit_and_settling_joins_it():
    records = RequestRecords()
    assert records.add(record(7), 0.0, last_batch_id=None, first_chunk_sent=True) == []
    joined, _ = records.waiting[7]
    assert records.settle(commit(7), joined) == [] and 7 in records.joined and not records.waiting
    again = records.add(record(7), 1.0, last_batch_id=7, first_chunk_sent=True)
    assert kinds(again) == [(7, "duplicate_records", None)]


def test_records_for_batches_already_out_are_late():
    records = RequestRecords()
    assert records.settle(commit(4), None) == [] and 4 in records.timed_out  # expected, never came
    assert kinds(records.add(record(4), 1.0, last_batch_id=4, first_chunk_sent=True)) == [(4, "late_records", None)]
    assert records.stray_kind(3, last_batch_id=4) == "late_records" and records.stray_kind(5, last_batch_id=4) is None


def test_settling_drops_what_no_later_commit_can_claim():
    records = RequestRecords()
    for batch_id, tokens in ((1, (5,)), (2, ()), (3, (5, 6)), (4, (5, 6))):
        records.add(record(batch_id, tokens), 0.0, last_batch_id=None, first_chunk_sent=True)
    dropped = records.settle(commit(3, expect=False), None)  # a replayed commit: it expects no record
    assert kinds(dropped) == [(3, "unjoined_records", "record_not_expected"), (1, "unjoined_records", "stale_record")]
    assert 2 in records.joined and list(records.waiting) == [4]  # 2: a prefill record, its prompt part kept
    assert kinds(records.clear()) == [(4, "unjoined_records", "record_never_joined")] and not records.waiting


def test_too_many_waiting_records_evict_the_earliest_batch():
    records = RequestRecords()
    for batch_id in range(MAX_RECORDS_PER_REQUEST):
        records.add(record(batch_id), 0.0, last_batch_id=None, first_chunk_sent=True)
    dropped = records.add(record(MAX_RECORDS_PER_REQUEST), 0.0, last_batch_id=None, first_chunk_sent=True)
    assert kinds(dropped) == [(0, "unjoined_records", "record_evicted")]
    assert len(records.waiting) == MAX_RECORDS_PER_REQUEST


def test_the_first_commit_waits_until_the_prompt_is_covered():
    options = LogprobOptions(prompt_logprobs=1)
    first = commit(2, seq=0, prompt_token_ids=[1, 2, 3, 4, 5], logprobs=options)
    records = RequestRecords()
    records.add(record(1, (), prompt_offset=1, prompt_n=2), 0.0, last_batch_id=None, first_chunk_sent=False)
    assert not records.prompt_covered(first, options)  # positions 1-2 of 1-4
    records.add(record(2, (9,), prompt_offset=3, prompt_n=2), 0.0, last_batch_id=None, first_chunk_sent=False)
    assert records.prompt_covered(first, options) and len(records.prompt) == 2
    assert records.prompt_covered(commit(3), options) and records.prompt_covered(first, LogprobOptions())
    late = RequestRecords()
    late.add(record(5, (), prompt_offset=1, prompt_n=2), 0.0, last_batch_id=None, first_chunk_sent=True)
    assert late.prompt == []  # the first chunk is out: nothing collects prompt logprobs any more


def test_a_record_fits_its_commit_only_with_its_tokens_and_parts():
    asks_masks = LogprobOptions(sampling_mask=True)
    assert record_fits(record(1, (5, 6, 7)), commit(1, (5, 6)))  # the commit was cut short
    assert not record_fits(record(1, (5, 9)), commit(1, (5, 6)))
    assert not record_fits(record(1, (5,)), commit(1, (5, 6)))
    assert not record_fits(record(1, (5, 6)), commit(1, (5, 6), logprobs=asks_masks))
    masks = [SamplingMask(all_tokens=True, size=10)] * 2
    assert record_fits(record(1, (5, 6), masks=masks), commit(1, (5, 6), logprobs=asks_masks))
