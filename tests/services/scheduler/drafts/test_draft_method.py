"""Which drafter a request drafts with (services/scheduler/drafts/draft_method.py), through SchedulerState
without NATS: draft_method "model" / "ngram" / "auto", the ngram drafter fitting any tokenizer,
and "auto"'s per-request trial."""

import time

from schemas.bus.control import Heartbeat
from schemas.bus.protocol import ANY_TOKENIZER
from services.scheduler.drafts.draft_method import TRIAL_STEPS
from tests.services.scheduler.scheduler_harness import TOKENIZER_HASH, new_state, step, submit

BASE = (("v1", "verifier"), ("p1", "postprocessor"))


def beat_drafter(state, instance_id, method):
    model_ids = {"tokenizer": ANY_TOKENIZER, "draft_method": "ngram"} if method == "ngram" else \
        {"tokenizer": TOKENIZER_HASH}  # a model drafter from before draft_method: "model"
    state.observe(Heartbeat(instance_id=instance_id, role="drafter", capacity=8, load=0, model_ids=model_ids,
                            sent_at=time.time(), interval_s=0.5))


def state_with(tokenizer, **drafters):
    state = new_state(tokenizer, roles=BASE)
    for instance_id, method in drafters.items():
        beat_drafter(state, instance_id, method)
    return state


def run(state, method, request_id="r1"):
    request = submit(state, request_id, sampling={"max_tokens": 400},
                     speculative={"num_speculative_tokens": 4, "draft_method": method})
    step(state)  # prefill: pins
    return request


def test_an_ngram_drafter_fits_any_tokenizer_but_a_verifier_does_not(tokenizer):
    state = state_with(tokenizer, n1="ngram")
    assert state.counters["instances_incompatible"] == 0
    state.observe(Heartbeat(instance_id="v2", role="verifier", capacity=8, load=0,
                            model_ids={"tokenizer": ANY_TOKENIZER}, sent_at=time.time(), interval_s=0.5))
    assert state.counters["instances_incompatible"] == 1
    assert [i.instance_id for i in state.placement.compatible("verifier")] == ["v1"]


def test_model_and_ngram_requests_use_only_drafters_of_their_method(tokenizer):
    state = state_with(tokenizer, d1="model", n1="ngram")
    assert run(state, "model", "m").drafter_id == "d1"
    assert run(state, "ngram", "n").drafter_id == "n1"
    only_model = state_with(tokenizer, d1="model")
    request = run(only_model, "ngram")
    assert request.drafter_id is None
    _, _, outbox = step(only_model)
    assert outbox.commits[0][1].degraded == ["draft_timeout"]  # as with no drafter at all


def test_auto_uses_whichever_method_is_live(tokenizer):
    assert run(state_with(tokenizer, d1="model"), "auto").drafter_id == "d1"
    assert run(state_with(tokenizer, n1="ngram"), "auto").drafter_id == "n1"  # no model drafter registered
    assert run(state_with(tokenizer), "auto").drafter_id is None


def drafted_steps(state, request, count, accepted):
    """count steps whose drafter proposes 4 tokens and the verifier accepts `accepted` of them."""
    for _ in range(count):
        step(state, drafts={request.request_id: [1, 2, 3, 4]}, num_accepted={request.request_id: accepted},
             tokens={request.request_id: [9] * (accepted + 1)})


def test_auto_tries_both_methods_then_keeps_the_one_accepted_more(tokenizer):
    state = state_with(tokenizer, d1="model", n1="ngram")
    request = run(state, "auto")
    assert request.drafter_id == "n1"  # ngram first: its slot costs nothing to fill
    drafted_steps(state, request, TRIAL_STEPS - 1, accepted=0)
    assert request.drafter_id == "n1"
    drafted_steps(state, request, 1, accepted=0)
    assert request.drafter_id == "d1" and request.drafter_len == 0  # the model drafter gets the whole history
    assert state.releases.pending["n1"] == ["r1"]
    step(state, drafts={"r1": [1, 2]}, draft_reply=False)  # no answer: not counted
    drafted_steps(state, request, TRIAL_STEPS, accepted=2)
    assert request.draft_trial.settled == "model" and request.drafter_id == "d1"
    assert request.draft_trial.steps == {"ngram": TRIAL_STEPS, "model": TRIAL_STEPS}
    drafted_steps(state, request, 3, accepted=0)  # settled: it stays
    assert request.drafter_id == "d1" and state.counters["draft_method_switches"] == 1


def test_auto_goes_back_to_ngram_when_it_was_accepted_more_or_as_much(tokenizer):
    state = state_with(tokenizer, d1="model", n1="ngram")
    request = run(state, "auto")
    drafted_steps(state, request, TRIAL_STEPS, accepted=1)
    drafted_steps(state, request, TRIAL_STEPS, accepted=1)  # a tie goes to ngram, which costs no forward
    assert request.draft_trial.settled == "ngram" and request.drafter_id == "n1" and request.drafter_len == 0
    assert state.releases.pending["d1"] == ["r1"] and state.counters["draft_method_chose_ngram"] == 1


def test_auto_with_one_method_live_stays_on_it(tokenizer):
    state = state_with(tokenizer, n1="ngram")
    request = run(state, "auto")
    drafted_steps(state, request, 2 * TRIAL_STEPS, accepted=1)
    assert request.drafter_id == "n1" and request.draft_trial.settled is None
