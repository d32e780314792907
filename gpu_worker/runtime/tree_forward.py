"""Tree verify: one forward over a tree of draft tokens per row (`tree_forward`), each node's
logits bit for bit those of decoding its path token by token, then the accepted path kept in
the KV cache (`keep_path`).

A row's tree: the root, the row's last committed token, fed now as a decode step would feed it,
and N draft nodes, node i a child of node parents[i] (ROOT: of the root), every parent before
its children (depth-first preorder, or any such order). Column c of a row's tokens is node
c - 1; column 0 is the root. With L the slot's committed length, node i sits at position
L + depth(i) (RoPE by it) and sees the slot's prefix, the root, its ancestors and itself.

Letters as in gpu_worker/runtime/model.py, and N draft nodes per row, J = N + 1 columns, A
accepted nodes, R = B*J*H query rows.

A mask over the tree's columns gives decode bits only where the block kernel sums a row's keys
in key order and a masked key adds exact zeros (our kernel, linear_kernel.cpp `attend_rows`;
torch's flash kernel's reduction depends on where each key sits in the block), and only within
one key block (a row's blocks are combined by their log-sum-exps). So:
- Projections, norms and the MLP run on all J columns at once (`linear` is row-invariant).
- K/V: column c is written at cache position L + c, as `forward` writes a chain; nothing is
  committed (`keep_path` commits the root and the accepted path).
- Attention, per layer and window group:
  - in place (our kernel, and every row's columns inside its root's block): `model.attention`
    itself, the columns as T = J rows over the window as stored, the blocks before the root's
    all seen, in the root's block column j seeing the prefix below L and the columns of its
    path, which come in depth order (parents before children): the same nonzero terms in the
    same order as a decode step's over L..L + depth (`tree_window_plan`);
  - else in two calls of `model.block_outputs`, then `model.combine_blocks` over each query
    row's blocks in the order a decode step has them: the prefix, the slot's whole key blocks
    before the root's block, shared as they are by the row's nodes (the T = J rows of a step
    that sees keys up to there); and the tail by copies, each node a T = 1 row over its own copy
    of the blocks from the root's on, its path's keys and values gathered to positions
    L..L + depth, where decoding puts them.
  A query row's kernel bits depend neither on T, B or its unit neighbours, nor on keys it
  cannot see, and blocks past its last weigh exactly 0: each node gets a decode step's bits.
tests/gpu_worker/runtime/test_tree_forward.py checks it with torch.equal.
"""

from dataclasses import dataclass, replace

import torch

from gpu_worker.runtime.kv_cache import KEY_BLOCK, KVCache, SlotError, WindowGroup
from gpu_worker.runtime.kernel_paths import attention_kernel
from gpu_worker.runtime.model import (
    MASKED,
    QUERY_TILE,
    AttentionPlan,
    Model,
    Step,
    attention,
    attention_plan,
    block_outputs,
    by_group,
    check_cache,
    combine_blocks,
    read_out,
    rope_rows,
    run_layers,
    unit_layout,
)
from schemas.arrays import ROOT_PARENT

# The root's node index: a parent ROOT makes a node a child of the root. It also pads
# accepted_nodes (a path never lists the root).
ROOT = ROOT_PARENT


def tree_paths(parents: torch.Tensor, num_nodes: torch.Tensor) -> list[list[list[int]]]:
    """Check a batch of trees; per row, per column c in 0..N, the columns on c's path from the
    root, [0, ..., c] ([0] for padding columns).

    parents: (B, N) int64, row b's nodes its first num_nodes[b], each parent ROOT or an earlier
    node; entries past num_nodes[b] are padding (any value). num_nodes: (B,) int64 in [0, N].
    Raises ValueError naming the first bad row and node.
    """
    if parents.dim() != 2 or num_nodes.shape != parents.shape[:1]:
        raise ValueError(f"parents must be (B, N) and num_nodes (B,), got {tuple(parents.shape)} "
                         f"and {tuple(num_nodes.shape)}")
    B, N = parents.shape
    out = []
    for b, (row, n) in enumerate(zip(parents.tolist(), num_nodes.tolist())):
        if not 0 <= n <= N:
            raise ValueError(f"row {b}: num_nodes {n} must lie in [0, N={N}]")
        paths = [[0]]
        for i, parent in enumerate(row[:n]):
            if not ROOT <= parent < i:
                raise ValueError(f"row {b}: node {i} has parent {parent}; a parent must be ROOT ({ROOT}) "
                                 f"or an earlier node (parents before children)")
            paths.append(paths[parent + 1] + [i + 1])
        out.append(paths + [[0]] * (N - n))
    return out


@dataclass
class TreeGroupPlan:
    """How `tree_group_attention` lays out one window group's Bg rows of J columns, the same
    for every layer; built by `tree_group_plan`."""
    prefix_blocks: int                # nbp: the group's most whole key blocks before a root's block
    prefix: AttentionPlan | None      # the columns as T = J rows over keys 0..nbp*KEY_BLOCK - 1, row b
                                      # seeing its own whole blocks; None when nbp = 0 or in place
    tail: AttentionPlan               # each column a T = 1 row over its tail window of nbt blocks, or
                                      # (in place) the columns as T = J rows over the window of nbp + 1
                                      # blocks as stored (`tree_window_plan`)
    tail_rows: list[torch.Tensor] | None  # per row, (J*Hkv*nbt*KEY_BLOCK,) rows of its slot's layer storage
                                      # viewed (Hkv*(C + 1), D) that form its columns' tail windows; None in place
    blocks: torch.Tensor | None       # (R*nb,) each query row's nb = nbp + nbt blocks in decode order, as
                                      # rows of the prefix's then the tail's `block_outputs`; None in place


@dataclass
class TreeStep(Step):
    """A `Step` whose attention is the tree's: plan.rope_pos holds L + depth of each column."""
    attention: list[TreeGroupPlan]    # one per window group of the plan, in its order

    def attend(self, q: torch.Tensor, cache: KVCache, index: int) -> torch.Tensor:
        return by_group(q, self.plan.groups, self.attention,
                        lambda q_g, group, plan: tree_group_attention(q_g, cache, index, group, plan))


def tree_group_plan(group: WindowGroup, starts: list[int], paths: list[list[list[int]]], num_kv_heads: int,
                    group_size: int, device: torch.device, in_place: bool = False) -> TreeGroupPlan:
    """The TreeGroupPlan of a window group whose rows have committed lengths starts (Bg) and
    trees `paths` (tree_paths' rows), for Hkv = num_kv_heads heads of G = group_size. in_place:
    the columns attend over the window as stored, masked per column in the root's block
    (`tree_window_plan`), where every row's columns lie in that block; else each column's tail is
    a copy of its path."""
    Bg, J, Hkv, G, KB = len(starts), len(paths[0]), num_kv_heads, group_size, KEY_BLOCK
    L = torch.tensor(starts).view(Bg, 1)
    whole = L // KB                                      # (Bg, 1) whole blocks before the root's
    if in_place and all(start % KB + J - 1 < KB for start in starts):
        return TreeGroupPlan(prefix_blocks=int(whole.max()), prefix=None,
                             tail=tree_window_plan(starts, paths, Hkv, G, int(whole.max()) + 1, device),
                             tail_rows=None, blocks=None)
    depth = torch.tensor([[len(p) - 1 for p in row] for row in paths])               # (Bg, J)
    Dm = int(depth.max()) + 1
    base = whole * KB                                    # a row's tail window starts here
    qpos = L - base + depth                              # (Bg, J) each column's position in it
    nbp, nbt = int(whole.max()), int(qpos.max()) // KB + 1
    # Tail window position w of column j holds position base + w: the prefix below L, the path's
    # column at L + d for d <= depth(j); past that masked, so any column (the root's) will do.
    ancestors = torch.tensor([[p + p[-1:] * (Dm - len(p)) for p in row] for row in paths])  # (Bg, J, Dm)
    rel = (base - L + torch.arange(nbt * KB)).view(Bg, 1, -1).expand(-1, J, -1)      # (Bg, J, Wt) pos - L
    on_path = (rel >= 0) & (rel <= depth.unsqueeze(-1))
    column = L.unsqueeze(-1) + torch.where(rel < 0, rel, ancestors.gather(2, rel.clamp(0, Dm - 1)) * on_path)
    heads = torch.arange(Hkv).view(1, Hkv, 1)
    tail_rows = [(heads * keys[0].shape[1] + cols.unsqueeze(1)).flatten().to(device)  # (J, Hkv, Wt)
                 for keys, cols in zip(group.keys, column)]
    tail = attention_plan(qpos.view(Bg * J, 1).to(device), Hkv, G, nbt * KB)
    prefix = attention_plan((base - 1).expand(Bg, J).to(device), Hkv, G, nbp * KB) if nbp else None
    # Query row r (b, j, head) has block p at: prefix p below its row's whole blocks, then its
    # nbt tail blocks, then the group's masked prefix blocks past the row's (weight exactly 0).
    p = torch.arange(nbp + nbt, device=device)
    w = whole.to(device).view(Bg, 1).expand(-1, J * Hkv * G).reshape(-1, 1)         # (R, 1)
    blocks = output_rows(tail, (p - w).clamp(0, nbt - 1))                             # (R, nb)
    if prefix is not None:
        blocks = torch.where((p >= w) & (p < w + nbt), blocks + Bg * Hkv * nbp * prefix.nq * QUERY_TILE,
                             output_rows(prefix, torch.where(p < w, p, p - nbt).clamp(0, nbp - 1)))
    return TreeGroupPlan(prefix_blocks=nbp, prefix=prefix, tail=tail, tail_rows=tail_rows, blocks=blocks.flatten())


def tree_window_plan(starts: list[int], paths: list[list[list[int]]], Hkv: int, G: int, nb: int,
                     device: torch.device) -> AttentionPlan:
    """The columns of each row as T = J query rows over the group's window of nb key blocks as
    stored, the columns' K/V where the tree forward wrote them (at L + c, all inside the root's
    block): the blocks before the root's all visible, in the root's block the prefix below L and
    the columns of the column's path, the blocks after masked. The block kernel sums a row's keys
    in key order and a masked key adds exact zeros, and the path's columns come in the order of
    their depths (parents before children), so each column gets the bits of a decode step over
    its path at L..L + depth: `attention` itself, one block call and one combine a layer."""
    Bg, J, KB = len(starts), len(paths[0]), KEY_BLOCK
    visible = torch.zeros(Bg, J, KB, dtype=torch.bool)
    for b, (start, row) in enumerate(zip(starts, paths)):
        visible[b, :, :start % KB] = True                                   # the prefix in this block
        for j, path in enumerate(row):
            visible[b, j, [start % KB + c for c in path]] = True
    row_token, unit_q, unit_out, out_rows = unit_layout(Bg, J, Hkv, G, device)
    nq = row_token.numel() // QUERY_TILE
    rows = visible[:, row_token.cpu().clamp_max(J - 1)]                       # (Bg, nq*QT, KB); padding rows: the last column's
    root = torch.tensor(starts).view(Bg, 1, 1, 1) // KB                       # each row's root block
    block = torch.arange(nb).view(1, nb, 1, 1)
    seen = (block < root) | ((block == root) & rows.unsqueeze(1))             # (Bg, nb, nq*QT, KB)
    mask = torch.zeros(Bg, nb, nq * QUERY_TILE, KB).masked_fill_(~seen, MASKED)
    return AttentionPlan(nq=nq, nb=nb, mask=mask.to(device), unit_q=unit_q, unit_out=unit_out, out_rows=out_rows)


def output_rows(plan: AttentionPlan, block: torch.Tensor) -> torch.Tensor:
    """Where query row r's block block[r, i] is among the rows of `block_outputs(..., plan)`'s
    out flattened to (U*nb*nq*QT, D): block (R, n) int64 -> (R, n)."""
    M = plan.nq * QUERY_TILE                             # rows of a unit
    return (plan.out_rows // M * plan.nb * M + plan.out_rows % M).view(-1, 1) + block * M


def tree_group_attention(q: torch.Tensor, cache: KVCache, index: int, group: WindowGroup,
                         plan: TreeGroupPlan) -> torch.Tensor:
    """Attention of a window group's columns q (Bg, J, H, D) for layer `index`, the columns'
    K/V written at L + c: (Bg*J, H*D), each column's rows the bits of a decode step at its
    position after its path."""
    Bg, J, H, D = q.shape
    if plan.tail_rows is None:  # in place: `attention` over the window with the tree's mask
        k, v = (t[:, :, :plan.tail.nb * KEY_BLOCK] for t in cache.window(index, group))
        return attention(q, k, v, plan.tail)
    outs, lses = [], []
    if plan.prefix is not None:
        k, v = (t[:, :, :plan.prefix_blocks * KEY_BLOCK] for t in cache.window(index, group))
        out, lse = block_outputs(q, k, v, plan.prefix)
        outs.append(out.reshape(-1, D))
        lses.append(lse.reshape(-1))
    Hkv, Wt = group.keys[0][index].shape[0], plan.tail.nb * KEY_BLOCK
    k, v = ([storage[index].view(-1, D).index_select(0, rows) for storage, rows in zip(stored, plan.tail_rows)]
            for stored in (group.keys, group.values))
    k, v = ((t[0] if len(t) == 1 else torch.cat(t)).view(Bg * J, Hkv, Wt, D) for t in (k, v))
    out, lse = block_outputs(q.reshape(Bg * J, 1, H, D), k, v, plan.tail)
    outs.append(out.reshape(-1, D))
    lses.append(lse.reshape(-1))
    nb = plan.prefix_blocks + plan.tail.nb
    out = torch.cat(outs).index_select(0, plan.blocks).view(-1, nb, D)                # (R, nb, D)
    if nb > 1:  # nb == 1: the one block's weight is exp(0) = 1, as in `attention`
        out = combine_blocks(out, torch.cat(lses).index_select(0, plan.blocks).view(-1, nb, 1), q.dtype)
    return out.view(Bg * J, H * D)


def tree_step(cfg, cache: KVCache, slots: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor, J: int,
              rope_cos: torch.Tensor, rope_sin: torch.Tensor, weights: torch.Tensor) -> TreeStep:
    """The planned step of a batch of trees over cache (slots, parents, num_nodes as `tree_forward`'s,
    J columns a row) for decoder layers of shape cfg (`model.DecoderShape`: the target's, or an
    EAGLE head's) whose weights are like `weights` (dtype and device pick the attention kernel).
    Raises ValueError for a malformed tree, CacheCapacityError (nothing written) past max_seq_len."""
    paths = tree_paths(parents, num_nodes)
    plan = cache.plan(slots, num_nodes.cpu() + 1, J)                   # checks the slots, grows them
    starts = cache.lengths[slots.cpu()].tolist()
    depth = torch.tensor([[len(p) - 1 for p in row] for row in paths])
    plan = replace(plan, rope_pos=(torch.tensor(starts).view(-1, 1) + depth).to(cache.device))
    G = cfg.num_heads // cfg.num_kv_heads
    in_place = attention_kernel(weights, cfg.head_dim) is not None  # `block_outputs` runs our kernel
    groups = [tree_group_plan(g, starts if g.rows is None else [starts[b] for b in g.rows.tolist()],
                              paths if g.rows is None else [paths[b] for b in g.rows.tolist()],
                              cfg.num_kv_heads, G, cache.device, in_place) for g in plan.groups]
    return TreeStep(plan, *rope_rows(rope_cos, rope_sin, plan.rope_pos), attention=groups)


@torch.inference_mode()
def tree_forward(model: Model, cache: KVCache, slots: torch.Tensor, token_ids: torch.Tensor,
                 parents: torch.Tensor, num_nodes: torch.Tensor,
                 return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Verify a tree of draft tokens per row in one forward; return every column's logits.

    slots: (B,) int64, distinct allocated cache slots (CPU).
    token_ids: (B, J) int64, J = N + 1: column 0 the root (the row's last committed token, not
        yet in its slot), column c = i + 1 node i; columns past num_nodes[b] + 1 are padding
        (any valid id).
    parents: (B, N) int64 on CPU, node i's parent node, or ROOT; every parent before its
        children; entries past num_nodes[b] are padding (any value).
    num_nodes: (B,) int64 on CPU in [0, N]: row b's draft nodes.
    Returns logits (B, J, V) in the model's dtype; with return_hidden, also the final-normed
    hidden states (B, J, E). Column c's are bit for bit those `forward` gives when the root
    and the nodes on c's path are fed to the slot in order (one at a time or as one chain).
    Padding columns' are unspecified.

    Column c of row b is written to cache position L_b + c (L_b = cache.lengths[slot_b]);
    lengths do not change: `keep_path` then keeps the root and the accepted path. Raises
    ValueError for a malformed tree, CacheCapacityError (nothing written) when L_b + num_nodes[b]
    + 1 passes cache.max_seq_len.
    """
    cfg = model.config
    B, J = token_ids.shape
    if slots.shape != (B,) or parents.shape != (B, J - 1):
        raise ValueError(f"token_ids (B, J) = {tuple(token_ids.shape)} needs slots (B,) and parents "
                         f"(B, J - 1), got {tuple(slots.shape)} and {tuple(parents.shape)}")
    check_cache(model, cache)
    step = tree_step(cfg, cache, slots, parents, num_nodes, J, model.rope_cos, model.rope_sin, model.embed)
    x = run_layers(model, cache, step, token_ids)
    return read_out(model, x.view(B, J, cfg.hidden_size), None, return_hidden)


@torch.inference_mode()
def keep_path(cache: KVCache, slots: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
              accepted_nodes: torch.Tensor) -> None:
    """After `tree_forward` (slots, parents and num_nodes as there), keep each row's root and
    accepted path: move the path's K/V from positions L + 1 + node to L + 1..L + A (all layers)
    and commit them, so the slot holds what decoding the root and the path would have left.

    accepted_nodes: (B, A') int64 on CPU, row b's accepted nodes from the root's child down,
    then ROOT as padding (all ROOT: only the root is kept). Raises ValueError, changing
    nothing, when a row's nodes are not a path from its root, SlotError when a slot's storage
    cannot hold what the tree forward wrote. lengths[slots] advance by 1 + A_b.
    """
    paths = tree_paths(parents, num_nodes)
    B = len(paths)
    if slots.shape != (B,) or accepted_nodes.dim() != 2 or accepted_nodes.shape[0] != B:
        raise ValueError(f"slots must be (B,) and accepted_nodes (B, A) for B = {B} trees, got "
                         f"{tuple(slots.shape)} and {tuple(accepted_nodes.shape)}")
    slot_list = slots.tolist()
    if len(set(slot_list)) != B:
        raise SlotError(f"slots {slot_list} must be distinct")
    kept = []
    for b, (row, slot) in enumerate(zip(accepted_nodes.tolist(), slot_list)):
        A = row.index(ROOT) if ROOT in row else len(row)
        path = row[:A]
        # padding columns' paths are [0]: a path through padding does not match
        if any(n != ROOT for n in row[A:]) or not all(0 <= n < len(paths[b]) - 1 for n in path) or \
                (path and paths[b][path[-1] + 1] != [0] + [n + 1 for n in path]):
            raise ValueError(f"row {b}: accepted nodes {row} are not a path from the root of its tree "
                             f"then {ROOT} padding")
        if not 0 <= slot < cache.max_slots or slot in cache.free_slots:
            raise SlotError(f"slot {slot} is not an allocated slot")
        start = int(cache.lengths[slot])
        if cache.capacity(slot) < start + 1 + A:
            raise SlotError(f"slot {slot} holds {cache.capacity(slot)} positions, not the {start + 1 + A} "
                            f"of its tree's kept path: keep_path follows tree_forward")
        kept.append((slot, start, path))
    for slot, start, path in kept:
        if path:
            source = torch.tensor(path, device=cache.device) + start + 1
            for t in cache.tensors(slot):                                # (layers, Hkv, C + 1, D)
                t[:, :, start + 1:start + 1 + len(path)] = t.index_select(2, source)
    cache.commit(slots, torch.tensor([1 + len(path) for _, _, path in kept]))
