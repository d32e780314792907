"""A verifier's measured pace (services/scheduler/budget/step_budget.py): the fit of a batch's round
trip to its tokens, the step budget it gives and the verify deadline; timings are made up."""

import pytest

from services.scheduler.budget.step_budget import COLD_STEP_TOKENS, DECODE_SHARE, MIN_STEP_TOKENS, VERIFY_SLACK, Pace, StepBudget


def budget(target_step_s=0.5, max_step_tokens=1024, verify_timeout_s=10.0) -> StepBudget:
    return StepBudget(target_step_s, max_step_tokens, verify_timeout_s)


def test_a_verifier_never_timed_gets_the_cold_budget_and_the_floor_wait():
    fresh = budget()
    assert fresh.step_tokens("v1") == COLD_STEP_TOKENS and fresh.attempt_s("v1", 5000) == 10.0
    assert budget(max_step_tokens=10).step_tokens("v1") == 10  # never above max_step_tokens


def test_sizes_far_apart_separate_the_overhead_from_the_cost_per_token():
    pace = budget()
    for tokens in (10, 200, 40, 400, 100) * 3:
        pace.timed("v1", tokens, 0.05 + 0.002 * tokens)
    overhead, per_token = pace.paces["v1"].fit()
    assert overhead == pytest.approx(0.05) and per_token == pytest.approx(0.002)
    assert pace.step_tokens("v1") == 225  # (0.5 - 0.05) / 0.002
    assert pace.step_tokens("other") == COLD_STEP_TOKENS  # per verifier


def test_sizes_alike_charge_every_token_the_overhead():
    pace = Pace()
    for _ in range(5):
        pace.add(100, 0.3)
    assert pace.fit() == (0.0, pytest.approx(0.003))  # 0.3 s / 100 tokens, none of it overhead


def test_decode_only_steps_after_prompts_keep_the_cost_per_token_and_refit_the_overhead():
    """Between prompts every batch is a few decode tokens: their sizes tell nothing of a token's
    cost, so the last fit that did keeps it, and the recent times give the overhead."""
    pace = budget()
    for tokens in (10, 200, 40, 400, 100) * 3:
        pace.timed("v1", tokens, 0.05 + 0.002 * tokens)
    for _ in range(60):
        pace.timed("v1", 8, 0.116)  # decode rows only, on a verifier now busier: 0.1 s + 8 tokens
    overhead, per_token = pace.paces["v1"].fit()  # the last fit that told them apart mixed both phases
    assert per_token == pytest.approx(0.002, rel=0.1) and overhead == pytest.approx(0.116 - 8 * per_token, rel=1e-3)
    assert pace.step_tokens("v1") == pytest.approx(200, rel=0.1)  # (0.5 - 0.1) / 0.002; 0.116 s / 8 tokens: 34
    for _ in range(60):
        pace.timed("v1", 8, 0.008)  # faster than the kept cost allows an overhead: charged per token
    assert pace.paces["v1"].fit() == (0.0, pytest.approx(0.001, rel=0.05))


def test_the_budget_stays_within_its_bounds():
    slow, fast = budget(), budget()
    slow.timed("v1", 10, 5.0)  # a step of 10 tokens already takes 10 x the target
    fast.timed("v1", 1000, 0.001)
    assert slow.step_tokens("v1") == MIN_STEP_TOKENS and fast.step_tokens("v1") == 1024


def test_the_pace_follows_a_verifier_that_slows_down():
    pace = budget()
    for _ in range(20):
        pace.timed("v1", 100, 0.1)
    before = pace.step_tokens("v1")
    for _ in range(60):
        pace.timed("v1", 100, 0.4)  # another scheduler's batches now queue there too
    assert before == 500 and pace.step_tokens("v1") == pytest.approx(125, abs=2)


def test_a_bigger_batch_is_waited_for_longer_and_never_less_than_verify_timeout_s():
    """A try waits VERIFY_SLACK x lanes predicted round trips of the batch, or of the step
    budget when that is larger (every lane's batch may be queued before it), at least
    verify_timeout_s."""
    pace, two_lanes = budget(verify_timeout_s=1.0), StepBudget(0.5, 1024, 1.0, lanes=2)
    for tokens in (10, 100, 1000) * 3:
        pace.timed("v1", tokens, 0.001 * tokens)  # 1 ms a token: the step budget is 500
        two_lanes.timed("v1", tokens, 0.001 * tokens)
    assert pace.step_tokens("v1") == 500
    assert pace.attempt_s("v1", 10) == pace.attempt_s("v1", 500) == pytest.approx(VERIFY_SLACK * 0.5)
    assert pace.attempt_s("v1", 4000) == pytest.approx(VERIFY_SLACK * 4.0)
    assert two_lanes.attempt_s("v1", 4000) == pytest.approx(2 * VERIFY_SLACK * 4.0)
    assert budget(verify_timeout_s=30.0).attempt_s("v1", 4000) == 30.0  # not timed yet: the floor
    floor = budget(verify_timeout_s=30.0)
    floor.timed("v1", 100, 0.1)
    assert floor.attempt_s("v1", 100) == 30.0  # timed, and still under the floor


def test_time_spent_queued_behind_another_answer_is_not_the_batchs_own():
    """Two lanes' batches sent together: the second's round trip includes the first's time at
    the verifier, which is not counted against it."""
    pace = budget()
    pace.timed("v1", 100, 0.2, answered_at=10.2)  # sent at 10.0, answered at 10.2
    pace.timed("v1", 100, 0.4, answered_at=10.4)  # sent at 10.0 too: queued until 10.2
    assert pace.paces["v1"].fit() == (0.0, pytest.approx(0.002))  # 0.2 s each, not 0.2 and 0.4


@pytest.mark.parametrize("start_rows", [4, 80])
def test_the_rows_a_step_fits_approach_what_fits_the_target_from_either_side(start_rows):
    """A decode step of R rows takes 0.05 + 0.01 R s; decode rows may fill DECODE_SHARE of the
    0.5 s target: 20 rows. Requests start while fewer run than the estimate, and running ones
    only leave as they end (here: one a step)."""
    pace, rows = budget(), start_rows
    for _ in range(200):
        pace.step_timed("v1", rows, 0, 0.05 + 0.01 * rows)
        rows = rows + 1 if pace.room("v1", rows) else max(rows - 1, 1)
    fits = (DECODE_SHARE * 0.5 - 0.05) / 0.01
    assert pace.rows_fit["v1"] == pytest.approx(fits, abs=1.0) and abs(rows - fits) <= 2


def test_a_steps_prefill_is_not_put_down_to_its_decode_rows():
    with_prefill, decode_only = budget(), budget()
    for tokens in (10, 200, 40, 400, 100) * 3:
        with_prefill.timed("v1", tokens, 0.05 + 0.002 * tokens)  # 2 ms a prompt token
    with_prefill.step_timed("v1", 10, 100, 0.15 + 0.2)  # 10 decode rows in 0.15 s, 100 prompt tokens in 0.2
    decode_only.step_timed("v1", 10, 0, 0.15)
    assert with_prefill.rows_fit["v1"] == pytest.approx(decode_only.rows_fit["v1"]) == \
        pytest.approx(10 * DECODE_SHARE * 0.5 / 0.15)
    overstated = budget()
    overstated.timed("v1", 100, 1.0)  # a cautious pace: 10 ms a token
    overstated.step_timed("v1", 10, 100, 0.4)  # its prefill estimate (1 s) exceeds the step
    assert overstated.rows_fit["v1"] == pytest.approx(10 * DECODE_SHARE * 0.5 / (0.25 * 0.4))


def test_room_before_any_step_timed_and_always_for_a_first_request():
    pace = budget()
    assert pace.room("v1", 500)  # never timed: max_running and the verifier's slots are the bounds
    pace.step_timed("v1", 4, 0, 40.0)  # a verifier that took 40 s for a step of 4 rows
    assert not pace.room("v1", 1) and pace.room("v1", 0)
    two_lanes = StepBudget(0.5, 1024, 10.0, lanes=2)
    two_lanes.step_timed("v1", 10, 0, 0.5)  # each lane's step fits 5 rows: the verifier 10
    assert two_lanes.room("v1", 9) and not two_lanes.room("v1", 10)
