"""Commits and ends (services/scheduler/commits.py), through the scheduler's core without NATS:
the cut at max_tokens / EOS / stop ids, seq numbering and usage, cancels, stop notices,
scoring, the hand-over on shutdown, and errors that end one request with their reason."""

import time

from schemas.errors import ErrorCode
from schemas.generation import StructuredOutputs
from schemas.steps import VerifyResponse, VerifyResult
from schemas.bus.wire import Error
from services.scheduler.commits import cut_tokens
from tests.services.scheduler.scheduler_harness import (
    EOS,
    beat_verifier,
    commits_of,
    new_state,
    step,
    submit,
)


def test_cut_at_max_tokens_eos_and_stop_token(tokenizer):
    state = new_state(tokenizer)
    params = submit(state, "x", sampling={"max_tokens": 4, "stop_token_ids": [13]}).sampling
    assert cut_tokens([3, 4, 5], 2, params, (EOS,)) == ([3, 4], "length")
    assert cut_tokens([3, EOS, 5], 0, params, (EOS,)) == ([3, EOS], "eos")
    assert cut_tokens([13, 5], 0, params, (EOS,)) == ([13], "stop")
    assert cut_tokens([3, 5], 0, params, (EOS,)) == ([3, 5], None)
    ignoring = params.model_copy(update={"ignore_eos": True})
    assert cut_tokens([3, EOS, 5], 0, ignoring, (EOS,)) == ([3, EOS, 5], None)
    # a grammar's EOS ends it whatever ignore_eos says: the grammar allows nothing after it (the
    # next step's verify failed the request, "the output so far does not follow the grammar")
    grammar = ignoring.model_copy(update={"structured_outputs": StructuredOutputs(regex="(yes|no)!?")})
    assert cut_tokens([3, EOS, 5], 0, grammar, (EOS,)) == ([3, EOS], "eos")


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
    assert final.usage.model_dump() == {"prompt_tokens": 3, "cached_tokens": 0, "completion_tokens": 6, "draft_tokens_proposed": 3,
                                        "draft_tokens_accepted": 3, "acceptance_rate": 1.0, "steps": 3,
                                        "degraded_steps": {}, "speculative_lengths": [0, 1, 1]}
    assert request.request_id not in state.running and state.releases.pending == {"v1": ["r1"], "d1": ["r1"]}


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


def test_a_final_commit_that_cannot_be_built_still_ends_the_request_with_an_error_chunk(tokenizer):
    """A final commit that cannot be built still ends the request: its client gets a final
    error chunk, and nothing raises into the lane."""
    state = new_state(tokenizer)
    request = submit(state)
    step(state)
    request.client_inbox = "_INBOX." + "x" * 300  # a Commit refuses it
    outbox = state.end(request, "error", time.time())
    [(inbox, chunk)] = outbox.chunks
    assert inbox == request.client_inbox and chunk.finish_reason == "error"
    assert chunk.error.code == ErrorCode.internal and chunk.error.message
    assert "r1" not in state.running


def test_max_tokens_is_capped_by_max_seq_len_and_the_request_ends_with_length(tokenizer):
    """max_tokens is capped at max_seq_len less the prompt: the request ends "length", and no
    row reaches past the positions the verifier holds."""
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
    """A verifier's row error after the first commit ends the request with that error, its
    field in the client's terms."""
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


def test_error_reply_ends_the_batch_with_error(tokenizer):
    state = new_state(tokenizer)
    submit(state)
    state.boundary(time.time())
    plan = state.plan_step(time.time())
    state.verify_batches(plan, time.time())
    refused = Error(code=ErrorCode.invalid_field, message="bad", field="rows[0].new_token_ids")
    [commit] = commits_of(state.apply_verify(plan, "v1", refused, time.time()))
    assert commit.finish_reason == "error"
