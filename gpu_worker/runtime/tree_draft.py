"""EAGLE-2's tree search (Li et al. 2024, arXiv:2406.16858), for any drafter whose step scores a
tree of columns: `best_first_tree` expands, level by level, the topk best nodes of the level
before (by cumulative draft log-probability) into their topk best children; of every drafted
node the max_nodes best are kept (score, then depth: a child never scores above its parent, so
the kept set holds every kept node's ancestors). `preorder` lays them out as the wire's tree
(docs/PROTOCOL.md#tree-drafts). The drafter's own step is `grow(chosen, nodes)`: the logits of
each chosen node's children, in one forward over the tree so far (gpu_worker/runtime/eagle.py
`draft_tree` for the EAGLE head, gpu_worker/drafter/drafter_core.py for a draft model), so a tree
of depth d costs d steps, as a chain of d drafts does.

Letters: Vd the drafter's vocabulary, n chosen nodes.
"""

import math
from dataclasses import dataclass
from typing import Callable

import torch

from schemas.arrays import ROOT_PARENT


@dataclass
class DraftNode:
    """A drafted node: its cumulative draft log-probability, depth (1: a child of the root),
    parent (an index into the drafted nodes, or ROOT_PARENT) and draft id."""
    score: float
    depth: int
    parent: int
    draft_id: int


Grow = Callable[[list[int], list[DraftNode]], torch.Tensor]
Rank = Callable[[torch.Tensor, int], torch.Tensor]


def best_first_tree(first_logits: torch.Tensor, grow: Grow, depth: int, max_nodes: int, topk: int,
                    rank: Rank | None = None) -> tuple[list[DraftNode], list[int]]:
    """The search (module docstring). first_logits (Vd,): the drafter's logits after the root;
    grow(chosen, nodes) -> (n, Vd) logits after each chosen node's path (chosen: indices into
    nodes, ascending: parents come before children). rank(logits (n, Vd), depth) -> (n, Vd): what
    the children at that depth are ranked and scored by, as logits (None: the logits themselves).
    Returns every drafted node and the kept ones' indices, ascending (parents before children)."""
    assert depth >= 1 and max_nodes >= 1 and topk >= 1
    nodes: list[DraftNode] = []

    def add(parents: list[int], logits: torch.Tensor, level: int) -> list[int]:
        if rank is not None:
            logits = rank(logits, level)
        logprobs, ids = torch.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), -1).topk(topk)
        start = len(nodes)
        for parent, row_lp, row_ids in zip(parents, logprobs.tolist(), ids.tolist()):
            score = 0.0 if parent == ROOT_PARENT else nodes[parent].score
            nodes.extend(DraftNode(score + lp, level, parent, i) for lp, i in zip(row_lp, row_ids) if lp > -math.inf)
        return list(range(start, len(nodes)))

    children = add([ROOT_PARENT], first_logits.view(1, -1), 1)
    for level in range(2, depth + 1):
        chosen = sorted(sorted(children, key=lambda n: -nodes[n].score)[:topk])
        if not chosen:
            break
        children = add(chosen, grow(chosen, nodes), level)
    kept = sorted(sorted(range(len(nodes)), key=lambda n: (-nodes[n].score, nodes[n].depth))[:max_nodes])
    return nodes, kept


def column_parents(columns: list[int], nodes: list[DraftNode]) -> torch.Tensor:
    """(1, len(columns)) int64: each column's parent as a column index (ROOT_PARENT for the root's
    children), for `tree_forward` / `tree_step`; columns hold every column's parent before it."""
    return torch.tensor([[ROOT_PARENT if nodes[n].parent == ROOT_PARENT else columns.index(nodes[n].parent)
                          for n in columns]])


def preorder(nodes: list[DraftNode], kept: list[int], d2t: torch.Tensor) -> tuple[list[int], list[int]]:
    """The kept nodes (ancestor-closed) in depth-first preorder, siblings best first: (target ids
    through d2t (Vd,), parents as indices into that order, ROOT_PARENT for the root's children)."""
    children: dict[int, list[int]] = {}
    for n in kept:
        children.setdefault(nodes[n].parent, []).append(n)
    ids, parents = [], []
    stack = [(n, ROOT_PARENT) for n in sorted(children.get(ROOT_PARENT, []), key=lambda n: (nodes[n].score, -n))]
    while stack:
        n, parent = stack.pop()
        ids.append(int(d2t[nodes[n].draft_id]))
        parents.append(parent)
        stack += [(c, len(ids) - 1) for c in sorted(children.get(n, []), key=lambda c: (nodes[c].score, -c))]
    return ids, parents
