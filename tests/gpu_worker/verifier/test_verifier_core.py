"""The verifier's step (gpu_worker/verifier/verifier_core.py) on a tiny random Llama written to
disk: retries answered from the stored answer, slot release and idle eviction, request ids
scoped by scheduler."""

import time

from gpu_worker.batching.slots import evict_idle
from gpu_worker.verifier.verifier_core import verify_batch
from schemas.generation import LogprobOptions
from schemas.steps import VerifyRequest
from tests.gpu_worker.verifier.verifier_steps import MAX_SLOTS, PROMPT, SAMPLED, new_verifier, one, run, vrow


def test_a_retried_step_returns_the_stored_answer_and_appends_nothing(target):
    verifier = new_verifier(target)
    first = one(verifier, vrow("a", PROMPT, drafts=[1, 2], logprobs=LogprobOptions(logprobs=2), **SAMPLED))
    length = int(verifier.cache.lengths[verifier.requests[("sched-test", "a")].slot])
    retried = one(verifier, vrow("a", PROMPT, drafts=[1, 2], logprobs=LogprobOptions(logprobs=2), **SAMPLED)
                  .model_copy(update={"is_retry": True}))
    assert retried[0] == first[0] and retried[1] == first[1]  # the side record is published again
    assert int(verifier.cache.lengths[verifier.requests[("sched-test", "a")].slot]) == length
    assert verifier.counters["retries_answered"] == 1


def test_release_and_idle_eviction_free_slots(target):
    verifier = new_verifier(target)
    run(verifier, vrow("a", PROMPT), vrow("b", PROMPT[:4], prompt_len=4))
    assert verifier.cache.num_free == MAX_SLOTS - 2
    run(verifier, release=["a", "never-seen"])
    assert ("sched-test", "a") not in verifier.requests and verifier.cache.num_free == MAX_SLOTS - 1
    assert verifier.counters["release_unknown"] == 1
    assert evict_idle(verifier, now=time.monotonic() + verifier.slot_idle_ttl_s + 1) == 1
    assert verifier.cache.num_free == MAX_SLOTS and not verifier.requests


def test_two_schedulers_may_use_the_same_request_id(target, greedy_tokens):
    """Issue 11 item 7: slots keyed by request_id alone let a second scheduler's request with the
    same id truncate the first one's slot."""
    verifier = new_verifier(target)

    def batch(scheduler_id, row, batch_id):
        request = VerifyRequest(batch_id=batch_id, scheduler_id=scheduler_id, deadline=time.time() + 30, rows=[row])
        return verify_batch(verifier, request)[0].rows[0]

    first = batch("sched-a", vrow("same", PROMPT), 1)
    batch("sched-b", vrow("same", PROMPT[:5]), 1)
    following = batch("sched-a", vrow("same", first.token_ids.tolist(), cached_len=len(PROMPT), step=1), 2)
    assert not following.need_resync and following.error is None
    assert [*first.token_ids.tolist(), *following.token_ids.tolist()] == greedy_tokens[:2]
    assert sorted(verifier.requests) == [("sched-a", "same"), ("sched-b", "same")]
