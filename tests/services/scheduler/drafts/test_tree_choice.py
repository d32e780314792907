"""Trees or chains (services/scheduler/drafts/tree_choice.py): measure first, the rate comparison over
adaptive k's costs, the probes and their back-off, and the scheduler core driving it with timings
from a cost model (no NATS; the real stack is tests/system/pipeline/test_tree_pipeline.py)."""

import time

import pytest

from schemas.config import SchedulerConfig, load_config
from schemas.errors import SpecbusError
from schemas.bus.protocol import MAX_TREE_NODES
from schemas.steps import DraftResponse, DraftResult, VerifyResponse, VerifyResult
from services.scheduler.drafts.adaptive_k import MIN_SAMPLES, AdaptiveK, RowState
from services.scheduler.drafts.tree_choice import RowPlace, TreeChoice, TreeCounts, TreeRow, tree_sizes
from tests.services.scheduler.scheduler_harness import acceptance_history as chain_history
from tests.services.scheduler.scheduler_harness import new_state, submit

KEY = ("d", "greedy/greedy")
PLACE = RowPlace("v", "d")


def costs(chain_s, tree_s, k_max=4) -> AdaptiveK:
    """An AdaptiveK with MIN_SAMPLES timings of every batch-1 chain size (verify chain_s(T), a
    draft 0.002 s a token) and of tree batches of T = 2 .. 17 tokens (tree_s(T))."""
    adaptive = AdaptiveK(probe_steps=16)
    for _ in range(MIN_SAMPLES):
        for k in range(k_max + 1):
            adaptive.verify_timed("v", k + 1, chain_s(k + 1), 0.0)
            if k:
                adaptive.draft_timed("d", k, 0.002 * k)
        for tokens in range(2, 18):
            adaptive.verify_timed("v", tokens, tree_s(tokens), 0.0, tree=True)
    return adaptive


def chooser(adaptive, tokens_per_step, nodes_per_step=16, steps=40, size=16) -> TreeChoice:
    trees = TreeChoice(adaptive, probe_steps=16)
    trees.priors[KEY] = {size: TreeCounts(steps, steps * tokens_per_step, steps * nodes_per_step)}
    return trees


def flat(_tokens):
    return 0.030


def per_node(tokens):
    """A tree forward that costs more with every node: a 16-node tree 2.2x a one-token step."""
    return 0.030 * (1 + 0.08 * (tokens - 1))


def choices(trees, own, steps, depth=4, sizes=(16,), tree_tokens=2.0):
    """steps scheduler steps of one row, each verified (a tree step emits tree_tokens, a chain step
    1): the tree size each asked, 0 for a chain."""
    row, picked = TreeRow(), []
    for step in range(steps):
        tree = trees.choose(RowState(acceptance=own), row, KEY, depth, list(sizes), RowPlace("v", "d", step=step))
        picked.append(tree)
        trees.verified(row, KEY, tree, tree or depth, int(tree_tokens) - 1 if tree else 0)
    return picked


# ------------------------------------------------------------------ the pieces


def test_tree_counts_mean_own_steps_behind_the_drafters():
    prior = TreeCounts(10, 30, 120)  # 3 tokens and 12 nodes a step
    assert TreeCounts().means(prior) == (3.0, 12.0)
    own = TreeCounts()
    for _ in range(40):
        own.record(nodes=4, tokens=1, decay=0.9)
    tokens, nodes = own.means(prior)
    # its own decayed steps (about 10) outweigh the prior's PRIOR_WEIGHT pseudo-steps
    assert 1.0 < tokens < 1.7 and 4.0 < nodes < 7.0


def test_a_drafter_and_rule_ask_trees_first_until_measured():
    trees = TreeChoice(costs(flat, per_node), probe_steps=16)
    row = TreeRow()
    for _ in range(MIN_SAMPLES):
        assert trees.choose(RowState(acceptance=chain_history(0.9)), row, KEY, 4, [16], PLACE)
        trees.verified(row, KEY, 16, 16, 0)
    assert not trees.choose(RowState(acceptance=chain_history(0.9)), row, KEY, 4, [16], PLACE)  # a good chain now


def test_a_tree_that_emits_more_for_its_cost_wins_and_one_that_does_not_loses():
    own = RowState(acceptance=chain_history(0.5))  # a chain of 4 emits 1.94 tokens a step
    assert chooser(costs(flat, flat), tokens_per_step=3.0).choose(own, TreeRow(), KEY, 4, [16], PLACE)
    # the same tree at 2.2x a step's cost: 3 tokens for 2.2 steps' time is less than 1.94 for one
    assert not chooser(costs(flat, per_node), tokens_per_step=3.0).choose(own, TreeRow(), KEY, 4, [16], PLACE)
    # the tree's cost is read at its measured size: small trees cost less than full ones
    assert chooser(costs(flat, per_node), tokens_per_step=2.5, nodes_per_step=2).choose(own, TreeRow(), KEY, 4, [16],
                                                                                           PLACE)


def test_until_adaptive_k_has_timed_its_chains_a_measured_drafter_takes_them():
    adaptive = AdaptiveK(probe_steps=16)
    trees = chooser(adaptive, tokens_per_step=3.0)
    assert not trees.choose(RowState(), TreeRow(), KEY, 4, [16], RowPlace("v", "d", alone=False))  # nothing timed
    adaptive.verify_timed("v", 17, 0.030, 0.0, tree=True)
    assert not trees.choose(RowState(), TreeRow(), KEY, 4, [16], PLACE)  # alone: adaptive k measures its chain sizes
    measured = chooser(costs(flat, flat), tokens_per_step=3.0)
    assert measured.choose(RowState(), TreeRow(), KEY, 4, [16], PLACE)


def test_a_losing_tree_is_probed_and_a_failed_probe_doubles_the_wait():
    trees = chooser(costs(flat, per_node), tokens_per_step=2.0)
    picked = choices(trees, chain_history(0.5), 16 + 32 + 1)
    assert [i for i, tree in enumerate(picked) if tree] == [15, 15 + 32]  # the probe did not win: twice as long


def test_a_losing_chain_is_probed_too():
    trees = chooser(costs(flat, flat), tokens_per_step=3.0)
    picked = choices(trees, chain_history(0.5), 40, tree_tokens=3.0)
    assert [i for i, tree in enumerate(picked) if not tree] == [15]  # then every 32 steps


def test_a_step_counts_once_towards_the_probe_however_many_rows_choose_in_it():
    trees = chooser(costs(flat, per_node), tokens_per_step=2.0)
    own = RowState(acceptance=chain_history(0.5))
    picked = [trees.choose(own, TreeRow(), KEY, 4, [16], RowPlace("v", "d", step=step // 4)) for step in range(64)]
    assert sum(map(bool, picked)) == 1 and picked.index(16) == 4 * 15


def test_tree_sizes_halve_while_a_tree_still_branches():
    assert tree_sizes(16, 4) == [16, 8] and tree_sizes(32, 4) == [32, 16, 8] and tree_sizes(8, 4) == [8]
    assert tree_sizes(64, 8) == [64, 32, 16] and tree_sizes(3, 4) == [3]


def test_every_size_is_measured_first_then_the_best_rate_is_asked():
    trees = TreeChoice(costs(flat, per_node), probe_steps=16)
    own, row = RowState(acceptance=chain_history(0.3)), TreeRow()
    asked = []
    for _ in range(2 * MIN_SAMPLES):
        asked.append(trees.choose(own, row, KEY, 4, [16, 8], PLACE))
        trees.verified(row, KEY, asked[-1], asked[-1], 2)  # both emit 3 tokens: the tree of 8 costs less

    assert asked == [16] * MIN_SAMPLES + [8] * MIN_SAMPLES
    assert trees.choose(own, row, KEY, 4, [16, 8], PLACE) == 8


def test_a_probe_of_trees_asks_the_least_measured_size():
    trees = chooser(costs(flat, per_node), tokens_per_step=2.0)   # trees of 16 lose to the chain
    trees.priors[KEY][8] = TreeCounts(2 * MIN_SAMPLES, 2 * MIN_SAMPLES * 2.0, 2 * MIN_SAMPLES * 8)
    picked = choices(trees, chain_history(0.5), 16, sizes=(16, 8))
    assert [size for size in picked if size] == [8]               # the probe: 8 has fewer steps than 16's 40


# ------------------------------------------------------------------ in the scheduler core


@pytest.mark.parametrize("nodes", [-1, MAX_TREE_NODES + 1])
def test_the_node_budget_setting_is_within_a_trees_bound(nodes):
    assert load_config(SchedulerConfig, env={}).max_tree_nodes == 0  # chains only by default
    assert load_config(SchedulerConfig, env={"SPECBUS_MAX_TREE_NODES": "16"}).max_tree_nodes == 16
    with pytest.raises(SpecbusError, match=f"max_tree_nodes: {nodes} is not in") as error:
        load_config(SchedulerConfig, env={}, max_tree_nodes=nodes)
    assert error.value.field == "max_tree_nodes"



def timed_step(state, accept, tree_s, chain_s=flat):
    """One step of every running request: a chain row is proposed [50, 51, ...]; a tree row two
    chains of its depth, [50, ...] and [60, ...]; the verifier accepts accept(tree) drafts (at
    most what the row has) and emits them plus token 9; timings from chain_s(T) / tree_s(T) and
    0.002 s a draft. Returns {request_id: drafts verified} of the emitting rows."""
    state.boundary(time.time())
    plan = state.plan_step(time.time())
    for drafter_id, message in state.draft_batches(plan, time.time()).items():
        rows = []
        for r in message.rows:
            chain = list(range(50, 50 + r.num_draft))
            if r.max_nodes:
                rows.append(DraftResult(request_id=r.request_id, draft_token_ids=chain + [60 + i for i in chain[:-1]],
                                        parents=[-1, *range(r.num_draft - 1), -1, *range(r.num_draft, 2 * r.num_draft - 2)]))
            else:
                rows.append(DraftResult(request_id=r.request_id, draft_token_ids=chain))
        reply = DraftResponse(batch_id=message.batch_id, drafter_id=drafter_id, rows=rows)
        state.apply_draft(plan, drafter_id, message, reply)
        state.draft_timed(drafter_id, message, reply, 0.002 * max(r.num_draft for r in message.rows))
    drafts = {}
    for verifier_id, message in state.verify_batches(plan, time.time()).items():
        results = []
        for r in message.rows:
            tree = r.parents is not None
            accepted = min(accept(tree), len(r.draft_token_ids) if not tree else r.draft_token_ids.size // 2) \
                if r.emit else 0
            results.append(VerifyResult(request_id=r.request_id, step=r.step, num_draft=len(r.draft_token_ids),
                                        num_accepted=accepted, token_ids=[7] * accepted + [9] if r.emit else []))
            if r.emit:
                drafts[r.request_id] = len(r.draft_token_ids)
        reply = VerifyResponse(batch_id=message.batch_id, verifier_id=verifier_id, rows=results)
        state.apply_verify(plan, verifier_id, reply, time.time())
        tokens = sum(len(r.new_token_ids) + len(r.draft_token_ids) for r in message.rows)
        timing = tree_s if any(r.parents is not None for r in message.rows) else chain_s
        state.verify_timed(verifier_id, message, reply, timing(tokens), 0.0, retried=False)
    state.end_step(plan)
    return drafts


def test_a_tree_that_pays_is_taken_and_its_steps_count_their_nodes(tokenizer):
    state = new_state(tokenizer, max_tree_nodes="8")
    request = submit(state, sampling={"max_tokens": 400}, speculative={"num_speculative_tokens": 4})
    steps = [timed_step(state, lambda tree: 3 if tree else 1, tree_s=flat)["r1"] for _ in range(60)]
    assert steps[-30:].count(7) >= 28  # trees of 7 nodes (two paths of 4 sharing nothing but the root) but probes
    usage = request.usage()
    assert usage.speculative_lengths[7] == steps.count(7) and usage.draft_tokens_proposed == sum(steps)


def test_a_tree_that_costs_more_than_it_emits_falls_back_to_the_chain(tokenizer):
    state = new_state(tokenizer, max_tree_nodes="8")
    submit(state, sampling={"max_tokens": 400}, speculative={"num_speculative_tokens": 4})
    steps = [timed_step(state, lambda tree: 2 if tree else 2, tree_s=per_node)["r1"] for _ in range(60)]
    assert steps[1:1 + MIN_SAMPLES] == [7] * MIN_SAMPLES  # measured first
    assert steps[-30:].count(7) <= 1 and steps[-30:].count(2) >= 29  # adaptive k's chains, a probe at most
