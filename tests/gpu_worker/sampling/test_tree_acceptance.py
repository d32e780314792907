"""Tree acceptance (gpu_worker/sampling/tree_acceptance.py): the greedy walk, chains equal to
rejection_sample bit for bit, the emitted tokens' law for several tree shapes and proposal kinds,
Gumbel-coupled rows invariant to the tree, and typed errors."""

import pytest
import torch

from gpu_worker.sampling.coupling import gumbel_argmax
from gpu_worker.sampling.rejection import proposal_to_draft_probs, rejection_sample
from gpu_worker.sampling.sampler import STREAM_ACCEPT, STREAM_RESIDUAL, SamplingInputError, make_uniforms
from gpu_worker.sampling.tree_acceptance import (node_positions, sibling_ranks, tree_rejection_sample,
                                                 tree_uniforms)


def ids(rows):
    return torch.tensor(rows, dtype=torch.int64)


def f64(rows):
    return torch.tensor(rows, dtype=torch.float64)


# --- greedy -------------------------------------------------------------------------------

# node:      0  1  2  3  4  5
TOKENS = [5, 3, 4, 7, 2, 1]
PARENTS = [-1, 0, 0, 2, -1, 4]  # root -> {0 -> {1, 2 -> 3}, 4 -> 5}


def test_greedy_walk_follows_the_targets_tokens_through_the_tree():
    B, V = 5, 10
    # target_token_ids[:, 0] is the root's token, [:, i + 1] node i's
    targets = ids([
        [2, 0, 0, 0, 0, 1, 6],  # root 2 -> node 4, its 1 -> node 5, a leaf: bonus 6
        [5, 4, 0, 0, 0, 0, 0],  # root 5 -> node 0, its 4 -> node 2 (not 1), its 0 != 7: recovered 0
        [9, 0, 0, 0, 0, 0, 0],  # no child of the root is 9
        [5, 4, 0, 7, 8, 0, 0],  # the deepest path, bonus 8 at node 3
        [3, -1, -1, -1, -1, -1, -1],  # an empty tree
    ])
    num_nodes = ids([6, 6, 6, 6, 0])
    drafts = ids([TOKENS] * 4 + [[-1] * 6])
    result = tree_rejection_sample(drafts, ids([PARENTS] * B), num_nodes, None, torch.full((B, 7, V), 1.0 / V),
                                   targets, torch.ones(B, dtype=torch.bool))
    assert result.token_ids.tolist() == [[2, 1, 6, -1], [5, 4, 0, -1], [9, -1, -1, -1], [5, 4, 7, 8], [3, -1, -1, -1]]
    assert result.num_accepted.tolist() == [2, 2, 0, 3, 0]
    assert result.accepted_nodes.tolist() == [[4, 5, -1], [0, 2, -1], [-1, -1, -1], [0, 2, 3], [-1, -1, -1]]
    assert result.num_residual_fallbacks == 0


def test_empty_batch_of_trees_emits_the_roots_token():
    result = tree_rejection_sample(ids([[], []]).view(2, 0), ids([[], []]).view(2, 0), ids([0, 0]), None,
                                   torch.full((2, 1, 4), 0.25), ids([[1], [3]]), torch.tensor([True, False]))
    assert result.token_ids.tolist() == [[1], [3]]
    assert result.accepted_nodes.shape == (2, 0)


# --- sampled, by hand ---------------------------------------------------------------------


def test_a_rejected_siblings_mass_is_removed_and_the_rest_renormalised():
    # root law q = [.1, .2, .3, .4], point-mass children 3 then 2.
    # row 0: u = .5 >= q(3) = .4 rejects 3; r = [1/6, 1/3, 1/2, 0], .45 < r(2) = 1/2 accepts 2
    #        (the unnormalised .3 would reject it); node 1 is a leaf: bonus t = 0.
    # row 1: .6 >= 1/2 rejects 2 too; r = [1/3, 2/3, 0, 0], u = .5 draws id 1.
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    result = tree_rejection_sample(
        ids([[3, 2]] * 2), ids([[-1, -1]] * 2), ids([2, 2]), None, q.expand(2, 3, 4).contiguous(),
        ids([[1, 1, 0]] * 2), torch.tensor([False, False]),
        uniforms=f64([[0.5, 0.45], [0.5, 0.6]]), residual_uniforms=f64([[0.5, 0.5]] * 2),
    )
    assert result.token_ids.tolist() == [[2, 0], [1, -1]]
    assert result.num_accepted.tolist() == [1, 0]
    assert result.accepted_nodes.tolist() == [[1], [-1]]


def test_zero_mass_residual_falls_back_to_the_targets_token_and_is_flagged():
    target_probs = torch.full((1, 3, 4), 0.25)
    draft_probs = torch.full((1, 2, 4), 0.5)  # inconsistent: max(q - p, 0) has no mass
    result = tree_rejection_sample(ids([[1, 2]]), ids([[-1, -1]]), ids([2]), draft_probs, target_probs,
                                   ids([[3, 0, 0]]), torch.tensor([False]),
                                   uniforms=f64([[0.9, 0.9]]), residual_uniforms=f64([[0.5, 0.5]]))
    assert result.token_ids.tolist() == [[3, -1]]
    assert result.residual_fallback.tolist() == [True]


# --- chains: rejection_sample bit for bit -------------------------------------------------


def chain_inputs(seed, proposal, dtype, B=256, K=4, V=12, S=3):
    """Random rows of a chain of K drafts (some shorter), a quarter greedy; drafts drawn from a
    draft law near the target's, so rows accept, reject and fall back."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=gen) * 2
    target_probs = logits.softmax(-1).to(dtype)
    num_draft = torch.randint(0, K + 1, (B,), generator=gen)
    num_draft[0] = K
    near = (logits[:, :K] + torch.randn(B, K, V, generator=gen)).softmax(-1)  # (B, K, V)
    sparse_ids = sparse_probs = dense_probs = None
    if proposal == "sparse":
        sparse_ids = near.topk(S, -1).indices
        sparse_probs = torch.rand(B, K, S, generator=gen).softmax(-1)
        slot = torch.multinomial(sparse_probs.flatten(0, 1), 1, generator=gen).view(B, K, 1)
        drafts = sparse_ids.gather(-1, slot).squeeze(-1)
    else:
        drafts = torch.multinomial(near.flatten(0, 1), 1, generator=gen).view(B, K)
        dense_probs = near.clone()
        dense_probs[1:9] = 2 * target_probs[1:9, :K]  # an empty residual wherever rows 1-8 reject
    slots = torch.arange(K)
    drafts = torch.where(slots < num_draft[:, None], drafts, -1)
    greedy = torch.rand(B, generator=gen) < 0.25
    greedy[1:9] = False
    targets = torch.multinomial(target_probs.float().flatten(0, 1), 1, generator=gen).view(B, K + 1)
    targets = torch.where(greedy[:, None], target_probs.argmax(-1), targets)
    targets = torch.where(torch.arange(K + 1) <= num_draft[:, None], targets, -1)
    draft_probs = proposal_to_draft_probs(proposal, drafts, V, sparse_ids=sparse_ids, sparse_probs=sparse_probs,
                                          dense_probs=dense_probs)
    if draft_probs is not None:
        draft_probs = draft_probs.to(dtype)
    parents = (slots - 1).expand(B, K).contiguous()
    return dict(draft_token_ids=drafts, draft_probs=draft_probs, target_probs=target_probs,
                target_token_ids=targets, greedy=greedy), num_draft, parents


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("proposal", ["point_mass", "sparse", "dense"])
def test_a_chain_is_accepted_exactly_as_rejection_sample_accepts_it(proposal, dtype):
    args, num_draft, parents = chain_inputs(7, proposal, dtype)
    B, K = parents.shape
    seeds, first = torch.arange(100, 100 + B), torch.randint(0, 10**6, (B,), generator=torch.Generator().manual_seed(1))
    chain_positions = first[:, None] + torch.arange(K)
    explicit = dict(uniforms=make_uniforms(seeds, chain_positions, STREAM_ACCEPT),
                    residual_uniforms=make_uniforms(seeds, chain_positions, STREAM_RESIDUAL))
    for uniforms, tree_uniforms_ in ((dict(generator=torch.Generator().manual_seed(5)),
                                      dict(generator=torch.Generator().manual_seed(5))),
                                     (explicit, dict(zip(("uniforms", "residual_uniforms"),
                                                         tree_uniforms(seeds, first, parents, num_draft))))):
        expected = rejection_sample(num_draft=num_draft, **args, **uniforms)
        got = tree_rejection_sample(parents=parents, num_nodes=num_draft, **args, **tree_uniforms_)
        assert torch.equal(got.token_ids, expected.token_ids)
        assert torch.equal(got.num_accepted, expected.num_accepted)
        assert torch.equal(got.residual_fallback, expected.residual_fallback)
        slot = torch.arange(K)
        assert torch.equal(got.accepted_nodes, torch.where(slot < got.num_accepted[:, None], slot, -1))
    # the rows exercised every outcome: all accepted, a recovered draw, a fallback (dense)
    assert (expected.num_accepted == K).any() and ((expected.num_accepted < num_draft) & ~args["greedy"]).any()
    assert expected.num_residual_fallbacks > 0 or proposal != "dense"


def test_tree_uniforms_key_first_children_as_the_chain_and_siblings_apart():
    parents = ids([[-1, 0, 0, 2, -1, -1], [-1, 0, 1, -1, -1, -1]])
    num_nodes = ids([6, 3])
    assert sibling_ranks(parents, num_nodes).tolist() == [[0, 0, 1, 0, 1, 2], [0, 0, 0, 0, 0, 0]]
    seeds, first = ids([3, 4]), ids([50, 90])
    uniforms, residual_uniforms = tree_uniforms(seeds, first, parents, num_nodes)
    at = first[:, None] + torch.arange(6)
    chain_accept, chain_residual = make_uniforms(seeds, at, STREAM_ACCEPT), make_uniforms(seeds, at, STREAM_RESIDUAL)
    assert torch.equal(uniforms[1, :3], chain_accept[1, :3])  # a chain
    assert torch.equal(residual_uniforms, chain_residual)  # one per depth
    # first children get their position's chain uniform; later siblings their own
    assert torch.equal(uniforms[0, [0, 1, 3]], chain_accept[0, [0, 1, 2]])
    assert len(set(uniforms[0, [0, 4, 5]].tolist())) == 3 and uniforms[0, 2] != uniforms[0, 1]
    assert node_positions(parents, num_nodes, first).tolist() == [[50, 51, 52, 52, 53, 51, 51],
                                                                  [90, 91, 92, 93, 90, 90, 90]]


def test_a_rows_result_does_not_depend_on_its_batch():
    gen = torch.Generator().manual_seed(11)
    B, N, V = 6, 6, 10
    parents = ids([PARENTS] * B)
    num_nodes = ids([6, 4, 0, 6, 2, 6])
    drafts = torch.where(torch.arange(N) < num_nodes[:, None], torch.randint(0, V, (B, N), generator=gen), -1)
    target_probs = (torch.randn(B, N + 1, V, generator=gen) * 2).softmax(-1)
    targets = torch.multinomial(target_probs.flatten(0, 1), 1, generator=gen).view(B, N + 1)
    greedy = torch.tensor([False, True, False, False, True, False])
    seeds, first = torch.arange(B) + 9, torch.arange(B) * 100

    def run(rows):
        u, ru = tree_uniforms(seeds[rows], first[rows], parents[rows], num_nodes[rows])
        return tree_rejection_sample(drafts[rows], parents[rows], num_nodes[rows], None, target_probs[rows],
                                     targets[rows], greedy[rows], uniforms=u, residual_uniforms=ru)

    batch = run(list(range(B)))
    for row in range(B):
        alone = run([row])
        assert torch.equal(alone.token_ids[0], batch.token_ids[row, :alone.token_ids.shape[1]])
        assert torch.equal(alone.accepted_nodes[0], batch.accepted_nodes[row, :alone.accepted_nodes.shape[1]])


# --- statistics ---------------------------------------------------------------------------

ROWS, V = 40000, 8


def assert_follows(samples, probs, min_p=1e-6):
    """Chi-square goodness of fit of samples [n] (indices into probs) to the law probs [C]:
    zero-probability cells stay empty; cells expecting fewer than 10 are pooled; the test fails
    only when the p-value is below min_p (a false failure once in 1/min_p runs)."""
    probs = probs.double() / probs.double().sum()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0, (counts, probs)
    expected = probs * samples.numel()
    big, small = expected >= 10, (expected < 10) & (probs > 0)
    observed = torch.cat([counts[big], counts[small].sum()[None]])
    expected_ = torch.cat([expected[big], expected[small].sum()[None]])
    observed, expected_ = observed[expected_ > 0], expected_[expected_ > 0]
    stat = ((observed - expected_) ** 2 / expected_).sum()
    df = torch.tensor((observed.numel() - 1) / 2, dtype=torch.float64)
    p_value = float(torch.special.gammaincc(df, stat / 2))
    assert p_value > min_p, (p_value, counts.tolist(), expected.tolist())


def target_laws(seed):
    """The root's law (one token masked to 0, as a grammar would) and laws[d - 1][x]: the target's
    law after a path of depth d ending in token x."""
    gen = torch.Generator().manual_seed(seed)
    root = (torch.randn(V, generator=gen) * 1.2).softmax(-1)
    root[V - 1] = 0.0
    root /= root.sum()
    return root, (torch.randn(3, V, V, generator=gen) * 1.2).softmax(-1), gen


def depths_of(parents):
    depth = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


def speculate(parents, drafts, draft_probs, root, laws, gen):
    """ROWS sampled rows of one tree shape: drafts [ROWS, N], draft_probs [ROWS, N, V] or None."""
    N = len(parents)
    depth = depths_of(parents)
    target_probs = torch.stack([root.expand(ROWS, V)] + [laws[depth[i] - 1][drafts[:, i]] for i in range(N)], 1)
    targets = torch.multinomial(target_probs.flatten(0, 1), 1, generator=gen).view(ROWS, N + 1)
    return tree_rejection_sample(drafts, ids(parents).expand(ROWS, N), torch.full((ROWS,), N), draft_probs,
                                 target_probs, targets, torch.zeros(ROWS, dtype=torch.bool), gen)


def assert_emits_the_targets_law(result, root, laws, gen):
    """The first emitted token follows the root's law; the first two follow root(x) laws[0][x](y),
    a row that emitted one token drawing its second as a k=0 step would."""
    first = result.token_ids[:, 0]
    assert_follows(first, root)
    fresh = torch.multinomial(laws[0][first], 1, generator=gen).squeeze(1)
    second = torch.where(result.num_accepted >= 1, result.token_ids[:, 1], fresh)
    assert_follows(first * V + second, (root[:, None] * laws[0]).flatten())
    assert result.num_residual_fallbacks == 0


def draw_from(law, gen):
    return torch.multinomial(law.expand(ROWS, V), 1, generator=gen).squeeze(1)


def test_wide_root_of_point_mass_children_emits_the_targets_law():
    root, laws, gen = target_laws(1)
    a, b = root.topk(2).indices.tolist()
    # root -> {a -> top of its law, b -> 2nd of its law, the masked token, b again}
    parents = [-1, 0, -1, 2, -1, -1]
    tokens = [a, int(laws[0][a].argmax()), b, int(laws[0][b].topk(2).indices[1]), V - 1, b]
    result = speculate(parents, ids(tokens).expand(ROWS, 6).contiguous(), None, root, laws, gen)
    assert_emits_the_targets_law(result, root, laws, gen)
    # a zero-probability child, and a repeat of a rejected sibling, are never accepted
    assert not bool(torch.isin(result.accepted_nodes[:, 0], ids([4, 5])).any())
    assert set(result.accepted_nodes[:, 0].tolist()) == {-1, 0, 2}


def test_deep_tree_of_dense_children_branching_at_depth_two_emits_the_targets_law():
    root, laws, gen = target_laws(2)
    parents = [-1, 0, 0, 2, 0, 4, -1]  # root -> {0 -> {1, 2 -> 3, 4 -> 5}, 6}
    node_laws = (torch.randn(7, V, generator=gen) * 1.5).softmax(-1)  # each node its own law
    drafts = torch.stack([draw_from(node_laws[i], gen) for i in range(7)], 1)
    draft_probs = proposal_to_draft_probs("dense", drafts, V, dense_probs=node_laws.expand(ROWS, 7, V))
    result = speculate(parents, drafts, draft_probs, root, laws, gen)
    assert_emits_the_targets_law(result, root, laws, gen)
    assert int(result.num_accepted.max()) == 3


def test_sparse_children_with_different_laws_emit_the_targets_law():
    root, laws, gen = target_laws(3)
    parents = [-1, 0, 0, -1, 3, -1, 5]  # root -> {0 -> {1, 2}, 3 -> 4, 5 -> 6}
    N, S = len(parents), 3
    support = torch.stack([torch.randperm(V, generator=gen)[:S] for _ in range(N)])  # (N, S)
    weights = (torch.randn(N, S, generator=gen) * 1.5).softmax(-1)
    slot = torch.stack([torch.multinomial(weights[i].expand(ROWS, S), 1, generator=gen).squeeze(1)
                        for i in range(N)], 1)  # (ROWS, N)
    drafts = support.expand(ROWS, N, S).gather(-1, slot[..., None]).squeeze(-1)
    draft_probs = proposal_to_draft_probs("sparse", drafts, V, sparse_ids=support.expand(ROWS, N, S),
                                          sparse_probs=weights.expand(ROWS, N, S))
    result = speculate(parents, drafts, draft_probs, root, laws, gen)
    assert_emits_the_targets_law(result, root, laws, gen)


# --- Gumbel coupling ----------------------------------------------------------------------


def gumbel_decode(seed, weights, length, widths, gen):
    """A Gumbel-coupled row decoded `length` tokens past a 2-token prompt, drafting at each step
    a random preorder tree with widths[d] children per node at depth d (the first child is the
    target's own Gumbel draw 60% of the time, the rest random). Returns (tokens, accepted)."""
    tokens, accepted = [0, 1], 0
    seeds = ids([seed])

    def law(context):
        return weights[context[-2], context[-1]]  # (V,)

    def target_token(context):
        return int(gumbel_argmax(law(context).view(1, 1, V), seeds, ids([[len(context)]]))[0, 0])

    while len(tokens) < 2 + length:
        drafts, parents, paths = [], [], []

        def grow(parent, path):
            if len(path) == len(widths):
                return
            for j in range(widths[len(path)]):
                own = j == 0 and float(torch.rand(1, generator=gen)) < 0.6
                token = target_token(tokens + path) if own else int(torch.randint(0, V, (1,), generator=gen))
                drafts.append(token)
                parents.append(parent)
                paths.append(path + [token])
                grow(len(drafts) - 1, path + [token])

        grow(-1, [])
        N = len(drafts)
        target_probs = torch.stack([law(tokens)] + [law(tokens + p) for p in paths])[None]  # (1, N+1, V)
        tree = ids(parents).view(1, N), ids([N])
        targets = gumbel_argmax(target_probs, seeds, node_positions(*tree, ids([len(tokens)])))
        result = tree_rejection_sample(ids(drafts).view(1, N), *tree, None, target_probs, targets,
                                       torch.tensor([True]))
        n = int(result.num_accepted[0])
        tokens += result.token_ids[0, :n + 1].tolist()
        accepted += n
    return tokens[:2 + length], accepted


def test_gumbel_rows_emit_the_same_tokens_whatever_the_tree():
    gen = torch.Generator().manual_seed(6)
    weights = (torch.randn(V, V, V, generator=gen) * 1.5).softmax(-1)
    total_accepted = 0
    for seed in (0, 1, 2):
        plain, _ = gumbel_decode(seed, weights, 12, [], gen)  # k = 0
        for widths in ([1, 1, 1], [4], [3, 2, 1], [2, 1, 2, 1]):
            tokens, accepted = gumbel_decode(seed, weights, 12, widths, gen)
            assert tokens == plain, (seed, widths)
            total_accepted += accepted
    assert total_accepted > 20


# --- bad input ----------------------------------------------------------------------------


def good_args():
    return dict(
        draft_token_ids=ids([[1, 2, 3]]),
        parents=ids([[-1, 0, -1]]),
        num_nodes=ids([3]),
        draft_probs=torch.full((1, 3, 4), 0.25),
        target_probs=torch.full((1, 4, 4), 0.25),
        target_token_ids=ids([[1, 2, 3, 0]]),
        greedy=torch.tensor([False]),
    )


@pytest.mark.parametrize(
    "name, value, match",
    [
        ("parents", ids([[-1, 1, -1]]), "parents.*earlier node"),
        ("parents", ids([[-1, 0, -2]]), "parents.*earlier node"),
        ("parents", ids([[-1, 0]]), "parents.*shape"),
        ("parents", torch.tensor([[-1, 0, -1]], dtype=torch.int32), "parents.*int64"),
        ("num_nodes", ids([4]), "num_nodes"),
        ("draft_token_ids", ids([[1, 4, 3]]), "draft_token_ids.*out of range"),
        ("target_token_ids", ids([[1, 2, -1, 0]]), "target_token_ids.*out of range"),
        ("target_probs", torch.full((1, 3, 4), 0.25), "target_probs"),
        ("draft_probs", torch.full((1, 3, 5), 0.2), "draft_probs"),
        ("greedy", torch.tensor([0]), "greedy"),
        ("target_probs", torch.tensor([[[0.25, float("nan"), 0.25, 0.25]] * 4]), "target_probs.*NaN"),
        ("draft_probs", torch.tensor([[[0.5, -0.25, 0.5, 0.25]] * 3]), "draft_probs.*negative"),
    ],
)
def test_invalid_inputs_fail_fast_naming_the_argument(name, value, match):
    args = good_args() | {name: value}
    with pytest.raises(SamplingInputError, match=match):
        tree_rejection_sample(**args)


def test_good_args_are_accepted_and_padding_is_not_checked_as_a_node():
    assert tree_rejection_sample(**good_args()).token_ids.shape == (1, 3)
    padded = good_args() | dict(draft_token_ids=ids([[1, -1, -1]]), parents=ids([[-1, 5, -1]]), num_nodes=ids([1]),
                                target_token_ids=ids([[1, 2, -1, -1]]))
    assert tree_rejection_sample(**padded).token_ids.shape == (1, 2)
