"""The verifier's tree rows (gpu_worker/verifier/verifier_trees.py) on a tiny random Llama: decode
steps whose drafts form trees emit exactly what k = 0 emits (greedy, Gumbel-coupled, penalised),
with the same logprobs, and leave the slot's ids, K/V and features as decoding does; a chain sent
as a tree is the chain, seeded sampling included; a tree row in a batch with chain and k = 0 rows
is what it is alone; rows a tree cannot be on are refused, naming the field. Sampled exactness
over trees is the sampler's (tests/gpu_worker/sampling/test_tree_acceptance.py)."""

import itertools

import numpy as np
import pytest
import torch

from schemas.errors import ErrorCode
from schemas.generation import LogprobOptions, RowSampling
from schemas.steps import Proposal, VerifyRow, chain_parents
from tests.gpu_worker.verifier.verifier_steps import (PENALTIES, PROMPT, SAMPLED, V, generate, new_verifier, one, run,
                                                   vrow)

OPTIONS = LogprobOptions(logprobs=3, logprob_token_ids=[0, 11], sampling_mask=True)
LOGPROB_FIELDS = ("token_logprobs", "top_ids", "top_logprobs", "requested_logprobs", "ranks")
GUMBEL = dict(temperature=0.9, top_p=0.8, seed=77, coupling="gumbel")
# (wrong siblings before, after) the path's node at each depth, and the depth from which the
# path's tokens are wrong (a tree with nothing right from there on)
SHAPES = [
    ([(0, 0)] * 3, 3),                          # the continuation as a chain
    ([(1, 1), (0, 2), (2, 0), (1, 0)], 4),      # the continuation among siblings at every depth
    ([(3, 0), (0, 1)], 2),                      # the last of four children of the root, then first of two
    ([(1, 2), (1, 0), (0, 0)], 0),              # nothing right
    ([(0, 1), (2, 0), (0, 0), (0, 0)], 2),      # right for two nodes, then a wrong path under it
    ([], 0),                                    # no node: a k = 0 step sent as a tree
]


def with_drafts(row: VerifyRow, drafts, parents=None, **fields) -> VerifyRow:
    """row with these drafts, a tree of these parents (None: a chain), and fields, validated as
    the wire validates them."""
    return VerifyRow.model_validate({**row.model_dump(), "draft_token_ids": np.array(drafts, np.int32),
                                     "parents": None if parents is None else np.array(parents, np.int32), **fields})


def tree_around(path: list[int], layout: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(drafts, parents) in depth-first preorder: path[d] at depth d + 1 with layout[d] = (before,
    after) wrong siblings, each wrong one with path[d + 1] as its child (never to be accepted)."""
    drafts, parents = [], []

    def add(token, parent):
        drafts.append(token)
        parents.append(parent)
        return len(drafts) - 1

    def level(d, parent):
        before, after = layout[d]
        decoys = [(path[d] + 1 + j) % V for j in range(before + after)]
        for token in decoys[:before] + [path[d]] + decoys[before:]:
            node = add(token, parent)
            if d + 1 == len(layout):
                continue
            if token == path[d]:
                level(d + 1, node)
            else:
                add(path[d + 1], node)

    if layout:
        level(0, -1)
    return drafts, parents


def trees_along(stream: list[int], expected: list[int]):
    """tree_for of `decode`: SHAPES in turn around the continuation of stream after the output so
    far, its tokens wrong (+50) from the shape's wrong depth on; appends to expected the drafts
    each tree should have accepted."""
    shapes = itertools.cycle(SHAPES)

    def tree_for(output):
        layout, wrong_from = next(shapes)
        p = len(output)
        assert p + len(layout) <= len(stream), "the stream covers every tree"
        path = [stream[p + d] if d < wrong_from else (stream[p + d] + 50) % V for d in range(len(layout))]
        expected.append(min(wrong_from, len(layout)))
        return tree_around(path, layout)

    return tree_for


def decode(verifier, request_id, prompt, num_tokens, tree_for, proposal=lambda drafts: {}, **row_kwargs):
    """A scheduler's loop: the prompt's step k = 0, then decode steps carrying
    tree_for(output so far) -> (drafts, parents), parents None sending them as a chain, with the
    proposal(drafts) fields. Returns (tokens, side records, results)."""
    history, records, results = list(prompt), [], []
    while len(history) < len(prompt) + num_tokens:
        cached_len = len(history) - 1 if records else 0
        drafts, parents = tree_for(history[len(prompt):]) if records else ([], None)
        row = vrow(request_id, history[cached_len:], cached_len, step=len(records), prompt_len=len(prompt),
                   **row_kwargs)
        result, record = one(verifier, with_drafts(row, drafts, parents, **proposal(drafts)), batch_id=len(records))
        assert result.error is None and not result.need_resync, result.error
        assert result.num_draft == len(drafts)
        history += result.token_ids.tolist()
        records.append(record)
        results.append(result)
    return history[len(prompt):], records, results


def assert_same_logprobs(records, reference, n):
    """The first n emitted tokens' logprobs and masks of records equal reference's, bit for bit."""
    for name in LOGPROB_FIELDS:
        got = np.concatenate([getattr(r.logprobs, name) for r in records])[:n]
        assert np.array_equal(got, np.concatenate([getattr(r.logprobs, name) for r in reference])[:n]), name
    masks = [m for r in records for m in r.masks][:n]
    assert masks == [m for r in reference for m in r.masks][:n]


def slot_of(verifier, request_id):
    state = verifier.requests[("sched-test", request_id)]
    return state, int(verifier.cache.lengths[state.slot])


def assert_same_slot(verifier, reference, request_id, reference_id):
    """The two slots hold the same ids, K/V and features over the positions both committed."""
    (state, length), (ref_state, ref_length) = slot_of(verifier, request_id), slot_of(reference, reference_id)
    L = min(length, ref_length)
    assert state.token_ids[:L] == ref_state.token_ids[:L]
    for t, ref in zip(verifier.cache.tensors(state.slot), reference.cache.tensors(ref_state.slot)):
        assert torch.equal(t[:, :, :L], ref[:, :, :L])
    assert torch.equal(state.features[:L], ref_state.features[:L])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sampling", [dict(temperature=0), GUMBEL], ids=["greedy", "gumbel"])
def test_trees_emit_the_k0_stream_with_its_logprobs_and_leave_its_slot(target, dtype, sampling):
    reference = new_verifier(target, dtype=dtype)
    stream, reference_records, _ = generate(reference, "plain", PROMPT, 22, logprobs=OPTIONS, **sampling)
    verifier, expected = new_verifier(target, dtype=dtype), []
    tokens, records, results = decode(verifier, "tree", PROMPT, 16, trees_along(stream, expected), logprobs=OPTIONS,
                                      **sampling)
    assert tokens == stream[:len(tokens)]
    accepted = [result.num_accepted for result in results[1:]]
    assert accepted == expected and max(accepted) == 4  # found among siblings, at every depth
    assert_same_logprobs(records, reference_records, len(tokens))
    assert_same_slot(verifier, reference, "tree", "plain")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gumbel_chains_emit_the_k0_stream_with_its_logprobs(target, dtype):
    """A Gumbel-coupled chain takes the target's laws only along the accepted drafts and the draw
    after them (verifier_drafts.walk_draws): the same tokens, logprobs and masks as k = 0."""
    reference = new_verifier(target, dtype=dtype)
    stream, reference_records, _ = generate(reference, "plain", PROMPT, 22, logprobs=OPTIONS, **GUMBEL)
    accepted = []

    def chain_for(output):  # three drafts of the stream, the second wrong every other step
        drafts = stream[len(output):len(output) + 3]
        if len(accepted) % 2:
            drafts[1] = (drafts[1] + 50) % V
        accepted.append(3 if len(accepted) % 2 == 0 else 1)
        return drafts, None

    tokens, records, results = decode(new_verifier(target, dtype=dtype), "chain", PROMPT, 16, chain_for,
                                      logprobs=OPTIONS, **GUMBEL)
    assert tokens == stream[:len(tokens)]
    assert [result.num_accepted for result in results[1:]] == accepted
    assert_same_logprobs(records, reference_records, len(tokens))


def test_penalties_count_each_columns_own_path(target, penalised_tokens):
    expected = []
    tokens, _, results = decode(new_verifier(target), "tree", PROMPT, 12, trees_along(penalised_tokens, expected),
                                **PENALTIES)
    assert tokens == penalised_tokens[:len(tokens)]
    assert [result.num_accepted for result in results[1:]] == expected and sum(expected) > 4


@pytest.mark.parametrize("kind", ["greedy", "sampled", "sampled_sparse"])
def test_a_chain_sent_as_a_tree_is_the_chain(target, kind):
    # the biases make the (nearly uniform) tiny model favour three tokens, which the drafts cycle
    favoured, bias = [11, 40, 3], {11: 5.0, 40: 4.5, 3: 4.0}

    def proposal(drafts):  # sparse laws, or point masses
        if kind != "sampled_sparse":
            return {}
        return dict(proposal=Proposal(kind="sparse", ids=[[t, (t + 1) % V] for t in drafts],
                                      probs=[[0.6, 0.4]] * len(drafts)))

    runs = []
    for as_tree in (False, True):
        def tree_for(output):
            drafts = [favoured[(len(output) + i) % 3] for i in range(3)]
            return drafts, chain_parents(len(drafts)) if as_tree else None

        runs.append(decode(new_verifier(target), "r", PROMPT, 12, tree_for, proposal, logprobs=OPTIONS,
                           logit_bias=bias, **({} if kind == "greedy" else SAMPLED)))
    (chain_tokens, chain_records, chain_results), (tokens, records, results) = runs
    assert tokens == chain_tokens and results == chain_results and records == chain_records
    assert sum(result.num_accepted for result in results) > 0


def mixed_steps(verifier, together):
    """Three steps (prompt, speculative, decode) of a chain row, two tree rows (one sampled with
    penalties and logprobs, one greedy) and a k = 0 row, in one batch a step or each alone:
    request_id -> [(result, record)] per step."""
    prompts = {"chain": PROMPT, "tree": PROMPT[::-1], "greedy_tree": PROMPT[2:], "plain": PROMPT[:9]}
    extra = {"tree": dict(logprobs=OPTIONS, **SAMPLED, **PENALTIES)}
    speculative = {"chain": ([66, 26, 1], None), "tree": ([3, 4, 5, 6, 7], [-1, 0, 0, -1, 3]),
                   "greedy_tree": ([9, 8, 7, 6], [-1, 0, -1, -1]), "plain": ([], None)}
    out = {rid: [] for rid in prompts}
    for step in range(3):
        rows = []
        for rid, prompt in prompts.items():
            history = list(prompt) + [t for result, _ in out[rid] for t in result.token_ids.tolist()]
            cached_len = len(history) - 1 if step else 0
            drafts, parents = speculative[rid] if step == 1 else ([], None)
            row = vrow(rid, history[cached_len:], cached_len, step=step, prompt_len=len(prompt), **extra.get(rid, {}))
            rows.append(with_drafts(row, drafts, parents))
        for batch in [rows] if together else [[row] for row in rows]:
            for rid, answer in run(verifier, *batch, batch_id=step + 1).items():
                assert answer[0].error is None, answer[0].error
                out[rid].append(answer)
    return out


def test_a_batch_of_chain_tree_and_k0_rows_gives_each_row_what_it_gets_alone(target):
    alone, together = mixed_steps(new_verifier(target), False), mixed_steps(new_verifier(target), True)
    assert alone == together
    assert together["chain"][1][0].num_accepted == 2  # the greedy continuation, then a wrong draft
    assert [result.num_draft for result, _ in together["tree"]] == [0, 5, 0]


@pytest.mark.parametrize("bad, field", [
    (dict(new_token_ids=[5, 6]), "rows[1].new_token_ids"),
    (dict(sampling=RowSampling(temperature=0, structured_outputs={"regex": "[0-9]+"})), "rows[1].parents"),
    (dict(emit=False, draft_token_ids=[], parents=[]), "rows[1].parents"),
    # cached_len 0 + the root + 40 nodes exceed max_seq_len 32
    (dict(draft_token_ids=list(range(40)), parents=[-1] * 40), "rows[1].new_token_ids"),
])
def test_a_tree_row_that_is_no_decode_step_is_refused_naming_its_field(target, greedy_tokens, bad, field):
    verifier = new_verifier(target, max_seq_len=32)
    base = with_drafts(vrow("bad", [5], prompt_len=1), [1, 2], [-1, 0]).model_dump()
    bad = {name: np.array(value, np.int32) if name in ("new_token_ids", "draft_token_ids", "parents") else value
           for name, value in bad.items()}
    results = run(verifier, vrow("good", PROMPT, drafts=greedy_tokens[:2]), VerifyRow.model_validate({**base, **bad}))
    assert results["good"][0].error is None and results["good"][0].token_ids.tolist() == greedy_tokens[:3]
    error = results["bad"][0].error
    assert (error.code, error.field, error.request_id) == (ErrorCode.invalid_field, field, "bad")
    assert ("sched-test", "bad") not in verifier.requests
