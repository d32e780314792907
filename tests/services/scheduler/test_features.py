"""Target features on the scheduler's side (services/scheduler/features.py) without NATS: blocks
joined, cut and taken as bytes; through SchedulerState, what an eagle request's verify rows ask
and its draft rows carry, the restart from position 0 on need_resync, a lost draft answer, the
payload limit, and which eagle drafter fits a request."""

import time

import pytest

from schemas.bus.control import Heartbeat
from schemas.steps import DraftResponse, DraftResult, FeatureBlock, VerifyResponse, VerifyResult
from services.scheduler import features
from tests.services.scheduler.scheduler_harness import TOKENIZER_HASH, new_state, submit

E = 4  # features per position in these tests: 8 bytes


def block(start, stop) -> FeatureBlock:
    """Positions [start, stop), each position's 2E bytes all equal to it (mod 256)."""
    return FeatureBlock(start=start, shape=[stop - start, E], data=b"".join(bytes([t % 256]) * 2 * E
                                                                            for t in range(start, stop)))


def test_blocks_join_cut_and_take_as_bytes():
    assert features.join([block(0, 3), block(3, 5)]) == block(0, 5)
    assert features.join([]) is None
    with pytest.raises(ValueError, match=r"\[0, 3\) x 4 and \[4, 5\) x 4 do not join"):
        features.join([block(0, 3), block(4, 5)])
    assert features.cut(block(2, 9), 4, 6) == block(4, 6) and features.cut(block(2, 9), 9, 12) is None
    room = features.BLOCK_OVERHEAD_BYTES + 3 * 2 * E
    assert features.take([block(0, 2), block(2, 5), block(5, 8)], room) == block(0, 3)
    assert features.take([block(0, 2)], room) == block(0, 2)
    assert features.take([block(0, 2)], features.BLOCK_OVERHEAD_BYTES) is None
    assert features.take([], room) is None


def eagle_state(tokenizer, drafter_target="target-a", hidden=E, **overrides):
    state = new_state(tokenizer, roles=(("p1", "postprocessor"),), **overrides)
    for instance_id, role, model_ids in (
            ("v1", "verifier", {"target": "target-a", "hidden_size": str(hidden)}),
            ("e1", "drafter", {"draft_method": "eagle", "target": drafter_target})):
        state.observe(Heartbeat(instance_id=instance_id, role=role, capacity=8, load=0, sent_at=time.time(),
                                interval_s=0.5, model_ids={"tokenizer": TOKENIZER_HASH, **model_ids}))
    return state


def eagle_step(state, accepted=0, draft_reply=True, need_resync=()):
    """One step: the drafter proposes [1, 2, ...] (num_draft of them) or need_resync, the verifier
    accepts `accepted` and answers each row's features_from as a verifier does (positions
    features_from .. its length after the step - 1). Returns (draft rows, verify rows)."""
    now = time.time()
    state.boundary(now)
    plan = state.plan_step(now)
    draft_rows, verify_rows = {}, {}
    for drafter_id, message in state.draft_batches(plan, now).items():
        draft_rows.update({r.request_id: r for r in message.rows})
        reply = DraftResponse(batch_id=message.batch_id, drafter_id=drafter_id, rows=[
            DraftResult(request_id=r.request_id, need_resync=r.request_id in need_resync,
                        draft_token_ids=[] if r.request_id in need_resync else list(range(1, r.num_draft + 1)))
            for r in message.rows]) if draft_reply else None
        state.apply_draft(plan, drafter_id, message, reply)
    for verifier_id, message in state.verify_batches(plan, now).items():
        verify_rows.update({r.request_id: r for r in message.rows})
        results = []
        for r in message.rows:
            n = min(accepted, len(r.draft_token_ids)) if r.emit else 0
            length = r.cached_len + len(r.new_token_ids) + n
            results.append(VerifyResult(
                request_id=r.request_id, step=r.step, num_draft=len(r.draft_token_ids), num_accepted=n,
                token_ids=[9] * (n + 1) if r.emit else [],
                features=block(r.features_from, length) if r.features_from is not None and
                r.features_from < length else None))
        state.apply_verify(plan, verifier_id, VerifyResponse(batch_id=message.batch_id, verifier_id=verifier_id,
                                                             rows=results), now)
    state.end_step(plan)
    return draft_rows, verify_rows


def eagle_request(state, request_id="r1", prompt=(5, 6, 7, 8, 10), k=2, **fields):
    return submit(state, request_id, prompt_ids=prompt, sampling={"max_tokens": 40},
                  speculative={"num_speculative_tokens": k, "draft_method": "eagle"}, **fields)


def test_verify_rows_ask_the_features_the_drafter_lacks_and_draft_rows_carry_them(tokenizer):
    state = eagle_state(tokenizer, adaptive_k=False)
    request = eagle_request(state)
    drafts, verifies = eagle_step(state)  # prefill: no draft row
    assert not drafts and verifies["r1"].features_from == 0
    assert request.features_end == 5 and len(request.history) == 6
    drafts, verifies = eagle_step(state, accepted=1)
    assert drafts["r1"].cached_len == 0 and drafts["r1"].features == block(0, 5)
    assert verifies["r1"].features_from == 5 and request.features_end == 7 and len(request.history) == 8
    assert request.feature_blocks == [block(5, 7)]  # the prefill's went with the draft row
    drafts, verifies = eagle_step(state)
    assert drafts["r1"].cached_len == 6 and drafts["r1"].features == block(5, 7)
    assert verifies["r1"].features_from == 7


def test_prefill_chunks_features_join_into_one_draft_row(tokenizer):
    state = eagle_state(tokenizer, adaptive_k=False, max_step_tokens=4)
    request = eagle_request(state, prompt=tuple(range(3, 13)))  # 10 tokens: chunks 4, 4, 2
    asked = [eagle_step(state)[1]["r1"].features_from for _ in range(3)]
    assert asked == [0, 4, 8] and request.feature_blocks == [block(0, 4), block(4, 8), block(8, 10)]
    drafts, _ = eagle_step(state)
    assert drafts["r1"].features == block(0, 10)


def test_need_resync_asks_every_feature_again_from_position_0(tokenizer):
    state = eagle_state(tokenizer, adaptive_k=False)
    request = eagle_request(state)
    for _ in range(3):
        eagle_step(state, accepted=1)
    _, verifies = eagle_step(state, need_resync={"r1"})
    assert verifies["r1"].features_from == 0 and request.drafter_len == 0
    drafts, _ = eagle_step(state)
    assert drafts["r1"].cached_len == 0 and drafts["r1"].features.start == 0
    assert drafts["r1"].features.end == len(drafts["r1"].new_token_ids) - 1  # every pair of the history


def test_a_draft_row_without_answer_carries_its_features_again(tokenizer):
    state = eagle_state(tokenizer, adaptive_k=False)
    eagle_request(state)
    eagle_step(state)
    lost, _ = eagle_step(state, draft_reply=False)
    again, _ = eagle_step(state)
    assert lost["r1"].features == block(0, 5) and again["r1"].features == block(0, 6)


def test_features_wait_for_room_under_max_payload(tokenizer):
    state = eagle_state(tokenizer, adaptive_k=False, hidden=100_000)  # 200 kB a position
    state.max_payload = 1 << 20
    request = eagle_request(state, prompt=tuple(range(3, 13)))
    _, verifies = eagle_step(state)
    assert verifies["r1"].features_from is None and state.counters["features_deferred_payload"] == 1
    assert request.features_end == 0


def test_an_eagle_drafter_drafts_only_for_the_target_it_was_trained_for(tokenizer):
    state = eagle_state(tokenizer, drafter_target="target-b")
    request = eagle_request(state)
    eagle_step(state)
    assert request.drafter_id is None
    _, verifies = eagle_step(state)
    assert verifies["r1"].features_from is None and verifies["r1"].draft_token_ids.size == 0
    assert request.degraded_steps == {"draft_timeout": 1}


def test_auto_tries_an_eagle_drafter_and_a_model_one(tokenizer):
    state = eagle_state(tokenizer, adaptive_k=False)
    state.observe(Heartbeat(instance_id="d1", role="drafter", capacity=8, load=0, sent_at=time.time(),
                            interval_s=0.5, model_ids={"tokenizer": TOKENIZER_HASH}))
    request = submit(state, "r1", prompt_ids=(5, 6, 7), sampling={"max_tokens": 200},
                     speculative={"num_speculative_tokens": 2, "draft_method": "auto"})
    eagle_step(state)
    assert request.drafter_id == "e1"  # eagle before model: its head is one layer
    for _ in range(8):
        eagle_step(state, accepted=0)
    assert request.drafter_id == "d1" and request.features_end == 0 and not request.feature_blocks
    _, verifies = eagle_step(state)
    assert verifies["r1"].features_from is None  # a model drafter wants no features
