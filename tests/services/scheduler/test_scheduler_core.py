"""The scheduler's core without NATS (services/scheduler/scheduler_core.py): instances heard,
pins, lanes and the in-flight rule; a real tokenizer (trained on the spot) gives EOS and text; the helpers the
scheduler's tests share are in scheduler_harness.py. Each collaborator has its own test module: test_admission.py, test_step_planner.py,
test_batch_builder.py, test_commits.py, test_recovery.py."""

import time

import pytest
from structlog.testing import capture_logs

from schemas.config import SchedulerConfig, load_config
from schemas.errors import SpecbusError
from services.scheduler.budget.step_budget import DECODE_SHARE
from tests.services.scheduler.scheduler_harness import (
    TOKENIZER_HASH,
    beat,
    commits_of,
    new_state,
    step,
    submit,
    verified,
)

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


def test_a_queued_request_waits_while_the_running_ones_fill_the_step_time(tokenizer):
    """step_budget.py, step rows: the verifier's steps take 10 x what the target lets the decode
    rows fill; a new request stays queued (its client heard it is queued) until room returns."""
    state = new_state(tokenizer)
    for name in "abc":
        submit(state, name, sampling={"max_tokens": 50})
    step(state)  # prefill
    step(state, step_s=3 * DECODE_SHARE * state.config.target_step_s * 10)
    late = submit(state, "late")
    outbox = state.boundary(time.time())
    assert "late" not in state.running and late in state.waiting and not outbox.acks
    for _ in range(60):
        step(state, step_s=0.01)  # steps got fast: the estimate comes back
        if "late" in state.running:
            break
    assert "late" in state.running and state.stats()["step_rows_fit"] > 3


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


# ------------------------------------------------------------------ one owner per table


def test_no_collaborator_holds_the_cores_tables_or_a_callback_into_it(tokenizer):
    """docs/ARCHITECTURE.md#one-owner-per-table: the running requests, the ids in flight and the
    counters are the core's alone; its collaborators get them as arguments, never keep them."""
    state = new_state(tokenizer)
    tables = (state.running, state.in_flight, state.counters)
    for collaborator in (state.admission, state.planner, state.builder, state.committer, state.recovery,
                         state.releases, state.placement):
        for name, value in vars(collaborator).items():
            where = f"{type(collaborator).__name__}.{name}"
            assert not any(value is table for table in tables), where
            assert getattr(value, "__self__", None) is not state, where  # a bound method of the core
            assert getattr(value, "__name__", "") != "<lambda>", where


def test_a_finishing_row_changes_nothing_of_the_core_until_it_applies_it(tokenizer):
    """Committer.commit_batch returns what a row changed (the request to end, with its final
    commit's fields); the request leaves the running table only when the core applies it."""
    state = new_state(tokenizer)
    submit(state, sampling={"max_tokens": 1})
    state.boundary(time.time())
    plan = state.plan_step(time.time())
    message = state.verify_batches(plan, time.time())["v1"]
    counters = dict(state.counters)
    [counted, row] = list(state.committer.commit_batch(plan, "v1", verified(message), time.time(), state.running))
    assert counted.counts == {"steps": 1} and [(e.request.request_id, e.reason) for e in row.ended] == [("r1", "length")]
    assert "r1" in state.running and "r1" in state.in_flight and dict(state.counters) == counters
    [final] = commits_of(state.apply(row, time.time()))
    assert final.finish_reason == "length" and "r1" not in state.running and state.counters["finished_length"] == 1
