"""The EAGLE drafter (`--draft-method eagle`): the feature-level head of gpu_worker/runtime/eagle.py behind
the DraftRequest protocol, NATS-free; services/drafter/drafter.py serves it.

`load_eagle_drafter(config) -> EagleDrafter`: the head in config.eagle_head and, of the target
in config.target_model, only its config and embedding (the head reads the target's embedding and
lm_head rows, frozen); a head that does not fit the target is refused, naming both.
The EagleDrafter is a drafter kind (gpu_worker/drafter/drafter_protocol.py): drafter_core.py
`draft_batch(drafter, request) -> DraftResponse` runs its steps (token ids checked, releases,
idle eviction, a failed batch drops its rows' slots) with:

1. every row's FeatureBlock checked first (its width must be the head's hidden size): a bad one
   refuses the batch with an Error naming `rows[i].features.shape`, nothing changed;
2. per row, drafter_core's receiver rule (`receive_row`) over the slot's tokens, target ids: the
   slot holds the history. The head's own KV cache holds the row's pairs (f_t, x_{t+1}),
   t = 0..L-1, one per position whose feature it was given; at most N - 1 for N tokens, rolled
   back with the tokens;
3. the row's FeatureBlock (docs/PROTOCOL.md#feature-level-drafts) must start at or before L:
   rows before L are the same bits again and are skipped. A block that starts after L (the slot
   was evicted, the drafter restarted, a block was lost) answers need_resync and frees the slot.
   Its rows up to position N - 2 become pairs L.. with the tokens that followed them;
4. a row whose pairs then reach the history's end (N - 1 of them, N >= 2) drafts: long feeds (a
   resync) go through the head first, all but their last pair, in chunks of prefill_chunk
   (`drafter_core.feed_groups`); then the rows' remaining pairs start one draft chain
   (`eagle.draft_chain`, one head forward per draft position). Drafts are chosen as the model
   drafter chooses them (`drafter_core.choose`: greedy rows the argmax, sent as point masses;
   sampled rows a draw from the processed head distribution with the draft stream's uniforms,
   sent as sparse proposals in target ids through d2t; Gumbel-coupled rows argmax(log q + G) with
   the target's noise). A row with no new pair (its step is repeated: the verify before it was
   lost) feeds its last pair again, whose feature the drafter keeps per slot. A row short of
   pairs (its features are still on their way: the scheduler sends a large block in pieces)
   feeds what it has and proposes nothing this step.
5. a row that asks a tree gets one where drafter_core's step 7 says (draft_trees.py), drafted by
   `eagle.draft_tree`: one head step a level over the tree's columns, each node's pair its
   parent's predicted feature and its token. Tree rows draft one at a time after the feed; the
   other rows draft chains.

Its heartbeat's model_ids: {"draft": "<its kind>:<head dir name>", "draft_method": <its kind>,
"tokenizer": the target's tokenizer hash, "target": the target's model id, "hidden_size",
"target_vocab_size"}: a scheduler pins it only for requests whose verifier serves that very
target (services/scheduler/drafts/draft_method.py), since its drafts are worthless on any other's features.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from gpu_worker.runtime.checkpoint import model_id
from gpu_worker.drafter.draft_trees import tree_plan, tree_rank, tree_result
from gpu_worker.drafter.drafter_core import (SHORT_FEED, check_token_ids, choose, draft_results, feed_groups,
                                             receive_row, start_choice)
from gpu_worker.drafter.drafter_protocol import DraftRowWork
from gpu_worker.runtime.eagle import (EagleHead, build_head, draft_chain, draft_tree, head_forward, load_head_weights,
                                      load_target_pieces, new_cache, tree_columns_needed, unpack_features)
from gpu_worker.runtime.model import ConfigError
from gpu_worker.batching.slots import SlotOwner, free_request, model_settings
from text.tokenizer import tokenizer_id
from schemas.config import DrafterConfig, check_model_dir
from schemas.errors import ErrorCode, SpecbusError
from schemas.steps import DraftRequest, DraftResult, DraftRow

log = structlog.get_logger(__name__)


@dataclass(kw_only=True)
class EagleDrafter(SlotOwner):
    """The head, its KV cache (one layer; a slot's length is the pairs it holds) and the
    request_id -> DraftSlot map (token_ids: the history, target ids): a VocabularyDrafter
    (drafter_protocol.py).

    t2d: (V_target,) int64, target id -> draft id; last_features (max_slots, E) bf16: each slot's
    newest pair's feature, to feed it again when a step repeats.
    """

    head: EagleHead
    t2d: torch.Tensor
    last_features: torch.Tensor
    prefill_chunk: int

    def check(self, request: DraftRequest) -> None:
        check_features(self, request)
        check_token_ids(self, request)

    def prepare(self, scheduler_id: str, row: DraftRow, batch_keys: set[tuple[str, str]],
                now: float) -> PairWork | DraftResult:
        return prepare_pairs(self, scheduler_id, row, batch_keys, now)

    def propose(self, works: list[PairWork]) -> dict[str, DraftResult]:
        return run_head(self, works)

    @property
    def d2t(self) -> torch.Tensor:
        return self.head.d2t

    @property
    def other_id(self) -> int:
        return self.head.other_id

    @property
    def target_vocab_size(self) -> int:
        return self.t2d.numel()

    @property
    def draft_vocab_size(self) -> int:
        return self.head.d2t.numel()

    @property
    def slot_to_draft(self) -> torch.Tensor:
        """The ids a slot holds (target ids) -> draft ids."""
        return self.t2d

    @property
    def hidden_size(self) -> int:
        return self.head.config.hidden_size


@dataclass
class PairWork:
    """A row for the head: drafter_core's work (num_draft 0 when it cannot draft this step) and
    the pairs it appends: features (m, E) of positions L..L+m-1 and tokens (m,) int64, the target
    ids that followed them."""

    work: DraftRowWork
    features: torch.Tensor
    tokens: torch.Tensor

    @property
    def row(self) -> DraftRow:
        return self.work.row


def load_eagle_drafter(config: DrafterConfig) -> EagleDrafter:
    """The head of config.eagle_head over config.target_model's embedding, and its KV cache.
    SpecbusError naming the field for a missing directory, a bad setting or a head that does not
    fit the target."""
    check_model_dir(config.target_model, "target_model")
    check_model_dir(config.eagle_head, "eagle_head")
    dtype, memory_bytes = model_settings(config)
    log.info("eagle_head_loading", head=config.eagle_head, target=config.target_model,
             dtype=str(dtype).removeprefix("torch."))
    target = load_target_pieces(config.target_model, config.device, dtype)
    head_config, weights, maps = load_head_weights(config.eagle_head)
    if head_config.feature_layers:  # the verifier ships the last layer's features only (docs/PROTOCOL.md)
        raise SpecbusError(ErrorCode.invalid_field, f"eagle_head {config.eagle_head} reads fused target layers "
                                                    f"{list(head_config.feature_layers)}, which the serving path "
                                                    "does not ship yet; serve a last-layer head", "eagle_head")
    try:
        head = build_head(head_config, weights, maps, target, config.max_seq_len)
    except ConfigError as exc:
        raise SpecbusError(ErrorCode.invalid_field, f"eagle_head {config.eagle_head} cannot serve target_model "
                                                    f"{config.target_model}: {exc}", "eagle_head") from None
    cache = new_cache(head, config.max_slots, config.max_seq_len, memory_bytes)
    model_ids = {"draft": f"{config.draft_method}:{Path(config.eagle_head).resolve().name}",
                 "draft_method": config.draft_method,
                 "tokenizer": tokenizer_id(config.target_model), "target": model_id(config.target_model),
                 "hidden_size": str(head_config.hidden_size), "target_vocab_size": str(maps.target_vocab_size)}
    last = torch.zeros(config.max_slots, head_config.hidden_size, dtype=torch.bfloat16, device=head.embed.device)
    return EagleDrafter(instance_id=config.instance_id, head=head, cache=cache, t2d=maps.t2d, last_features=last,
                        model_ids=model_ids, prefill_chunk=config.prefill_chunk,
                        slot_idle_ttl_s=config.slot_idle_ttl_s, tokenizer_dir=config.target_model)


# ---------------------------------------------------------------------------------------------
# one batch


def check_features(drafter: EagleDrafter, request: DraftRequest) -> None:
    """SpecbusError naming the row's field for a block of another width than the head's."""
    for index, row in enumerate(request.rows):
        if row.features is not None and row.features.shape[1] != drafter.hidden_size:
            raise SpecbusError(ErrorCode.invalid_field, f"features of width {row.features.shape[1]}: this drafter's "
                                                        f"head reads features of {drafter.hidden_size}",
                               f"rows[{index}].features.shape")


def prepare_pairs(drafter: EagleDrafter, scheduler_id: str, row: DraftRow, batch_keys: set[tuple[str, str]],
                  now: float) -> PairWork | DraftResult:
    """Steps 2 and 3 of the module docstring for one row: its PairWork, or its final answer."""
    work = receive_row(drafter, scheduler_id, row, row.new_token_ids.tolist(), batch_keys, now)
    if isinstance(work, DraftResult):
        return work
    state = work.state
    state.token_ids.extend(work.feed)  # the whole history, target ids
    N = len(state.token_ids)
    held = min(int(drafter.cache.lengths[state.slot]), N - 1)
    drafter.cache.truncate(state.slot, held)
    block = row.features
    if block is not None and block.start > held:
        drafter.counters["feature_gaps"] += 1
        free_request(drafter, (scheduler_id, row.request_id), "feature_gap")
        return DraftResult(request_id=row.request_id, need_resync=True)
    features = torch.zeros(0, drafter.hidden_size, dtype=torch.bfloat16)
    stop = held if block is None else min(block.end, N - 1)
    if stop > held:
        rows = unpack_features(block.data, tuple(block.shape), f"rows[{row.row}].features")
        features = rows[held - block.start:stop - block.start]
    tokens = torch.tensor(state.token_ids[held + 1:stop + 1], dtype=torch.int64)
    if stop < N - 1 or stop == 0:  # short of pairs: feed what there is, draft nothing
        drafter.counters["rows_short_of_features"] += work.num_draft > 0
        work.num_draft = 0
    elif stop == held and work.num_draft > 0:  # nothing new: the last pair again, for its prediction
        drafter.cache.truncate(state.slot, held - 1)
        features = drafter.last_features[state.slot, None].cpu()
        tokens = torch.tensor(state.token_ids[held:held + 1], dtype=torch.int64)
    return PairWork(work=work, features=features, tokens=tokens)


def slot_tensor(items: list[PairWork]) -> torch.Tensor:
    return torch.tensor([item.work.state.slot for item in items], dtype=torch.int64)


def padded(items: list[tuple[PairWork, int, int]], E: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """features (B, T, E), tokens (B, T) and num_new (B,) of the pairs [begin, end) of each item."""
    T = max(end - begin for _, begin, end in items)
    features = torch.zeros(len(items), T, E, dtype=torch.bfloat16)
    tokens = torch.zeros(len(items), T, dtype=torch.int64)
    for b, (item, begin, end) in enumerate(items):
        features[b, :end - begin] = item.features[begin:end]
        tokens[b, :end - begin] = item.tokens[begin:end]
    return features, tokens, torch.tensor([end - begin for _, begin, end in items], dtype=torch.int64)


def keep_last_feature(drafter: EagleDrafter, item: PairWork) -> None:
    if len(item.tokens):
        drafter.last_features[item.work.state.slot] = item.features[-1]


def feed_pairs(drafter: EagleDrafter, items: list[tuple[PairWork, int]]) -> None:
    """Append the first count pairs of each (item, count) to its slot, in chunks of prefill_chunk."""
    for group in feed_groups([count for _, count in items], drafter.prefill_chunk):
        chunks = [(items[i][0], begin, end) for i, begin, end in group]
        features, tokens, num_new = padded(chunks, drafter.hidden_size)
        head_forward(drafter.head, drafter.cache, slot_tensor([item for item, _, _ in chunks]), features, tokens,
                     num_new, logits_index=torch.zeros(len(chunks), 1, dtype=torch.int64))
        drafter.counters["fed_pairs"] += int(num_new.sum())


def draft_trees(drafter: EagleDrafter, trees: list[tuple[PairWork, int, int, int]]) -> dict[str, DraftResult]:
    """Each (item, first pair, max_nodes, topk): its remaining pairs fed, then its tree drafted
    (`eagle.draft_tree`), one row at a time."""
    results = {}
    for item, begin, max_nodes, topk in trees:
        work = item.work
        tokens, parents = draft_tree(drafter.head, drafter.cache, work.state.slot, item.features[begin:],
                                     item.tokens[begin:], work.num_draft, max_nodes, topk, tree_rank(drafter, work))
        drafter.counters["fed_pairs"] += len(item.tokens) - begin
        results[work.row.request_id] = tree_result(drafter, work, tokens, parents)
    return results


def tree_shape(drafter: EagleDrafter, item: PairWork, begin: int) -> tuple[int, int] | None:
    """drafter_core.tree_plan for a row whose first `begin` pairs are fed."""
    held = int(drafter.cache.lengths[item.work.state.slot]) + len(item.tokens) - begin
    return tree_plan(item.work, drafter.cache.max_seq_len - item.work.start, drafter.cache.max_seq_len - held + 1,
                     tree_columns_needed)


@torch.inference_mode()
def run_head(drafter: EagleDrafter, items: list[PairWork]) -> dict[str, DraftResult]:
    """Step 4 of the module docstring: feed every row's pairs, draft for the rows that can."""
    drafting = [item for item in items if item.work.num_draft > 0]
    chained = {id(item): len(item.tokens) - 1 if len(item.tokens) > SHORT_FEED else 0 for item in drafting}
    feed_pairs(drafter, [(item, chained.get(id(item), len(item.tokens))) for item in items])
    for item in items:
        keep_last_feature(drafter, item)
    shapes = {id(item): tree_shape(drafter, item, chained[id(item)]) for item in drafting}
    results = draft_trees(drafter, [(item, chained[id(item)], *shapes[id(item)]) for item in drafting
                                    if shapes[id(item)] is not None])
    drafting = [item for item in drafting if shapes[id(item)] is None]
    if not drafting:
        return results
    features, tokens, num_new = padded([(item, chained[id(item)], len(item.tokens)) for item in drafting],
                                       drafter.hidden_size)
    works = [item.work for item in drafting]
    choice = start_choice(drafter, works)
    draft_chain(drafter.head, drafter.cache, slot_tensor(drafting), features, tokens, num_new,
                max(work.num_draft for work in works),
                choose=lambda logits, j: choose(drafter, choice, logits.float().cpu(), j))
    drafter.counters["fed_pairs"] += int(num_new.sum())
    return results | draft_results(drafter, works, choice.draft_ids, choice.probs)
