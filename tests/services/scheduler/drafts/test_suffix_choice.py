"""The hybrid (services/scheduler/drafts/suffix_choice.py): per row and step the suffix index's drafts
where their expected tokens per second beat the drafter's, else the drafter's, else none; and
through the scheduler's core, rows that take them are sent to no drafter."""

import time

import pytest

from schemas.generation import LogprobOptions, SamplingParams, SpeculativeOptions
from services.scheduler.drafts.adaptive_k import MIN_SAMPLES, AcceptanceCounts, AdaptiveK
from services.scheduler.scheduler_types import Request
from services.scheduler.drafts.suffix_choice import SuffixChoice
from services.scheduler.drafts.suffix_index import SuffixPools
from services.scheduler.drafts.tree_choice import RowPlace
from tests.services.scheduler.scheduler_harness import new_state, submit
from tests.services.scheduler.drafts.test_adaptive_k import timed_step

TEMPLATE = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
PLACE = RowPlace("v", "d")


def measured(verify_s, k_max=4) -> AdaptiveK:
    """An AdaptiveK with every batch-1 size timed: verify_s(T), drafts at 2 ms each."""
    adaptive = AdaptiveK(probe_steps=4)
    for _ in range(MIN_SAMPLES):
        for k in range(k_max + 1):
            adaptive.verify_timed("v", k + 1, verify_s(k + 1), 0.0)
            if k:
                adaptive.draft_timed("d", k, 0.002 * k)
    return adaptive


def request(history, request_id="r", user="alice", method="auto", **sampling) -> Request:
    sampling = SamplingParams(**({"temperature": 0.0} | sampling))
    return Request(request_id=request_id, client_inbox="_INBOX.x", history=list(history), prompt_len=len(history),
                   sampling=sampling, logprobs=LogprobOptions(), speculative=SpeculativeOptions(draft_method=method),
                   stream=False, deadline=time.time() + 60, user=user)


def choice(adaptive, seen=(TEMPLATE,) * 3, user="alice") -> SuffixChoice:
    pools = SuffixPools(10_000)
    for i, tokens in enumerate(seen):
        pools.ended(f"seen{i}", user, list(tokens))
    return SuffixChoice(pools, adaptive, probe_steps=4)


def acceptance(rate, k=4):
    counts = AcceptanceCounts(judged=[40.0] * k, accepted=[40.0 * rate] * k)
    return counts


def test_a_sure_suffix_beats_a_weak_drafter_and_a_weak_suffix_loses_to_a_good_one():
    adaptive = measured(lambda tokens: 0.030)  # a verify that costs the same at every size
    hybrid = choice(adaptive)
    weak = request([1, 11, 12, 13])
    weak.adaptive.acceptance = acceptance(0.2)
    drafts, step = hybrid.choose(weak, 4, PLACE, True, ("d", "greedy/greedy"))
    assert drafts == [14, 15, 16, 17] and step.expected == pytest.approx(4.0)
    # the template's continuation was seen once in three: a good drafter wins
    mixed = choice(adaptive, seen=[TEMPLATE, [11, 12, 13, 40, 41], [11, 12, 13, 50, 51]])
    good = request([1, 11, 12, 13])
    good.adaptive.acceptance = acceptance(0.9)
    assert mixed.choose(good, 4, PLACE, True, ("d", "greedy/greedy")) is None


def test_without_a_drafter_the_suffix_must_beat_no_drafts_and_probes_after_losing():
    steep = measured(lambda tokens: 0.030 * tokens)  # every token costs a whole step: drafts never pay
    hybrid = choice(steep)
    row = request([1, 11, 12, 13], method="suffix")
    outcomes = [hybrid.choose(row, 4, PLACE, False, ("", "greedy/greedy")) for _ in range(5)]
    assert outcomes[:3] == [None] * 3  # a calibrated half of 4 expected drafts does not pay 4 positions
    assert outcomes[3] is not None and outcomes[3][1].probe  # probe_steps (4) losses: tried once
    assert outcomes[4] is None
    hybrid.verified(outcomes[3][1], 0)  # nothing accepted: the next probe waits twice as long (8 losses)
    later = [hybrid.choose(row, 4, PLACE, False, ("", "greedy/greedy")) is None for _ in range(8)]
    assert later == [True] * 6 + [False, True]  # outcomes[4] was the first loss
    flat = choice(measured(lambda tokens: 0.030))
    assert flat.choose(row, 4, PLACE, False, ("", "greedy/greedy"))[0] == [14, 15, 16, 17]


def test_its_calibration_follows_what_was_accepted():
    adaptive = measured(lambda tokens: 0.030 + 0.004 * tokens)
    hybrid = choice(adaptive)
    row = request([1, 11, 12, 13])
    row.adaptive.acceptance = acceptance(0.3)
    drafts, step = hybrid.choose(row, 4, PLACE, True, ("d", "greedy/greedy"))
    key = step.key
    assert len(drafts) == 4 and key == ("alice", "greedy", 2)  # calibrated with the matches of 2 or 3 tokens
    for _ in range(30):  # its drafts keep being rejected: the ratio falls, and the drafter wins
        hybrid.verified(step, 0)
    assert hybrid.calibrations[key].scale() < 0.1
    assert hybrid.choose(row, 4, PLACE, True, ("d", "greedy/greedy")) is None
    other = request([1, 11, 12, 13], user="bob")  # bob's calibration is his own (and bob saw nothing)
    assert hybrid.choose(other, 4, PLACE, True, ("d", "greedy/greedy")) is None
    assert not any(key[0] == "bob" for key in hybrid.calibrations)


@pytest.mark.parametrize("kind", ["rejection", "model", "k0"])
def test_rows_whose_tokens_depend_on_drafts_or_that_want_none_never_take_them(kind):
    hybrid = choice(measured(lambda tokens: 0.030))
    row = {"rejection": lambda: request([11, 12], temperature=1.0, coupling="rejection", seed=1),
           "model": lambda: request([11, 12], method="model"), "k0": lambda: request([11, 12])}[kind]()
    assert hybrid.choose(row, 0 if kind == "k0" else 4, PLACE, True, ("d", "greedy/greedy")) is None
    gumbel = request([11, 12], temperature=1.0, seed=1)
    assert hybrid.choose(gumbel, 4, PLACE, True, ("d", "gumbel/greedy"))[1].key == ("alice", "gumbel", 2)


def test_with_adaptive_k_off_a_drafter_keeps_its_rows_and_suffix_rows_take_every_draft():
    hybrid = choice(None)
    assert hybrid.choose(request([11, 12]), 4, PLACE, True, ("d", "greedy/greedy")) is None
    assert hybrid.choose(request([11, 12], method="suffix"), 4, PLACE, False, ("", "x"))[0] == [13, 14, 15, 16]


def test_the_core_sends_suffix_rows_to_no_drafter_and_indexes_ended_requests(tokenizer):
    state = new_state(tokenizer, suffix_max_tokens=4096)
    submit(state, "first", prompt_ids=TEMPLATE[:3], sampling={"max_tokens": 40},  # adaptive k measures every k
           speculative={"num_speculative_tokens": 4})
    timed_step(state, lambda _request_id, _num_draft: 0)
    user = state.running["first"].user
    while state.running:  # a drafter whose drafts are never accepted: its rows settle at k=0
        timed_step(state, lambda _request_id, _num_draft: 0)
    index = state.planner.suffix.pools.index(user)
    assert index.propose([13, 9], 2, 0.0).token_ids == [9, 9]  # the first one's history, output 9s
    state.planner.suffix.pools.ended("seen", user, [1, *TEMPLATE[:3], 9, *TEMPLATE])
    submit(state, "second", prompt_ids=[1, *TEMPLATE[:3]], sampling={"max_tokens": 8},
           speculative={"num_speculative_tokens": 4})
    timed_step(state, lambda _request_id, _num_draft: 0)  # its prefill
    plan = state.plan_step(time.time())
    (row,) = plan.rows["v1"]
    assert row.request.history == [1, 11, 12, 13, 9]  # the longest match is "seen"'s, not the first's "13 9"
    assert row.suffix is not None and row.draft.draft_token_ids.tolist() == TEMPLATE[:4]
    assert not any(batch.rows for batch in state.draft_batches(plan, time.time()).values())  # asked of no drafter
