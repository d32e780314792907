"""tree_forward and keep_path: a tree of drafts verified in one forward gives every node the bits
of decoding its path, and keeping the accepted path leaves the cache decoding would have left.

References are plain `forward`s on a second cache holding the same prefixes: the root and a
node's path fed one token at a time, and as one chain. Batches of rows with different prefix
lengths and trees (padded), in one window group and in several, a group whose rows have
different numbers of whole key blocks before the root, trees inside their root's key block
(attended in place) and trees that cross a key block boundary (attended over copies; with
torch's flash kernel, every tree);
two models: Hkv = 1 with G = 3 (the shipped tiny target) and Hkv = 2 with G = 5 (a node's
query heads need two units); float32 and bfloat16; torch.equal throughout.
"""

import pytest
import torch

from gpu_worker.runtime.checkpoint import load_model
from gpu_worker.runtime.kv_cache import KEY_BLOCK, KVCache, SlotError
from gpu_worker.runtime.model import forward
from gpu_worker.runtime import linear_kernel
from gpu_worker.runtime.tree_forward import ROOT, keep_path, tree_forward, tree_group_plan, tree_paths
from schemas.config import TINY_TARGET
from tests.tiny_checkpoints import write_hf_model

DTYPES = [torch.float32, torch.bfloat16]
MAX_SEQ_LEN = 1024
PAD = 99  # padding parents: any value
TREES = {
    "chain": [ROOT, 0, 1, 2, 3, 4],
    "wide": [ROOT] * 7,
    "deep_mixed": [ROOT, 0, 1, 1, 0, 4, 5, 6, ROOT, 8, 8, 2],
    "bushy": [ROOT, ROOT, 0, 0, 1, 1, 2, 4],
}
# (prefix length, tree) per row, each batch's rows in two window groups. Some trees cross a key
# block boundary (deep_mixed has depth 5); rows of one group differ in their whole blocks before
# the root (250: 0, 300: 1; 764: 2, 778: 3), so a row's blocks are not where the group's are:
# 764's are p0 p1 t0 t1, whose pairwise sum a hole between p1 and t0 would change.
BATCHES = [
    [(KEY_BLOCK - 6, "deep_mixed"), (300, "wide"), (12, "bushy")],
    [(3 * KEY_BLOCK - 4, "deep_mixed"), (3 * KEY_BLOCK + 10, "chain"), (130, "wide")],
]


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread (the tests compare bits; a second thread on a shared machine mostly
    waits); a test may raise it for the calls it compares."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["tiny_target", "gqa5"])
def family(request, tmp_path_factory):
    """(path, name) of a checkpoint: the shipped tiny target, or a random Llama with Hkv = 2
    key/value heads of G = 5 query heads each."""
    if request.param == "tiny_target":
        return TINY_TARGET
    path = tmp_path_factory.mktemp("gqa5")
    write_hf_model(path, "llama", hidden_size=80, intermediate_size=64, num_attention_heads=10,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=MAX_SEQ_LEN)
    return path


def column_paths(parents: list[int]) -> list[list[int]]:
    """Each column's path from the root: [0, ..., c] (column c = node c - 1)."""
    paths = [[0]]
    for i, parent in enumerate(parents):
        paths.append(paths[parent + 1] + [i + 1])
    return paths


def one(token, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor([[int(token)]], dtype=dtype)


def prefilled(model, config, dtype, prefixes: list[torch.Tensor]) -> KVCache:
    """A cache whose slot b holds prefixes[b]."""
    cache = KVCache(config, max_slots=len(prefixes), max_seq_len=MAX_SEQ_LEN, dtype=dtype)
    for prefix in prefixes:
        slot = cache.allocate()
        forward(model, cache, torch.tensor([slot]), prefix[None], torch.tensor([len(prefix)]))
    return cache


def make_batch(config, rows, seed):
    """Random prefixes and tokens for rows [(prefix length, tree name)]: prefixes, token_ids
    (B, J), parents (B, N) and num_nodes (B,), padding ids random and padding parents PAD."""
    g = torch.Generator().manual_seed(seed)
    N = max(len(TREES[name]) for _, name in rows)
    prefixes = [torch.randint(0, config.vocab_size, (n,), generator=g) for n, _ in rows]
    token_ids = torch.randint(0, config.vocab_size, (len(rows), N + 1), generator=g)
    parents = torch.full((len(rows), N), PAD)
    for b, (_, name) in enumerate(rows):
        parents[b, :len(TREES[name])] = torch.tensor(TREES[name])
    num_nodes = torch.tensor([len(TREES[name]) for _, name in rows])
    return prefixes, token_ids, parents, num_nodes


def decode_each_column(model, cache, slot, start, tokens, parents):
    """Feed the root and each column's path one token at a time after the slot's prefix (length
    start), backing up to the common part between columns; (J, V) logits and (J, E) hidden."""
    logits, hidden, fed = [], [], []
    for path in column_paths(parents):
        keep = 0
        while keep < min(len(fed), len(path) - 1) and fed[keep] == path[keep]:
            keep += 1
        cache.truncate(slot, start + keep)
        fed = fed[:keep]
        for c in path[keep:]:
            out, h = forward(model, cache, torch.tensor([slot]), one(tokens[c]), torch.tensor([1]), return_hidden=True)
            fed.append(c)
        logits.append(out[0, 0])
        hidden.append(h[0, 0])
    cache.truncate(slot, start)
    return torch.stack(logits), torch.stack(hidden)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_node_gets_the_bits_of_decoding_its_path(family, dtype):
    model, config = load_model(family, dtype=dtype, max_seq_len=MAX_SEQ_LEN)
    assert_decode_bits(model, config, dtype)


def test_with_torchs_flash_kernel_the_copied_tails_give_decode_bits(monkeypatch):
    """Where our kernel does not run (here turned off), attention is torch's flash kernel, whose
    bits depend on where a key sits in its block: every tail is then a copy of its path."""
    monkeypatch.setenv("SPECBUS_LINEAR_KERNEL", "0")
    linear_kernel.load.cache_clear()
    try:
        model, config = load_model(TINY_TARGET, dtype=torch.float32, max_seq_len=MAX_SEQ_LEN)
        assert_decode_bits(model, config, torch.float32)
    finally:
        linear_kernel.load.cache_clear()


def test_a_tree_inside_its_roots_key_block_is_attended_in_place_else_by_copies():
    _, config = load_model(TINY_TARGET, dtype=torch.float32, max_seq_len=MAX_SEQ_LEN)
    cache = KVCache(config, max_slots=2, max_seq_len=MAX_SEQ_LEN)
    slots = torch.tensor([cache.allocate(), cache.allocate()])
    parents = torch.tensor([TREES["bushy"]] * 2)
    for starts, in_place in (([12, 300], True), ([12, KEY_BLOCK - 3], False)):
        plan = cache.plan(slots, torch.tensor([9, 9]), 9)
        paths = tree_paths(parents, torch.tensor([8, 8]))
        groups = [tree_group_plan(g, [starts[b] for b in (range(2) if g.rows is None else g.rows.tolist())],
                                  [paths[b] for b in (range(2) if g.rows is None else g.rows.tolist())],
                                  config.num_kv_heads, config.num_heads // config.num_kv_heads, cache.device,
                                  in_place=True) for g in plan.groups]
        assert [g.tail_rows is None for g in groups] == [in_place] * len(groups), starts


def assert_decode_bits(model, config, dtype):
    """Every batch of BATCHES through tree_forward: each column's logits and hidden state equal
    decoding its path one token at a time, and each leaf's path as one chain step."""
    for seed, rows in enumerate(BATCHES):
        prefixes, token_ids, parents, num_nodes = make_batch(config, rows, seed)
        tree, ref = prefilled(model, config, dtype, prefixes), prefilled(model, config, dtype, prefixes)
        order = list(range(len(rows)))[::-1]  # slots not in batch order
        stored = [tree.tensors(b)[0][:, :, :len(p)].clone() for b, p in enumerate(prefixes)]
        logits, hidden = tree_forward(model, tree, torch.tensor(order), token_ids[order], parents[order],
                                      num_nodes[order], return_hidden=True)
        assert logits.shape == (len(rows), token_ids.shape[1], config.vocab_size)
        assert tree.lengths.tolist() == [len(p) for p in prefixes]  # nothing committed
        for b, prefix in enumerate(prefixes):
            assert torch.equal(tree.tensors(b)[0][:, :, :len(prefix)], stored[b])  # prefix untouched
            J, tree_parents, at = int(num_nodes[b]) + 1, parents[b, :int(num_nodes[b])].tolist(), order.index(b)
            want_logits, want_hidden = decode_each_column(model, ref, b, len(prefix), token_ids[b], tree_parents)
            assert torch.equal(logits[at, :J], want_logits), f"row {b} ({rows[b]}): decode"
            assert torch.equal(hidden[at, :J], want_hidden), f"row {b} ({rows[b]}): decode hidden"
            leaves = set(range(J)) - {p + 1 for p in tree_parents}
            for leaf in sorted(leaves):  # each path as one chain step: every column is on one
                path = column_paths(tree_parents)[leaf]
                chain, chain_hidden = forward(model, ref, torch.tensor([b]), token_ids[b, path][None],
                                              torch.tensor([len(path)]), return_hidden=True)
                ref.truncate(b, len(prefix))
                assert torch.equal(logits[at, path], chain[0]), f"row {b} ({rows[b]}): chain to {leaf}"
                assert torch.equal(hidden[at, path], chain_hidden[0])


@pytest.mark.parametrize("dtype, threads", [(torch.float32, 1), (torch.bfloat16, 1), (torch.float32, 2)],
                         ids=["float32", "bfloat16", "float32-2-threads"])
def test_a_chain_tree_gives_the_bits_of_forward(dtype, threads):
    model, config = load_model(TINY_TARGET, dtype=dtype, max_seq_len=MAX_SEQ_LEN)
    rows = [(KEY_BLOCK - 2, "chain"), (40, "chain")]
    prefixes, token_ids, parents, num_nodes = make_batch(config, rows, seed=5)
    num_nodes[1] = 3  # a shorter chain in the second row: padding columns after it
    tree, plain = prefilled(model, config, dtype, prefixes), prefilled(model, config, dtype, prefixes)
    slots = torch.tensor([0, 1])
    torch.set_num_threads(threads)
    got = tree_forward(model, tree, slots, token_ids, parents, num_nodes)
    want = forward(model, plain, slots, token_ids, num_nodes + 1)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1, :4], want[1, :4])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_keep_path_leaves_the_cache_decoding_the_path_would(dtype):
    """Rows accepting a deep path, nothing, and one node; then a decode and a verify step."""
    model, config = load_model(TINY_TARGET, dtype=dtype, max_seq_len=MAX_SEQ_LEN)
    rows = [(KEY_BLOCK - 3, "deep_mixed"), (300, "wide"), (20, "bushy")]
    prefixes, token_ids, parents, num_nodes = make_batch(config, rows, seed=7)
    accepted = torch.tensor([[0, 4, 5, 6], [ROOT] * 4, [1, ROOT, ROOT, ROOT]])
    after = torch.randint(0, config.vocab_size, (3, 3), generator=torch.Generator().manual_seed(8))
    tree, ref = prefilled(model, config, dtype, prefixes), prefilled(model, config, dtype, prefixes)
    slots = torch.tensor([2, 0, 1])  # not in batch order
    tree_forward(model, tree, slots, token_ids[slots], parents[slots], num_nodes[slots])
    keep_path(tree, slots, parents[slots], num_nodes[slots], accepted[slots])
    kept = [[0] + [n + 1 for n in row if n != ROOT] for row in accepted.tolist()]
    assert tree.lengths.tolist() == [len(p) + len(k) for p, k in zip(prefixes, kept)]
    # the next steps: a decode step, then a verify step of two tokens
    decode = forward(model, tree, slots, after[slots, :1], torch.ones(3, dtype=torch.int64))
    verify = forward(model, tree, slots, after[slots, 1:], torch.full((3,), 2))
    for b, prefix in enumerate(prefixes):
        for c in kept[b]:
            forward(model, ref, torch.tensor([b]), one(token_ids[b, c]), torch.tensor([1]))
        want = torch.stack([forward(model, ref, torch.tensor([b]), one(t), torch.tensor([1]))[0, 0] for t in after[b]])
        at = slots.tolist().index(b)
        assert torch.equal(decode[at, 0], want[0]), f"row {b}: decode after keep_path"
        assert torch.equal(verify[at], want[1:]), f"row {b}: verify after keep_path"
        n = int(ref.lengths[b])
        assert n == int(tree.lengths[b])
        assert all(torch.equal(t[:, :, :n], r[:, :, :n]) for t, r in zip(tree.tensors(b), ref.tensors(b)))


def test_bad_trees_are_refused():
    model, config = load_model(TINY_TARGET, max_seq_len=MAX_SEQ_LEN)
    cache = prefilled(model, config, torch.float32, [torch.tensor([1, 2, 3])])
    slots, ids = torch.tensor([0]), torch.zeros(1, 4, dtype=torch.int64)
    for parents, num_nodes, match in [
        ([[ROOT, 1, 0]], [3], "node 1 has parent 1"),        # its own parent
        ([[ROOT, 0, 2]], [3], "node 2 has parent 2"),
        ([[-2, 0, 0]], [3], "node 0 has parent -2"),
        ([[ROOT, 0, 0]], [4], r"num_nodes 4 must lie in \[0, N=3\]"),
    ]:
        with pytest.raises(ValueError, match=match):
            tree_forward(model, cache, slots, ids, torch.tensor(parents), torch.tensor(num_nodes))
    with pytest.raises(ValueError, match="needs slots"):
        tree_forward(model, cache, slots, ids, torch.tensor([[ROOT, 0]]), torch.tensor([2]))
    assert cache.lengths.tolist() == [3]


def test_keep_path_refuses_what_is_not_a_path():
    model, config = load_model(TINY_TARGET, max_seq_len=MAX_SEQ_LEN)
    cache = prefilled(model, config, torch.float32, [torch.tensor([1, 2, 3])])
    slots, parents, num_nodes = torch.tensor([0]), torch.tensor([[ROOT, 0, ROOT, PAD]]), torch.tensor([3])
    tree_forward(model, cache, slots, torch.zeros(1, 5, dtype=torch.int64), parents, num_nodes)
    for accepted in ([[1, ROOT]],        # node 1 is not a child of the root
                     [[0, 2]],           # node 2 is not a child of node 0
                     [[ROOT, 0]],        # padding before a node
                     [[2, 3]],           # node 3 is padding
                     [[5, ROOT]]):       # out of range
        with pytest.raises(ValueError, match="not a path from the root"):
            keep_path(cache, slots, parents, num_nodes, torch.tensor(accepted))
    with pytest.raises(SlotError, match="not an allocated slot"):
        keep_path(cache, torch.tensor([1]), parents, num_nodes, torch.tensor([[0, 1]]))
    assert cache.lengths.tolist() == [3]
    keep_path(cache, slots, parents, num_nodes, torch.tensor([[0, 1]]))
    assert cache.lengths.tolist() == [6]
