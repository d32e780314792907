"""Prompt lookup: a drafter with no model (`--draft-method ngram`).

Its drafts continue the longest n-gram of the request's own history (prompt + output so far)
that occurred before: text that copies from its input (a code block to fix, a passage to
rewrite or translate) is proposed for free. The idea is prompt lookup decoding (Saxena, 2023;
transformers' `prompt_lookup_num_tokens`, vLLM's ngram proposer); this is its own code.

`load_ngram_drafter(config) -> NgramDrafter`, a drafter kind (gpu_worker/drafter/drafter_protocol.py):
drafter_core.py `draft_batch(drafter, request) -> DraftResponse` answers a DraftRequest with it:
1. free the slots named in `request.release`, then slots idle longer than slot_idle_ttl_s (token
   ids are not checked: none is looked up in a table);
2. per row, the model drafter's receiver rule (drafter_core.receive_row: need_resync when the
   slot holds fewer than cached_len committed tokens, too_long, slot allocation and eviction);
   a slot is the request's token list only (TokenSlots: no tensors);
3. per row, `propose_ngram` over the history: up to num_draft drafts, fewer or none when the
   history has no match; for a row with max_nodes > 0, `propose_ngram_tree`: a tree of at most
   max_nodes nodes (within the row's max_seq_len room) no deeper than num_draft, with its parents,
   or a chain (parents None) when the matches' continuations make one path (what the verifier's
   chain path verifies alike, docs/PROTOCOL.md#tree-drafts). Drafts are point_mass proposals (the
   deterministic draft's law is one-hot at the token), exact for every row: greedy, sampled
   (rejection sampling accepts d with probability p(d)) and Gumbel-coupled (accepted iff d equals
   the target's draw).

Token ids are the target's (no vocabulary of its own, nothing to map): drafts are ids the
history holds, so the instance fits every target. Its heartbeat says so with model_ids
{"draft": <its kind>, "draft_method": <its kind>, "tokenizer": ANY_TOKENIZER}
(services/scheduler/placement.py). Logit bias and penalties are not looked at: a banned token
proposed is rejected by the verifier, which changes speed, never the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from gpu_worker.drafter.drafter_core import receive_row
from gpu_worker.drafter.drafter_protocol import DraftRowWork
from gpu_worker.runtime.kv_cache import CacheFullError, SlotError
from gpu_worker.batching.slots import SlotOwner
from schemas.config import DrafterConfig
from schemas.errors import ErrorCode, SpecbusError
from schemas.bus.protocol import ANY_TOKENIZER
from schemas.steps import DraftRequest, DraftResult, DraftRow, Proposal, chain_parents


def continuations(history: np.ndarray, depth: int, max_n: int, min_n: int = 1):
    """The `depth` tokens after each earlier occurrence of history's suffix, lazily: for n = max_n
    down to min_n, the last n tokens are looked up in history[:T-1] (so a match ends before the
    last token and is followed by at least one token), the most recent match h[i:i+n] first; its
    continuation h[i+n], h[i+n+1], ... reads on past the end of history into itself (a match that
    runs into the suffix repeats its period). history: (T,) int token ids."""
    T = len(history)
    for n in range(min(max_n, T - 1), max(min_n, 1) - 1, -1):
        windows = sliding_window_view(history[:T - 1], n)  # (T - n, n): window i is h[i:i+n], i + n <= T - 1
        for hit in np.flatnonzero((windows == history[T - n:]).all(1))[::-1]:
            drafts: list[int] = []
            for position in range(int(hit) + n, int(hit) + n + depth):
                drafts.append(int(history[position]) if position < T else drafts[position - T])
            yield drafts


def propose_ngram(history: np.ndarray, num_draft: int, max_n: int, min_n: int = 1) -> list[int]:
    """Up to num_draft drafts continuing the longest suffix of history that occurred before: the
    first of `continuations` (the longest n-gram's most recent match), prompt + output so far as
    history (T,). [] when no n-gram matches or num_draft is 0.
    """
    assert history.ndim == 1, history.shape
    if num_draft <= 0 or min_n < 1:
        return []
    return next(continuations(history, num_draft, max_n, min_n), [])


def propose_ngram_tree(history: np.ndarray, max_nodes: int, depth: int, max_n: int,
                       min_n: int = 1) -> tuple[list[int], list[int]]:
    """A tree of drafts from every earlier occurrence of the history's suffix, not only the most
    recent: (draft tokens, parents) in depth-first preorder, parents as docs/PROTOCOL.md#tree-drafts
    (-1: a child of the root, the last token), at most max_nodes nodes, no path deeper than depth.

    The `continuations` of `depth` tokens (the longest n-gram's matches first, most recent first,
    then shorter n-grams') are merged into a trie (a continuation sharing a prefix with an earlier
    one adds only its new tokens) until max_nodes nodes; siblings keep the order they were found
    in. With max_nodes == depth this is propose_ngram's chain.
    """
    assert history.ndim == 1, history.shape
    children: dict[int, dict[int, int]] = {-1: {}}  # trie: node -> {token: child}, -1 the root
    tokens: list[int] = []
    for drafts in continuations(history, depth, max_n, min_n):
        at = -1
        for token in drafts:
            if token not in children[at]:
                if len(tokens) == max_nodes:
                    break
                children[at][token] = len(tokens)
                children[len(tokens)] = {}
                tokens.append(token)
            at = children[at][token]
        if len(tokens) == max_nodes:  # full: a later continuation could add nothing
            break
    order: list[tuple[int, int]] = []  # (node, parent) in preorder
    stack = [(child, -1) for child in reversed(children[-1].values())]
    while stack:
        node, parent = stack.pop()
        order.append((node, parent))
        stack += [(child, node) for child in reversed(children[node].values())]
    index = {node: i for i, (node, _) in enumerate(order)}
    return [tokens[node] for node, _ in order], [index.get(parent, -1) for _, parent in order]


class TokenSlots:
    """KVCache's slot bookkeeping (allocate, reserve, free, num_free, num_admissible)
    without tensors: a slot's whole state is its DraftSlot.token_ids, so memory never runs short
    and `reserve` only checks the slot. max_seq_len bounds a history as the verifier's does."""

    def __init__(self, max_slots: int, max_seq_len: int):
        if max_slots <= 0 or max_seq_len <= 0:
            raise ValueError(f"max_slots ({max_slots}) and max_seq_len ({max_seq_len}) must be positive")
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self._free = set(range(max_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_admissible(self) -> int:
        return len(self._free)

    def allocate(self, length: int = 0) -> int:
        if not self._free:
            raise CacheFullError(f"all {self.max_slots} slots are in use")
        slot = min(self._free)
        self._free.remove(slot)
        return slot

    def free(self, slot: int) -> None:
        self._check(slot)
        self._free.add(slot)

    def reserve(self, slot: int, length: int) -> None:
        """No storage to grow: a token list."""
        self._check(slot)

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots or slot in self._free:
            raise SlotError(f"slot {slot} is not an allocated slot")


@dataclass(kw_only=True)
class NgramDrafter(SlotOwner):
    """The slot owner of a prompt-lookup drafter (gpu_worker/batching/slots.py SlotOwner): request slots
    keyed (scheduler_id, request_id), holding each request's committed history. A Drafter
    (drafter_protocol.py) whose rows need the receiver rule only and propose one at a time."""

    max_n: int
    min_n: int

    def check(self, request: DraftRequest) -> None:
        """Nothing to check: token ids are not looked up in a table."""

    def prepare(self, scheduler_id: str, row: DraftRow, batch_keys: set[tuple[str, str]],
                now: float) -> DraftRowWork | DraftResult:
        return receive_row(self, scheduler_id, row, row.new_token_ids.tolist(), batch_keys, now)

    def propose(self, works: list[DraftRowWork]) -> dict[str, DraftResult]:
        return {work.row.request_id: propose_row(self, work) for work in works}


def load_ngram_drafter(config: DrafterConfig) -> NgramDrafter:
    """An NgramDrafter from config (max_slots, max_seq_len, ngram_max, ngram_min); SpecbusError
    naming the field for a bad value. Loads nothing."""
    if not 1 <= config.ngram_min <= config.ngram_max:
        raise SpecbusError(ErrorCode.invalid_field, f"ngram_min {config.ngram_min} and ngram_max {config.ngram_max}: "
                                                    f"need 1 <= ngram_min <= ngram_max", "ngram_min")
    for name in ("max_slots", "max_seq_len"):
        if getattr(config, name) < 1:
            raise SpecbusError(ErrorCode.invalid_field, f"{name} must be >= 1, got {getattr(config, name)}", name)
    model_ids = {"draft": config.draft_method, "draft_method": config.draft_method, "tokenizer": ANY_TOKENIZER,
                 "ngram": f"{config.ngram_min}-{config.ngram_max}"}
    return NgramDrafter(instance_id=config.instance_id, cache=TokenSlots(config.max_slots, config.max_seq_len),
                        model_ids=model_ids, slot_idle_ttl_s=config.slot_idle_ttl_s, max_n=config.ngram_max,
                        min_n=config.ngram_min)


def propose_row(drafter: NgramDrafter, work: DraftRowWork) -> DraftResult:
    """Record the row's new tokens in its slot and propose from its history: a chain, or for a row
    with max_nodes a tree (module docstring, step 3)."""
    work.state.token_ids.extend(work.feed)
    history = np.asarray(work.state.token_ids, dtype=np.int64)
    max_nodes = min(work.row.max_nodes, drafter.cache.max_seq_len - work.start)  # the verifier's room, as num_draft's
    parents = None
    if max_nodes > 0 and work.num_draft > 0:
        drafts, parents = propose_ngram_tree(history, max_nodes, work.num_draft, drafter.max_n, drafter.min_n)
        if parents == chain_parents(len(parents)).tolist():
            parents = None
        drafter.counters["rows_tree"] += parents is not None
    else:
        drafts = propose_ngram(history, work.num_draft, drafter.max_n, drafter.min_n)
    drafter.counters["draft_tokens"] += len(drafts)
    drafter.counters["rows_unmatched"] += work.num_draft > 0 and not drafts
    return DraftResult(request_id=work.row.request_id, draft_token_ids=np.array(drafts, dtype=np.int32),
                       parents=None if parents is None else np.array(parents, dtype=np.int32), proposal=Proposal())
