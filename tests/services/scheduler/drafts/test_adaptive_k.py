"""Adaptive speculation length: the formula, the cost tables, the choice, and the scheduler core
driving it with timings from a cost model (no NATS; the real stack is tests/system/pipeline/test_adaptive_k_stack.py)."""

import time

import pytest

from schemas.steps import DraftResponse, DraftResult, VerifyResponse, VerifyResult
from services.scheduler.drafts.adaptive_k import (
    COST_SAMPLES,
    MIN_SAMPLES,
    MAX_PROBE_BACKOFF,
    AcceptanceCounts,
    AdaptiveK,
    CostTable,
    RowState,
    expected_tokens,
)
from tests.services.scheduler.scheduler_harness import acceptance_history as history
from tests.services.scheduler.scheduler_harness import new_state, submit

# ------------------------------------------------------------------ the pieces


def test_expected_tokens_is_one_plus_the_sum_of_the_prefix_products():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == 1 + 0.5 + 0.25 + 0.125
    assert expected_tokens([1.0, 0.0, 1.0], 3) == 2.0  # nothing past a position never accepted
    assert expected_tokens([0.9, 0.5], 2) == pytest.approx(1 + 0.9 + 0.45)


def test_acceptance_counts_judge_the_accepted_drafts_and_the_first_rejected_one():
    counts = AcceptanceCounts()
    counts.record(num_draft=4, num_accepted=2)  # 1, 2 accepted, 3 rejected, 4 never compared
    counts.record(num_draft=4, num_accepted=4)
    counts.record(num_draft=1, num_accepted=0)
    assert counts.judged == [3, 2, 2, 1] and counts.accepted == [2, 2, 1, 1]
    assert counts.rate(0) == (2 + 1) / (3 + 2)  # Laplace's rule by default
    assert counts.rate(3, prior_rate=0.0, prior_weight=1.0) == 1 / 2
    assert AcceptanceCounts().rate(5, prior_rate=0.25, prior_weight=4.0) == 0.25  # no counts: the prior


def test_decayed_counts_follow_a_change_of_acceptance():
    counts = AcceptanceCounts()
    for _ in range(50):
        counts.record(1, 1, decay=0.9)
    assert counts.rate(0, 0.5, 4.0) > 0.8
    for _ in range(20):
        counts.record(1, 0, decay=0.9)
    assert counts.rate(0, 0.5, 4.0) < 0.25  # 50 accepted steps are mostly forgotten after 20 rejections


def test_cost_table_takes_the_least_interpolates_and_keeps_recent_samples():
    table = CostTable()
    assert table.estimate(3) is None and not table.known(1)
    for seconds in (0.011, 0.010, 0.500):  # one stalled step among them
        table.add(1, seconds)
    assert table.known(1) and table.estimate(1) == 0.010
    table.add(5, 0.032)
    assert not table.known(5)
    assert table.estimate(3) == pytest.approx(0.021)  # halfway between T=1 and T=5
    assert table.estimate(9) == 0.032 and table.estimate(0) == 0.010  # beyond: the nearest measured
    for _ in range(COST_SAMPLES):
        table.add(1, 0.020)
    assert table.estimate(1) == 0.020  # only the last COST_SAMPLES count


def measured(verify_s, draft_s, k_max, commit_s=0.0) -> AdaptiveK:
    """An AdaptiveK with MIN_SAMPLES timings at every batch-1 size: verify_s(T), draft_s(k)."""
    adaptive = AdaptiveK(probe_steps=16)
    for _ in range(MIN_SAMPLES):
        for k in range(k_max + 1):
            adaptive.verify_timed("v", k + 1, verify_s(k + 1), commit_s)
            if k:
                adaptive.draft_timed("d", k, draft_s(k))
    return adaptive


def choose(adaptive, own=None, k_max=4, zero_steps=0, prior=None):
    if prior is not None:
        adaptive.priors[("d", "greedy/greedy")] = prior
    adaptive.zero_steps[("d", "greedy/greedy")] = zero_steps
    row = RowState(acceptance=own or AcceptanceCounts())
    return adaptive.choose(row, ("d", "greedy/greedy"), k_max, "v", 0, "d", 0, True)


def test_without_timings_every_step_takes_the_requests_k():
    adaptive = AdaptiveK(probe_steps=16)
    assert choose(adaptive, history(0.0)) == 4
    assert adaptive.choose(RowState(), ("d", "greedy/greedy"), 4, "v", 5, "d", 2, False) == 4


def test_sizes_are_measured_first_from_the_largest_k_down():
    adaptive = AdaptiveK(probe_steps=16)
    chosen = []
    for _ in range(MIN_SAMPLES * 3):
        k = choose(adaptive, k_max=2)
        chosen.append(k)
        adaptive.verify_timed("v", k + 1, 0.01, 0.0)
        if k:
            adaptive.draft_timed("d", k, 0.001)
    assert chosen == [2] * MIN_SAMPLES + [1] * MIN_SAMPLES + [0] * MIN_SAMPLES


def flat_verify(_tokens):
    return 0.030


def test_a_useless_draft_runs_at_zero_and_probes_with_one_draft_every_probe_steps():
    adaptive = measured(flat_verify, lambda k: 0.002 * k, k_max=4)
    assert choose(adaptive, history(0.0)) == 0
    assert choose(adaptive, history(0.0), zero_steps=14) == 0
    assert choose(adaptive, history(0.0), zero_steps=15) == 1  # the 16th step at 0


def test_failed_probes_back_off_and_an_accepted_one_resets_the_interval():
    adaptive = measured(flat_verify, lambda k: 0.002 * k, k_max=4)
    row = RowState(acceptance=history(0.0))
    key = ("d", "greedy/greedy")

    def steps_to_next_probe():
        for steps in range(1, 1000):
            if adaptive.choose(row, key, 4, "v", 0, "d", 0, True):
                return steps
            adaptive.verified(row, key, 0, 0)  # a step at 0: nothing to record but the step
        raise AssertionError("no probe")

    intervals = []
    for _ in range(5):
        intervals.append(steps_to_next_probe())
        adaptive.verified(row, key, 1, 0)  # rejected
    assert intervals == [16, 32, 64, 16 * MAX_PROBE_BACKOFF, 16 * MAX_PROBE_BACKOFF]
    steps_to_next_probe()
    adaptive.verified(row, key, 1, 1)  # accepted: back to probe_steps
    assert adaptive.failed_probes[key] == 0


def test_probes_count_the_drafters_steps_so_requests_shorter_than_the_interval_still_probe():
    adaptive = measured(flat_verify, lambda k: 0.002 * k, k_max=4)
    key = ("d", "greedy/greedy")
    adaptive.failed_probes[key] = 3  # the longest interval: 16 * MAX_PROBE_BACKOFF steps
    chosen = []
    for _ in range(16 * MAX_PROBE_BACKOFF // 10 + 1):  # requests of 10 steps each
        row = RowState(acceptance=history(0.0))
        chosen += [adaptive.choose(row, key, 4, "v", 0, "d", 0, True) for _ in range(10)]
    assert chosen.count(1) == 1 and chosen.index(1) == 16 * MAX_PROBE_BACKOFF - 1


def test_a_step_counts_once_towards_the_probe_however_many_of_its_rows_are_at_zero():
    adaptive = measured(flat_verify, lambda k: 0.002 * k, k_max=4)
    key = ("d", "greedy/greedy")
    rows = [RowState(acceptance=history(0.0)) for _ in range(16)]
    chosen = [[adaptive.choose(row, key, 4, "v", 0, "d", 0, False, step=step) for row in rows]
              for step in range(1, 33)]
    # a batch of 16 rows at k_t = 0 probes once every 16 steps, with one row, not in every step
    assert [step for step, ks in enumerate(chosen, start=1) if any(ks)] == [16, 32]
    assert all(sum(ks) <= 1 for ks in chosen)


def test_the_probe_back_off_is_the_drafters_so_a_new_request_starts_where_the_last_one_left_off():
    adaptive = measured(flat_verify, lambda k: 0.002 * k, k_max=4)
    key, other_rule = ("d", "greedy/greedy"), ("d", "gumbel")

    def steps_to_probe(row, prior_key):
        for steps in range(1, 1000):
            if adaptive.choose(row, prior_key, 4, "v", 0, "d", 0, True):
                return steps
            adaptive.verified(row, prior_key, 0, 0)
        raise AssertionError("no probe")

    first = RowState(acceptance=history(0.0))
    for _ in range(3):
        steps_to_probe(first, key)
        adaptive.verified(first, key, 1, 0)  # rejected
    assert steps_to_probe(RowState(acceptance=history(0.0)), key) == 16 * MAX_PROBE_BACKOFF
    assert steps_to_probe(RowState(acceptance=history(0.0)), other_rule) == 16  # another rule: its own
    second = RowState(acceptance=history(0.0))
    steps_to_probe(second, key)
    adaptive.verified(second, key, 1, 1)  # one accepted probe: every request of the drafter back to 16
    assert steps_to_probe(RowState(acceptance=history(0.0)), key) == 16


def test_a_good_draft_with_a_cheap_verify_takes_every_draft():
    adaptive = measured(flat_verify, lambda k: 0.002 * k, k_max=4)
    assert choose(adaptive, history(0.8)) == 4


def test_the_best_k_balances_acceptance_against_a_verify_that_grows_with_its_tokens():
    # fp32 CPU-like: verify 27 ms at T=1 growing 6 ms per token, drafts 1 ms each plus a 1 ms trip
    adaptive = measured(lambda t: 0.027 + 0.006 * (t - 1), lambda k: 0.001 + 0.001 * k, k_max=4)
    picks = {rate: choose(adaptive, history(rate)) for rate in (0.1, 0.5, 0.7, 0.95)}
    assert picks[0.1] == 0 and picks[0.95] == 4
    assert 0 < picks[0.5] <= picks[0.7] < 4
    for rate, k in picks.items():  # the pick is the argmax of the formula
        a = [rate] * 4
        time_of = [0.027 + 0.006 * j + (0.001 + 0.001 * j if j else 0) for j in range(5)]
        assert max(range(5), key=lambda j: expected_tokens(a, j) / time_of[j]) == k


def test_a_new_request_starts_from_the_drafters_history():
    adaptive = measured(flat_verify, lambda k: 0.002 * k, k_max=4)
    assert choose(adaptive, prior=history(0.0, steps=200)) == 0
    assert choose(adaptive, prior=history(0.9, steps=200)) == 4
    # its own steps soon outweigh the prior (PRIOR_WEIGHT pseudo-steps)
    assert choose(adaptive, own=history(0.9, steps=30), prior=history(0.0, steps=200)) == 4


def test_a_row_batched_behind_others_pays_only_what_it_adds_to_the_drafter_batch():
    adaptive = measured(flat_verify, lambda k: 0.010 * k, k_max=4)  # expensive drafts
    own = history(0.3)
    assert choose(adaptive, own) == 0
    # the drafter already drafts 4 for another row: more drafts for this one are free
    assert adaptive.choose(RowState(own), ("d", "greedy/greedy"), 4, "v", 5, "d", 4, False) == 4


def test_in_a_batch_a_draft_pays_for_the_step_time_of_every_row():
    # verify 27 ms at T=1 growing 6 ms per token: alone, a draft accepted at 0.6 pays its 6 ms
    adaptive = measured(lambda t: 0.027 + 0.006 * (t - 1), lambda k: 0.001 * k, k_max=4)
    own = history(0.6)
    assert choose(adaptive, own) > 0
    for _ in range(MIN_SAMPLES):  # the sizes of a batch of 8 decode rows
        for t in range(8, 13):
            adaptive.verify_timed("v", t, 0.027 + 0.006 * (t - 1), 0.0)
    # behind 7 other decode rows each extra token slows 8 rows' step: no draft pays
    assert adaptive.choose(RowState(own), ("d", "greedy/greedy"), 4, "v", 7, "d", 0, False, others=7) == 0
    # counted as the row's own rate (others=0), the same batch would draft
    assert adaptive.choose(RowState(own), ("d", "greedy/greedy"), 4, "v", 7, "d", 0, False) > 0


# ------------------------------------------------------------------ in the scheduler core


def timed_step(state, accept, verify_s=flat_verify, draft_s=lambda k: 0.002 * k):
    """One step of every running request: the drafter proposes [50, 51, ...], the verifier
    accepts accept(request_id, num_draft) of them and emits them plus token 9; the step's
    timings come from verify_s(T) and draft_s(largest k), as the service would report them.
    Returns {request_id: drafts verified} for the decode rows."""
    state.boundary(time.time())
    plan = state.plan_step(time.time())
    for drafter_id, message in state.draft_batches(plan, time.time()).items():
        reply = DraftResponse(batch_id=message.batch_id, drafter_id=drafter_id, rows=[
            DraftResult(request_id=r.request_id, draft_token_ids=list(range(50, 50 + r.num_draft))) for r in message.rows])
        state.apply_draft(plan, drafter_id, message, reply)
        state.draft_timed(drafter_id, message, reply, draft_s(max((r.num_draft for r in message.rows), default=0)))
    drafts = {}
    for verifier_id, message in state.verify_batches(plan, time.time()).items():
        rows = []
        for r in message.rows:
            accepted = accept(r.request_id, len(r.draft_token_ids)) if r.emit else 0
            rows.append(VerifyResult(request_id=r.request_id, step=r.step, num_draft=len(r.draft_token_ids),
                                     num_accepted=accepted, token_ids=[*r.draft_token_ids[:accepted], 9] if r.emit else []))
            drafts[r.request_id] = len(r.draft_token_ids)
        reply = VerifyResponse(batch_id=message.batch_id, verifier_id=verifier_id, rows=rows)
        state.apply_verify(plan, verifier_id, reply, time.time())
        tokens = sum(len(r.new_token_ids) + len(r.draft_token_ids) for r in message.rows)
        state.verify_timed(verifier_id, message, reply, verify_s(tokens), 0.0, retried=False)
    state.end_step(plan)
    return drafts


def never(_request_id, _num_draft):
    return 0


def test_a_greedy_request_with_a_useless_draft_settles_at_k0_and_reports_its_ks(tokenizer):
    state = new_state(tokenizer)
    request = submit(state, sampling={"max_tokens": 200}, speculative={"num_speculative_tokens": 4})
    ks = [timed_step(state, never)["r1"] for _ in range(80)]
    # prefill (0), then the measuring steps (k = 4, 3, 2, 1, 0, MIN_SAMPLES each, one more at 4:
    # the first draft batch feeds the prompt and is not timed), then 0 with probes of 1
    measuring = [4] + [k for k in (4, 3, 2, 1, 0) for _ in range(MIN_SAMPLES)]
    assert ks[1:1 + len(measuring)] == measuring
    settled = ks[1 + len(measuring):]
    assert set(settled) == {0, 1}
    first = settled.index(1)  # the measuring steps at 0 count towards the first probe's 16
    assert first < 16 and settled.index(1, first + 1) == first + 32  # then a failed probe doubles the wait
    usage = request.usage()
    decode_ks = ks[1:]
    assert usage.speculative_lengths == [decode_ks.count(k) for k in range(5)]
    assert usage.draft_tokens_proposed == sum(decode_ks) and usage.draft_tokens_accepted == 0


def test_a_greedy_request_with_a_perfect_draft_keeps_its_k(tokenizer):
    state = new_state(tokenizer)
    submit(state, sampling={"max_tokens": 400}, speculative={"num_speculative_tokens": 4})
    ks = [timed_step(state, lambda _r, n: n)["r1"] for _ in range(40)]
    assert ks[-10:] == [4] * 10


def test_rejection_sampled_rows_keep_their_k_and_gumbel_rows_adapt(tokenizer):
    state = new_state(tokenizer)
    sampled = {"temperature": 1.0, "max_tokens": 300, "seed": 3}
    submit(state, "rej", sampling={**sampled, "coupling": "rejection"}, speculative={"num_speculative_tokens": 4})
    submit(state, "gum", sampling=sampled, speculative={"num_speculative_tokens": 4})  # gumbel: the default
    steps = [timed_step(state, never, verify_s=lambda t: 0.030 + 0.003 * t) for _ in range(60)]
    assert {s["rej"] for s in steps[1:]} == {4}  # a seeded stream of rejection sampling depends on k
    assert [s["gum"] for s in steps[-30:]].count(0) >= 27  # at most the probes take a draft


def test_adaptive_k_off_takes_the_requests_k_every_step(tokenizer):
    state = new_state(tokenizer, adaptive_k="false")
    submit(state, sampling={"max_tokens": 200}, speculative={"num_speculative_tokens": 3})
    ks = [timed_step(state, never)["r1"] for _ in range(40)]
    assert ks[1:] == [3] * 39
