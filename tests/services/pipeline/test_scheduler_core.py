"""Scheduler logic without NATS: admission, batch building under the token budget with chunked
prefill, commit rules, usage, fallback decisions. Verifier and drafter answers are built here
as the real message types they send; a real tokenizer (trained on the spot) gives EOS and text."""

import time

import pytest
from structlog.testing import capture_logs

from schemas.codec import decode, encode
from schemas.commits import Commit
from schemas.config import SchedulerConfig, load_config
from schemas.control import Heartbeat
from schemas.errors import ErrorCode, SpecbusError
from schemas.generation import GenerateRequest, seed_from_request_id
from schemas.protocol import MAX_DRAFT_SUPPORT
from schemas.steps import DraftResponse, DraftResult, VerifyResponse, VerifyResult
from schemas.wire import Error
from services.pipeline.scheduler_core import SchedulerState, cut_tokens, prompt_token_ids

TOKENIZER_HASH = "0123456789abcdef"
EOS = 0
class Clock:
    """A monotonic clock the test moves by hand (heartbeat liveness)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def beat(state, instance_id, role, capacity=8, free_slots=None, tokenizer_hash=TOKENIZER_HASH):
    state.observe(Heartbeat(instance_id=instance_id, role=role, capacity=capacity, load=0, free_slots=free_slots,
                            model_ids={"tokenizer": tokenizer_hash}, sent_at=time.time(), interval_s=0.5))


def new_state(tokenizer, roles=(("v1", "verifier"), ("d1", "drafter"), ("p1", "postprocessor")), **overrides):
    config = load_config(SchedulerConfig, env={}, instance_id="sched-1", **overrides)
    clock = Clock()
    state = SchedulerState(config, tokenizer, TOKENIZER_HASH, monotonic=clock)
    state.clock = clock
    for instance_id, role in roles:
        beat(state, instance_id, role)
    return state


def submit(state, request_id="r1", prompt_ids=(5, 6, 7), now=None, **fields):
    sampling = {"temperature": 0.0, "max_tokens": 8, **fields.pop("sampling", {})}
    generate = GenerateRequest(request_id=request_id, prompt_token_ids=list(prompt_ids), sampling=sampling, **fields)
    return state.admit(generate, f"_INBOX.{request_id}", list(prompt_ids), time.time() if now is None else now)


def step(state, drafts=None, tokens=None, num_accepted=None, draft_reply=True, verify_reply=True):
    """One step. drafts / tokens / num_accepted: request_id -> what the drafter proposes / the
    verifier emits / accepts (defaults: no drafts; each emitting row emits [9]; accepted 0)."""
    drafts, tokens, num_accepted = drafts or {}, tokens or {}, num_accepted or {}
    outbox = state.boundary(time.time())
    plan = state.plan_step(time.time())
    for drafter_id, message in state.draft_batches(plan, time.time()).items():
        reply = DraftResponse(batch_id=message.batch_id, drafter_id=drafter_id, rows=[
            DraftResult(request_id=r.request_id, draft_token_ids=drafts.get(r.request_id, [])[:r.num_draft])
            for r in message.rows]) if draft_reply else None
        state.apply_draft(plan, drafter_id, message, reply)
    verify_requests = state.verify_batches(plan, time.time())
    for verifier_id, message in verify_requests.items():
        reply = VerifyResponse(batch_id=message.batch_id, verifier_id=verifier_id, rows=[
            VerifyResult(request_id=r.request_id, step=r.step, num_draft=len(r.draft_token_ids),
                         num_accepted=num_accepted.get(r.request_id, 0) if r.emit else 0,
                         token_ids=tokens.get(r.request_id, [9]) if r.emit else [])
            for r in message.rows]) if verify_reply else None
        outbox.extend(state.apply_verify(plan, verifier_id, reply, time.time()))
    state.end_step(plan)
    return plan, verify_requests, outbox


def commits_of(outbox, request_id="r1"):
    return [c for _, c in outbox.commits if c.request_id == request_id]


# ------------------------------------------------------------------ admission


def test_queue_bound_refuses_with_overloaded(tokenizer):
    state = new_state(tokenizer, max_running=1, max_queue=1)
    submit(state, "a")
    submit(state, "b")
    with pytest.raises(SpecbusError, match="limit is 1 running \\+ 1 queued") as info:
        submit(state, "c")
    assert info.value.code == ErrorCode.overloaded
    assert state.counters["admitted"] == 2


def submit_as(state, user, request_id):
    generate = GenerateRequest(request_id=request_id, prompt_token_ids=[5, 6, 7], sampling={"temperature": 0.0})
    return state.admit(generate, f"_INBOX.{user}.{request_id}", [5, 6, 7], time.time())


def test_a_user_under_its_share_is_admitted_in_place_of_the_newest_queued_request_over_share(tokenizer):
    state = new_state(tokenizer, max_running=2, max_queue=2)
    alice = [submit_as(state, "alice", f"a{i}") for i in range(4)]  # alone, alice may take everything
    with pytest.raises(SpecbusError, match="'alice' has 4 of its share of 4") as refused:
        submit_as(state, "alice", "a4")
    assert refused.value.code == ErrorCode.overloaded
    bob = submit_as(state, "bob", "b0")  # share 2, has 0: admitted, alice's newest queued request refused
    assert state.counters["refused_fair_share"] == 1 and alice[3].end_error.code == ErrorCode.overloaded
    outbox = state.boundary(time.time())
    [(inbox, chunk)] = [(inbox, chunk) for inbox, chunk in outbox.chunks if chunk.request_id == "a3"]
    assert inbox == "_INBOX.alice.a3" and chunk.error.code == ErrorCode.overloaded and "fair share" in chunk.error.message
    # two start (max_running 2): bob, who runs nothing, before alice's third
    assert set(state.running) == {"a0", "b0"} and [r.request_id for r in state.waiting] == ["a1", "a2"]
    assert bob.user == "bob"
    submit_as(state, "bob", "b1")  # bob has 1 of 2, the scheduler is full: alice's newest queued goes
    with pytest.raises(SpecbusError, match="'bob' has 2 of its share of 2"):
        submit_as(state, "bob", "b2")
    sample = state.metrics.registry.get_sample_value
    assert sample("specbus_scheduler_user_requests_total", {"user": "alice", "outcome": "fair_share"}) == 2
    assert sample("specbus_scheduler_user_requests_total", {"user": "bob", "outcome": "overloaded"}) == 1


def test_user_weights_set_the_shares(tokenizer):
    state = new_state(tokenizer, max_running=2, max_queue=4, user_weights="alice=2,bob=1")
    for i in range(6):
        submit_as(state, "bob", f"b{i}")
    for i in range(4):  # alice's share is 6 * 2/3 = 4: each takes one of bob's queued places
        submit_as(state, "alice", f"a{i}")
    with pytest.raises(SpecbusError, match="'alice' has 4 of its share of 4"):
        submit_as(state, "alice", "a4")
    with pytest.raises(SpecbusError, match="user_weights"):
        new_state(tokenizer, user_weights="alice=0")


def test_sampled_request_without_seed_gets_one_from_its_id(tokenizer):
    state = new_state(tokenizer)
    sampled = submit(state, "s1", sampling={"temperature": 0.8})
    seeded = submit(state, "s2", sampling={"temperature": 0.8, "seed": 7})
    greedy = submit(state, "g1")
    assert sampled.sampling.seed == seed_from_request_id("s1") != seed_from_request_id("s2")
    assert seeded.sampling.seed == 7
    assert greedy.sampling.seed is None


def test_prompt_text_is_tokenized_and_out_of_vocabulary_ids_are_refused(tokenizer):
    text = GenerateRequest(request_id="t", prompt="the quick brown fox")
    assert prompt_token_ids(text, tokenizer) == tokenizer.encode("the quick brown fox")
    bad = GenerateRequest(request_id="b", prompt_token_ids=[1, tokenizer.vocab_size])
    with pytest.raises(SpecbusError, match="outside the vocabulary") as info:
        prompt_token_ids(bad, tokenizer)
    assert info.value.field == "prompt_token_ids"


def test_request_waits_for_a_compatible_verifier_then_times_out(tokenizer):
    state = new_state(tokenizer, roles=(("p1", "postprocessor"),))
    beat(state, "other", "verifier", tokenizer_hash="ffffffffffffffff")  # another tokenizer: never used
    request = submit(state, now=time.time() - 59.5, timeout_s=60.0)
    assert step(state)[0].empty and list(state.waiting) == [request]
    request.deadline = time.time() - 0.1
    outbox = state.boundary(time.time())
    [(inbox, chunk)] = outbox.chunks
    assert inbox == "_INBOX.r1" and chunk.finish_reason == "timeout" and chunk.error.code == ErrorCode.timeout
    assert not state.waiting and state.counters["finished_timeout"] == 1


def test_an_incompatible_drafter_is_a_warning_and_a_count_once(tokenizer):
    state = new_state(tokenizer, roles=(("v1", "verifier"), ("p1", "postprocessor")))
    with capture_logs() as logs:
        for _ in range(3):  # heard again: counted once
            beat(state, "d-other", "drafter", tokenizer_hash="ffffffffffffffff")
    assert state.counters["instances_incompatible"] == 1
    [warning] = [entry for entry in logs if entry["event"] == "instance_incompatible"]
    assert warning["instance_id"] == "d-other" and "ffffffffffffffff" in warning["why"] and TOKENIZER_HASH in warning["why"]
    beat(state, "d1", "drafter")
    assert state.counters["instances_incompatible"] == 1


def test_pins_the_verifier_with_most_free_slots(tokenizer):
    state = new_state(tokenizer)
    beat(state, "v2", "verifier", capacity=8, free_slots=2)
    beat(state, "v1", "verifier", capacity=8, free_slots=5)
    first, second = submit(state, "a"), submit(state, "b")
    outbox = state.boundary(time.time())
    assert (first.verifier_id, first.drafter_id, first.postprocessor_id) == ("v1", "d1", "p1")
    assert [(inbox, ack.request_id, ack.started) for inbox, ack in outbox.acks] == [
        (first.client_inbox, "a", True), (second.client_inbox, "b", True)]  # the client hears they started
    assert second.verifier_id == "v1"  # v1: min(5, 8 - 1) = 5 free still beats v2's 2


# ------------------------------------------------------------------ batch building


def test_decode_rows_first_then_prefill_chunks_fill_the_token_budget(tokenizer):
    state = new_state(tokenizer, max_step_tokens=10)
    decoding = submit(state, "dec", prompt_ids=[1, 2], speculative={"num_speculative_tokens": 3})
    step(state)  # prefill of "dec": 2 tokens, emits one
    long_prompt = list(range(1, 25))
    submit(state, "pre", prompt_ids=long_prompt, speculative={"num_speculative_tokens": 3})

    _, requests, outbox = step(state, drafts={"dec": [4, 4, 4]})
    rows = {r.request_id: r for r in requests["v1"].rows}
    assert [r.request_id for r in requests["v1"].rows] == ["dec", "pre"]
    assert len(rows["dec"].new_token_ids) == 1 and len(rows["dec"].draft_token_ids) == 3
    assert rows["pre"].new_token_ids.tolist() == long_prompt[:6] and not rows["pre"].emit  # 10 - (1 + 3)
    assert commits_of(outbox, "pre") == []

    chunks = [6]
    while True:
        _, requests, outbox = step(state)
        row = next(r for r in requests["v1"].rows if r.request_id == "pre")
        assert row.cached_len == sum(chunks)
        chunks.append(len(row.new_token_ids))
        if row.emit:
            break
    assert sum(chunks) == len(long_prompt) and all(c <= 10 for c in chunks)
    [commit] = commits_of(outbox, "pre")
    assert commit.seq == 0 and commit.prompt_token_ids.tolist() == long_prompt and commit.token_ids.tolist() == [9]
    assert decoding.verifier_len == len(decoding.history) - 1


def test_max_batch_rows_leaves_the_rest_for_the_next_step(tokenizer):
    state = new_state(tokenizer, max_batch_rows=2)
    for name in "abc":
        submit(state, name)
    _, requests, _ = step(state)
    assert [r.request_id for r in requests["v1"].rows] == ["a", "b"]
    _, requests, _ = step(state)
    assert [r.request_id for r in requests["v1"].rows][-1] == "c"


def test_drafts_never_reach_past_max_tokens(tokenizer):
    state = new_state(tokenizer)
    request = submit(state, sampling={"max_tokens": 3}, speculative={"num_speculative_tokens": 8})
    step(state)
    plan, requests, _ = step(state, drafts={"r1": [4] * 8})
    assert len(requests["v1"].rows[0].draft_token_ids) == 1  # 2 tokens left: 1 draft + 1 bonus
    assert request.request_id not in state.running or len(request.completion) <= 3


# ------------------------------------------------------------------ commit rules and usage


def test_cut_at_max_tokens_eos_and_stop_token(tokenizer):
    state = new_state(tokenizer)
    params = submit(state, "x", sampling={"max_tokens": 4, "stop_token_ids": [13]}).sampling
    assert cut_tokens([3, 4, 5], 2, params, (EOS,)) == ([3, 4], "length")
    assert cut_tokens([3, EOS, 5], 0, params, (EOS,)) == ([3, EOS], "eos")
    assert cut_tokens([13, 5], 0, params, (EOS,)) == ([13], "stop")
    assert cut_tokens([3, 5], 0, params, (EOS,)) == ([3, 5], None)
    ignoring = params.model_copy(update={"ignore_eos": True})
    assert cut_tokens([3, EOS, 5], 0, ignoring, (EOS,)) == ([3, EOS, 5], None)


def test_commits_are_numbered_and_the_final_one_has_usage(tokenizer):
    state = new_state(tokenizer)
    request = submit(state, sampling={"max_tokens": 6}, speculative={"num_speculative_tokens": 2})
    outbox = step(state, tokens={"r1": [20]})[2]
    outbox.extend(step(state, drafts={"r1": [21, 22]}, tokens={"r1": [21, 22, 23]}, num_accepted={"r1": 2})[2])
    outbox.extend(step(state, drafts={"r1": [24, 30]}, tokens={"r1": [24, 25]}, num_accepted={"r1": 1})[2])
    commits = commits_of(outbox)
    assert [c.seq for c in commits] == [0, 1, 2]
    assert [c.token_ids.tolist() for c in commits] == [[20], [21, 22, 23], [24, 25]]
    assert [(c.num_draft, c.num_accepted) for c in commits] == [(0, 0), (2, 2), (1, 1)]
    assert commits[0].prompt_token_ids.tolist() == [5, 6, 7] and commits[1].prompt_token_ids is None
    final = commits[-1]
    assert final.finish_reason == "length" and commits[0].usage is None
    # the last step planned one draft, not two: 2 tokens were left (1 draft + the bonus)
    assert final.usage.model_dump() == {"prompt_tokens": 3, "completion_tokens": 6, "draft_tokens_proposed": 3,
                                        "draft_tokens_accepted": 3, "acceptance_rate": 1.0, "steps": 3,
                                        "degraded_steps": {}, "speculative_lengths": [0, 1, 1]}
    assert request.request_id not in state.running and state.releases == {"v1": ["r1"], "d1": ["r1"]}


def test_a_stopping_scheduler_hands_every_request_over_with_shutting_down(tokenizer):
    """drain(): running and queued requests end with code `shutting_down`, which the client
    library takes as "send it to another scheduler", not as the request's end."""
    state = new_state(tokenizer, max_running=1)
    running, queued = submit(state, "r1"), submit(state, "r2")
    step(state, tokens={"r1": [20]})
    assert running.request_id in state.running and list(state.waiting) == [queued]
    outbox = state.drain(time.time())
    finals = {c.request_id: c for c in commits_of(outbox)}
    # r2, queued, had no postprocessor: its final chunk goes straight to the client
    assert set(finals) == {"r1"} and [chunk.request_id for _, chunk in outbox.chunks] == ["r2"]
    for error in (finals["r1"].error, outbox.chunks[0][1].error):
        assert error.code == ErrorCode.shutting_down and "sched-1 is stopping" in error.message
    assert not state.running and not state.waiting


def test_eos_ends_the_request_and_slots_are_released_on_the_next_batch(tokenizer):
    state = new_state(tokenizer)
    submit(state, "a")
    submit(state, "b")
    outbox = step(state, tokens={"a": [EOS]})[2]
    assert commits_of(outbox, "a")[0].finish_reason == "eos"
    _, requests, _ = step(state)
    assert requests["v1"].release == ["a"] and [r.request_id for r in requests["v1"].rows] == ["b"]


def test_cancel_ends_at_the_next_boundary_with_a_final_commit(tokenizer):
    state = new_state(tokenizer)
    submit(state)
    step(state)
    assert state.cancel("r1") and not state.cancel("someone-else")
    plan, requests, outbox = step(state)
    [commit] = commits_of(outbox)
    assert commit.finish_reason == "cancelled" and commit.token_ids.tolist() == [] and commit.seq == 1
    assert requests["v1"].rows == [] and requests["v1"].release == ["r1"]  # a release-only batch


def test_stop_notice_ends_without_a_commit(tokenizer):
    state = new_state(tokenizer)
    submit(state)
    step(state)
    assert state.stop_notice("r1")
    _, requests, outbox = step(state)
    assert outbox.commits == [] and requests["v1"].release == ["r1"]


def test_scoring_request_prefills_and_ends_with_an_empty_final_commit(tokenizer):
    state = new_state(tokenizer, max_step_tokens=4)
    submit(state, prompt_ids=[1, 2, 3, 4, 5, 6], sampling={"max_tokens": 0}, logprobs={"prompt_logprobs": 2})
    _, first, outbox = step(state)
    assert not first["v1"].rows[0].emit and commits_of(outbox) == []
    _, second, outbox = step(state)
    row = second["v1"].rows[0]
    assert not row.emit and row.cached_len == 4 and row.postprocessor_id == "p1"
    assert row.logprobs.prompt_logprobs == 2
    [commit] = commits_of(outbox)
    assert commit.finish_reason == "length" and commit.token_ids.tolist() == [] and commit.expect_side_channel
    assert commit.batch_id == second["v1"].batch_id


# ------------------------------------------------------------------ fallbacks


def test_drafter_late_runs_k0_and_flags_draft_timeout(tokenizer):
    state = new_state(tokenizer)
    request = submit(state, speculative={"num_speculative_tokens": 4})
    step(state)
    _, requests, outbox = step(state, drafts={"r1": [1, 2, 3, 4]}, draft_reply=False)
    assert len(requests["v1"].rows[0].draft_token_ids) == 0
    [commit] = commits_of(outbox)
    assert commit.degraded == ["draft_timeout"] and commit.num_draft == 0
    assert request.drafter_len == 0 and request.degraded_steps == {"draft_timeout": 1}


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
    assert state.releases["v1"] == ["r1"]
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


def test_error_reply_ends_the_batch_with_error(tokenizer):
    state = new_state(tokenizer)
    submit(state)
    state.boundary(time.time())
    plan = state.plan_step(time.time())
    state.verify_batches(plan, time.time())
    refused = Error(code=ErrorCode.invalid_field, message="bad", field="rows[0].new_token_ids")
    [commit] = commits_of(state.apply_verify(plan, "v1", refused, time.time()))
    assert commit.finish_reason == "error"


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


def test_a_burst_between_heartbeats_never_overfills_a_verifier(tokenizer):
    state = new_state(tokenizer, roles=(("p1", "postprocessor"),))
    beat(state, "v1", "verifier", capacity=8, free_slots=2)  # 6 slots held by another scheduler
    for name in "abcd":
        submit(state, name)
    state.boundary(time.time())
    assert sorted(state.running) == ["a", "b"] and len(state.waiting) == 2
    beat(state, "v1", "verifier", capacity=8, free_slots=1)  # one more freed elsewhere
    state.boundary(time.time())
    assert sorted(state.running) == ["a", "b", "c"]


# ------------------------------------------------------------------ lanes


def verified(message, verifier_id="v1"):
    """The verifier's answer to a VerifyRequest: each emitting row emits [9], no draft accepted."""
    return VerifyResponse(batch_id=message.batch_id, verifier_id=verifier_id, rows=[
        VerifyResult(request_id=r.request_id, step=r.step, num_draft=len(r.draft_token_ids), num_accepted=0,
                     token_ids=[9] if r.emit else []) for r in message.rows])


def test_lanes_split_the_requests_and_a_request_is_in_one_step_at_a_time(tokenizer):
    state = new_state(tokenizer, lanes=2)
    first, second = submit(state, "r1"), submit(state, "r2")
    state.boundary(time.time())
    assert (first.lane, second.lane) == (0, 1)
    plan_0 = state.plan_step(time.time(), lane=0)
    assert [p.request.request_id for p in plan_0.rows["v1"]] == ["r1"]
    plan_1 = state.plan_step(time.time(), lane=1)
    assert [p.request.request_id for p in plan_1.rows["v1"]] == ["r2"]
    assert state.plan_step(time.time()).empty  # every lane: nothing left that is not in flight
    state.end_step(plan_0)
    assert [p.request.request_id for p in state.plan_step(time.time(), lane=0).rows["v1"]] == ["r1"]


def test_another_lanes_boundary_and_verifier_failure_leave_a_request_in_flight_alone(tokenizer):
    state = new_state(tokenizer, lanes=2)
    first, second = submit(state, "r1"), submit(state, "r2")
    state.boundary(time.time())
    plan_0 = state.plan_step(time.time(), lane=0)
    message_0 = state.verify_batches(plan_0, time.time())["v1"]
    state.cancel("r1")
    assert state.boundary(time.time(), lane=1).commits == [] and "r1" in state.running
    beat(state, "v2", "verifier")
    plan_1 = state.plan_step(time.time(), lane=1)
    state.verify_batches(plan_1, time.time())
    state.apply_verify(plan_1, "v1", None, time.time())  # lane 1's batch to v1 failed after the retry
    assert (first.verifier_id, second.verifier_id) == ("v1", "v2")  # r1's step is lane 0's to finish
    state.end_step(plan_1)
    [commit] = commits_of(state.apply_verify(plan_0, "v1", verified(message_0), time.time()))
    assert commit.token_ids.tolist() == [9] and commit.finish_reason is None
    state.end_step(plan_0)
    [final] = commits_of(state.boundary(time.time(), lane=1))
    assert final.finish_reason == "cancelled" and "r1" not in state.running


def test_lanes_must_be_at_least_one():
    with pytest.raises(SpecbusError) as error:
        load_config(SchedulerConfig, env={}, lanes=0)
    assert error.value.field == "lanes"


# ------------------------------------------------------------------ admission and failures end one request


def beat_verifier(state, instance_id="v1", max_seq_len=None):
    model_ids = {"tokenizer": TOKENIZER_HASH, **({"max_seq_len": str(max_seq_len)} if max_seq_len else {})}
    state.observe(Heartbeat(instance_id=instance_id, role="verifier", capacity=8, load=0, model_ids=model_ids,
                            sent_at=time.time(), interval_s=0.5))


def test_a_reply_subject_too_long_for_a_commit_is_refused_at_admission(tokenizer):
    """Item 1: the first Commit refused the inbox (max 256), and ending the request raised again."""
    state = new_state(tokenizer)
    generate = GenerateRequest(request_id="long", prompt_token_ids=[5, 6], sampling={"temperature": 0.0})
    with pytest.raises(SpecbusError) as info:
        state.admit(generate, "_INBOX.client." + "x" * 300, [5, 6], time.time())
    assert (info.value.code, info.value.field) == (ErrorCode.invalid_field, "reply_subject")
    assert "at most 256" in info.value.message and not state.waiting


def test_a_final_commit_that_cannot_be_built_still_ends_the_request_with_an_error_chunk(tokenizer):
    """Item 1: end() built the Commit outside any try, so one bad request killed its lane."""
    state = new_state(tokenizer)
    request = submit(state)
    step(state)
    request.client_inbox = "_INBOX." + "x" * 300  # a Commit refuses it
    outbox = state.end(request, "error", time.time())
    [(inbox, chunk)] = outbox.chunks
    assert inbox == request.client_inbox and chunk.finish_reason == "error"
    assert chunk.error.code == ErrorCode.internal and chunk.error.message
    assert "r1" not in state.running


def test_a_prompt_longer_than_the_verifiers_max_seq_len_is_refused_before_any_work(tokenizer):
    """Item 3: a too-long prompt was refused by the verifier only after it was prefilled."""
    state = new_state(tokenizer, roles=(("p1", "postprocessor"),))
    beat_verifier(state, "v1", max_seq_len=16)
    beat_verifier(state, "v2", max_seq_len=8)  # the smallest live limit holds: a request may migrate there
    with pytest.raises(SpecbusError, match="max_seq_len 8") as info:
        submit(state, prompt_ids=range(1, 9))
    assert (info.value.code, info.value.field) == (ErrorCode.invalid_field, "prompt_token_ids")
    assert submit(state, "fits", prompt_ids=range(1, 8)).prompt_len == 7
    assert submit(state, "scoring", prompt_ids=range(1, 9), sampling={"max_tokens": 0}).prompt_len == 8


def test_a_prompt_whose_first_commit_exceeds_max_payload_is_refused_too_large(tokenizer):
    """Item 3: the Commit carrying prompt_token_ids went over max_payload and was only logged."""
    state = new_state(tokenizer)
    state.max_payload = 64 * 1024
    with pytest.raises(SpecbusError, match="max_payload of 65536") as info:
        submit(state, prompt_ids=[5] * 20_000)
    assert (info.value.code, info.value.field) == (ErrorCode.too_large, "prompt_token_ids")
    assert submit(state, "small", prompt_ids=[5] * 1000).prompt_len == 1000


def test_max_tokens_is_capped_by_max_seq_len_and_the_request_ends_with_length(tokenizer):
    """Item 4: reaching max_seq_len ended in an unexplained "error"."""
    state = new_state(tokenizer, roles=(("p1", "postprocessor"), ("d1", "drafter")))
    beat_verifier(state, "v1", max_seq_len=8)
    request = submit(state, prompt_ids=(5, 6, 7), sampling={"max_tokens": 100},
                     speculative={"num_speculative_tokens": 4})
    outbox = step(state, tokens={"r1": [20]})[2]
    assert request.sampling.max_tokens == 5  # 8 - 3 prompt tokens
    while "r1" in state.running:
        _, requests, out = step(state, drafts={"r1": [21] * 4}, tokens={"r1": [21]})
        outbox.extend(out)
        for row in requests["v1"].rows:  # never more than the verifier holds
            assert row.cached_len + len(row.new_token_ids) + len(row.draft_token_ids) <= 8
    final = commits_of(outbox)[-1]
    assert final.finish_reason == "length" and final.error is None and final.usage.completion_tokens == 5


def test_an_error_after_the_first_commit_always_carries_its_reason(tokenizer):
    """Item 4: a verifier's row error after the first chunk reached the client without one."""
    state = new_state(tokenizer)
    submit(state)
    step(state)
    state.boundary(time.time())
    plan = state.plan_step(time.time())
    message = state.verify_batches(plan, time.time())["v1"]
    row_error = Error(code=ErrorCode.invalid_field, message="exceeds max_seq_len 8", field="rows[0].new_token_ids")
    reply = VerifyResponse(batch_id=message.batch_id, verifier_id="v1",
                           rows=[VerifyResult(request_id="r1", step=message.rows[0].step, error=row_error)])
    [commit] = commits_of(state.apply_verify(plan, "v1", reply, time.time()))
    assert commit.finish_reason == "error" and commit.error.message == "exceeds max_seq_len 8"
    assert commit.error.field == "new_token_ids"


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


def test_a_batch_over_max_payload_defers_rows_and_a_row_too_large_alone_ends_alone(tokenizer):
    """Item 5: an oversized VerifyRequest was retried, then treated as a dead verifier."""
    state = new_state(tokenizer, max_step_tokens=100_000)
    for name in ("a", "b", "c"):
        submit(state, name, prompt_ids=[5] * 3000)
    state.max_payload = 4096 + 3 * 1024 + 2 * 12_000 + 100  # room for two rows of ~13 KB, not three
    state.boundary(time.time())
    plan = state.plan_step(time.time())
    message = state.verify_batches(plan, time.time())["v1"]
    assert [r.request_id for r in message.rows] == ["a", "b"] and [r.row for r in message.rows] == [0, 1]
    assert len(encode(message)) <= state.max_payload
    assert "c" not in state.in_flight and state.counters["rows_deferred_payload"] == 1 and "c" in state.running
    state.end_step(plan)
    state.max_payload = 8192  # now not even one row fits: that request ends, with why
    state.boundary(time.time())
    plan = state.plan_step(time.time())
    state.verify_batches(plan, time.time())
    ended = {chunk_or_commit.request_id: chunk_or_commit for _, chunk_or_commit in plan.outbox.commits}
    assert set(ended) == {"a", "b", "c"} and all(c.error.code == ErrorCode.too_large for c in ended.values())
    assert state.placement.avoid_until == {}  # the verifier is not blamed


def test_a_request_id_in_use_or_just_finished_is_refused_as_duplicate(tokenizer):
    """Item 7: a reused id was admitted, then silently dropped by the postprocessor."""
    state = new_state(tokenizer)
    submit(state, "same")
    with pytest.raises(SpecbusError, match="already running") as info:
        submit(state, "same")
    assert (info.value.code, info.value.field) == (ErrorCode.duplicate_request_id, "request_id")
    step(state, tokens={"same": [EOS]})
    assert "same" not in state.running
    with pytest.raises(SpecbusError, match="finished less than 60 s ago") as info:
        submit(state, "same")
    assert info.value.code == ErrorCode.duplicate_request_id
    state.clock.now += 61
    assert submit(state, "same").request_id == "same"


def test_a_resumed_request_prefills_one_token_short_then_decodes_with_drafts(tokenizer):
    """Scheduler failover (GenerateRequest.resume_token_ids): the history is prompt + resumed
    tokens, the prefill stops one token short so the next token comes from a decode row with
    drafts (as in the interrupted run), and the first commit carries the resumed tokens."""
    state = new_state(tokenizer)
    request = submit(state, resume_token_ids=[11, 12], sampling={"max_tokens": 6},
                     speculative={"num_speculative_tokens": 2})
    assert request.history == [5, 6, 7, 11, 12] and request.completion == [11, 12]
    plan, verify_requests, outbox = step(state)  # admission and the prefill
    [row] = verify_requests["v1"].rows
    assert row.new_token_ids.tolist() == [5, 6, 7, 11] and not row.emit and not commits_of(outbox)
    plan, verify_requests, outbox = step(state, drafts={"r1": [13, 14]}, tokens={"r1": [13, 14, 15]},
                                         num_accepted={"r1": 2})
    [row] = verify_requests["v1"].rows
    assert row.new_token_ids.tolist() == [12] and row.draft_token_ids.tolist() == [13, 14] and row.emit
    [commit] = commits_of(outbox)
    assert commit.seq == 0 and commit.token_ids.tolist() == [13, 14, 15]
    assert commit.resume_token_ids.tolist() == [11, 12] and commit.prompt_token_ids.tolist() == [5, 6, 7]


@pytest.mark.parametrize("resume, message", [([11, 12, 13], "leave nothing"), ([11, 999], "outside the vocabulary")])
def test_a_resume_that_cannot_continue_is_refused_naming_the_field(tokenizer, resume, message):
    state = new_state(tokenizer)
    with pytest.raises(SpecbusError, match=message) as refused:
        submit(state, resume_token_ids=resume, sampling={"max_tokens": 3})
    assert refused.value.field == "resume_token_ids"


def test_a_text_prompt_far_over_max_seq_len_is_refused_before_tokenizing(tokenizer):
    """Item 3: a 1 MiB text prompt kept the scheduler's event loop in the tokenizer for ~10 s."""
    state = new_state(tokenizer, roles=(("p1", "postprocessor"),))
    beat_verifier(state, "v1", max_seq_len=8)
    with pytest.raises(SpecbusError, match="characters; max_seq_len 8") as info:
        state.check_prompt_text(GenerateRequest(request_id="big", prompt="é" * (1 << 20)))
    assert (info.value.code, info.value.field) == (ErrorCode.invalid_field, "prompt")
    state.check_prompt_text(GenerateRequest(request_id="fine", prompt="the quick brown fox"))
    chat = [{"role": "system", "content": "é" * (1 << 19)}, {"role": "user", "content": "é" * (1 << 19)}]
    with pytest.raises(SpecbusError, match="characters; max_seq_len 8") as info:
        state.check_prompt_text(GenerateRequest(request_id="big-chat", messages=chat))
    assert info.value.field == "messages"


def test_a_draft_batch_over_max_payload_leaves_the_rest_without_drafts(tokenizer):
    """Item 5: a sampled draft's answer is up to MAX_DRAFT_SUPPORT ids per draft; a DraftRequest
    whose answer could pass max_payload was sent anyway, and its rows all lost their drafts."""
    state = new_state(tokenizer)
    sampled = {"sampling": {"temperature": 1.0}, "speculative": {"num_speculative_tokens": 4, "draft_mode": "sample"}}
    for name in ("a", "b", "c"):
        submit(state, name, **sampled)
    step(state)  # prefill
    one_answer = 1024 + 4 * (4 + 8 * MAX_DRAFT_SUPPORT)
    state.max_payload = 4096 + 2 * one_answer + 100  # room for two rows' answers, not three
    state.boundary(time.time())
    plan = state.plan_step(time.time())
    message = state.draft_batches(plan, time.time())["d1"]
    assert [r.request_id for r in message.rows] == ["a", "b"] and [r.row for r in message.rows] == [0, 1]
    undrafted = {p.request.request_id: p for p in plan.rows["v1"]}["c"]
    assert undrafted.num_draft == 0 and undrafted.degraded == ["draft_timeout"]
    assert state.counters["rows_undrafted_payload"] == 1 and state.placement.avoid_until == {}
