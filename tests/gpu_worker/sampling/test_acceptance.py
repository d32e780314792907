"""The acceptance entry point (gpu_worker/sampling/acceptance.py): whatever branch a batch's mix of
laws takes (the greedy chain's argmaxes, the walk, the rejection kernels), a row emits the same
tokens from the same path, with the same laws where both take them; a row's output does not
depend on its neighbours'; a law that contradicts the sampling tensors is refused, naming it."""

import pytest
import torch

from gpu_worker.sampling import acceptance
from gpu_worker.sampling.acceptance import DraftTree, Law, RowLaws, accept
from gpu_worker.sampling.coupling import coupled_sample
from gpu_worker.sampling.sampler import STREAM_TARGET, SamplingInputError, SamplingTensors, make_uniforms
from gpu_worker.sampling.tree_acceptance import node_positions

V = 40
TREE = [-1, 0, 1, 1, -1, 4, 5]  # two branches from the root, siblings under node 1
CHAIN = [-1, 0, 1, 2, 3, 4, 5]


def batch(shape: list[int], laws: list[Law], seed: int):
    """(tree, logits (B, N+1, V), RowLaws) for rows of these laws over the parents `shape`: each
    node's draft is its parent's draw (taken at every column), or one beside it where it is to be
    wrong."""
    B, N = len(laws), len(shape)
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, N + 1, V, generator=generator) * 3
    temperature = [0.0 if law == Law.GREEDY else 0.9 for law in laws]
    params = SamplingTensors.build(temperature, top_p=[1.0 if law == Law.GREEDY else 0.9 for law in laws])
    law = torch.tensor([int(x) for x in laws])
    seeds, first = torch.tensor([0 if x == Law.GREEDY else 100 + b for b, x in enumerate(laws)]), torch.arange(B) + 7
    parents = torch.tensor([shape] * B)
    num_nodes = torch.full((B,), N)
    positions = first[:, None] + torch.arange(N + 1) if shape == CHAIN else node_positions(parents, num_nodes, first)
    _, draws = coupled_sample(logits, params, make_uniforms(seeds, positions, STREAM_TARGET), law == Law.GUMBEL, seeds,
                              positions)
    drafts = torch.empty(B, N, dtype=torch.long)
    for b in range(B):
        for i, parent in enumerate(shape):
            # wrong: node 3 (the second sibling under node 1 in TREE), node 0 on odd rows (then the
            # tree walks to node 4) and node 2 + b (a depth that varies with the row)
            right = i != 3 and not (i == 0 and b % 2) and i != 2 + b
            drafts[b, i] = draws[b, parent + 1] if right else (draws[b, parent + 1] + 1) % V
    draft_laws = [None] * B
    tree = DraftTree.of_chain(drafts, num_nodes, draft_laws) if shape == CHAIN else \
        DraftTree(drafts, parents, num_nodes, draft_laws)
    return tree, logits, RowLaws(law, params, seeds, first)


def rows_of(result: acceptance.Accepted) -> list[tuple]:
    """Each row's tokens, path, fallback and columns, comparable."""
    return [(tokens.tolist(), path, fallback, list(range(cols.stop)) if isinstance(cols, slice) else cols.tolist())
            for tokens, path, fallback, cols in zip(result.token_ids, result.paths, result.residual_fallback,
                                                    result.columns)]


def assert_same_laws(got, expected):
    for a, b in zip(got, expected):
        assert torch.equal(a.probs, b.probs) and torch.equal(a.num_candidates, b.num_candidates)
        for t in range(a.probs.shape[1]):
            n = int(a.num_candidates[0, t])
            if n < V:
                assert torch.equal(a.candidate_ids[0, t, :n], b.candidate_ids[0, t, :n])


def row(tree: DraftTree, logits, laws: RowLaws, b: int):
    """Row b alone."""
    one = DraftTree(tree.token_ids[b:b + 1], tree.parents[b:b + 1], tree.num_nodes[b:b + 1], tree.draft_laws[b:b + 1],
                    tree.chain)
    return one, logits[b:b + 1], RowLaws(laws.law[b:b + 1], laws.params.index(torch.tensor([b])), laws.seeds[b:b + 1],
                                         laws.first[b:b + 1])


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_rows_emit_the_same_whichever_branch(shape):
    args = batch(shape, [Law.GREEDY] * 4, seed=1)
    fast = accept(*args)
    walked, rejected = acceptance._walk(*args), acceptance._rejection(*args)
    assert rows_of(fast) == rows_of(walked) == rows_of(rejected)
    assert [n for n in fast.num_accepted] == [len(path) for path in fast.paths]
    assert sorted(set(fast.num_accepted)) != [0]  # drafts were accepted, at several depths
    assert fast.laws == walked.laws == [None] * 4  # argmaxes alone


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_gumbel_rows_walk_to_the_bits_of_every_column_drawn(shape):
    args = batch(shape, [Law.GUMBEL, Law.GREEDY, Law.GUMBEL, Law.GUMBEL], seed=2)
    walked, rejected = accept(*args), acceptance._rejection(*args)
    assert rows_of(walked) == rows_of(rejected)
    assert max(walked.num_accepted) >= 2
    assert_same_laws(walked.laws, rejected.laws)


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_a_row_emits_alone_what_it_emits_beside_any_law(shape):
    tree, logits, laws = batch(shape, [Law.GREEDY, Law.GUMBEL, Law.REJECTION, Law.GUMBEL, Law.GREEDY], seed=3)
    mixed = accept(tree, logits, laws)
    for b in range(5):
        alone = accept(*row(tree, logits, laws, b))
        assert rows_of(alone) == rows_of(mixed)[b:b + 1]
        if alone.laws[0] is not None:
            assert_same_laws(alone.laws, mixed.laws[b:b + 1])


def test_a_law_that_contradicts_the_temperature_is_refused():
    tree, logits, laws = batch(CHAIN, [Law.GREEDY, Law.REJECTION], seed=4)
    with pytest.raises(SamplingInputError, match="temperature is 0"):
        RowLaws(torch.tensor([Law.REJECTION, Law.REJECTION]), laws.params, laws.seeds, laws.first)
    with pytest.raises(SamplingInputError, match="unknown law"):
        RowLaws(torch.tensor([Law.GREEDY, 7]), laws.params, laws.seeds, laws.first)
    with pytest.raises(SamplingInputError, match="logits"):
        accept(tree, logits[:, 1:], laws)
