"""Trees of draft tokens (schemas/steps.py, docs/PROTOCOL.md#tree-drafts): a valid tree crosses the
codec unchanged, each malformed one is refused with a typed error naming its field, and a chain
without parents validates as it always did."""

import time

import msgpack
import numpy as np
import pytest

from schemas import (Commit, CodecError, DraftRequest, DraftResponse, DraftResult, DraftRow, ErrorCode, Proposal, Usage,
                     VerifyRequest, VerifyResponse, VerifyResult, VerifyRow, decode, encode)
from schemas.arrays import ROOT_PARENT
from schemas.bus.protocol import MAX_SPECULATIVE_TOKENS, MAX_TREE_NODES
from schemas.steps import DraftTokens, chain_parents, tree_depths

# Top-2 expansion two levels deep, then one more token under the first leaf (EAGLE's point-mass trees):
#   root -> 5 -> 7 -> 11
#             -> 8
#        -> 6 -> 9
#             -> 10
TREE_TOKENS = [5, 7, 11, 8, 6, 9, 10]
TREE_PARENTS = [-1, 0, 1, 0, -1, 4, 4]
TREE_DEPTHS = [1, 2, 3, 2, 1, 2, 2]


def sparse_laws(tokens: list[int]) -> Proposal:
    """One sparse row per node: its own token at 0.75, token 1 at 0.25."""
    ids = [[token, 1] for token in tokens]
    return Proposal(kind="sparse", ids=ids, probs=[[0.75, 0.25]] * len(tokens))


def dense_laws(num_nodes: int, vocab: int = 12) -> Proposal:
    return Proposal(kind="dense", probs=np.full((num_nodes, vocab), 1 / vocab, np.float32), draft_vocab_size=vocab)


def verify_request(**row_fields) -> VerifyRequest:
    row = VerifyRow(request_id="r0", row=0, step=3, cached_len=10, prompt_len=8, **row_fields)
    return VerifyRequest(batch_id=4, scheduler_id="s0", deadline=time.time() + 1, rows=[row])


def tree_payload(overrides: dict) -> bytes:
    """A VerifyRequest whose one row is TREE_TOKENS under point-mass laws, its fields edited as a
    peer would send them ("proposal.x" edits the proposal)."""
    raw = verify_request(draft_token_ids=TREE_TOKENS, parents=TREE_PARENTS).model_dump()
    row = raw["rows"][0]
    for key, value in overrides.items():
        if key.startswith("proposal."):
            row["proposal"][key.removeprefix("proposal.")] = value
        else:
            row[key] = value
    return msgpack.packb(raw, use_bin_type=True)


def full_tree() -> tuple[list[int], list[int]]:
    """MAX_TREE_NODES nodes, MAX_SPECULATIVE_TOKENS deep: chains of full depth under the root."""
    chains = MAX_TREE_NODES // MAX_SPECULATIVE_TOKENS
    parents = [ROOT_PARENT if depth == 0 else chain * MAX_SPECULATIVE_TOKENS + depth - 1
               for chain in range(chains) for depth in range(MAX_SPECULATIVE_TOKENS)]
    tokens = [chain for chain in range(chains) for _ in range(MAX_SPECULATIVE_TOKENS)]
    return tokens, parents


# ---------------------------------------------------------------------------------------------
# the shape


def test_depths_of_a_tree_and_of_a_chain():
    assert tree_depths(np.array(TREE_PARENTS, np.int32)).tolist() == TREE_DEPTHS
    assert chain_parents(4).tolist() == [ROOT_PARENT, 0, 1, 2]
    assert tree_depths(chain_parents(5)).tolist() == [1, 2, 3, 4, 5]
    assert tree_depths(chain_parents(0)).tolist() == []


@pytest.mark.parametrize("proposal", [Proposal(), sparse_laws(TREE_TOKENS), dense_laws(len(TREE_TOKENS))],
                         ids=lambda proposal: proposal.kind)
def test_a_tree_crosses_the_codec_unchanged(proposal):
    request = verify_request(draft_token_ids=TREE_TOKENS, parents=TREE_PARENTS, proposal=proposal)
    decoded = decode(encode(request), VerifyRequest)
    assert decoded == request
    assert decoded.rows[0].parents.dtype == np.int32 and decoded.rows[0].parents.tolist() == TREE_PARENTS
    response = DraftResponse(batch_id=1, drafter_id="d0", rows=[
        DraftResult(request_id="r0", draft_token_ids=TREE_TOKENS, parents=TREE_PARENTS, proposal=proposal)])
    assert decode(encode(response), DraftResponse) == response


def test_parents_travel_packed_as_int32():
    raw = verify_request(draft_token_ids=TREE_TOKENS, parents=TREE_PARENTS).model_dump()
    parents = raw["rows"][0]["parents"]
    assert (parents["dtype"], parents["shape"]) == ("int32", [len(TREE_PARENTS)])
    assert np.frombuffer(parents["data"], "<i4").tolist() == TREE_PARENTS


def test_the_largest_tree_is_valid():
    tokens, parents = full_tree()
    request = verify_request(draft_token_ids=tokens, parents=parents)
    assert len(tokens) == MAX_TREE_NODES
    assert tree_depths(request.rows[0].parents).max() == MAX_SPECULATIVE_TOKENS
    assert decode(encode(request), VerifyRequest) == request


def test_sampled_siblings_may_repeat_a_token():
    """Under sampled (sparse or dense) laws two siblings may draw the same token; only point-mass
    siblings must differ."""
    tokens, parents = [5, 5, 5], [-1, -1, -1]
    assert len(DraftTokens(draft_token_ids=tokens, parents=parents, proposal=sparse_laws(tokens)).parents) == 3
    assert len(DraftTokens(draft_token_ids=tokens, parents=parents, proposal=dense_laws(3)).parents) == 3


def test_a_chain_without_parents_validates_as_before():
    tokens = list(range(MAX_SPECULATIVE_TOKENS))
    chain = verify_request(draft_token_ids=tokens, proposal=sparse_laws(tokens))
    raw = chain.model_dump()
    assert raw["rows"][0]["parents"] is None
    del raw["rows"][0]["parents"]  # a peer may leave the default out
    assert decode(msgpack.packb(raw, use_bin_type=True), VerifyRequest) == chain
    # the same chain as a tree: the same depths, the same bound
    assert tree_depths(chain_parents(len(tokens))).max() == MAX_SPECULATIVE_TOKENS
    as_tree = verify_request(draft_token_ids=tokens, parents=chain_parents(len(tokens)), proposal=sparse_laws(tokens))
    assert as_tree.rows[0].draft_token_ids.tolist() == tokens
    # repeated tokens in a chain are fine (no siblings), as ever
    assert verify_request(draft_token_ids=[3, 3, 3]).rows[0].parents is None


# ---------------------------------------------------------------------------------------------
# refusals, each naming its field


@pytest.mark.parametrize("overrides, field, message", [
    ({"parents": [-1, 0, 1, 0]}, "rows[0].parents", "4 parents for 7 draft tokens"),
    ({"parents": [-1, 0, 2, 0, -1, 4, 4]}, "rows[0].parents", "node 2's parent 2 does not come before it"),
    ({"parents": [-1, 0, 1, 0, -1, 4, 99]}, "rows[0].parents", "node 6's parent 99 does not come before it"),
    ({"parents": [-1, 0, 1, 0, -1, 4, -2]}, "rows[0].parents", r"parent indices must be >= 0 \(or -1 for the root\)"),
    ({"parents": [-1, 0, 1, 0, -1, 1, 4]}, "rows[0].parents",
     "node 5's parent 1 is neither node 4 nor one of its ancestors: nodes go in depth-first preorder"),
    ({"parents": [[-1, 0, 1, 0, -1, 4, 4]]}, "rows[0].parents", "expected 1-D array"),
    ({"parents": [-1.0, 0.0, 1.0, 0.0, -1.0, 4.0, 4.0]}, "rows[0].parents", "expected integers"),
    ({"parents": {"dtype": "float32", "shape": [7], "data": bytes(28)}}, "rows[0].parents", "dtype 'float32'"),
    ({"draft_token_ids": list(range(17)), "parents": chain_parents(17).tolist()}, "rows[0].parents",
     "node 16 is at depth 17, deeper than 16 draft tokens"),
    ({"draft_token_ids": list(range(65)), "parents": [-1] * 65}, "rows[0].draft_token_ids",
     "at most 64 nodes in a tree of draft tokens, got 65"),
    ({"draft_token_ids": [5, 7, 11, 7, 6, 9, 10]}, "rows[0].draft_token_ids",
     "nodes 1 and 3, siblings, both propose token 7 under point-mass laws"),
    ({"draft_token_ids": [5, 7, 11, 8, 5, 9, 10]}, "rows[0].draft_token_ids",
     "nodes 0 and 4, siblings, both propose token 5"),
    ({"proposal.kind": "sparse", "proposal.ids": [[5, 1]] * 6, "proposal.probs": [[0.75, 0.25]] * 6},
     "rows[0].proposal.probs", "6 proposal rows for 7 draft tokens"),
    ({"proposal.kind": "sparse", "proposal.ids": [[5, 1]] * 7, "proposal.probs": [[0.75, 0.25]] * 7},
     "rows[0].proposal.ids", "draft token at position 1 has no probability"),
    ({"max_forced": 2}, "rows[0].max_forced", "forced tokens follow a chain of drafts, not a tree"),
])
def test_a_malformed_tree_names_the_field(overrides, field, message):
    with pytest.raises(CodecError, match=message) as caught:
        decode(tree_payload(overrides), VerifyRequest)
    assert (caught.value.code, caught.value.field) == (ErrorCode.invalid_field, field)


def test_a_drafters_tree_is_checked_too():
    row = DraftResult(request_id="r", draft_token_ids=[3, 4], parents=[-1, 0])
    raw = DraftResponse(batch_id=1, drafter_id="d0", rows=[row]).model_dump()
    raw["rows"][0]["parents"] = [-1, 1]
    with pytest.raises(CodecError, match="node 1's parent 1 does not come before it") as caught:
        decode(msgpack.packb(raw, use_bin_type=True), DraftResponse)
    assert (caught.value.code, caught.value.field) == (ErrorCode.invalid_field, "rows[0].parents")


def test_a_chain_keeps_its_own_bound():
    """Without parents, 17 drafts are 17 in a row: refused by the chain's bound, naming draft_token_ids."""
    with pytest.raises(CodecError, match="at most 16 draft tokens, got 17") as caught:
        decode(tree_payload({"draft_token_ids": list(range(17)), "parents": None}), VerifyRequest)
    assert (caught.value.code, caught.value.field) == (ErrorCode.invalid_field, "rows[0].draft_token_ids")


def test_result_counts_count_every_node():
    """A row's draft count is len(draft_token_ids), a tree's nodes: the verifier's num_draft, the
    commit's and the usage's speculative lengths hold up to MAX_TREE_NODES."""
    result = VerifyResult(request_id="r0", step=3, token_ids=[5, 7, 11, 2], num_draft=MAX_TREE_NODES, num_accepted=3)
    assert decode(encode(VerifyResponse(batch_id=4, verifier_id="v0", rows=[result])), VerifyResponse).rows == [result]
    commit = Commit(request_id="r0", batch_id=4, step=3, seq=0, scheduler_id="s0", client_inbox="_INBOX.c",
                    token_ids=[5, 7, 11, 2], num_draft=MAX_TREE_NODES, num_accepted=3)
    assert decode(encode(commit), Commit) == commit
    assert len(Usage(speculative_lengths=[0] * (MAX_TREE_NODES + 1)).speculative_lengths) == MAX_TREE_NODES + 1
    with pytest.raises(ValueError, match=f"less than or equal to {MAX_TREE_NODES}"):
        VerifyResult(request_id="r0", step=3, num_draft=MAX_TREE_NODES + 1)


# ---------------------------------------------------------------------------------------------
# asking for a tree: DraftRow.max_nodes


def draft_request(**row_fields) -> DraftRequest:
    row = DraftRow(request_id="r0", row=0, step=3, cached_len=10, **row_fields)
    return DraftRequest(batch_id=4, scheduler_id="s0", deadline=time.time() + 1, rows=[row])


def test_a_draft_row_asks_a_chain_by_default_and_a_tree_with_a_node_budget():
    chain = draft_request(num_draft=4)
    assert chain.rows[0].max_nodes == 0
    raw = chain.model_dump()
    del raw["rows"][0]["max_nodes"]  # a peer may leave the default out
    assert decode(msgpack.packb(raw, use_bin_type=True), DraftRequest) == chain
    for depth, nodes in ((4, 16), (4, 4), (1, MAX_TREE_NODES), (MAX_SPECULATIVE_TOKENS, MAX_TREE_NODES)):
        tree = draft_request(num_draft=depth, max_nodes=nodes)
        assert decode(encode(tree), DraftRequest) == tree


@pytest.mark.parametrize("fields, message", [
    ({"num_draft": 4, "max_nodes": MAX_TREE_NODES + 1}, f"less than or equal to {MAX_TREE_NODES}"),
    ({"num_draft": 4, "max_nodes": -1}, "greater than or equal to 0"),
    ({"num_draft": 4, "max_nodes": 3}, "a tree of at most 3 nodes needs a depth \\(num_draft\\) of 1 to 3, got 4"),
    ({"num_draft": 0, "max_nodes": 8}, "a tree of at most 8 nodes needs a depth \\(num_draft\\) of 1 to 8, got 0"),
])
def test_a_node_budget_out_of_its_range_names_the_field(fields, message):
    raw = draft_request(num_draft=1).model_dump()
    raw["rows"][0].update(fields)
    with pytest.raises(CodecError, match=message) as caught:
        decode(msgpack.packb(raw, use_bin_type=True), DraftRequest)
    assert (caught.value.code, caught.value.field) == (ErrorCode.invalid_field, "rows[0].max_nodes")
