"""The verifier's tree rows (docs/PROTOCOL.md#tree-drafts): a decode step whose drafts form a tree,
verified exactly in one forward. The row's one new token is the root (the last emitted token,
at position L = cached_len) and its k nodes come in depth-first preorder, node i at L + depth(i).

3. `run_trees`: the tree rows of a step, packed into forwards as chunks are (`pack_chunks`, a
   tree in one forward whatever prefill_chunk), through `tree_forward` (gpu_worker/runtime/
   tree_forward.py): column c's logits and hidden states (c = 0 the root, c = i + 1 node i) are
   bit for bit those of decoding its path; nothing is committed yet.
4. verifier_drafts.py `verify_drafts`, as for chains: per column, logit_bias and penalties over
   its own history, the output then its path's tokens (`path_penalised`), then
   gpu_worker/sampling/acceptance.py `accept` over the rows' trees. Its Verified carries the
   accepted path, and its logits the root's column then the path's: the laws its emitted tokens
   were drawn from.
   `keep_tree_path` (from verifier_core.py `commit_row`): `keep_path` moves the path's K/V next to the root and
   commits root + path, the slot's ids become the root then the path's tokens (no rejected
   node), and the features of those positions are stored from the tree forward's hidden states.
"""

from __future__ import annotations

from array import array

import torch

from gpu_worker.runtime.tree_forward import keep_path, tree_forward
from gpu_worker.verifier.verifier_drafts import tree_parents
from gpu_worker.verifier.verifier_features import store_features
from gpu_worker.verifier.verifier_forwards import forward_each, pack_chunks
from gpu_worker.verifier.verifier_state import Verified, Verifier, VerifyRowWork


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
    parents, num_nodes = tree_parents(works, J - 1), torch.tensor([w.num_draft for w in works], dtype=torch.long)
    slots = torch.tensor([w.state.slot for w in works], dtype=torch.long)
    logits, hidden = tree_forward(verifier.model, verifier.cache, slots, token_ids.to(verifier.model.embed.device),
                                  parents, num_nodes, return_hidden=True)  # (B, J, V), (B, J, E)
    for b, w in enumerate(works):
        w.verify_logits.append(logits[b, :len(w.tokens)])
        w.hidden = hidden[b, :len(w.tokens)]
        w.fed = len(w.tokens)


def keep_tree_path(verifier: Verifier, work: VerifyRowWork, verified: Verified) -> None:
    """After verify_drafts: keep the row's root and accepted path in its slot, ids and features
    (module docstring); the slot then holds what decoding them would have left."""
    state, path = work.state, verified.accepted_nodes
    keep_path(verifier.cache, torch.tensor([state.slot]), work.parents[None], torch.tensor([work.num_draft]),
              torch.tensor([path], dtype=torch.long).view(1, len(path)))
    state.token_ids[work.start + 1:work.start + 1 + len(path)] = array("i", verified.token_ids[:len(path)].tolist())
    store_features(state, work.start, work.hidden[[0] + [i + 1 for i in path]], verifier.cache)
