"""The scheduler's core without NATS (services/pipeline/scheduler_core.py): instances heard,
pins, lanes and the in-flight rule; and the helpers its collaborators' tests share (a state
with instances, a request submitted, one whole step). Verifier and drafter answers are built
here as the real message types they send; a real tokenizer (trained on the spot) gives EOS and
text. Each collaborator has its own test module: test_admission.py, test_step_planner.py,
test_batch_builder.py, test_commits.py, test_recovery.py."""

import time

import pytest
from structlog.testing import capture_logs

from schemas.codec import decode, encode
from schemas.commits import Commit
from text.tokenizer import load_tokenizer
from schemas.config import SchedulerConfig, load_config
from schemas.errors import SpecbusError
from schemas.control import Heartbeat
from schemas.generation import GenerateRequest
from schemas.steps import DraftResponse, DraftResult, VerifyResponse, VerifyResult
from services.pipeline.scheduler_core import SchedulerState

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


def verified(message, verifier_id="v1"):
    """The verifier's answer to a VerifyRequest: each emitting row emits [9], no draft accepted."""
    return VerifyResponse(batch_id=message.batch_id, verifier_id=verifier_id, rows=[
        VerifyResult(request_id=r.request_id, step=r.step, num_draft=len(r.draft_token_ids), num_accepted=0,
                     token_ids=[9] if r.emit else []) for r in message.rows])


def beat_verifier(state, instance_id="v1", max_seq_len=None):
    model_ids = {"tokenizer": TOKENIZER_HASH, **({"max_seq_len": str(max_seq_len)} if max_seq_len else {})}
    state.observe(Heartbeat(instance_id=instance_id, role="verifier", capacity=8, load=0, model_ids=model_ids,
                            sent_at=time.time(), interval_s=0.5))


# ------------------------------------------------------------------ instances and pins


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


# ------------------------------------------------------------------ keepalives and queue time


def test_a_running_request_whose_client_heard_nothing_for_a_heartbeat_interval_is_kept_alive(tokenizer):
    """Admitted `started` again to a running request's client, in a step or not, once it was sent
    nothing (an Admitted, a commit) for heartbeat_interval_s; a queued request gets none (its
    client's idle bound starts with the start). The time queued is observed at the start."""
    state = new_state(tokenizer, max_running=2)
    for name in ("r1", "r2", "queued"):
        submit(state, name)
    state.clock.now += 3.0  # queued for 3 s
    for instance_id, role in (("v1", "verifier"), ("d1", "drafter"), ("p1", "postprocessor")):
        beat(state, instance_id, role)
    state.boundary(time.time())
    assert not state.keepalives().acks  # the start's Admitted was just sent
    state.clock.now += state.config.heartbeat_interval_s
    plan = state.plan_step(time.time())  # both in a step: a long prefill, a slow verifier
    acks = state.keepalives().acks
    assert sorted((inbox, ack.request_id, ack.started) for inbox, ack in acks) == [
        ("_INBOX.r1", "r1", True), ("_INBOX.r2", "r2", True)]
    assert not state.keepalives().acks  # told just now
    message = state.verify_batches(plan, time.time())["v1"]
    state.clock.now += state.config.heartbeat_interval_s
    state.apply_verify(plan, "v1", verified(message), time.time())  # a commit each: told again
    state.end_step(plan)
    assert not state.keepalives().acks
    sample = state.metrics.registry.get_sample_value
    assert sample("specbus_scheduler_queue_seconds_count") == 2 and sample("specbus_scheduler_queue_seconds_sum") == 6.0
