"""The verifier's rows before the model (gpu_worker/verifier/verifier_rows.py): the receiver rule's
need_resync, KV admission, and rows the checks or the kernels refuse failing alone."""

import numpy as np
import pytest

from gpu_worker.batching.slots import instance_heartbeat
from schemas.errors import ErrorCode
from schemas.generation import LogprobOptions, RowSampling
from schemas.steps import Proposal, VerifyRow
from tests.gpu_worker.verifier.verifier_steps import MAX_SLOTS, PROMPT, V, new_verifier, one, run, vrow


def test_cached_len_mismatch_answers_need_resync_and_changes_nothing(target):
    verifier = new_verifier(target)
    unknown, _ = one(verifier, vrow("new", PROMPT[3:], cached_len=3))
    assert unknown.need_resync and len(unknown.token_ids) == 0 and ("sched-test", "new") not in verifier.requests
    one(verifier, vrow("a", PROMPT[:5], emit=False))
    ahead, _ = one(verifier, vrow("a", PROMPT[8:], cached_len=8, step=1))
    assert ahead.need_resync and len(ahead.token_ids) == 0
    assert int(verifier.cache.lengths[verifier.requests[("sched-test", "a")].slot]) == 5
    # the scheduler then resends the whole history from 0
    assert len(one(verifier, vrow("a", PROMPT, step=2))[0].token_ids) == 1


def test_a_full_cache_fails_only_the_new_row(target):
    verifier = new_verifier(target, max_slots=1)
    results = run(verifier, vrow("a", PROMPT), vrow("b", PROMPT))
    assert results["a"][0].error is None and len(results["a"][0].token_ids) == 1
    assert results["b"][0].error.code == ErrorCode.no_capacity


def test_short_kv_memory_refuses_the_new_row_overloaded_and_heartbeats_say_so(target):
    # one slot of the tiny target (max_seq_len 128, rounded up to a whole key block of 256) is 257
    # positions of 320 bytes (256 of keys and values, 64 of the bf16 feature row): the budget holds
    # two, the third would eat the headroom kept for growth
    verifier = new_verifier(target, kv_cache_memory="185000")
    slot_bytes = verifier.cache.slot_bytes(1)
    assert slot_bytes == 257 * 320 and verifier.cache.memory_bytes == 185000 and verifier.cache.nbytes == 0
    results = run(verifier, vrow("a", PROMPT), vrow("b", PROMPT), vrow("c", PROMPT))
    assert results["a"][0].error is None and results["b"][0].error is None
    error = results["c"][0].error
    assert error.code == ErrorCode.overloaded and "KV cache memory budget 185000 bytes is short" in error.message
    assert verifier.cache.nbytes == 2 * slot_bytes and verifier.counters["refused_memory"] == 1
    beat = instance_heartbeat(verifier, "verifier", 0.5)
    assert (beat.capacity, beat.load, beat.free_slots, verifier.cache.num_free) == (MAX_SLOTS, 2, 0, MAX_SLOTS - 2)
    results = run(verifier, vrow("c", PROMPT), release=["a"])
    assert results["c"][0].error is None and verifier.cache.nbytes == 2 * slot_bytes


@pytest.mark.parametrize("bad, field", [
    (dict(new_token_ids=[1, V + 3]), "rows[1].new_token_ids"),
    (dict(draft_token_ids=[V]), "rows[1].draft_token_ids"),
    (dict(new_token_ids=[]), "rows[1].new_token_ids"),
    (dict(new_token_ids=list(range(90)) * 2), "rows[1].new_token_ids"),
    (dict(emit=False, draft_token_ids=[1]), "rows[1].draft_token_ids"),
    (dict(logprobs=LogprobOptions(logprob_token_ids=[V + 1])), "rows[1].logprobs.logprob_token_ids"),
    (dict(draft_token_ids=[1], sampling=RowSampling(temperature=1.0, seed=3),
          proposal=Proposal(kind="dense", probs=np.full((1, V + 1), 1.0 / V, np.float32), draft_vocab_size=V + 1)),
     "rows[1].proposal.draft_vocab_size"),
    # a draft distribution that does not sum to 1 would bias the output silently
    (dict(draft_token_ids=[1], sampling=RowSampling(temperature=1.0, seed=3),
          proposal=Proposal(kind="sparse", ids=[[1, 2]], probs=[[0.5, 0.2]])), "rows[1].proposal.probs"),
])
def test_a_bad_row_gets_its_own_error_while_the_others_succeed(target, greedy_tokens, bad, field):
    verifier = new_verifier(target)
    bad_row = VerifyRow.model_validate({**vrow("bad", PROMPT).model_dump(), **bad})
    results = run(verifier, vrow("good", PROMPT, drafts=greedy_tokens[:2]), bad_row)
    good, _ = results["good"]
    assert good.error is None and good.token_ids.tolist() == greedy_tokens[:3]
    error = results["bad"][0].error
    assert error.code == ErrorCode.invalid_field and error.field == field and error.request_id == "bad"
    assert ("sched-test", "bad") not in verifier.requests and verifier.counters["rows_failed"] == 1


def test_sampling_values_the_kernels_refuse_fail_their_row_only(target, greedy_tokens):
    """Issue 11 item 2: SamplingInputError was no SpecbusError, so one row's value failed the
    whole batch as `internal`. The schema now refuses such values; a row that still carries one
    (built around the schema) fails alone, naming its field."""
    verifier = new_verifier(target)
    hot = RowSampling.model_construct(temperature=1e308, top_k=0, top_p=1.0, min_p=0.0, seed=3)  # inf in float32
    results = run(verifier, vrow("good", PROMPT, drafts=greedy_tokens[:2]),
                  vrow("hot", PROMPT).model_copy(update={"sampling": hot}))
    assert results["good"][0].error is None and results["good"][0].token_ids.tolist() == greedy_tokens[:3]
    error = results["hot"][0].error
    assert (error.code, error.field, error.request_id) == (ErrorCode.invalid_field, "rows[1].sampling.temperature", "hot")


@pytest.mark.parametrize("sampling, field", [
    (RowSampling(temperature=0, logit_bias={V + 2: 1.0}), "rows[1].sampling.logit_bias"),  # outside the vocabulary
    # built around the schema, which refuses these
    (RowSampling.model_construct(temperature=0, repetition_penalty=0.0), "rows[1].sampling.repetition_penalty"),
    (RowSampling.model_construct(temperature=1.0, frequency_penalty=float("nan")),
     "rows[1].sampling.frequency_penalty"),
])
def test_a_penalty_the_kernels_refuse_fails_its_row_only(target, greedy_tokens, sampling, field):
    verifier = new_verifier(target)
    results = run(verifier, vrow("good", PROMPT, drafts=greedy_tokens[:2]),
                  vrow("bad", PROMPT).model_copy(update={"sampling": sampling}))
    assert results["good"][0].error is None and results["good"][0].token_ids.tolist() == greedy_tokens[:3]
    error = results["bad"][0].error
    assert (error.code, error.field, error.request_id) == (ErrorCode.invalid_field, field, "bad")
    assert ("sched-test", "bad") not in verifier.requests  # refused before it took a slot
