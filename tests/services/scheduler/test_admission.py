"""Admission (services/scheduler/admission.py), through the scheduler's core without NATS: the
queue bound and fair share, a request's checks before any work (ids, prompt length, reply
subject, first commit size, resume), prompt tokenization, the wait for a compatible verifier."""

import time

import pytest

from schemas.config import TINY_TARGET
from schemas.bus.control import Heartbeat
from schemas.errors import ErrorCode, SpecbusError
from schemas.generation import GenerateRequest, seed_from_request_id
from services.scheduler.admission import prompt_token_ids
from text.tokenizer import load_tokenizer
from tests.services.scheduler.scheduler_harness import (
    EOS,
    TOKENIZER_HASH,
    beat,
    beat_verifier,
    new_state,
    step,
    submit,
)


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
    state.observe(Heartbeat(instance_id="old", role="verifier", capacity=8, load=0, protocol_version=1,
                            model_ids={"tokenizer": TOKENIZER_HASH}, sent_at=time.time(), interval_s=0.5))  # nor v1
    assert state.counters["instances_incompatible"] == 2
    request = submit(state, now=time.time() - 59.5, timeout_s=60.0)
    assert step(state)[0].empty and list(state.waiting) == [request]
    request.deadline = time.time() - 0.1
    outbox = state.boundary(time.time())
    [(inbox, chunk)] = outbox.chunks
    assert inbox == "_INBOX.r1" and chunk.finish_reason == "timeout" and chunk.error.code == ErrorCode.timeout
    assert not state.waiting and state.counters["finished_timeout"] == 1


def test_a_reply_subject_too_long_for_a_commit_is_refused_at_admission(tokenizer):
    """A reply subject longer than a Commit's client_inbox may be (MAX_INBOX_LEN) is refused at
    admission, before any work."""
    state = new_state(tokenizer)
    generate = GenerateRequest(request_id="long", prompt_token_ids=[5, 6], sampling={"temperature": 0.0})
    with pytest.raises(SpecbusError) as info:
        state.admit(generate, "_INBOX.client." + "x" * 300, [5, 6], time.time())
    assert (info.value.code, info.value.field) == (ErrorCode.invalid_field, "reply_subject")
    assert "at most 256" in info.value.message and not state.waiting


def test_a_prompt_longer_than_the_verifiers_max_seq_len_is_refused_before_any_work(tokenizer):
    """A prompt longer than the smallest live verifier's max_seq_len is refused at admission,
    before any prefill (a scoring request needs no position past its prompt)."""
    state = new_state(tokenizer, roles=(("p1", "postprocessor"),))
    beat_verifier(state, "v1", max_seq_len=16)
    beat_verifier(state, "v2", max_seq_len=8)  # the smallest live limit holds: a request may migrate there
    with pytest.raises(SpecbusError, match="max_seq_len 8") as info:
        submit(state, prompt_ids=range(1, 9))
    assert (info.value.code, info.value.field) == (ErrorCode.invalid_field, "prompt_token_ids")
    assert submit(state, "fits", prompt_ids=range(1, 8)).prompt_len == 7
    assert submit(state, "scoring", prompt_ids=range(1, 9), sampling={"max_tokens": 0}).prompt_len == 8


def test_a_prompt_whose_first_commit_exceeds_max_payload_is_refused_too_large(tokenizer):
    """A prompt whose first Commit (it carries prompt_token_ids) would exceed max_payload is
    refused `too_large` at admission."""
    state = new_state(tokenizer)
    state.max_payload = 64 * 1024
    with pytest.raises(SpecbusError, match="max_payload of 65536") as info:
        submit(state, prompt_ids=[5] * 20_000)
    assert (info.value.code, info.value.field) == (ErrorCode.too_large, "prompt_token_ids")
    assert submit(state, "small", prompt_ids=[5] * 1000).prompt_len == 1000


def test_a_request_id_in_use_or_just_finished_is_refused_as_duplicate(tokenizer):
    """An id running, queued or finished in the last FINISHED_ID_TTL_S is refused
    `duplicate_request_id`: the postprocessor would drop its commits."""
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


@pytest.mark.parametrize("resume, message", [([11, 12, 13], "leave nothing"), ([11, 999], "outside the vocabulary")])
def test_a_resume_that_cannot_continue_is_refused_naming_the_field(tokenizer, resume, message):
    state = new_state(tokenizer)
    with pytest.raises(SpecbusError, match=message) as refused:
        submit(state, resume_token_ids=resume, sampling={"max_tokens": 3})
    assert refused.value.field == "resume_token_ids"


def test_a_text_prompt_far_over_max_seq_len_is_refused_before_tokenizing(tokenizer):
    """A text prompt or chat far over max_seq_len, counted in characters, is refused before the
    tokenizer runs (tokenizing holds the event loop)."""
    state = new_state(tokenizer, roles=(("p1", "postprocessor"),))
    beat_verifier(state, "v1", max_seq_len=8)
    with pytest.raises(SpecbusError, match="prompt: 1048576 characters of text; max_seq_len 8 holds at most") as info:
        state.admission.check_prompt_text(GenerateRequest(request_id="big", prompt="é" * (1 << 20)))
    assert (info.value.code, info.value.field) == (ErrorCode.invalid_field, "prompt")
    state.admission.check_prompt_text(GenerateRequest(request_id="fine", prompt="the quick brown fox"))
    chat = [{"role": "system", "content": "é" * (1 << 19)}, {"role": "user", "content": "é" * (1 << 19)}]
    with pytest.raises(SpecbusError, match="messages: 1048576 characters of text; max_seq_len 8") as info:
        state.admission.check_prompt_text(GenerateRequest(request_id="big-chat", messages=chat))
    assert info.value.field == "messages"


@pytest.mark.parametrize("fields, field", [
    ({"sampling": {"stop_token_ids": [10**9]}}, "sampling.stop_token_ids"),
    ({"sampling": {"logit_bias": {"1000000": 5.0}}}, "sampling.logit_bias"),
    ({"logprobs": {"logprob_token_ids": [1, 10**6]}}, "logprobs.logprob_token_ids"),
])
def test_token_ids_outside_the_vocabulary_are_refused_at_admission_wherever_they_are(tokenizer, fields, field):
    """Like a prompt id: the stop ids, logit_bias ids and requested logprob ids are checked at
    admission, not first by a verifier mid-request."""
    state = new_state(tokenizer)
    request = GenerateRequest(request_id="oov", prompt_token_ids=[5, 6], **fields)
    with pytest.raises(SpecbusError, match="outside the vocabulary") as info:
        state.admission.check_request(request)
    assert (info.value.code, info.value.field) == (ErrorCode.invalid_field, field)
    state.admission.check_request(GenerateRequest(request_id="fine", prompt_token_ids=[5, 6],
                                                  sampling={"stop_token_ids": [7], "logit_bias": {"7": 1.0}}))


def test_max_tokens_over_the_effective_cap_is_refused_stating_that_cap(tokenizer):
    """The cap is the least of max_tokens_cap and the verifiers' max_seq_len (max_model_len), and
    the message states the one that holds."""
    state = new_state(tokenizer, roles=(("p1", "postprocessor"),), max_tokens_cap=64)
    over = GenerateRequest(request_id="long", prompt_token_ids=[5, 6], sampling={"max_tokens": 100})
    with pytest.raises(SpecbusError, match="max_tokens 100 is above the cap 64") as info:
        state.admission.check_request(over)
    assert info.value.field == "sampling.max_tokens"
    beat_verifier(state, "v1", max_seq_len=32)
    with pytest.raises(SpecbusError, match=r"above the cap 32 \(max_model_len 32") as info:
        state.admission.check_request(over)
    assert info.value.field == "sampling.max_tokens"
    state.admission.check_request(GenerateRequest(request_id="fits", prompt_token_ids=[5, 6],
                                                  sampling={"max_tokens": 32}))


def test_grammars_are_warmed_before_any_request_and_a_grammar_is_probed():
    """warm_grammars (the scheduler calls it before it serves) makes the grammar view of the
    tokenizer and compiles one grammar, so the first request with a grammar pays neither; a
    grammar that breaks the matcher in its first tokens is refused naming the field."""
    state = new_state(load_tokenizer(TINY_TARGET))
    assert state.admission.grammars is None
    state.admission.warm_grammars()
    assert state.admission.grammars is not None and len(state.admission.grammars.templates) == 1
    wide = "start: " + " | ".join('"w%dz"' % i for i in range(3000))
    with pytest.raises(SpecbusError, match="grammar fails after") as refused:
        state.admission.check_grammar(GenerateRequest(request_id="wide", prompt="x",
                                                      sampling={"structured_outputs": {"grammar": wide}}))
    assert refused.value.field == "sampling.structured_outputs"
