"""The step planner (services/scheduler/step_planner.py), through the scheduler's core without
NATS: decode rows first, prefill chunks in the token budget, max_batch_rows, drafts within
max_tokens, a resumed request's prefill one token short, the prefill room shared fairly
between client users."""

import time

from schemas.generation import GenerateRequest, LogprobOptions
from services.scheduler.budget.payload import SIDE_POSITION_BYTES, side_position_bytes
from services.scheduler.budget.step_budget import MIN_STEP_TOKENS
from tests.services.scheduler.scheduler_harness import (
    beat,
    commits_of,
    new_state,
    step,
    submit,
)


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


def measured(state, seconds_per_token, verifier_id="v1"):
    """The verifier's pace as if timed (step_budget.py): round trips of seconds_per_token a token."""
    for tokens in (10, 100, 40, 400) * 3:
        state.planner.budget.timed(verifier_id, tokens, seconds_per_token * tokens)
    return state.planner.budget.step_tokens(verifier_id)


def test_every_decoding_row_comes_first_and_prefill_chunks_get_the_rest_of_the_step_budget(tokenizer):
    """Decode priority under the measured step budget: each step takes every decoding row, then
    a chunk of the budget less their tokens for a prompt that arrived later, so a long prompt
    never holds the decoding rows back and the step stays near target_step_s."""
    state = new_state(tokenizer, target_step_s=0.5)
    budget = measured(state, 1 / 256)  # 0.5 s at 1/256 s a token: 128 tokens
    assert budget == 128
    for i in range(4):
        submit(state, f"d{i}", sampling={"max_tokens": 100}, speculative={"num_speculative_tokens": 0})
    step(state)  # their prompts: 4 x 3 tokens, one step
    submit(state, "long", prompt_ids=list(range(1, 400)))
    prefilled = 0
    while prefilled < 399:
        _, requests, _ = step(state)
        rows = requests["v1"].rows
        assert [r.request_id for r in rows] == ["d0", "d1", "d2", "d3", "long"]
        assert all(r.emit and len(r.new_token_ids) == 1 for r in rows[:4])
        assert len(rows[-1].new_token_ids) == min(budget - 4, 399 - prefilled)
        prefilled += len(rows[-1].new_token_ids)


def prefill_chunks(state, request_id, prompt_len, cached):
    """(chunk, cached_tokens) of each step's row of request_id until its prompt is prefilled."""
    chunks = []
    while sum(c for c, _ in chunks) < prompt_len:
        plan, _, _ = step(state, cached={request_id: cached})
        [row] = [r for rows in plan.rows.values() for r in rows if r.request.request_id == request_id]
        before = row.request.cached_tokens - sum(h for _, h in chunks)
        chunks.append((row.end - row.cached_len, before))
    return chunks


def test_a_chunk_the_prefix_cache_gave_whole_lets_the_next_one_grow_by_as_much(tokenizer):
    """A chat's next turn: a history the verifier's cache holds passes in a few steps, and what a
    step computes stays within its share plus the tokens just found cached."""
    for held, expected in [(300, [(124, 124), (248, 176), (27, 0)]),  # the cache ends inside chunk 2
                           (124, [(124, 124), (248, 0), (27, 0)]),   # at its start: 248 computed, 124 + 124
                           (0, [(124, 0), (124, 0), (124, 0), (27, 0)])]:  # no hit: the budget's chunks
        state = new_state(tokenizer, target_step_s=0.5)
        assert measured(state, 1 / 256) == 128
        for i in range(4):
            submit(state, f"d{i}", sampling={"max_tokens": 100}, speculative={"num_speculative_tokens": 0})
        step(state)
        submit(state, "turn", prompt_ids=list(range(1, 400)))
        assert prefill_chunks(state, "turn", 399, held) == expected, held


def test_prefill_takes_as_many_tokens_as_the_decode_rows_when_they_fill_the_budget(tokenizer):
    """Decode rows over the budget leave prompts an equal share: queued requests keep starting."""
    state = new_state(tokenizer, max_running=64)
    beat(state, "v1", "verifier", capacity=64)
    beat(state, "p1", "postprocessor", capacity=64)
    assert measured(state, 1.0) == MIN_STEP_TOKENS  # a step of any size is over the target
    for i in range(40):
        submit(state, f"d{i}", sampling={"max_tokens": 100}, speculative={"num_speculative_tokens": 0})
    while any(r.pending_len > 1 for r in state.running.values()) or state.waiting:
        step(state)  # 40 prompts of 3 tokens, MIN_STEP_TOKENS a step
    submit(state, "long", prompt_ids=list(range(1, 400)))
    _, requests, _ = step(state)
    rows = requests["v1"].rows
    assert len(rows) == 41 and all(r.emit for r in rows[:40])  # 40 decode tokens, over the budget
    assert rows[-1].request_id == "long" and len(rows[-1].new_token_ids) == 40 > MIN_STEP_TOKENS


def test_with_rows_scarce_decoding_requests_come_first_and_one_row_is_kept_for_a_prompt(tokenizer):
    state = new_state(tokenizer, max_batch_rows=3)
    for name in ("a", "b", "c", "d"):
        submit(state, name, sampling={"max_tokens": 100})
    step(state)
    step(state)  # a, b, c prefilled in the first step, d in the second
    submit(state, "late", prompt_ids=[5, 6, 7, 8])
    _, requests, _ = step(state)
    rows = requests["v1"].rows
    assert [len(r.new_token_ids) for r in rows] == [1, 1, 4] and rows[-1].request_id == "late"


def admit_as(state, user, request_id, prompt_ids, max_tokens=8, **fields):
    generate = GenerateRequest(request_id=request_id, prompt_token_ids=list(prompt_ids),
                               sampling={"temperature": 0.0, "max_tokens": max_tokens}, **fields)
    return state.admit(generate, f"_INBOX.{user}.{request_id}", list(prompt_ids), time.time())


def test_one_users_long_prompts_share_each_step_with_another_users_prompt_and_decode_rows(tokenizer):
    """bob's four long prompts arrived first; alice's short one gets its whole prompt in the
    next step beside them (max-min fair split of the room), and while her prompt ends and her
    row decodes bob's prefill takes at most MIN_STEP_TOKENS a step (prefill parity): her steps
    stay short."""
    state = new_state(tokenizer, target_step_s=0.5)
    budget = measured(state, 1 / 256)  # 128 tokens a step
    for i in range(4):
        admit_as(state, "bob", f"bob{i}", [10 + i] * 1000, max_tokens=1)
    step(state)
    admit_as(state, "alice", "alice", [5, 6, 7], max_tokens=8)
    _, requests, _ = step(state)
    rows = {r.request_id: r for r in requests["v1"].rows}
    assert len(rows["alice"].new_token_ids) == 3 and rows["alice"].emit
    assert sum(len(r.new_token_ids) for name, r in rows.items() if name != "alice") <= MIN_STEP_TOKENS
    for _ in range(5):  # alice decodes
        _, requests, _ = step(state)
        rows = {r.request_id: r for r in requests["v1"].rows}
        assert rows["alice"].emit and len(rows["alice"].new_token_ids) == 1
        assert sum(len(r.new_token_ids) for name, r in rows.items() if name != "alice") <= MIN_STEP_TOKENS
    for _ in range(4):
        step(state)  # alice finishes (max_tokens 8): bob's prefill takes the whole room again
    _, requests, _ = step(state)
    assert "alice" not in state.running
    assert sum(len(r.new_token_ids) for r in requests["v1"].rows) == budget


def test_a_user_with_nothing_running_starts_while_anothers_requests_fill_the_step_rows(tokenizer):
    """The step rows (step_budget.py) keep bob's new requests queued once his running ones fill
    the step time; alice, with none running, starts at the next boundary all the same."""
    state = new_state(tokenizer)
    for i in range(3):
        admit_as(state, "bob", f"bob{i}", [5, 6, 7], max_tokens=50)
    step(state)
    step(state, step_s=3 * 0.5 * state.config.target_step_s * 10)  # 10 x what the rows may fill
    late = admit_as(state, "bob", "bob-late", [5, 6, 7])
    admit_as(state, "alice", "alice", [5, 6, 7])
    state.boundary(time.time())
    assert "alice" in state.running and late in state.waiting


def test_one_users_prompt_logprobs_take_their_bytes_from_his_own_share_of_a_shared_step(tokenizer):
    """bob's long prompt asks 20 prompt logprobs a position: alone he takes the whole budget
    (work conserving); beside alice's decoding row his chunk carries at most MIN_STEP_TOKENS
    plain positions' side-channel bytes (payload.py's estimate), fewer tokens than a chunk
    without prompt logprobs (prefill parity, counted in bytes)."""
    state = new_state(tokenizer, target_step_s=0.5)
    budget = measured(state, 1 / 256)  # 128 tokens a step
    admit_as(state, "bob", "bob", [10] * 2000, max_tokens=1, logprobs={"prompt_logprobs": 20})
    _, requests, _ = step(state)
    assert [len(r.new_token_ids) for r in requests["v1"].rows] == [budget]
    admit_as(state, "alice", "alice", [5, 6, 7], max_tokens=8)
    step(state)  # alice's prompt
    per_position = side_position_bytes(LogprobOptions(prompt_logprobs=20), prompt=True)
    most = MIN_STEP_TOKENS * SIDE_POSITION_BYTES // per_position
    for _ in range(4):  # alice decodes
        _, requests, _ = step(state)
        rows = {r.request_id: r for r in requests["v1"].rows}
        assert rows["alice"].emit and 1 <= len(rows["bob"].new_token_ids) <= most < MIN_STEP_TOKENS
