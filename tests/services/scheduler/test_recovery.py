"""Recovery (services/scheduler/recovery.py), through the scheduler's core without NATS: dead
drafters and postprocessors replaced (commits replayed), resyncs, verifiers that fail a batch or
die (migrations, waits for one), and a failed step number never reused."""

import time

from schemas.bus.codec import decode, encode
from schemas.commits import Commit
from schemas.steps import VerifyResponse, VerifyResult
from tests.services.scheduler.scheduler_harness import (
    beat,
    commits_of,
    new_state,
    step,
    submit,
)


def test_dead_drafter_is_replaced_and_the_new_one_gets_the_whole_history(tokenizer):
    state = new_state(tokenizer)
    request = submit(state, speculative={"num_speculative_tokens": 2})
    step(state)
    step(state, drafts={"r1": [1, 2]})
    assert request.drafter_len == 4
    state.clock.now += 5.0  # everyone silent past heartbeat_timeout_s ...
    for instance_id, role in (("v1", "verifier"), ("p1", "postprocessor"), ("d2", "drafter")):
        beat(state, instance_id, role)  # ... but d1 never beats again
    state.boundary(time.time())
    plan = state.plan_step(time.time())
    [message] = state.draft_batches(plan, time.time()).values()
    assert request.drafter_id == "d2" and message.rows[0].cached_len == 0
    assert message.rows[0].new_token_ids.tolist() == request.history


def re_prefill(state, verifier_id: str, history: list[int]):
    """The two steps of a re-prefill from scratch (resync, migration): history but its last token
    without emitting, then that token as a decode row (so a seeded sampled request draws the
    same tokens as before, docs/PROTOCOL.md#scheduler-failover). Returns the decode step's outbox."""
    _, requests, outbox = step(state)
    row = requests[verifier_id].rows[0]
    assert row.cached_len == 0 and row.new_token_ids.tolist() == history[:-1] and not row.emit
    assert commits_of(outbox) == []
    _, requests, outbox = step(state)
    row = requests[verifier_id].rows[0]
    assert row.cached_len == len(history) - 1 and row.new_token_ids.tolist() == history[-1:] and row.emit
    return outbox


def test_need_resync_resends_the_whole_history_and_flags_the_next_commit(tokenizer):
    state = new_state(tokenizer)
    request = submit(state)
    step(state)
    outbox = state.boundary(time.time())
    plan = state.plan_step(time.time())
    message = state.verify_batches(plan, time.time())["v1"]
    reply = VerifyResponse(batch_id=message.batch_id, verifier_id="v1",
                           rows=[VerifyResult(request_id="r1", step=message.rows[0].step, need_resync=True)])
    outbox.extend(state.apply_verify(plan, "v1", reply, time.time()))
    state.end_step(plan)
    assert commits_of(outbox) == [] and request.verifier_len == 0
    [commit] = commits_of(re_prefill(state, "v1", list(request.history)))
    assert commit.degraded == ["resync"] and request.degraded_steps["resync"] == 1


def test_verifier_silent_after_retry_moves_requests_to_another_verifier(tokenizer):
    state = new_state(tokenizer)
    request = submit(state)
    step(state)
    beat(state, "v2", "verifier")
    history = list(request.history)
    _, _, outbox = step(state, verify_reply=False)
    assert outbox.commits == [] and request.verifier_id == "v2" and request.verifier_len == 0
    assert state.releases.pending["v1"] == ["r1"]
    [commit] = commits_of(re_prefill(state, "v2", history))
    assert commit.degraded == ["migrated"] and commit.seq == 1


def test_no_verifier_left_the_request_waits_then_ends_at_its_deadline(tokenizer):
    state = new_state(tokenizer)
    submit(state, timeout_s=10.0)
    step(state)
    state.clock.now += 5.0  # v1 silent past heartbeat_timeout_s: dead
    for instance_id, role in (("d1", "drafter"), ("p1", "postprocessor")):
        beat(state, instance_id, role)
    _, _, outbox = step(state)
    assert not commits_of(outbox) and "r1" in state.running
    [commit] = commits_of(state.boundary(time.time() + 11.0))
    assert commit.finish_reason == "timeout" and state.counters["finished_timeout"] == 1


def test_a_verifier_that_misses_a_batch_but_heartbeats_gets_the_request_again_from_scratch(tokenizer):
    """No other verifier, and the one that did not answer (try and retry) still heartbeats: its
    replies were lost on the way (a dead NATS node), so the request is re-prefilled there."""
    state = new_state(tokenizer)
    request = submit(state)
    step(state)
    history = list(request.history)
    _, _, outbox = step(state, verify_reply=False)
    assert outbox.commits == [] and request.verifier_id == "v1" and request.verifier_len == 0
    assert state.counters["finished_error"] == 0
    [commit] = commits_of(re_prefill(state, "v1", history))
    assert commit.degraded == ["migrated"] and commit.seq == 1


def test_lost_postprocessor_gets_replaced_and_commits_replayed_with_resume_ids(tokenizer):
    state = new_state(tokenizer, heartbeat_timeout_s=2.0)
    request = submit(state, logprobs={"logprobs": 1})
    step(state, tokens={"r1": [20]})
    step(state, tokens={"r1": [21]})
    state.clock.now += 5.0
    for instance_id, role in (("v1", "verifier"), ("d1", "drafter"), ("p2", "postprocessor")):
        beat(state, instance_id, role)
    _, _, outbox = step(state, tokens={"r1": [22]})
    to_new = [c for pp, c in outbox.commits if pp == "p2"]
    assert [c.seq for c in to_new] == [0, 1, 2] and request.postprocessor_id == "p2"
    assert to_new[0].resume_token_ids.tolist() == [] and to_new[0].prompt_token_ids.tolist() == [5, 6, 7]
    assert to_new[1].resume_token_ids is None
    assert [c.expect_side_channel for c in to_new] == [False, False, True]
    assert to_new[0].degraded == ["logprobs_timeout"]
    assert all(decode(encode(c), Commit) == c for c in to_new)  # replays are valid on the wire


def test_a_request_whose_only_verifier_died_waits_for_another_and_moves_there(tokenizer):
    """No verifier to move to is not the end: the request waits (up to its deadline) for one,
    e.g. the supervisor's restart, and is re-prefilled there from its history."""
    state = new_state(tokenizer)
    submit(state, "r2")
    step(state)
    state.clock.now += 5.0  # v1 dead (silent past heartbeat_timeout_s), no other verifier to migrate to
    for instance_id, role in (("d1", "drafter"), ("p1", "postprocessor")):
        beat(state, instance_id, role)
    state.boundary(time.time())
    assert not state.plan_step(time.time()).rows and "r2" in state.running
    assert state.counters["verifier_awaited"] == 1
    beat(state, "v2", "verifier")
    state.boundary(time.time())
    plan = state.plan_step(time.time())
    [row] = plan.rows["v2"]
    assert row.request.request_id == "r2" and row.cached_len == 0 and state.counters["migrated"] == 1


def test_a_request_whose_verifier_comes_back_never_reuses_the_failed_step(tokenizer):
    """All verifiers frozen: the batch fails, the request waits; the same verifier thaws and may
    run the stale batch, storing its answer for that step. The request's next row there must be
    a new step from cached_len 0, or the verifier would answer it with the stale result."""
    state = new_state(tokenizer)
    request = submit(state, "r3")
    step(state)
    failed_step = request.step
    state.clock.now += 5.0  # v1 silent past heartbeat_timeout_s: dead, no other verifier
    for instance_id, role in (("d1", "drafter"), ("p1", "postprocessor")):
        beat(state, instance_id, role)
    state.boundary(time.time())
    assert not state.plan_step(time.time()).rows and state.counters["verifier_awaited"] == 1
    beat(state, "v1", "verifier")  # thawed: alive again
    state.boundary(time.time())
    plan = state.plan_step(time.time())
    [row] = plan.rows["v1"]
    assert row.request is request and row.cached_len == 0 and request.step > failed_step
    [message] = state.verify_batches(plan, time.time()).values()
    assert message.rows[0].step == request.step and message.rows[0].cached_len == 0
