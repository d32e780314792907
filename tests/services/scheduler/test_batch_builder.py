"""Batch building (services/scheduler/batch_builder.py, services/scheduler/budget/payload.py), through
the scheduler's core without NATS: late drafts, and batches kept under max_payload."""

import time

import pytest

from schemas.bus.codec import encode
from schemas.errors import ErrorCode
from schemas.bus.protocol import MAX_DRAFT_SUPPORT
from services.scheduler.budget.step_budget import VERIFY_SLACK
from tests.services.scheduler.scheduler_harness import (
    beat_verifier,
    commits_of,
    new_state,
    step,
    submit,
)


def test_drafter_late_runs_k0_and_flags_draft_timeout(tokenizer):
    state = new_state(tokenizer)
    request = submit(state, speculative={"num_speculative_tokens": 4})
    step(state)
    _, requests, outbox = step(state, drafts={"r1": [1, 2, 3, 4]}, draft_reply=False)
    assert len(requests["v1"].rows[0].draft_token_ids) == 0
    [commit] = commits_of(outbox)
    assert commit.degraded == ["draft_timeout"] and commit.num_draft == 0
    assert request.drafter_len == 0 and request.degraded_steps == {"draft_timeout": 1}


def test_a_batch_over_max_payload_defers_rows_and_a_row_too_large_alone_ends_alone(tokenizer):
    """A VerifyRequest that would exceed max_payload leaves its last rows for the next step; a
    row too large alone ends its request `too_large`; the verifier is not blamed."""
    state = new_state(tokenizer, max_step_tokens=100_000)
    state.planner.budget.timed("v1", 1000, 0.001)  # a fast verifier: the step budget is max_step_tokens
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


def test_a_draft_batch_over_max_payload_leaves_the_rest_without_drafts(tokenizer):
    """A sampled draft's answer is up to MAX_DRAFT_SUPPORT ids per draft: a DraftRequest keeps
    its rows' answers within max_payload, and the rows past it run this step without drafts."""
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


def test_a_verify_deadline_is_the_step_budgets_wait_for_the_batch_for_every_try(tokenizer):
    """plan.attempt_s is StepBudget.attempt_s of the batch's tokens (step_budget.py, tested
    there), and VerifyRequest.deadline covers every try of it."""
    state = new_state(tokenizer, max_step_tokens=4096, verify_timeout_s=1.0, verify_retries=2, target_step_s=0.5)
    for tokens in (10, 100, 1000) * 3:
        state.planner.budget.timed("v1", tokens, 0.004 * tokens)  # 4 ms a token: the budget is 125
    submit(state, "big", prompt_ids=[5] * 2000)
    now = time.time()
    state.boundary(now)
    plan = state.plan_step(now)
    message = state.verify_batches(plan, now)["v1"]
    assert len(message.rows[0].new_token_ids) == 125
    assert plan.attempt_s["v1"] == state.planner.budget.attempt_s("v1", 125) == pytest.approx(
        VERIFY_SLACK * state.config.lanes * 0.5)
    assert message.deadline - now == pytest.approx(3 * plan.attempt_s["v1"])


# ------------------------------------------------------------------ trees of drafts

TREE = [5, 6, 3, 4]  # root -> 5 -> 6, root -> 3 -> 4
TREE_PARENTS = [-1, 0, -1, 2]


def tree_state(tokenizer, k=2, max_tree_nodes=8, max_seq_len=None, **sampling):
    """A scheduler that asks trees of max_tree_nodes in every step it may (adaptive_k off: no
    timings decide), one request of k prefilled."""
    state = new_state(tokenizer, max_tree_nodes=str(max_tree_nodes), adaptive_k="false")
    if max_seq_len is not None:
        beat_verifier(state, "v1", max_seq_len=max_seq_len)
    request = submit(state, sampling={"max_tokens": 20, **sampling}, speculative={"num_speculative_tokens": k})
    step(state)  # prefill
    return state, request


def test_a_tree_within_the_plan_reaches_the_verify_row_and_counts_its_nodes(tokenizer):
    state, request = tree_state(tokenizer)
    plan, requests, outbox = step(state, drafts={"r1": TREE}, parents={"r1": TREE_PARENTS}, num_accepted={"r1": 2},
                                  tokens={"r1": [3, 4, 9]})
    [asked] = plan.draft_rows["d1"]
    assert (asked.max_nodes, state.counters["dropped_excess_drafts"]) == (8, 0)
    [row] = requests["v1"].rows
    assert row.draft_token_ids.tolist() == TREE and row.parents.tolist() == TREE_PARENTS and row.max_forced == 0
    [commit] = commits_of(outbox)
    assert commit.num_draft == 4 and commit.token_ids.tolist() == [3, 4, 9]
    usage = request.usage()
    assert usage.draft_tokens_proposed == 4 and usage.speculative_lengths == [0, 0, 0, 0, 1]  # 4 nodes, depth 2


@pytest.mark.parametrize("drafts, parents, kept", [
    ([5, 6, 3, 4], [-1, 0, -1, 2], 4),  # within the plan
    ([5, 6], None, 2),  # a chain is always a valid answer
    ([5, 6, 7], None, 0),  # a chain deeper than num_draft
    ([5, 6, 7, 3], [-1, 0, 1, -1], 0),  # a path deeper than num_draft
    ([1, 2, 3, 4, 5], [-1, 0, -1, 2, -1], 0),  # more nodes than max_nodes
])
def test_a_tree_answer_over_the_plan_is_dropped_and_counted(tokenizer, drafts, parents, kept):
    state, _ = tree_state(tokenizer, max_tree_nodes=4)
    _, requests, _ = step(state, drafts={"r1": drafts}, parents={"r1": parents})  # sent whole
    assert len(requests["v1"].rows[0].draft_token_ids) == kept
    assert state.counters["dropped_excess_drafts"] == (kept == 0)


@pytest.mark.parametrize("sampling, speculative", [
    ({"temperature": 1.0, "seed": 3, "coupling": "rejection"}, {}),  # rejection-sampled: its draws depend on the drafts' shape
    ({"structured_outputs": {"regex": "[a-z]+"}}, {}),  # the verifier follows a grammar along one path
    ({}, {"num_speculative_tokens": 0}),  # no drafts at all
])
def test_rows_that_never_ask_a_tree_and_a_tree_they_get_is_dropped(tokenizer, sampling, speculative):
    state = new_state(tokenizer, max_tree_nodes="8", adaptive_k="false")
    submit(state, sampling={"max_tokens": 20, **sampling},
           speculative={"num_speculative_tokens": 2, **speculative})
    step(state)
    plan, requests, _ = step(state, drafts={"r1": TREE}, parents={"r1": TREE_PARENTS})
    assert all(p.max_nodes == 0 for rows in plan.rows.values() for p in rows)
    assert requests["v1"].rows[0].parents is None
    assert state.counters["dropped_excess_drafts"] == bool(plan.draft_rows)


def test_a_gumbel_coupled_row_asks_a_tree_and_prefill_rows_never_do(tokenizer):
    state = new_state(tokenizer, max_tree_nodes="8", adaptive_k="false")
    submit(state, sampling={"max_tokens": 20, "temperature": 1.0, "seed": 3, "coupling": "gumbel"},
           speculative={"num_speculative_tokens": 2})
    plan, _, _ = step(state)
    assert [p.max_nodes for p in plan.rows["v1"]] == [0] and not plan.draft_rows  # the prefill chunk
    plan, requests, _ = step(state, drafts={"r1": TREE}, parents={"r1": TREE_PARENTS})
    assert [p.max_nodes for p in plan.draft_rows["d1"]] == [8]
    assert requests["v1"].rows[0].parents.tolist() == TREE_PARENTS


def test_a_tree_keeps_within_the_verifiers_max_seq_len_and_an_empty_one_is_a_chain(tokenizer):
    state, _ = tree_state(tokenizer, max_seq_len=9)  # 3 prompt tokens + 1 emitted: room for 5 nodes
    plan, requests, _ = step(state, drafts={"r1": []}, parents={"r1": []})
    assert [(p.max_nodes, p.num_draft) for p in plan.rows["v1"]] == [(5, 0)]
    assert requests["v1"].rows[0].parents is None and state.counters["dropped_excess_drafts"] == 0
