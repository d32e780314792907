"""Prompt lookup (gpu_worker/drafter/ngram.py): the n-gram proposal rule, and the drafter's slot
bookkeeping (the model drafter's receiver rule) without any model."""

import time

import numpy as np
import pytest

from gpu_worker.drafter.drafter_core import draft_batch
from gpu_worker.drafter.ngram import load_ngram_drafter, propose_ngram, propose_ngram_tree
from schemas.config import DrafterConfig, load_config
from schemas.errors import SpecbusError
from schemas.steps import DraftRequest, DraftRow, DraftTokens, Proposal

MAX_SLOTS = 3


def ngram(history, k, max_n=4, min_n=1):
    return propose_ngram(np.array(history), k, max_n, min_n)


# --- the proposal rule -------------------------------------------------------------------------


def test_the_longest_suffix_match_wins_over_a_more_recent_shorter_one():
    # suffix [1, 2, 3]: matched in full at 0 (followed by 10, 11); [2, 3] alone also at 6 (then 20)
    history = [1, 2, 3, 10, 11, 5, 2, 3, 20, 9, 1, 2, 3]
    assert ngram(history, 2) == [10, 11]
    assert ngram(history, 2, max_n=2) == [20, 9]  # n capped at 2: the most recent [2, 3]


def test_the_most_recent_occurrence_is_used():
    history = [7, 8, 1, 7, 8, 2, 7, 8]
    assert ngram(history, 1) == [2]
    assert ngram(history, 3) == [2, 7, 8]  # reads on to the end of the history


def test_a_match_that_runs_into_the_suffix_repeats_its_period():
    assert ngram([4, 5, 6, 4, 5, 6, 4], 7) == [5, 6, 4, 5, 6, 4, 5]
    assert ngram([3, 3, 3], 4) == [3, 3, 3, 3]


def test_no_match_or_no_room_proposes_nothing():
    assert ngram([1, 2, 3, 4], 4) == []  # the last token never occurred before
    assert ngram([5], 4) == []
    assert ngram([1, 2, 1], 0) == []
    assert ngram([1, 9, 5, 2, 9], 3, min_n=2) == []  # only a 1-gram match, and min_n is 2
    assert ngram([1, 9, 5, 2, 9], 3, min_n=1) == [5, 2, 9]


def test_a_tree_merges_every_matchs_continuation_and_keeps_the_chain_first():
    history = np.array([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3])
    # the most recent match of (1, 2, 3) continues 5 7 1 (the chain), the earlier one 4 9 1
    assert propose_ngram_tree(history, 3, 3, 3) == ([5, 7, 1], [-1, 0, 1]) and propose_ngram(history, 3, 3) == [5, 7, 1]
    tokens, parents = propose_ngram_tree(history, 16, 3, 3)
    assert (tokens, parents) == ([5, 7, 1, 4, 9, 1], [-1, 0, 1, -1, 3, 4])
    DraftTokens(draft_token_ids=np.array(tokens, np.int32), parents=np.array(parents, np.int32), proposal=Proposal())
    # a shared prefix adds only the new tokens; the node budget cuts the last continuation
    shared = np.array([1, 2, 8, 9, 1, 2, 8, 5, 1, 2])
    assert propose_ngram_tree(shared, 3, 2, 2) == ([8, 5, 9], [-1, 0, 0])
    assert propose_ngram_tree(shared, 2, 2, 2) == ([8, 5], [-1, 0])
    assert propose_ngram_tree(np.array([1, 2, 3]), 8, 4, 2) == ([], [])


def test_proposals_are_only_ids_the_history_holds():
    rng = np.random.default_rng(0)
    for _ in range(200):
        history = rng.integers(0, 6, size=int(rng.integers(1, 40)))
        drafts = propose_ngram(history, 5, 4, 1)
        assert set(drafts) <= set(history.tolist()) and len(drafts) in (0, 5)


# --- the drafter -------------------------------------------------------------------------------


def new_drafter(**overrides):
    settings = dict(draft_method="ngram", instance_id="ngram-test", max_slots=MAX_SLOTS, max_seq_len=32)
    return load_ngram_drafter(load_config(DrafterConfig, env={}, **{**settings, **overrides}))


def row(request_id, new_token_ids, num_draft=4, cached_len=0, index=0, max_nodes=0):
    return DraftRow(request_id=request_id, row=index, step=0, cached_len=cached_len, new_token_ids=new_token_ids,
                    num_draft=num_draft, max_nodes=max_nodes)


def results(drafter, *rows, release=(), now=None):
    request = DraftRequest(batch_id=1, scheduler_id="sched-test", deadline=time.time() + 30, rows=list(rows),
                           release=list(release))
    return {r.request_id: r for r in draft_batch(drafter, request, now=now).rows}


PROMPT = [11, 12, 13, 14, 15, 16, 11, 12]  # ends with a 2-gram seen at the start: drafts 13, 14, 15, 16


def test_drafts_are_point_mass_proposals_from_the_history():
    drafter = new_drafter()
    got = results(drafter, row("a", PROMPT), row("none", [1, 2, 3], index=1), row("k0", PROMPT, num_draft=0, index=2))
    assert got["a"].draft_token_ids.tolist() == [13, 14, 15, 16] and got["a"].proposal.kind == "point_mass"
    assert got["none"].draft_token_ids.tolist() == [] and not got["none"].need_resync
    assert got["k0"].draft_token_ids.tolist() == []
    assert drafter.counters["rows_unmatched"] == 1 and drafter.counters["draft_tokens"] == 4


def test_steps_fed_piecewise_propose_as_the_whole_history_does():
    # the verifier accepted 13, 14 and emitted 99: the history grows by 3, then by one more
    drafter = new_drafter()
    results(drafter, row("a", PROMPT))
    history = PROMPT + [13, 14, 99]
    got = results(drafter, row("a", [13, 14, 99], cached_len=len(PROMPT)))["a"]
    assert got.draft_token_ids.tolist() == ngram(history, 4)
    history.append(11)
    got = results(drafter, row("a", [11], cached_len=len(history) - 1))["a"]
    assert got.draft_token_ids.tolist() == ngram(history, 4) == [12, 13, 14, 99]


def test_a_changed_history_replaces_what_the_slot_held_past_cached_len():
    drafter = new_drafter()
    results(drafter, row("a", PROMPT))
    got = results(drafter, row("a", [40, 41, 11], cached_len=3))["a"]  # the slot held PROMPT[3:] past 3
    assert got.draft_token_ids.tolist() == ngram(PROMPT[:3] + [40, 41, 11], 4) == [12, 13, 40, 41]


def test_unknown_request_or_short_slot_needs_resync():
    drafter = new_drafter()
    assert results(drafter, row("a", PROMPT[5:], cached_len=5))["a"].need_resync
    assert drafter.cache.num_free == MAX_SLOTS
    results(drafter, row("b", PROMPT[:4]))
    assert results(drafter, row("b", PROMPT[6:], cached_len=6))["b"].need_resync


def test_release_idle_eviction_and_a_full_table():
    drafter = new_drafter(slot_idle_ttl_s=60.0)
    now = time.monotonic()
    for i in range(MAX_SLOTS):
        results(drafter, row(f"r{i}", PROMPT), now=now + i)
    got = results(drafter, row("new", PROMPT), now=now + 10)["new"]
    assert len(got.draft_token_ids) == 4 and ("sched-test", "r0") not in drafter.requests  # least recently used
    results(drafter, release=["r1", "never-seen"], now=now + 11)
    assert drafter.cache.num_free == 1 and drafter.counters["release_unknown"] == 1
    results(drafter, now=now + 65.0)  # r2 (t+2) idle past 60 s; new (t+10) is not
    assert sorted(rid for _, rid in drafter.requests) == ["new"]


def test_drafts_stop_where_the_verifier_would_refuse_the_row():
    drafter = new_drafter(max_seq_len=32)
    history = (PROMPT * 4)[:30]
    assert len(results(drafter, row("a", history))["a"].draft_token_ids) == 2  # 30 + 2 = max_seq_len
    assert len(results(drafter, row("b", (PROMPT * 5)[:33]))["b"].draft_token_ids) == 0  # too long: nothing


# [1, 2] occurs twice before the end, followed by 3 4 and by 5 6: two continuations
BRANCHING = [1, 2, 3, 4, 9, 1, 2, 5, 6, 9, 1, 2]


def test_a_row_with_a_node_budget_is_answered_a_tree_of_every_match():
    drafter = new_drafter()
    got = results(drafter, row("tree", BRANCHING, num_draft=2, max_nodes=8),
                  row("chain", BRANCHING, num_draft=2, index=1))
    tree = got["tree"]
    assert (tree.draft_token_ids.tolist(), tree.parents.tolist()) == propose_ngram_tree(np.array(BRANCHING), 8, 2, 4)
    assert tree.draft_token_ids.tolist() == [5, 6, 3, 4] and tree.parents.tolist() == [-1, 0, -1, 2]
    assert tree.proposal.kind == "point_mass"
    assert got["chain"].draft_token_ids.tolist() == [5, 6] and got["chain"].parents is None  # no budget: a chain
    assert drafter.counters["rows_tree"] == 1 and drafter.counters["draft_tokens"] == 6


def test_a_tree_within_its_budget_and_one_path_as_a_chain():
    drafter = new_drafter()
    got = results(drafter, row("cut", BRANCHING, num_draft=2, max_nodes=3),
                  row("one", PROMPT, num_draft=4, max_nodes=16, index=1))
    assert got["cut"].draft_token_ids.tolist() == [5, 6, 3] and got["cut"].parents.tolist() == [-1, 0, -1]
    # one match: the same chain propose_ngram gives, sent without parents (the verifier's chain path)
    assert got["one"].draft_token_ids.tolist() == ngram(PROMPT, 4) and got["one"].parents is None


def test_a_tree_keeps_within_the_verifiers_room():
    drafter = new_drafter(max_seq_len=len(BRANCHING) + 3)
    got = results(drafter, row("a", BRANCHING, num_draft=2, max_nodes=8))["a"]
    assert got.draft_token_ids.tolist() == [5, 6, 3] and got.parents.tolist() == [-1, 0, -1]  # history + 3 nodes


@pytest.mark.parametrize("overrides, field", [({"ngram_min": 0}, "ngram_min"), ({"ngram_min": 5}, "ngram_min"),
                                              ({"max_slots": 0}, "max_slots")])
def test_bad_settings_are_refused_naming_the_field(overrides, field):
    with pytest.raises(SpecbusError, match=field) as raised:
        new_drafter(**overrides)
    assert raised.value.field == field


def test_an_unknown_draft_method_is_refused_naming_the_field():
    with pytest.raises(SpecbusError, match="draft_method: 'medusa' is not one of") as raised:
        load_config(DrafterConfig, env={}, draft_method="medusa")
    assert raised.value.field == "draft_method"
