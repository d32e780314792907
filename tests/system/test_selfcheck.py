"""`specbus selfcheck`: its statistics without NATS, then the command itself against
real multi-process stacks on the tiny pair: a healthy one passes the quick run, and one whose
verifier runs the same-token bypass (a known-bad rejection rule, injected through the test-only
hook in tests/system/selfcheck_hook/) fails the distribution check."""

import asyncio
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from services.commands.selfcheck import FULL, MIN_GROUP, QUICK
from services.commands.selfcheck_core import (
    ALPHA,
    CheckResult,
    LogprobEntry,
    bin_counts,
    chi2_sf,
    distribution_bins,
    distribution_results,
    logprob_diffs,
    merge_small_bins,
    pooled_gof,
    render_table,
    same_token_bypass,
)
from services.launch.stack import Stack

HOOK_DIR = Path(__file__).parent / "selfcheck_hook"
CELLS = 10  # the quick run's distribution cells: the Bonferroni factor the tests below use
BAD_RULE_SAMPLES = 200  # M for the bad-rule run: its bias shows in a few cells, at a fixed margin
TARGET_PROBS = np.array([0.4, 0.3, 0.15, 0.1, 0.05])  # a next-token distribution like the tiny pair's


# ---------------------------------------------------------------------------------------------
# statistics


@pytest.mark.parametrize("x", [0.01, 1.0, 3.84, 10.0, 80.0])
def test_chi2_sf_matches_the_closed_forms_for_one_and_two_degrees_of_freedom(x):
    assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-10)
    assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-10)


def test_chi2_sf_matches_tabulated_values():
    assert chi2_sf(0.5, 3) == pytest.approx(0.918891, rel=1e-5)
    assert chi2_sf(50.0, 10) == pytest.approx(2.669083e-07, rel=1e-5)
    assert chi2_sf(18.307, 10) == pytest.approx(0.05, rel=1e-4)


def test_small_bins_are_merged_until_each_expects_five():
    observed, expected = merge_small_bins(np.array([50, 30, 3, 2, 1]), np.array([48.0, 32.0, 2.0, 2.0, 2.0]))
    assert expected.tolist() == [48.0, 32.0, 6.0] and observed.tolist() == [50, 30, 6]
    observed, expected = merge_small_bins(np.array([9, 1, 0]), np.array([8.0, 1.0, 1.0]))
    assert expected.tolist() == [10.0] and observed.tolist() == [10]  # one bin: nothing to test
    assert pooled_gof([(np.array([9, 1, 0]), np.array([0.8, 0.1, 0.1]))]).p_value is None


def test_groups_add_their_statistics_and_degrees_of_freedom():
    one = (np.array([60, 40]), np.array([0.5, 0.5]))
    two = (np.array([30, 70]), np.array([0.5, 0.5]))
    alone = [pooled_gof([group]) for group in (one, two)]
    both = pooled_gof([one, two])
    assert both.dof == 2 and both.statistic == pytest.approx(alone[0].statistic + alone[1].statistic)
    assert both.p_value == pytest.approx(chi2_sf(both.statistic, 2))


def test_top_logprobs_become_bins_with_the_rest_last():
    ids, probs = distribution_bins([7, 3, 9], [math.log(0.5), math.log(0.25), -math.inf])
    assert ids == [7, 3] and probs == pytest.approx([0.5, 0.25, 0.25])
    assert bin_counts([7, 7, 3, 11, 12], ids).tolist() == [2, 1, 2]


def test_same_token_bypass_formula_matches_the_rule_run_draw_by_draw():
    rng = np.random.default_rng(0)
    draft, n = 0, 200_000
    target_draws = rng.choice(len(TARGET_PROBS), size=n, p=TARGET_PROBS)
    accepted = (target_draws == draft) | (rng.random(n) < TARGET_PROBS[draft])
    residual = np.where(np.arange(len(TARGET_PROBS)) == draft, 0.0, TARGET_PROBS)
    recovered = rng.choice(len(TARGET_PROBS), size=n, p=residual / residual.sum())
    emitted = np.where(accepted, draft, recovered)
    frequencies = np.bincount(emitted, minlength=len(TARGET_PROBS)) / n
    np.testing.assert_allclose(frequencies, same_token_bypass(TARGET_PROBS, draft), atol=4e-3)
    assert same_token_bypass(TARGET_PROBS, draft).sum() == pytest.approx(1.0)


@pytest.mark.parametrize("num_samples, min_power", [(QUICK.samples, 0.75), (FULL.samples, 1.0)])
def test_at_the_chosen_m_the_test_accepts_exact_samples_and_rejects_the_bypass(num_samples, min_power):
    """One cell, its Bonferroni share of alpha, 300 seeds: exact samples fail at about
    alpha / CELLS; samples from the bypass (draft = the likeliest token, q = 0.4) fail in at
    least min_power of the runs (the quick run has several such cells; the full run's M
    catches it in every one)."""
    rng = np.random.default_rng(1)
    threshold = ALPHA / CELLS
    biased = same_token_bypass(TARGET_PROBS, 0)
    exact_fail = sum(pooled_gof([(rng.multinomial(num_samples, TARGET_PROBS), TARGET_PROBS)]).p_value < threshold
                     for _ in range(300))
    biased_fail = sum(pooled_gof([(rng.multinomial(num_samples, biased), TARGET_PROBS)]).p_value < threshold
                      for _ in range(300))
    assert exact_fail <= 3 and biased_fail >= min_power * 300


def test_logprob_comparison_handles_inf_and_ties_at_the_top_n_cut():
    inf = -math.inf
    entry = LogprobEntry(5, -0.5, {5: -0.5, 6: -1.0, 7: -2.0}, [-3.0, inf])
    same, count, problems = logprob_diffs(entry, LogprobEntry(5, -0.50001, {5: -0.5, 6: -1.0, 8: -2.00002},
                                                              [-3.0, inf]), 1e-4)
    assert problems == [] and same == pytest.approx(1e-5) and count == 1 + 2 + 2
    _, _, problems = logprob_diffs(entry, LogprobEntry(5, -0.5, {5: -0.5, 6: -1.0, 8: -1.5}, [-3.0, -9.0]), 1e-4)
    assert "top id 8 in one list only" in problems and "logprob differs by inf" in problems


def test_distribution_rows_fail_on_a_token_outside_the_candidates_and_on_too_little_power():
    cell = {"context": 0, "temperature": 0.7, "draft_mode": "greedy", "position": 1, "G": 3.0, "dof": 4,
            "p": 0.5, "outside_candidates": 0, "bypass_p": 1e-9}
    distribution, power = distribution_results([cell, {**cell, "position": 2, "bypass_p": 0.3}], ALPHA, 200)
    assert distribution.passed and power.passed and power.statistic == "1/2 cells reject"
    distribution, power = distribution_results([{**cell, "p": 0.0, "outside_candidates": 2, "bypass_p": 0.3}],
                                               ALPHA, 200)
    assert not distribution.passed and "2 sampled tokens outside the candidate set" in distribution.notes[0]
    assert not power.passed and "raise --samples" in power.notes[0]


def test_the_table_marks_failures_and_says_the_run_failed():
    table = render_table([CheckResult("greedy identity", 12, "12/12 identical", "-", True),
                          CheckResult("distribution", 10, "worst G=47", "p_adj=1e-06", False, notes=["worst cell"])])
    assert "FAIL" in table and table.endswith("1/2 checks passed: FAILED") and "distribution: worst cell" in table


# ---------------------------------------------------------------------------------------------
# the command against real stacks (tiny pair)


def stack_settings(bad_rule: bool = False, dtype: str | None = None) -> dict:
    # A generous draft timeout: on a loaded 2-core machine, steps whose drafter is late run with
    # k=0, which the seed check would have to rerun.
    role_env = {}
    if bad_rule:
        role_env = {"verifier": {"PYTHONPATH": os.pathsep.join([str(HOOK_DIR), os.environ.get("PYTHONPATH", "")]),
                                 "SPECBUS_TEST_REJECTION_RULE": "same_token_bypass"}}
    return dict(dtype=dtype, role_args={"scheduler": ["--draft-timeout-s", "5"]}, role_env=role_env)


async def selfcheck(stack: Stack, *args: str) -> tuple[int, dict, str]:
    """`specbus selfcheck --url <stack> --json ...` as a user runs it; (exit code, report, stderr)."""
    login = stack.client_login()
    env = {**os.environ, "SPECBUS_NATS_USER": login["user"], "SPECBUS_NATS_PASSWORD": login["password"]}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "--log-level", "warning", "selfcheck", "--url", stack.url, "--json",
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=600)
    assert stdout, f"exit {process.returncode}, no report; stderr ends:\n{stderr.decode()[-3000:]}"
    return process.returncode, json.loads(stdout), stderr.decode()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_quick_selfcheck_passes_on_a_healthy_stack(start_stack, tiny_pair, dtype):
    async with start_stack(*tiny_pair, **stack_settings(dtype=dtype)) as stack:
        code, report, progress = await selfcheck(stack, "--quick")
    rows = {row["name"]: row for row in report["checks"]}
    assert code == 0 and report["passed"], json.dumps([row for row in report["checks"] if not row["passed"]])[:3000]
    # each check says on stderr when it starts and how it ended, one line each, in order
    lines = [line for line in progress.splitlines() if line.startswith("selfcheck: ")]
    titles = ["greedy identity", "distribution", "logprob identity", "seed reproducibility", "coupling invariance",
              "degradation honesty"]
    assert lines[0::2] == [f"selfcheck: {title}: started" for title in titles], progress[-3000:]
    assert [line.rsplit(" (", 1)[0] for line in lines[1::2]] == [f"selfcheck: {title}: passed" for title in titles]
    assert list(rows) == ["greedy identity", "distribution", "power: same-token bypass (simulated)",
                          "logprob identity", "seed reproducibility", "coupling invariance", "degradation honesty"]
    cells = rows["distribution"]["details"]
    assert rows["distribution"]["cells"] >= 4 and all(d["samples"] >= MIN_GROUP for d in cells if d["p"] is not None)
    assert rows["greedy identity"]["cells"] == QUICK.greedy_prompts * 3
    assert sum(d["draft_accepted"] for d in rows["greedy identity"]["details"]) > 0  # speculation ran
    assert rows["logprob identity"]["value"] == "max diff 0", rows["logprob identity"]  # bit for bit


async def test_selfcheck_fails_when_the_verifier_accepts_drafts_equal_to_its_own_sample(start_stack, tiny_pair):
    async with start_stack(*tiny_pair, **stack_settings(bad_rule=True)) as stack:
        code, report, progress = await selfcheck(stack, "--quick", "--checks", "distribution", "--samples",
                                                 str(BAD_RULE_SAMPLES))
    rows = {row["name"]: row for row in report["checks"]}
    shown = json.dumps(report)[:4000]
    assert code == 1 and not report["passed"] and not rows["distribution"]["passed"], shown
    assert "selfcheck: distribution: FAILED (" in progress
    assert rows["power: same-token bypass (simulated)"]["passed"], shown
    # where the bypass shows: a speculative position of the greedy-draft cells (point-mass drafts)
    worst = min(rows["distribution"]["details"], key=lambda d: d["p"] if d["p"] is not None else 1.0)
    assert worst["position"] >= 1 and worst["draft_mode"] == "greedy", shown
