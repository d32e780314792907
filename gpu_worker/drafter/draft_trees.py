"""Trees of drafts from a model drafter (docs/PROTOCOL.md#tree-drafts; step 7 of
gpu_worker/drafter/drafter_core.py's docstring): which rows that ask a tree get one and its shape
(`tree_plan`), how a Gumbel-coupled row ranks children (`tree_rank`), the draft model's EAGLE-2
tree (`draft_model_tree`, one `tree_forward` a level; the eagle head's is
gpu_worker/runtime/eagle.py `draft_tree`), and the DraftResult a tree goes out as (`tree_result`).
`drafter` is a ModelDrafter (drafter_core.py) or an EagleDrafter (eagle_drafter.py) throughout (a
drafter_protocol.VocabularyDrafter).
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.drafter.drafter_protocol import DraftRowWork, VocabularyDrafter
from gpu_worker.runtime.tree_draft import DraftNode, best_first_tree, column_parents, preorder
from gpu_worker.runtime.tree_forward import tree_forward
from gpu_worker.sampling.coupling import gumbel_noise, proposal_law
from gpu_worker.sampling.sampler import row_seed
from schemas.steps import DraftResult, Proposal, chain_parents

# The most children a tree node expands into (drafter_core.py's step 7): a tree of N nodes
# as deep as k expands ceil(N / k) a level, at most this many; SGLang's EAGLE default top-k is 4.
MAX_TREE_TOPK = 4


def tree_plan(work: DraftRowWork, verifier_room: int, own_room: int, columns_needed) -> tuple[int, int] | None:
    """(max_nodes, topk) of the EAGLE-2 tree a row that asked one gets (drafter_core.py's step 7),
    or None: it gets a chain. verifier_room: positions the verifier has past the
    row's history; own_room: positions the drafter's slot has past what it holds;
    columns_needed(topk, depth): the positions the drafter's tree steps write there."""
    sampling = work.row.sampling
    max_nodes = min(work.row.max_nodes, verifier_room)
    if work.num_draft == 0 or max_nodes <= work.num_draft or not (work.greedy or sampling.gumbel) or \
            sampling.penalised or sampling.structured_outputs is not None:
        return None
    topk = min(MAX_TREE_TOPK, -(-max_nodes // work.num_draft))
    return (max_nodes, topk) if columns_needed(topk, work.num_draft) <= own_room else None


def tree_result(drafter: VocabularyDrafter, work: DraftRowWork, tokens: list[int], parents: list[int]) -> DraftResult:
    """A drafted tree's DraftResult (point masses); a tree that is one path goes as that chain."""
    chain = parents == chain_parents(len(parents)).tolist()
    drafter.counters["rows_tree"] += not chain
    drafter.counters["draft_tokens"] += len(tokens)
    return DraftResult(request_id=work.row.request_id, draft_token_ids=np.array(tokens, dtype=np.int32),
                       parents=None if chain else np.array(parents, dtype=np.int32), proposal=Proposal())


def model_tree_columns(topk: int, depth: int) -> int:
    """Positions a draft model's tree steps write past its history: the root again and topk
    expanded nodes a level."""
    return topk * (depth - 1)


@torch.inference_mode()
def draft_model_tree(drafter: VocabularyDrafter, work: DraftRowWork, first_logits: torch.Tensor, max_nodes: int,
                     topk: int) -> DraftResult:
    """An EAGLE-2 tree from the draft model (gpu_worker/runtime/tree_draft.py): a level is one
    `tree_forward` over the root (the history's last token, written again at its place) and every
    expanded node so far. first_logits (V_draft,): after the history. The slot ends as it was.
    drafter: a ModelDrafter (its model and KV cache; not imported: drafter_core imports this module)."""
    slot, history = work.state.slot, work.state.token_ids
    slots, columns = torch.tensor([slot]), []
    if work.num_draft > 1:
        drafter.cache.truncate(slot, len(history) - 1)

    def grow(chosen: list[int], nodes: list[DraftNode]) -> torch.Tensor:
        columns.extend(chosen)
        tokens = torch.tensor([[history[-1]] + [nodes[n].draft_id for n in columns]])
        logits = tree_forward(drafter.model, drafter.cache, slots, tokens, column_parents(columns, nodes),
                              torch.tensor([len(columns)]))[0, len(columns) + 1 - len(chosen):].float()
        drafter.counters["fed_tokens"] += len(columns) + 1
        return mask_other(drafter, logits)

    nodes, kept = best_first_tree(mask_other(drafter, first_logits.view(1, -1))[0], grow, work.num_draft, max_nodes,
                                  topk, tree_rank(drafter, work))
    if work.num_draft > 1:
        drafter.cache.commit(slots, torch.tensor([1]))
    return tree_result(drafter, work, *preorder(nodes, kept, drafter.d2t))


def tree_rank(drafter: VocabularyDrafter, work: DraftRowWork):
    """What a row's tree ranks children by (`best_first_tree`'s rank): a greedy row its draft
    logits (None); a Gumbel-coupled row log q + G, q its draft law as `choose` proposes from
    (`coupling.proposal_law`) and G the target's noise at the children's stream position, keyed
    by target ids: a node's first child is what the chain would propose, the next the runner-up
    under the same noise, which the target's draw there picks when its law differs enough from
    the draft's.
    drafter: a ModelDrafter or an EagleDrafter."""
    if work.greedy:
        return None
    temperature = torch.tensor([work.row.sampling.temperature], dtype=torch.float32)
    seed = torch.tensor([row_seed(work.row.sampling)], dtype=torch.int64)

    def rank(logits: torch.Tensor, depth: int) -> torch.Tensor:
        probs = proposal_law(logits[None], temperature)[0]                                    # (n, Vd)
        noise = gumbel_noise(seed, torch.tensor([[work.start + depth - 1]]), drafter.d2t)[0, 0]   # (Vd,)
        return probs.double().log() + noise

    return rank


def mask_other(drafter: VocabularyDrafter, logits: torch.Tensor) -> torch.Tensor:
    """logits (n, V_draft) with other_id at -inf ("not in my vocabulary": never proposed)."""
    if drafter.other_id is not None:
        logits[:, drafter.other_id] = float("-inf")
    return logits
