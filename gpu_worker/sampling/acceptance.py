"""The acceptance of speculative decoding, one entry point: `accept(tree, logits, laws)` takes a
batch of draft trees (a chain is a tree whose node j has parent j - 1) and the target's logits at
their columns, draws the target's tokens under each row's law, and returns per row the accepted
path and the tokens it emits (docs/PROTOCOL.md#speculative-decoding-contract, #tree-drafts).

Letters: B rows, N draft nodes per row (padded), V vocabulary. Column 0 is the root (the last
committed token's position, stream position P = `laws.first`), column i + 1 node i, at stream
position P + depth(i) (`node_positions`; a chain's node j at P + j + 1).

The law (`Law`, one per row, data):
- GREEDY: the target's draw at a column is the argmax of its logits (lowest id on ties); a child
  is accepted iff its token is that draw (the greedy rule).
- GUMBEL: the draw is the Gumbel-max one keyed by (seed, stream position) (coupling.py), and the
  greedy rule accepts: the output is the target's own draws, whatever the tree.
- REJECTION: the draw is the sampler's (`sample`, STREAM_TARGET); children are accepted by
  recursive rejection against their draft laws (tree_acceptance.py; a chain's is rejection.py's
  `rejection_sample`), with the counter-based uniforms of `tree_uniforms`.

The general rule is the walk: from the root, move to the first child the rule accepts; where none
is, emit the draw (greedy rule) or the recovered token (rejection), the bonus at a leaf. Which
branch computes it is the batch's mix, never the output:

1. a batch with a REJECTION row: the target's laws and draws at every column (`coupled_sample`,
   greedy and Gumbel rows' draws the argmax / Gumbel-max ones), then `rejection_sample` for a
   chain batch (vectorised over the chain's slots) or `tree_rejection_sample` (a pass over the
   nodes), GREEDY and GUMBEL rows taking the greedy rule there. The two equal each other bit for
   bit on a chain with these uniforms (tests/gpu_worker/sampling/test_tree_acceptance.py).
2. a chain batch of GREEDY rows: the argmaxes of every column and the accepted prefix, nothing
   else. Proof: process_logits gives a greedy row the one-hot of that argmax and `sample` draws
   it without a uniform, so the walk accepts node j iff every draft up to j equals the argmax
   before it, and emits those argmaxes (the accepted drafts are equal to them, then the draw).
3. any other batch (GREEDY and GUMBEL rows, chains or trees): the walk itself, the target's law
   and draw computed only at the columns it reaches, a depth at a time over the rows still
   walking. Proof: a column's law depends on its logits and the row's params alone (process_logits
   is per position) and its draw on the row's seed and the column's stream position alone (the
   uniforms and the Gumbel noise are counter-based), so they have the bits branch 1 would give
   them; the columns never reached are not read by the greedy rule. A batch of GREEDY rows takes
   the argmax alone there, as in 2.

Output (`Accepted`), per row b: token_ids[b] (n,) int64 on the CPU, the accepted path's tokens
then the recovered or bonus token; paths[b] the accepted nodes, root side first; columns[b] the
columns the emitted tokens were drawn at (the root's, then the path's: a slice for a chain, an
index tensor for a tree); laws[b] the target's processed laws there, ProcessedLogits [1, n, ...],
or None where only argmaxes were taken (logprobs then recompute K from the logits); and
residual_fallback[b] (a rejection residual without mass emitted the draw instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.nn.functional as F

from gpu_worker.sampling.coupling import coupled_sample
from gpu_worker.sampling.rejection import accepted_prefix, rejection_sample
from gpu_worker.sampling.sampler import (STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_TARGET, ProcessedLogits,
                                         SamplingTensors, check, check_finite_logits, check_shape, make_uniforms)
from gpu_worker.sampling.tree_acceptance import ROOT, node_positions, tree_rejection_sample, tree_uniforms


class Law(IntEnum):
    """How a row's target draws are made and its drafts accepted (module docstring)."""

    GREEDY = 0
    GUMBEL = 1
    REJECTION = 2


@dataclass(frozen=True)
class DraftTree:
    """B rows of draft nodes in depth-first preorder. token_ids [B, N] int64 (target ids, -1 past
    a row's nodes); parents [B, N] int64 (ROOT or an earlier node; ROOT on padding); num_nodes [B]
    int64; draft_laws[b] (num_nodes[b], V) the laws row b's nodes were drawn from, or None for
    point masses; chain: node j's parent is j - 1 on every row (`DraftTree.chain`)."""

    token_ids: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor
    draft_laws: list[torch.Tensor | None]
    chain: bool = False

    def __post_init__(self):
        check(self.token_ids.dim() == 2, "draft_token_ids", f"expected [B, N], got {tuple(self.token_ids.shape)}")
        B, N = self.token_ids.shape
        check_shape(self.parents, (B, N), "parents")
        check_shape(self.num_nodes, (B,), "num_nodes")
        check(len(self.draft_laws) == B, "draft_laws", f"expected {B} rows, got {len(self.draft_laws)}")

    @classmethod
    def of_chain(cls, token_ids: torch.Tensor, num_nodes: torch.Tensor,
                 draft_laws: list[torch.Tensor | None]) -> DraftTree:
        """Chains token_ids [B, K] (-1 padded) of num_nodes [B] drafts as trees."""
        B, K = token_ids.shape
        return cls(token_ids, (torch.arange(K) - 1).expand(B, K), num_nodes, draft_laws, chain=True)


@dataclass(frozen=True)
class RowLaws:
    """Each row's law as data: law [B] int64 (`Law`); params the target sampler's (GREEDY rows,
    and only they, at temperature 0); seeds [B] int64 (0 for GREEDY rows, which draw nothing);
    first [B] int64, the stream position of the root's draw, on the logits' device."""

    law: torch.Tensor
    params: SamplingTensors
    seeds: torch.Tensor
    first: torch.Tensor

    def __post_init__(self):
        (B,) = self.law.shape
        check(bool(((self.law >= Law.GREEDY) & (self.law <= Law.REJECTION)).all()), "law", "unknown law")
        check_shape(self.params.temperature, (B,), "params")
        check(bool(torch.equal(self.law == Law.GREEDY, self.params.greedy)), "law",
              "a row is GREEDY exactly when its temperature is 0")
        check_shape(self.seeds, (B,), "seeds")
        check_shape(self.first, (B,), "first")


@dataclass
class Accepted:
    """Per row (module docstring): emitted token_ids, num_accepted, residual_fallback, the accepted
    paths, the columns the emitted tokens were drawn at and the laws there."""

    token_ids: list[torch.Tensor]
    num_accepted: list[int]
    residual_fallback: list[bool]
    paths: list[list[int]]
    columns: list[slice | torch.Tensor]
    laws: list[ProcessedLogits | None]


def accept(tree: DraftTree, logits: torch.Tensor, laws: RowLaws) -> Accepted:
    """The accepted path and emitted tokens of each row (module docstring).

    tree: the rows' DraftTree (N nodes); logits [B, N+1, V]: the target's logits (with a row's
    logit_bias, penalties and grammar mask applied) at the root, then at node i's column i + 1;
    laws: the rows' RowLaws."""
    B, N = tree.token_ids.shape
    check(logits.dim() == 3, "logits", f"expected [B, N+1, V], got {tuple(logits.shape)}")
    check_shape(logits, (B, N + 1, logits.shape[-1]), "logits")
    check_shape(laws.law, (B,), "law")
    if bool((laws.law == Law.REJECTION).any()):
        return _rejection(tree, logits, laws)
    if tree.chain and bool((laws.law == Law.GREEDY).all()):
        return _greedy_chain(tree, logits)
    return _walk(tree, logits, laws)


def _greedy_chain(tree: DraftTree, logits: torch.Tensor) -> Accepted:
    """Branch 2: a chain batch of GREEDY rows, the argmaxes alone."""
    check_finite_logits(logits)  # the same check (and error) as process_logits
    target_ids = logits.argmax(-1)  # (B, K+1): lowest id on ties, as process_logits
    K = tree.token_ids.shape[1]
    num_accepted = accepted_prefix(tree.token_ids == target_ids[:, :K]).tolist()  # -1 padding is never an argmax
    target_ids = target_ids.cpu()
    return Accepted([target_ids[b, :n + 1] for b, n in enumerate(num_accepted)], num_accepted,
                    [False] * len(num_accepted), [list(range(n)) for n in num_accepted],
                    [slice(0, n + 1) for n in num_accepted], [None] * len(num_accepted))


def _rejection(tree: DraftTree, logits: torch.Tensor, laws: RowLaws) -> Accepted:
    """Branch 1: the target's laws and draws at every column, then the rejection kernels."""
    (B, N), device = tree.token_ids.shape, logits.device
    parents, num_nodes = tree.parents.to(device), tree.num_nodes.to(device)
    if tree.chain:
        positions = laws.first[:, None] + torch.arange(N + 1, device=device)  # (B, N+1)
    else:
        positions = node_positions(parents, num_nodes, laws.first)
    # Gumbel-coupled rows: the target's draw is the Gumbel-max one and a draft is accepted iff it
    # equals it, which is the greedy rule over these draws (coupling.py)
    gumbel = laws.law == Law.GUMBEL
    processed, target_ids = coupled_sample(logits, laws.params, make_uniforms(laws.seeds, positions, STREAM_TARGET),
                                           gumbel, laws.seeds, positions)
    greedy = laws.law != Law.REJECTION
    draft_probs = stacked_draft_probs(tree, logits.shape[-1])
    if tree.chain:
        result = rejection_sample(tree.token_ids, num_nodes, draft_probs, processed.probs, target_ids, greedy,
                                  uniforms=make_uniforms(laws.seeds, positions[:, :N], STREAM_ACCEPT),
                                  residual_uniforms=make_uniforms(laws.seeds, positions[:, :N], STREAM_RESIDUAL))
        num_accepted = result.num_accepted.tolist()
        paths = [list(range(n)) for n in num_accepted]
        columns = [slice(0, n + 1) for n in num_accepted]
    else:
        uniforms, residual_uniforms = tree_uniforms(laws.seeds, laws.first, parents, num_nodes)
        result = tree_rejection_sample(tree.token_ids, parents, num_nodes, draft_probs, processed.probs, target_ids,
                                       greedy, uniforms=uniforms, residual_uniforms=residual_uniforms)
        num_accepted = result.num_accepted.tolist()
        paths = [nodes[:n] for nodes, n in zip(result.accepted_nodes.tolist(), num_accepted)]
        columns = [torch.tensor([0] + [i + 1 for i in path], device=device) for path in paths]  # root, then the path
    token_ids = result.token_ids.cpu()
    return Accepted([token_ids[b, :n + 1] for b, n in enumerate(num_accepted)], num_accepted,
                    result.residual_fallback.tolist(), paths, columns,
                    [ProcessedLogits(processed.probs[b:b + 1, cols], processed.candidate_ids[b:b + 1, cols],
                                     processed.num_candidates[b:b + 1, cols]) for b, cols in enumerate(columns)])


def stacked_draft_probs(tree: DraftTree, V: int) -> torch.Tensor | None:
    """The rows' draft laws (B, N, V), a point mass where a row has none or past its nodes; None
    when no row has any (the kernels then take every draft as a point mass)."""
    if all(law is None for law in tree.draft_laws):
        return None
    B, N = tree.token_ids.shape
    one_hot = torch.zeros(B, N, V, device=tree.token_ids.device)
    one_hot.scatter_(-1, tree.token_ids.clamp_min(0)[..., None], 1.0)
    return torch.stack([one_hot[b] if law is None else torch.cat([law, one_hot[b, law.shape[0]:]])
                        for b, law in enumerate(tree.draft_laws)])  # (B, N, V)


def _walk(tree: DraftTree, logits: torch.Tensor, laws: RowLaws) -> Accepted:
    """Branch 3: the greedy rule's walk, each column's law and draw taken when the walk reaches it."""
    (B, _), device = tree.token_ids.shape, logits.device
    greedy = bool((laws.law == Law.GREEDY).all())
    gumbel = laws.law == Law.GUMBEL
    kids = [{} for _ in range(B)]  # per row: parent node -> its (node, token), in order
    for b, (row_parents, row_drafts) in enumerate(zip(tree.parents.tolist(), tree.token_ids.tolist())):
        for node, (parent, token) in enumerate(zip(row_parents, row_drafts)):
            if token >= 0:
                kids[b].setdefault(parent, []).append((node, token))
    paths, tokens, steps = [[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)]
    walking = list(range(B))
    while walking:
        rows = torch.tensor(walking, device=device)
        at = torch.tensor([paths[b][-1] + 1 if paths[b] else 0 for b in walking], device=device)
        positions = laws.first[rows, None] + torch.tensor([[len(paths[b])] for b in walking], device=device)
        if greedy:
            column = logits[rows, at][:, None]
            check_finite_logits(column)  # the same check (and error) as process_logits
            processed, draws = None, column.argmax(-1)
        else:
            processed, draws = coupled_sample(logits[rows, at][:, None], laws.params.index(rows),
                                              make_uniforms(laws.seeds[rows], positions, STREAM_TARGET), gumbel[rows],
                                              laws.seeds[rows], positions)
        still = []
        for i, (b, draw) in enumerate(zip(walking, draws[:, 0].tolist())):
            tokens[b].append(draw)
            if processed is not None:
                steps[b].append(ProcessedLogits(processed.probs[i:i + 1], processed.candidate_ids[i:i + 1],
                                                processed.num_candidates[i:i + 1]))
            child = next((node for node, token in kids[b].get(paths[b][-1] if paths[b] else ROOT, ()) if token == draw),
                         None)
            if child is not None:
                paths[b].append(child)
                still.append(b)
        walking = still
    columns = [slice(0, len(path) + 1) if tree.chain else torch.tensor([0] + [node + 1 for node in path], device=device)
               for path in paths]
    return Accepted([torch.tensor(emitted, dtype=torch.long) for emitted in tokens], [len(path) for path in paths],
                    [False] * B, paths, columns, [joined_laws(row) if row else None for row in steps])


def joined_laws(laws: list[ProcessedLogits]) -> ProcessedLogits:
    """ProcessedLogits [1, 1, ...] of consecutive positions joined along T (candidate ids padded
    with 0 past each one's width: past num_candidates they are not read)."""
    width = max(law.candidate_ids.shape[-1] for law in laws)
    return ProcessedLogits(torch.cat([law.probs for law in laws], 1),
                           torch.cat([F.pad(law.candidate_ids, (0, width - law.candidate_ids.shape[-1]))
                                      for law in laws], 1),
                           torch.cat([law.num_candidates for law in laws], 1))
