"""The drafter interface: what every drafter kind is to the batch skeleton
(gpu_worker/drafter/drafter_core.py `draft_batch`) and to the slot service around it
(services/runtime/model_service.py), and the slot shapes the kinds share.

A kind is a slot owner (gpu_worker/batching/slots.py `SlotOwner`) whose requests hold `DraftSlot`s,
with the three steps `draft_batch` runs for one DraftRequest, in order:
1. `check(request)`: SpecbusError naming the field for a bad row, before any state changes;
2. `prepare(scheduler_id, row, batch_keys, now)`, per row, after the batch's releases and idle
   evictions: the receiver rule (drafter_core.py `receive_row`) and what the kind needs beside it:
   a work item with `.row` (a `DraftRowWork`, or one holding it) or the row's final DraftResult;
3. `propose(works)`: request_id -> DraftResult for the work items: chains, and trees for rows
   that ask one (docs/PROTOCOL.md#tree-drafts); a work item missing from it answers no drafts.
   When it raises, `draft_batch` frees the work items' slots (they resync) and raises on.

The kinds: `ModelDrafter` (drafter_core.py, a draft model), `NgramDrafter` (ngram.py, prompt
lookup), `EagleDrafter` (eagle_drafter.py, an EAGLE head over the target's features); each is
loaded by its line of gpu_worker/drafter/registry.py `DRAFTERS`. The model and EAGLE drafters
draft from logits over a vocabulary of their own: they are `VocabularyDrafter`s too, what the
shared choosing and tree functions (drafter_core.py `choose`, draft_trees.py) read.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from schemas.steps import DraftRequest, DraftResult, DraftRow
from text.grammar import OutputMatcher


@dataclass
class DraftSlot:
    """One request's cache slot. token_ids: the ids the slot holds, position by position (a model
    drafter's: draft ids, len == cache.lengths[slot]; the ngram and EAGLE drafters': target ids);
    the first committed_len are committed history, the rest are drafts fed last step (kept so
    accepted ones need not be recomputed)."""

    slot: int
    token_ids: list[int]
    committed_len: int
    last_used: float  # time.monotonic()
    grammar: OutputMatcher | None = None  # a row with structured_outputs: its output in target ids
    prefix_root: bytes | None = None  # its prefix cache's root key (drafter_core.take_hit); None: none


@dataclass
class DraftRowWork:
    """A row that drafts this step: feed (the drafter's own ids) is appended to its slot, then
    num_draft drafts are proposed; the first lands at absolute position `start` of the history."""

    row: DraftRow
    state: DraftSlot
    feed: list[int]
    num_draft: int
    start: int
    greedy: bool


class SlotCache(Protocol):
    """A drafter's slot storage: a KVCache (gpu_worker/runtime/kv_cache.py), or the ngram
    drafter's TokenSlots, which has its slot calls without tensors."""

    max_slots: int
    max_seq_len: int

    @property
    def num_free(self) -> int: ...

    @property
    def num_admissible(self) -> int: ...

    def allocate(self, length: int = 0) -> int: ...

    def free(self, slot: int) -> None: ...

    def reserve(self, slot: int, length: int) -> None: ...


class Drafter(Protocol):
    """A drafter kind's state (module docstring): its slot owner's fields and the three steps."""

    instance_id: str
    model_ids: dict[str, str]
    counters: Counter
    cache: SlotCache
    requests: dict[tuple[str, str], DraftSlot]
    slot_idle_ttl_s: float

    def free_state(self, state: DraftSlot, reason: str) -> None: ...

    def check(self, request: DraftRequest) -> None: ...

    def prepare(self, scheduler_id: str, row: DraftRow, batch_keys: set[tuple[str, str]],
                now: float) -> Any: ...

    def propose(self, works: list[Any]) -> dict[str, DraftResult]: ...


class VocabularyDrafter(Drafter, Protocol):
    """A drafter with a vocabulary of its own (the draft model's, the EAGLE head's). d2t:
    (V_draft,) int64, draft id -> target id; t2d: (V_target,) int64, target id -> draft id;
    other_id: the draft id of every target id outside its vocabulary (None: none is);
    slot_to_draft: (V,) the ids its slots hold -> draft ids."""

    d2t: torch.Tensor
    t2d: torch.Tensor
    other_id: int | None

    @property
    def target_vocab_size(self) -> int: ...

    @property
    def draft_vocab_size(self) -> int: ...

    @property
    def slot_to_draft(self) -> torch.Tensor: ...
