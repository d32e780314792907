"""Exact acceptance over a tree of draft tokens, in target-vocabulary space: `rejection_sample`
(gpu_worker/sampling/rejection.py) with the chain of drafts generalised to a tree; the tree kernel
of gpu_worker/sampling/acceptance.py `accept` (which callers use).

Letters: N draft nodes per row (padded), D the deepest node of the batch. Per row:
draft_token_ids[:, i] is node i's draft token x_i; parents[:, i] its parent (ROOT = -1: a child
of the root, the last committed token), parents[i] < i (depth-first preorder is such an order);
target_probs[:, 0] is the target's processed law at the root and target_probs[:, i + 1] its law
after the path root..i; target_token_ids the target sampler's draws from those laws. The walk
starts at the root and, at node c, tries c's children in index order:

- greedy rows: move to the first child whose token is t_c; if none, emit t_c (recovered, or the
  bonus at a leaf) and stop. Gumbel-coupled rows are passed as greedy with their Gumbel-max
  draws as t (coupling.py), taken at `node_positions`: the noise there is keyed by (seed, stream
  position), so what they emit does not depend on the tree.
- sampled rows: recursive rejection over the children (SpecInfer, Miao et al. 2023, Alg. 2;
  SpecTr, Sun et al. 2023). r = q_c; child j, drawn from its draft law p_j, is accepted iff
  u_j * p_j(x_j) < r(x_j), and the walk moves to it (r = its target law); if rejected,
  r <- normalize(max(r - p_j, 0)) and the next child is tried. When every child is rejected the
  recovered token is drawn from r; at a leaf the bonus t_c is emitted. A point-mass child
  (p_j = one-hot at x_j, EAGLE's top-k expansion) is accepted with probability r(x_j), else
  r(x_j) is zeroed and r renormalised. A residual of zero mass (inconsistent inputs) emits t_c
  and sets residual_fallback.

Exactness. If x ~ p independently of u, then P(accept, x) = min(p(x), r(x)) and
P(reject) = sum_x max(r(x) - p(x), 0) = Z, after which the next child sees r' = max(r - p, 0) / Z
(Leviathan et al. 2023, Thm. 1, applied to one sibling). By induction over the children, the
last step being an exact draw from the final residual, the token emitted at c has law
min(p, r) + Z r' = min(p, r) + max(r - p, 0) = r, i.e. q_c (Miao et al. 2023, Thm. 4.2). An
accepted child continues from the target's law given the longer path with fresh uniforms, so the
emitted tokens are distributed as the target's own sampling. This needs each sampled child's
token drawn from its p_j independently of its earlier siblings' (with replacement; point masses
qualify).

A chain of k drafts is the tree parents = [-1, 0, ..., k-2]: with the same uniforms the result
equals `rejection_sample`'s bit for bit.

Uniforms (`tree_uniforms`), P the root's stream position (where the first new token lands):
node i's acceptance uniform is `make_uniforms` at stream STREAM_ACCEPT and position
P + depth(i) - 1 + rank(i) * 2**SIBLING_SHIFT, rank(i) = the number of its earlier siblings;
the recovered draw at depth d (the root's is 0) uses STREAM_RESIDUAL at P + d. A first child
therefore has the chain's uniform for its position. target_token_ids are drawn at
`node_positions` (P + depth).

Output (TreeRejectionResult): token_ids [B, D+1] = the accepted path's tokens, then the
recovered or bonus token, then -1; num_accepted [B]; accepted_nodes [B, D] the accepted path's
node indices (whose KV the caller keeps), then -1; residual_fallback [B]. Only the rows that
reject a child pay O(V), once per rejected child.
"""

from dataclasses import dataclass

import torch

from gpu_worker.sampling.rejection import RejectionResult, check_ids, check_probs, draw_uniforms
from gpu_worker.sampling.sampler import (STREAM_ACCEPT, STREAM_RESIDUAL, check, check_shape, make_uniforms,
                                         sample_from_probs)
from schemas.arrays import PAD_TOKEN_ID, ROOT_PARENT

ROOT = ROOT_PARENT  # a child of the root's parent (docs/PROTOCOL.md#tree-drafts); also accepted_nodes' padding
SIBLING_SHIFT = 40  # a sibling's rank is keyed above the position bits: positions must be < 2**40


@dataclass
class TreeRejectionResult(RejectionResult):
    """RejectionResult with token_ids [B, D+1], plus accepted_nodes [B, D] int64: the node
    indices of the accepted path, root side first, then ROOT."""

    accepted_nodes: torch.Tensor


def node_depths(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """parents [B, N] int64 (parents[i] < i on nodes in use), num_nodes [B] -> depths [B, N]
    int64: 1 for a child of the root, its parent's + 1 below; 0 on padding."""
    B, N = parents.shape
    valid = torch.arange(N, device=parents.device) < num_nodes[:, None]
    depth = torch.zeros(B, N, dtype=torch.int64, device=parents.device)
    for i in range(N):
        parent = parents[:, i]
        above = depth.gather(1, parent.clamp(0, N - 1)[:, None]).squeeze(1)  # (B,)
        depth[:, i] = torch.where(valid[:, i], torch.where(parent >= 0, above, 0) + 1, 0)
    return depth


def node_positions(parents: torch.Tensor, num_nodes: torch.Tensor, root_positions: torch.Tensor) -> torch.Tensor:
    """The stream positions of the root and the nodes' target laws, [B, N+1] int64: P + depth,
    P = root_positions [B] (where the root's draw lands); padding nodes get P. For a chain this
    is P + arange(N+1). Key target_token_ids (STREAM_TARGET, or Gumbel-max draws) by these."""
    depth = node_depths(parents, num_nodes)
    return root_positions[:, None] + torch.cat([depth.new_zeros(depth.shape[0], 1), depth], 1)


def sibling_ranks(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """[B, N] int64: the number of earlier nodes in use with the same parent (0 on padding)."""
    B, N = parents.shape
    node = torch.arange(N, device=parents.device)
    valid = node < num_nodes[:, None]  # (B, N)
    same = (parents[:, :, None] == parents[:, None, :]) & (node[None, :] < node[:, None])  # (B, N, N): [i, j]
    return ((same & valid[:, None, :]).sum(-1) * valid).long()


def tree_uniforms(seeds: torch.Tensor, root_positions: torch.Tensor, parents: torch.Tensor,
                  num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The counter-based uniforms of `tree_rejection_sample` (keyed as the module docstring says).

    seeds [B] int64; root_positions [B] int64, below 2**SIBLING_SHIFT - N; parents [B, N];
    num_nodes [B]. Returns (uniforms [B, N], residual_uniforms [B, N]) float64; for a chain they
    are make_uniforms(seeds, P + arange(N), STREAM_ACCEPT / STREAM_RESIDUAL).
    """
    B, N = parents.shape
    check_shape(root_positions, (B,), "root_positions")
    check(bool(((root_positions >= 0) & (root_positions + N < 2**SIBLING_SHIFT)).all()), "root_positions",
          f"must be in [0, 2**{SIBLING_SHIFT} - N)")
    depth = node_depths(parents, num_nodes)
    position = root_positions[:, None] + (depth - 1).clamp_min(0)  # (B, N): where node i's token lands
    uniforms = make_uniforms(seeds, position + (sibling_ranks(parents, num_nodes) << SIBLING_SHIFT), STREAM_ACCEPT)
    depths = root_positions[:, None] + torch.arange(N, device=parents.device)  # (B, N): recovered draw at depth d
    return uniforms, make_uniforms(seeds, depths, STREAM_RESIDUAL)


def tree_rejection_sample(
    draft_token_ids: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    target_token_ids: torch.Tensor,
    greedy: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    uniforms: torch.Tensor | None = None,
    residual_uniforms: torch.Tensor | None = None,
    check_values: bool = True,
) -> TreeRejectionResult:
    """Accept a path of a draft tree per row against the target's laws (module docstring).

    draft_token_ids [B, N] int64, target-vocab ids, -1 past num_nodes [B] int64 (in 0..N).
    parents [B, N] int64: ROOT or an earlier node, on nodes in use.
    draft_probs [B, N, V] float (each node's draft law; `proposal_to_draft_probs` builds it from
    a sparse or dense proposal), or None for point-mass proposals.
    target_probs [B, N+1, V] float: the root's processed law, then node i's at i + 1.
    target_token_ids [B, N+1] int64: the target sampler's draws there (argmax for greedy rows,
    Gumbel-max draws for coupled rows, which are passed as greedy); -1 past num_nodes + 1.
    greedy [B] bool.
    uniforms [B, N] float64: acceptance uniform of each node; residual_uniforms [B, N] float64:
    the recovered draw's uniform at each depth (`tree_uniforms`). Either, if None, is drawn from
    `generator` as rejection_sample draws it (never the global RNG).
    check_values: scan draft_probs and target_probs once each for NaN / negative values."""
    B, N, V = _check_tree(draft_token_ids, parents, num_nodes, draft_probs, target_probs, target_token_ids, greedy,
                          check_values)
    device = target_probs.device
    uniforms, residual_uniforms = draw_uniforms(B, N, device, generator, uniforms, residual_uniforms)

    depth = node_depths(parents, num_nodes)  # (B, N)
    D = int(depth.max()) if depth.numel() else 0
    valid = torch.arange(N, device=device) < num_nodes[:, None]  # (B, N)
    draft_ids = draft_token_ids.clamp_min(0)  # -1 padding gathers id 0, never tried
    rows = torch.arange(B, device=device)
    cur = torch.full((B,), ROOT, dtype=torch.int64, device=device)  # the walk's node
    num_accepted = torch.zeros(B, dtype=torch.int64, device=device)
    rejected = torch.zeros(B, dtype=torch.bool, device=device)  # a child of cur was rejected: r is `residual`
    stopped = torch.zeros(B, dtype=torch.bool, device=device)  # the residual had no mass
    residual = mass = None  # (B, V) float32 max(r - p_j, 0) of the last rejected child, unnormalised; (B,) its mass
    token_ids = torch.full((B, D + 1), PAD_TOKEN_ID, dtype=torch.int64, device=device)
    accepted_nodes = torch.full((B, D), ROOT, dtype=torch.int64, device=device)

    # One pass in index order tries every node whose parent is the walk's node when it comes:
    # parents[i] < i puts a node's children after it, and siblings after an accepted one no
    # longer match cur.
    for i in range(N):
        x = draft_ids[:, i]
        tried = valid[:, i] & (parents[:, i] == cur) & ~stopped
        at = cur + 1  # (B,): cur's slot in target_probs / target_token_ids
        t = target_token_ids.gather(1, at[:, None]).squeeze(1)
        target_at_x = target_probs[rows, at, x]  # (B,)
        draft_at_x = 1.0 if draft_probs is None else draft_probs[rows, i, x].to(target_at_x.dtype)
        residual_at_x = target_at_x.double()  # r(x) = q_c(x) at cur's first child
        if residual is not None:
            residual_at_x = torch.where(rejected, residual[rows, x].double() / mass, residual_at_x)
        accept_sampled = uniforms[:, i] * draft_at_x < residual_at_x
        accept = tried & torch.where(greedy, x == t, accept_sampled)
        reject = (tried & ~accept & ~greedy).nonzero().squeeze(1)  # (R,)
        if reject.numel() > 0:
            if residual is None:
                residual = torch.zeros(B, V, dtype=torch.float32, device=device)
                mass = torch.zeros(B, dtype=torch.float64, device=device)
            _remove_rejected(residual, mass, rejected, reject, target_probs, draft_probs, at, x, i)
            stopped[reject] = mass[reject] == 0
        took = accept.nonzero().squeeze(1)
        if took.numel() > 0:
            slot = depth[took, i] - 1
            token_ids[took, slot] = x[took]
            accepted_nodes[took, slot] = i
            num_accepted[took] = slot + 1
            cur[took] = i
            rejected[took] = False

    last_token = _last_tokens(target_token_ids, cur, rejected, stopped, residual, residual_uniforms, num_accepted)
    token_ids.scatter_(1, num_accepted[:, None], last_token[:, None])
    return TreeRejectionResult(token_ids, num_accepted, stopped, accepted_nodes)


def _last_tokens(target_token_ids: torch.Tensor, cur: torch.Tensor, rejected: torch.Tensor, stopped: torch.Tensor,
                 residual: torch.Tensor | None, residual_uniforms: torch.Tensor,
                 num_accepted: torch.Tensor) -> torch.Tensor:
    """Each row's last token (B,): the recovered token drawn from its residual where a child of the
    walk's last node `cur` was rejected, else the target's draw there (the bonus at a leaf, a
    greedy row's own token, the fallback of an empty residual, which sets `stopped`)."""
    last_token = target_token_ids.gather(1, (cur + 1)[:, None]).squeeze(1)  # (B,)
    recover = (rejected & ~stopped).nonzero().squeeze(1)
    if recover.numel() > 0:
        recovered = sample_from_probs(residual[recover], residual_uniforms[recover, num_accepted[recover]])
        last_token[recover] = torch.where(recovered >= 0, recovered, last_token[recover])
        stopped[recover] = recovered < 0
    return last_token


def _remove_rejected(residual: torch.Tensor, mass: torch.Tensor, rejected: torch.Tensor, reject: torch.Tensor,
                     target_probs: torch.Tensor, draft_probs: torch.Tensor | None, at: torch.Tensor, x: torch.Tensor,
                     i: int) -> None:
    """Rows `reject` (R,) rejected node i (token x): their residual (B, V) becomes max(r - p_i, 0),
    unnormalised, with its mass (B,); r is the law at `at` (B,) (q_c, copied as rejection.py's
    _recover copies it) or, where `rejected` already, the residual so far normalised."""
    N = target_probs.shape[1] - 1
    base = target_probs.flatten(0, 1).index_select(0, reject * (N + 1) + at[reject]).float()  # (R, V)
    base = torch.where(rejected[reject, None], residual[reject] / mass[reject, None].float(), base)
    if draft_probs is None:
        base.scatter_(-1, x[reject, None], 0.0)  # max(r - onehot(x), 0): r with x zeroed
    else:
        base.sub_(draft_probs.flatten(0, 1).index_select(0, reject * N + i)).clamp_min_(0.0)
    residual[reject] = base
    mass[reject] = base.double().cumsum(-1)[:, -1]  # a per-row scan, as sample_from_probs sums
    rejected[reject] = True


def _check_tree(draft_token_ids: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                draft_probs: torch.Tensor | None, target_probs: torch.Tensor, target_token_ids: torch.Tensor,
                greedy: torch.Tensor, check_values: bool) -> tuple[int, int, int]:
    """`tree_rejection_sample`'s checks (the values of the probabilities only with check_values);
    returns (B, N, V)."""
    check(draft_token_ids.dim() == 2, "draft_token_ids", f"expected [B, N], got {tuple(draft_token_ids.shape)}")
    B, N = draft_token_ids.shape
    check(target_probs.dim() == 3, "target_probs", f"expected [B, N+1, V], got {tuple(target_probs.shape)}")
    V = target_probs.shape[-1]
    check_shape(target_probs, (B, N + 1, V), "target_probs")
    check_shape(parents, (B, N), "parents")
    check(parents.dtype == torch.int64, "parents", f"expected int64, got {parents.dtype}")
    check_shape(num_nodes, (B,), "num_nodes")
    check(num_nodes.dtype == torch.int64, "num_nodes", f"expected int64, got {num_nodes.dtype}")
    check(bool(((num_nodes >= 0) & (num_nodes <= N)).all()), "num_nodes", f"must be in 0..{N}")
    check_shape(target_token_ids, (B, N + 1), "target_token_ids")
    check_shape(greedy, (B,), "greedy")
    check(greedy.dtype == torch.bool, "greedy", f"expected bool, got {greedy.dtype}")
    node = torch.arange(N + 1, device=target_probs.device)
    valid = node[:N] < num_nodes[:, None]  # (B, N)
    before = (parents >= ROOT) & (parents < node[:N])
    check(bool((before | ~valid).all()), "parents", "a node's parent must be -1 (the root) or an earlier node")
    check_ids(draft_token_ids, valid, V, "draft_token_ids")
    check_ids(target_token_ids, node <= num_nodes[:, None], V, "target_token_ids")
    if draft_probs is not None:
        check_shape(draft_probs, (B, N, V), "draft_probs")
    if check_values:
        check_probs(target_probs, "target_probs")
        if draft_probs is not None:
            check_probs(draft_probs, "draft_probs")
    return B, N, V
