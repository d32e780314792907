"""A scheduler's hints of what its verifiers' prefix caches hold (services/scheduler/drafts/prefix_hints.py):
a chat's next turn takes the history the cache holds in its first chunk, and nothing is hinted
where the verifier keeps no cache, for another user's cache or below a block."""

import time

from schemas.generation import GenerateRequest
from services.scheduler.drafts.prefix_hints import HINT_BLOCK, PrefixHints
from services.scheduler.budget.step_budget import MIN_STEP_TOKENS
from tests.services.scheduler.scheduler_harness import beat, new_state, step, submit
from tests.services.scheduler.test_step_planner import measured, prefill_chunks


def test_a_history_that_extends_a_recorded_one_replaces_it_and_hints_its_length():
    hints = PrefixHints(max_histories=2)
    turn1 = list(range(100, 140))
    hints.record("v1", "user:a", turn1[:HINT_BLOCK - 1])  # less than a block: nothing the verifier would find
    assert hints.histories == {}
    hints.record("v1", "user:a", turn1)
    hints.record("v1", "user:a", turn1 + [7, 8])  # the next turn's slot: the first one is redundant
    assert [len(ids) for _, _, ids in hints.histories.values()] == [42]
    assert hints.expected("v1", "user:a", turn1 + [7, 9, 9]) == 41
    assert hints.expected("v1", "user:b", turn1) == 0  # another user's cache
    assert hints.expected("v2", "user:a", turn1) == 0  # another verifier
    assert hints.expected("v1", "user:a", turn1[:3] + [1] * 40) == 0  # a shorter match than a block
    hints.record("v2", "user:a", turn1)
    hints.expected("v1", "user:a", turn1)  # v1's becomes the most recently used
    hints.record("v3", "user:a", turn1)  # past max_histories the least recently used goes: v2's
    assert sorted(v for v, _, _ in hints.histories.values()) == ["v1", "v3"]


def finished_turn(state, request_id, prompt_ids):
    """Run a request (beside the decoding rows) until it ends; its history."""
    request = submit(state, request_id, prompt_ids=prompt_ids, sampling={"max_tokens": 3})
    while request_id in state.running or request in state.waiting:
        step(state)
    return request.history


def test_a_chats_next_turn_takes_the_history_its_verifier_holds_in_its_first_chunk(tokenizer):
    """Turn 2's prompt is turn 1's history and 300 new tokens: with the verifier's cache holding
    turn 1 (as it does after the release), its first chunk is that history and the step's share
    (128 less the four decode rows), where otherwise the chunks grow from one share (another
    user's, beside the first user's decode rows, from MIN_STEP_TOKENS: fair_share.py's prefill
    parity); a hint the cache no longer holds costs one step that computes the hint as well as
    its share."""
    for caching, user, held, first in [("on", "", 202, (202 + 124, 202)),
                                       # another user's cache holds nothing of it, and beside the
                                       # first user's decode rows its prefill is capped (prefill parity)
                                       ("on", "other", 0, (MIN_STEP_TOKENS, 0)),
                                       (None, "", 0, (124, 0)),  # a verifier without a prefix cache
                                       ("on", "", 0, (202 + 124, 0))]:  # turn 1 evicted: one larger step
        state = new_state(tokenizer, target_step_s=0.5)
        if caching:
            beat(state, "v1", "verifier", prefix_caching=caching)
        assert measured(state, 1 / 256) == 128
        for i in range(4):
            submit(state, f"d{i}", sampling={"max_tokens": 200}, speculative={"num_speculative_tokens": 0})
        step(state)
        history = finished_turn(state, "turn1", list(range(1, 201)))
        assert len(history) == 203  # 200 prompt tokens, 3 generated; the verifier holds 202
        prompt = history + list(range(300, 600))
        generate = GenerateRequest(request_id="turn2", prompt_token_ids=prompt, sampling={"temperature": 0.0})
        state.admit(generate, f"_INBOX.{user}.turn2" if user else "_INBOX.turn2", prompt, time.time())
        chunks = prefill_chunks(state, "turn2", len(prompt), held)
        assert chunks[0] == first, (caching, user, chunks)
        assert sum(c for c, _ in chunks) == len(prompt) and all(c - hit <= 124 for c, hit in chunks[1:])
