"""The verifier's tree rows (docs/PROTOCOL.md#tree-drafts): a decode step whose drafts form a tree,
verified exactly in one forward. The row's one new token is the root (the last emitted token,
at position L = cached_len) and its k nodes come in depth-first preorder, node i at L + depth(i).

3. `run_trees`: the tree rows of a step, packed into forwards as chunks are (`pack_chunks`, a
   tree in one forward whatever prefill_chunk), through `tree_forward` (gpu_worker/runtime/
   tree_forward.py): column c's logits and hidden states (c = 0 the root, c = i + 1 node i) are
   bit for bit those of decoding its path; nothing is committed yet.
4. `verify_trees`: per column, logit_bias and penalties over its own history, the output then
   its path's tokens (`path_penalised`, what `penalise` counts at a chain's position t: drafts
   0..t-1); the target's laws and draws keyed at `node_positions` (L + 1 + depth; a chain's are
   its positions), Gumbel-coupled rows' draws the Gumbel-max ones there; draft laws from the
   proposal as a chain's; `tree_rejection_sample` with `tree_uniforms`. A batch of greedy and
   Gumbel-coupled rows walks instead (verifier_drafts.walk_draws): the law and draw of the root,
   then of the child equal to the draw there, and so on, no other column's (greedy rows: the
   argmax alone). Its Verified carries the accepted path, and its logits the
   root's column then the path's: the laws its emitted tokens were drawn from.
   `keep_tree_path` (from finish_row): `keep_path` moves the path's K/V next to the root and
   commits root + path, the slot's ids become the root then the path's tokens (no rejected
   node), and the features of those positions are stored from the tree forward's hidden states.
"""

from __future__ import annotations

from array import array

import torch

from gpu_worker.verifier.verifier_drafts import (greedy_rule, padded_drafts, padded_logits, seeds_and_first,
                                              stacked_draft_probs, target_draws, verified_rows, walked_rows)
from gpu_worker.verifier.verifier_features import store_features
from gpu_worker.verifier.verifier_forwards import forward_each, pack_chunks
from gpu_worker.verifier.verifier_state import Verified, Verifier, VerifyRowWork
from gpu_worker.runtime.tree_forward import ROOT, keep_path, tree_forward, tree_paths
from gpu_worker.sampling.sampler import Penalties, penalise
from gpu_worker.sampling.tree_acceptance import node_positions, tree_rejection_sample, tree_uniforms


def tree_parents(works: list[VerifyRowWork], N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' parents (B, N) int64, ROOT past a row's nodes, and num_nodes (B,) int64, on CPU."""
    parents = torch.full((len(works), N), ROOT, dtype=torch.long)
    for b, w in enumerate(works):
        parents[b, :w.num_draft] = w.parents
    return parents, torch.tensor([w.num_draft for w in works], dtype=torch.long)


def run_trees(verifier: Verifier, works: list[VerifyRowWork]) -> None:
    """Step 3 for tree rows: each row's root and nodes through `tree_forward`, rows of similar
    size together; a failed forward fails only its rows."""
    forward_each(verifier, pack_chunks([(w, 0, len(w.tokens)) for w in works]), forward_trees)


def forward_trees(verifier: Verifier, group: list[tuple[VerifyRowWork, int, int]]) -> None:
    """One tree forward of group's rows ((work, 0, k + 1) chunks): each row's verify logits
    (k+1, V) and hidden states (k+1, E), column c = the root (0) or node c - 1."""
    works = [work for work, _, _ in group]
    J = max(len(w.tokens) for w in works)
    token_ids = torch.zeros(len(works), J, dtype=torch.long)  # (B, J): padding columns any valid id
    for b, w in enumerate(works):
        token_ids[b, :len(w.tokens)] = w.tokens
    parents, num_nodes = tree_parents(works, J - 1)
    slots = torch.tensor([w.state.slot for w in works], dtype=torch.long)
    logits, hidden = tree_forward(verifier.model, verifier.cache, slots, token_ids.to(verifier.model.embed.device),
                                  parents, num_nodes, return_hidden=True)  # (B, J, V), (B, J, E)
    for b, w in enumerate(works):
        w.verify_logits.append(logits[b, :len(w.tokens)])
        w.hidden = hidden[b, :len(w.tokens)]
        w.fed = len(w.tokens)


def verify_trees(verifier: Verifier, works: list[VerifyRowWork]) -> list[Verified]:
    """Step 4 for emitting tree rows, batched (module docstring), in works' order."""
    V, device = verifier.vocab_size, verifier.model.embed.device
    N = max(w.num_draft for w in works)
    logits = padded_logits(works, N)  # (B, N+1, V): column c's laws, padding columns repeat the last
    draft_ids = padded_drafts(works, N, device)  # (B, N)
    parents, num_nodes = tree_parents(works, N)
    raw_logits, logits = logits, path_penalised(works, logits, draft_ids, parents, num_nodes)
    if greedy_rule(works):  # greedy and Gumbel-coupled rows: only the walked columns' laws
        return walked_rows(works, logits, raw_logits, draft_ids, parents, tree=True)
    parents, num_nodes = parents.to(device), num_nodes.to(device)
    seeds, first = seeds_and_first(works, device)
    processed, target_ids, greedy = target_draws(works, logits, seeds, node_positions(parents, num_nodes, first))
    uniforms, residual_uniforms = tree_uniforms(seeds, first, parents, num_nodes)
    result = tree_rejection_sample(draft_ids, parents, num_nodes, stacked_draft_probs(works, draft_ids, V),
                                   processed.probs, target_ids, greedy, uniforms=uniforms,
                                   residual_uniforms=residual_uniforms)
    num_accepted = result.num_accepted.tolist()
    paths = [nodes[:n] for nodes, n in zip(result.accepted_nodes.tolist(), num_accepted)]
    columns = [torch.tensor([0] + [i + 1 for i in path], device=device) for path in paths]  # root, then the path
    return verified_rows(works, result.token_ids.cpu(), num_accepted, result.residual_fallback.tolist(), logits,
                         raw_logits, processed, columns, paths)


def path_penalised(works: list[VerifyRowWork], logits: torch.Tensor, draft_ids: torch.Tensor, parents: torch.Tensor,
                   num_nodes: torch.Tensor) -> torch.Tensor:
    """logits (B, J, V) with each penalised row's logit_bias and penalties applied (float32),
    column c counting the output then the tokens of the nodes on its path (penalise's rule for a
    chain, whose position t has drafts 0..t-1 on its path); the same tensor when no row has any.
    draft_ids (B, J-1), -1 padded; parents (B, J-1) and num_nodes (B,) on CPU."""
    rows = [b for b, w in enumerate(works) if w.penalties is not None]
    if not rows:
        return logits
    (B, J, V), R, device = logits.shape, len(rows), logits.device
    on_path = torch.zeros(R, J, J - 1)  # [r, c, i]: node i is on column c's path
    for r, paths in enumerate(tree_paths(parents[rows], num_nodes[rows])):
        for c, path in enumerate(paths):
            on_path[r, c, [column - 1 for column in path[1:]]] = 1.0
    index = torch.tensor(rows, device=device)
    drafts = draft_ids[index]  # (R, J-1)
    one_hot = torch.zeros(R, J - 1, V, device=device)
    one_hot.scatter_(-1, drafts.clamp_min(0)[..., None], (drafts >= 0)[..., None].float())
    drafted = torch.bmm(on_path.to(device), one_hot)  # (R, J, V): counts of small integers, exact
    base = Penalties.cat([works[b].penalties for b in rows])
    per_column = Penalties(base.bias.repeat_interleave(J, 0), (base.output_counts[:, None] + drafted).flatten(0, 1),
                           (base.seen[:, None] | (drafted > 0)).flatten(0, 1),
                           *(getattr(base, name).repeat_interleave(J) for name in ("repetition", "frequency",
                                                                                    "presence")))
    out = logits.to(torch.float32, copy=True)
    out[index] = penalise(out[index].reshape(R * J, 1, V), per_column).view(R, J, V)
    return out


def keep_tree_path(verifier: Verifier, work: VerifyRowWork, verified: Verified) -> None:
    """After verify_trees: keep the row's root and accepted path in its slot, ids and features
    (module docstring); the slot then holds what decoding them would have left."""
    state, path = work.state, verified.accepted_nodes
    keep_path(verifier.cache, torch.tensor([state.slot]), work.parents[None], torch.tensor([work.num_draft]),
              torch.tensor([path], dtype=torch.long).view(1, len(path)))
    state.token_ids[work.start + 1:work.start + 1 + len(path)] = array("i", verified.token_ids[:len(path)].tolist())
    store_features(state, work.start, work.hidden[[0] + [i + 1 for i in path]], verifier.cache)
