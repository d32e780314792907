"""The drafter: owns the draft model and its KV cache slots, proposes draft tokens per request.

Tensor code, NATS-free and testable alone (docs/ARCHITECTURE.md#naming): `load_drafter(config)
-> ModelDrafter`, `draft_batch(drafter, request) -> DraftResponse`. services/drafter/drafter.py
`run_drafter(config, stop)` serves it. `draft_batch` is every drafter kind's skeleton
(gpu_worker/drafter/drafter_protocol.py); `receive_row`, the receiver rule, every kind's too.

`draft_batch` for the draft model, in order (docs/PROTOCOL.md#receiver-rule-and-resync):
1. check every row's token ids against the target vocabulary (Error naming the field) before
   touching any state;
2. free the slots named in `request.release`, then slots idle longer than slot_idle_ttl_s;
3. per row, the receiver rule: the slot holds committed tokens h[0:L]. L < cached_len (or an
   unknown request with cached_len > 0) -> need_resync, nothing appended. Otherwise the slot
   becomes h[0:cached_len] + new_token_ids (target ids mapped to draft ids with t2d; ids outside
   the draft vocabulary become other_id). Positions whose tokens the slot already holds
   (drafts fed last step that were accepted) are kept, not recomputed; a slot that holds nothing
   yet copies what the prefix cache holds of its history (`take_hit`, prefix_cache.py), and a
   released slot's committed history is kept there;
4. feed: what each row still lacks goes through the model, in chunks of prefill_chunk tokens,
   short feeds (decode rows) in a forward apart from long ones (resync) to limit padding; the
   logits of each row's last fed token give its first draft;
5. draft: one batched forward per draft position; rows with fewer drafts ride along with
   num_new=0. other_id's logit is -inf before choosing; then a row's logit_bias and penalties
   (`penalise`) as the verifier applies them, over the history in draft ids (prompt_len from
   the row) and the drafts chosen before (ids the draft lacks carry no bias). Correctness does
   not depend on it (the proposal sent is whatever distribution the draft was drawn from), but
   a draft that ignored a bias of -100 would propose a banned token, rejected every time.
   greedy rows (draft_mode "greedy", or a temperature-0 row) take the argmax (of the penalised
   logits) and send a point_mass proposal; Gumbel-coupled rows (coupling "gumbel", whatever
   their draft_mode) propose argmax(log q + G) with the target's noise at the same position
   (gpu_worker/sampling/coupling.py), q the row's tempered draft law without top-k, top-p or
   min-p (`coupling.proposal_law`: their proposal is free to be any token, and ranking the
   vocabulary would cost most of a position's time) and send a point mass; sampled rows draw from
   process_logits(row params, top_k at most MAX_DRAFT_SUPPORT) with make_uniforms(seed, absolute
   position, STREAM_DRAFT) and send that distribution as a sparse proposal. The top-k cap
   bounds a proposal to MAX_DRAFT_SUPPORT ids per draft (~2 KB, where the whole vocabulary would
   be ~0.4 MB), so batches stay far under NATS's max_payload; since what is sent is exactly the
   (truncated, renormalised) law the draft was drawn from, rejection sampling stays exact;
6. draft ids -> target ids with d2t (the sparse support too, many-to-one ids summed);
7. a row that asks a tree (DraftRow.max_nodes > num_draft, docs/PROTOCOL.md#tree-drafts) of a
   greedy or Gumbel-coupled request without penalties or structured outputs gets an EAGLE-2 tree
   instead of step 5 (gpu_worker/drafter/draft_trees.py; gpu_worker/runtime/tree_draft.py): each
   level expands the best topk = min(MAX_TREE_TOPK, ceil(max_nodes / num_draft)) nodes by
   cumulative draft log-probability into their topk best children (a Gumbel-coupled row: by
   log q + G with the target's noise, `tree_rank`), one `tree_forward` a level, and the max_nodes
   best nodes go as point masses (a Gumbel-coupled row's acceptance reads no draft law), no
   deeper than num_draft, within the verifier's room; a tree that is one path goes as a chain.
   Tree rows draft one at a time; their drafts are not kept in the slot.
"""

from __future__ import annotations

import dataclasses
import time
from array import array
from dataclasses import dataclass, field

import structlog
import torch

from gpu_worker.runtime.checkpoint import load_d2t, model_id
from gpu_worker.sampling.coupling import gumbel_argmax, proposal_law
from gpu_worker.runtime.kv_cache import CacheMemoryError
from gpu_worker.runtime.model import Model, forward
from gpu_worker.sampling.sampler import (STREAM_DRAFT, Penalties, SamplingTensors, add_tokens, make_uniforms, penalise,
                                         row_seed, sample)
from gpu_worker.drafter.draft_trees import draft_model_tree, mask_other, model_tree_columns, tree_plan
from gpu_worker.drafter.drafter_protocol import Drafter, DraftRowWork, DraftSlot, VocabularyDrafter
from gpu_worker.batching.grammar_masks import allowed_now, grammars_of, mask_logits_
from gpu_worker.batching.prefix_cache import PrefixCache, extend_keys, root_key
from gpu_worker.batching.receiver_rule import receiver_rule
from gpu_worker.batching.row_sampling import logit_bias_tensors, row_params, row_penalties
from gpu_worker.batching.slots import SlotOwner, evict_idle, free_request, instance_heartbeat, load_model_and_cache, release
from text.tokenizer import check_in_vocabulary, tokenizer_id
from schemas.arrays import PAD_TOKEN_ID
from schemas.config import DrafterConfig
from schemas.bus.control import Heartbeat
from schemas.generation import draft_is_sampled
from schemas.bus.protocol import MAX_DRAFT_SUPPORT
from schemas.errors import SpecbusError
from schemas.steps import DraftRequest, DraftResponse, DraftResult, DraftRow, Proposal
from text.grammar import OutputMatcher

log = structlog.get_logger(__name__)

# A row whose feed is at most this long is a decode row (new tokens of one step); longer feeds
# (a resync prefill) go through their own forwards so decode rows are not padded to their length.
SHORT_FEED = 32


@dataclass(kw_only=True)
class ModelDrafter(SlotOwner):
    """The draft model, its KV cache and the request_id -> slot map: the drafter kind "model" of
    drafter_protocol.py (a VocabularyDrafter), loaded by `load_drafter`.

    d2t: (V_draft,) int64, draft id -> target id. t2d: (V_target,) int64, target id -> draft id
    (other_id for target ids outside the draft vocabulary). other_id is None when the draft
    shares the target's vocabulary (no d2t.safetensors): then d2t and t2d are the identity.
    """

    model: Model
    d2t: torch.Tensor
    t2d: torch.Tensor
    other_id: int | None
    prefill_chunk: int

    def check(self, request: DraftRequest) -> None:
        check_token_ids(self, request)

    def prepare(self, scheduler_id: str, row: DraftRow, batch_keys: set[tuple[str, str]],
                now: float) -> DraftRowWork | DraftResult:
        return prepare_row(self, scheduler_id, row, batch_keys, now)

    def propose(self, works: list[DraftRowWork]) -> dict[str, DraftResult]:
        return run_model(self, works)

    def kept(self, state: DraftSlot) -> tuple[array, list[bytes], None]:
        """A released slot's entry: its committed history (drafts fed after it left out), no
        block keys yet, no features."""
        return array("i", state.token_ids[:state.committed_len]), [], None

    @property
    def target_vocab_size(self) -> int:
        return self.t2d.numel()

    @property
    def draft_vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def slot_to_draft(self) -> torch.Tensor:
        """(V_draft,) the ids a slot holds (draft ids already) -> draft ids: the identity."""
        return torch.arange(self.draft_vocab_size)


def load_drafter(config: DrafterConfig) -> ModelDrafter:
    """Load the draft model, its d2t map (identity when the directory has none) and a KV cache.
    Its heartbeat's model_ids: {"draft", "tokenizer", "target_vocab_size"}, no "draft_method" (a
    scheduler reads its absence as schemas/draft_kinds.py DEFAULT_DRAFT_METHOD).

    dtype "auto" is bfloat16 for a draft on every device: a draft step reads every weight for a
    few rows, so half the bytes is what it costs, even where bf16 arithmetic is emulated (see
    ops/bench/RESULTS.md, Figures behind gpu_worker's choices), and the draft's rounding never
    reaches the output, which the target decides (the shipped draft's weights are bf16 anyway)."""
    if config.dtype == "auto":
        config = dataclasses.replace(config, dtype="bfloat16")
    model, cache = load_model_and_cache(config.draft_model, config)
    maps = load_d2t(config.draft_model)
    if maps is None:
        d2t = t2d = torch.arange(model.config.vocab_size)
        other_id = None
    else:
        d2t, t2d, other_id = maps.d2t, maps.t2d, maps.other_id
    model_ids = {
        "draft": model_id(config.draft_model),
        "tokenizer": tokenizer_id(config.draft_model),
        "target_vocab_size": str(t2d.numel()),
    }
    drafter = ModelDrafter(instance_id=config.instance_id, model=model, cache=cache, d2t=d2t, t2d=t2d,
                      other_id=other_id, model_ids=model_ids, prefill_chunk=config.prefill_chunk,
                      slot_idle_ttl_s=config.slot_idle_ttl_s, tokenizer_dir=config.draft_model)
    if config.prefix_caching:
        drafter.prefix = PrefixCache(cache, drafter.counters)
    return drafter


# ---------------------------------------------------------------------------------------------
# slots


def allocate(drafter: ModelDrafter, key: tuple[str, str], batch_keys: set[tuple[str, str]],
             now: float) -> DraftSlot | None:
    """A fresh slot for key (scheduler_id, request_id). With none free, the least recently used
    slot of a request outside this batch is taken (that request resyncs when it comes back);
    None if there is none."""
    if drafter.cache.num_free == 0:
        idle = [(state.last_used, k) for k, state in drafter.requests.items() if k not in batch_keys]
        if not idle:
            drafter.counters["no_slot"] += 1
            log.warning("no_free_slot", request_id=key[1], max_slots=drafter.cache.max_slots)
            return None
        victim = min(idle)[1]
        free_request(drafter, victim, "evicted_full")
        log.warning("slot_evicted_for_new_request", evicted=victim[1], request_id=key[1])
    state = DraftSlot(slot=drafter.cache.allocate(), token_ids=[], committed_len=0, last_used=now)
    drafter.requests[key] = state
    return state


# ---------------------------------------------------------------------------------------------
# one batch


def check_token_ids(drafter: VocabularyDrafter, request: DraftRequest) -> None:
    for index, row in enumerate(request.rows):
        check_in_vocabulary(row.new_token_ids, drafter.target_vocab_size, f"rows[{index}].new_token_ids")


def common_prefix(a: list[int], b: list[int], start: int) -> int:
    """Length of the common prefix of a and b, given that it is at least `start`."""
    end = min(len(a), len(b))
    i = start
    while i < end and a[i] == b[i]:
        i += 1
    return i


def prepare_row(drafter: ModelDrafter, scheduler_id: str, row: DraftRow, batch_keys: set[tuple[str, str]],
                now: float) -> DraftRowWork | DraftResult:
    """Apply the receiver rule to one row: a DraftRowWork for the model, or the row's final answer."""
    new_ids = drafter.t2d[torch.from_numpy(row.new_token_ids).long()].tolist()
    work = receive_row(drafter, scheduler_id, row, new_ids, batch_keys, now)
    if isinstance(work, DraftRowWork):  # the cache holds exactly the slot's tokens
        drafter.cache.truncate(work.state.slot, len(work.state.token_ids))
        take_hit(drafter, work)
    return work


def take_hit(drafter: ModelDrafter, work: DraftRowWork) -> None:
    """A slot that holds nothing yet (a new request's first draft row: its whole history) takes
    from the prefix cache the longest prefix of its feed another request's released slot held,
    up to the last token it must feed for its first draft's logits; its feed then starts after
    it. The keys chain from the draft model, its dtype and the row's cache_salt, as the verifier's
    (gpu_worker/batching/prefix_cache.py); the forward is batch-invariant, so the copy is what feeding
    the tokens would write."""
    state, row = work.state, work.row
    if drafter.prefix is None or row.cache_salt is None or state.token_ids:
        return
    # the model, dtype and weights never change inside one process: the salt is what parts caches
    state.prefix_root = root_key(drafter.model_ids["draft"], drafter.cache.dtype, "draft", row.cache_salt)
    ids = array("i", work.feed)
    limit = len(ids) - (work.num_draft > 0)
    keys: list[bytes] = []
    extend_keys(keys, state.prefix_root, ids, limit)
    drafter.counters["prefix_tokens_looked_up"] += limit
    found = drafter.prefix.find(keys, ids, 0, limit)
    if found is None:
        return
    entry, end = found
    drafter.cache.copy_prefix(state.slot, entry.keys, entry.values, end)
    state.token_ids.extend(work.feed[:end])
    work.feed = work.feed[end:]
    drafter.counters["prefix_tokens_hit"] += end


def receive_row(drafter: Drafter, scheduler_id: str, row: DraftRow, new_ids: list[int], batch_keys: set[tuple[str, str]],
                now: float) -> DraftRowWork | DraftResult:
    """The receiver rule for one row whose new tokens are new_ids (already in the drafter's own
    ids): a DraftRowWork (its feed: what the slot still lacks), or the row's final answer. drafter:
    any slot owner (gpu_worker/batching/slots.py) whose cache can allocate, reserve and free slots and
    whose requests hold DraftSlots: a ModelDrafter, the model-free NgramDrafter (gpu_worker/drafter/ngram.py)
    or the EagleDrafter (gpu_worker/drafter/eagle_drafter.py). The slot's token_ids end cut to the tokens
    kept; the caller rolls its cache back to match (a ModelDrafter's holds one position a token)."""
    key = (scheduler_id, row.request_id)
    state = drafter.requests.get(key)
    verdict = receiver_rule(0 if state is None else state.committed_len, row.cached_len, len(new_ids),
                            drafter.cache.max_seq_len)
    if verdict.need_resync:
        drafter.counters["need_resync"] += 1
        return DraftResult(request_id=row.request_id, need_resync=True)
    history = ([] if state is None else state.token_ids[:row.cached_len]) + new_ids
    if verdict.room < 0:
        free_request(drafter, key, "too_long")
        log.warning("history_too_long", request_id=row.request_id, length=len(history),
                    max_seq_len=drafter.cache.max_seq_len)
        return DraftResult(request_id=row.request_id)
    if not history:
        return DraftResult(request_id=row.request_id)
    if state is None:
        state = allocate(drafter, key, batch_keys, now)
        if state is None:
            return DraftResult(request_id=row.request_id, need_resync=True)
    # The verifier holds history + drafts (the same receiver_rule room): offering more would fail the row there.
    num_draft = max(0, min(row.num_draft, verdict.room))
    try:  # storage for the history and the drafts fed after it; short memory: no drafts this step
        drafter.cache.reserve(state.slot, len(history) + num_draft)
    except CacheMemoryError as exc:
        free_request(drafter, key, "memory")
        log.warning("kv_memory_short", request_id=row.request_id, error=str(exc))
        return DraftResult(request_id=row.request_id)
    keep = common_prefix(state.token_ids, history, row.cached_len)
    if num_draft > 0:
        keep = min(keep, len(history) - 1)  # the first draft needs the logits of a fed token
    drafter.counters["reused_tokens"] += max(0, keep - row.cached_len)
    del state.token_ids[keep:]
    state.committed_len = len(history)
    state.last_used = now
    return DraftRowWork(row=row, state=state, feed=history[keep:], num_draft=num_draft, start=len(history),
                        greedy=not draft_is_sampled(row.sampling, row.draft_mode))


def forward_last(drafter: ModelDrafter, slots: torch.Tensor, token_ids: torch.Tensor,
                 num_new: torch.Tensor) -> torch.Tensor:
    """Append token_ids[b, :num_new[b]] (B, T) to cache slots[b] (B,) in one forward; return
    the logits of each row's last new token (B, V_draft). Rows with num_new 0 ride along: their
    logits are zeros. Callers record the tokens in their DraftSlot."""
    B, T = token_ids.shape
    logits_index = None if T == 1 else (num_new - 1).clamp_min(0).view(B, 1)
    # Choosing drafts needs the values on the host anyway; (B, V_draft) is small.
    logits = forward(drafter.model, drafter.cache, slots, token_ids, num_new, logits_index)[:, 0].float().cpu()
    drafter.counters["fed_tokens"] += int(num_new.sum())
    riding = num_new == 0
    return logits.masked_fill_(riding.view(B, 1), 0.0) if bool(riding.any()) else logits


def slot_tensor(works: list[DraftRowWork]) -> torch.Tensor:
    return torch.tensor([work.state.slot for work in works], dtype=torch.int64)


def feed_groups(lengths: list[int], chunk: int):
    """The forwards that feed items of lengths[i] positions each: yields lists of (i, begin,
    end), every item's [0, lengths[i]) in chunks of at most chunk positions, in order; chunks of
    at most SHORT_FEED positions (decode rows) in forwards apart from longer ones (a resync), so
    they are not padded to their length."""
    offsets = [0] * len(lengths)
    while True:
        remaining = [n - offset for n, offset in zip(lengths, offsets)]
        short = [i for i, left in enumerate(remaining) if 0 < left <= SHORT_FEED]
        long = [i for i, left in enumerate(remaining) if left > SHORT_FEED]
        if not short and not long:
            return
        for group in (short, long):
            if group:
                chunks = [(i, offsets[i], min(lengths[i], offsets[i] + chunk)) for i in group]
                yield chunks
                for i, _, end in chunks:
                    offsets[i] = end


def feed(drafter: ModelDrafter, works: list[DraftRowWork]) -> list[torch.Tensor | None]:
    """Append every row's feed to its slot (chunked, `feed_groups`); the (V_draft,) logits of each
    row's last fed token, or None for rows that fed nothing."""
    last_logits: list[torch.Tensor | None] = [None] * len(works)
    for group in feed_groups([len(work.feed) for work in works], drafter.prefill_chunk):
        chunks = [works[i].feed[begin:end] for i, begin, end in group]
        T = max(map(len, chunks))
        token_ids = torch.tensor([chunk + [0] * (T - len(chunk)) for chunk in chunks], dtype=torch.int64)
        num_new = torch.tensor(list(map(len, chunks)), dtype=torch.int64)
        logits = forward_last(drafter, slot_tensor([works[i] for i, _, _ in group]), token_ids, num_new)
        for b, (i, _, end) in enumerate(group):
            works[i].state.token_ids.extend(chunks[b])
            if end == len(works[i].feed):
                last_logits[i] = logits[b]
    return last_logits


def draft_penalties(drafter: VocabularyDrafter, work: DraftRowWork) -> Penalties:
    """A row's logit_bias and penalties in draft ids, over the history its slot holds. Bias ids
    outside the target vocabulary are skipped here (the verifier fails that row, naming the
    field; failing the draft batch would cost every other row its drafts), and so are ids the
    draft has no id of its own for (other_id). drafter: a ModelDrafter or an EagleDrafter (its
    slot_to_draft maps the ids its slots hold to draft ids)."""
    bias_ids, bias_values = logit_bias_tensors(work.row.sampling)
    if bias_ids is not None:
        keep = bias_ids < drafter.target_vocab_size
        bias_ids, bias_values = drafter.t2d[bias_ids[keep]], bias_values[keep]
        if drafter.other_id is not None:
            drafted = bias_ids != drafter.other_id
            bias_ids, bias_values = bias_ids[drafted], bias_values[drafted]
    history = drafter.slot_to_draft[torch.tensor(work.state.token_ids[:work.start], dtype=torch.int64)]
    return row_penalties(work.row.sampling, drafter.draft_vocab_size, history, work.row.prompt_len, bias_ids,
                         bias_values)


@dataclass
class DraftChoice:
    """One batch's drafts, chosen position by position (`start_choice`, then `choose` once per
    draft position): what the rows' choosing needs, and the drafts chosen so far.

    num_draft (B,); draft_ids (B, K) draft ids, -1 past a row's num_draft; step_probs: per
    position the (B, V_draft) processed probs each row's draft was drawn from (none when every
    row is greedy). params, seeds (B,), starts (B,) (the absolute position of each row's first
    draft), uniforms (B, K) (STREAM_DRAFT) and gumbel (B,) bool: None when every row is greedy.
    penalised: the rows with logit_bias or penalties, penalties theirs (draft ids chosen so far
    included).
    """

    num_draft: torch.Tensor
    draft_ids: torch.Tensor
    penalised: list[int]
    penalties: Penalties | None
    grammars: dict[int, OutputMatcher] = field(default_factory=dict)  # row -> its matcher (draft_grammars)
    params: SamplingTensors | None = None
    seeds: torch.Tensor | None = None
    starts: torch.Tensor | None = None
    uniforms: torch.Tensor | None = None
    gumbel: torch.Tensor | None = None
    step_probs: list[torch.Tensor] = field(default_factory=list)

    @property
    def probs(self) -> torch.Tensor | None:
        """(B, K, V_draft), or None when every row is greedy."""
        return torch.stack(self.step_probs, 1) if self.step_probs else None


def draft_grammars(drafter: VocabularyDrafter, works: list[DraftRowWork]) -> dict[int, OutputMatcher]:
    """row -> the matcher of each row with structured_outputs, at the state after its output
    (docs/PROTOCOL.md#structured-outputs: the draft proposes under the mask the target's law
    has, so it wastes no position on a token the grammar refuses). The slot's matcher holds the
    output in target ids (the slot's own ids may have lost some to other_id); it takes the
    committed output from it and new_token_ids. A row whose output it cannot rebuild, or whose
    grammar fails, drafts without a mask: the verifier's mask keeps the output exact anyway."""
    matchers = {}
    for b, work in enumerate(works):
        spec, row, state = work.row.sampling.structured_outputs, work.row, work.state
        if spec is None:
            continue
        try:
            matcher = state.grammar or OutputMatcher(grammars_of(drafter, drafter.target_vocab_size).matcher(spec))
            held = max(0, row.cached_len - row.prompt_len)
            output = matcher.consumed[:held] + row.new_token_ids.tolist()[max(0, row.prompt_len - row.cached_len):]
            state.grammar = matcher
            if len(matcher.consumed) >= held and len(output) == work.start - row.prompt_len and matcher.follow(output):
                matchers[b] = matcher
        except SpecbusError:  # the verifier fails the row; the batch's other rows draft on
            state.grammar = None
    return matchers


def mask_by_grammar(drafter: VocabularyDrafter, choice: DraftChoice, logits: torch.Tensor, j: int) -> None:
    """Draft position j's logits (B, V_draft) of the rows with a matcher at -inf where the
    grammar refuses the target id (in place); a row whose allowed ids are all outside the draft's
    vocabulary is left as it is, and drafts on unmasked. A row whose grammar forces position j
    stops drafting there (its num_draft becomes j): the verifier appends the forced tokens itself
    (gpu_worker/verifier/verifier_grammar.py), so a draft there would cost a forward for nothing and
    count as a guess of the drafter's in adaptive k's acceptance (docs/PROTOCOL.md#structured-outputs)."""
    for b, matcher in list(choice.grammars.items()):
        if matcher.forced():
            choice.num_draft[b] = j  # j < its num_draft: choose drops a matcher at its last draft
            del choice.grammars[b]
            continue
        allowed = allowed_now(matcher, drafter.target_vocab_size)[drafter.d2t]  # (V_draft,)
        if drafter.other_id is not None:
            allowed[drafter.other_id] = False
        if not bool(allowed.any()):
            del choice.grammars[b]
            continue
        mask_logits_(logits[b], allowed)


def follows(matcher: OutputMatcher, target_id: int) -> bool:
    """Whether the grammar takes target_id (consumed); False too when its matcher fails on it
    (the row then drafts on unmasked, and the verifier fails it)."""
    try:
        return bool(matcher.advance([target_id]))
    except SpecbusError:
        return False


def start_choice(drafter: VocabularyDrafter, works: list[DraftRowWork]) -> DraftChoice:
    """The choosing state of a batch of rows that draft (num_draft >= 1 each). drafter: a
    ModelDrafter or an EagleDrafter."""
    B, K = len(works), max(work.num_draft for work in works)
    penalised = [b for b, work in enumerate(works) if work.row.sampling.penalised]
    choice = DraftChoice(num_draft=torch.tensor([work.num_draft for work in works]),
                         draft_ids=torch.full((B, K), PAD_TOKEN_ID, dtype=torch.int64), penalised=penalised,
                         penalties=Penalties.cat([draft_penalties(drafter, works[b]) for b in penalised])
                         if penalised else None, grammars=draft_grammars(drafter, works))
    if all(work.greedy for work in works):
        return choice
    choice.params = SamplingTensors.cat([row_params(work.row.sampling, greedy=work.greedy, top_k_cap=MAX_DRAFT_SUPPORT)
                                         for work in works])
    choice.seeds = torch.tensor([0 if work.greedy else row_seed(work.row.sampling) for work in works],
                                dtype=torch.int64)
    choice.starts = torch.tensor([work.start for work in works], dtype=torch.int64)
    # draft j of a row lands at absolute position start + j
    choice.uniforms = make_uniforms(choice.seeds, choice.starts.view(B, 1) + torch.arange(K), STREAM_DRAFT)  # (B, K)
    choice.gumbel = torch.tensor([work.row.sampling.gumbel for work in works])
    return choice


def choose(drafter: VocabularyDrafter, choice: DraftChoice, logits: torch.Tensor, j: int) -> torch.Tensor:
    """Draft position j of every row from its logits (B, V_draft) float32 (changed in place:
    other_id set to -inf, the row's penalties applied): greedy rows take the argmax; sampled rows
    draw from process_logits(row params, top_k at most MAX_DRAFT_SUPPORT) with their uniforms;
    Gumbel-coupled rows take argmax(log q + G), q their tempered law unfiltered
    (coupling.proposal_law) and G the target's noise at the same position
    (gpu_worker/sampling/coupling.py). Records the drafts (-1 past a row's num_draft) and their law in
    choice; returns the (B,) draft ids chosen, a valid id for every row (what a chain feeds next)."""
    B = logits.shape[0]
    assert logits.shape == (B, drafter.draft_vocab_size), logits.shape
    mask_other(drafter, logits)
    mask_by_grammar(drafter, choice, logits, j)
    penalised = choice.penalised
    if choice.penalties is not None:
        logits[penalised] = penalise(logits[penalised][:, None], choice.penalties)[:, 0]
    if choice.params is None:
        ids = logits.argmax(-1)  # (B,), lowest id on ties, as process_logits' greedy path
    else:
        ids, probs = logits.new_empty(B, dtype=torch.int64), torch.empty_like(logits)
        gumbel, drawn = choice.gumbel, ~choice.gumbel
        if bool(gumbel.any()):  # the target's noise at the same position, keyed by target ids
            probs[gumbel] = law = proposal_law(logits[gumbel], choice.params.temperature[gumbel])
            ids[gumbel] = gumbel_argmax(law[:, None], choice.seeds[gumbel], choice.starts[gumbel].view(-1, 1) + j,
                                        drafter.d2t)[:, 0]
        if bool(drawn.any()):
            processed, sampled = sample(logits[drawn][:, None], choice.params.index(drawn),
                                        choice.uniforms[drawn, j:j + 1])
            ids[drawn], probs[drawn] = sampled[:, 0], processed.probs[:, 0]
        choice.step_probs.append(probs)
    choice.draft_ids[:, j] = torch.where(j < choice.num_draft, ids, PAD_TOKEN_ID)
    for b, matcher in list(choice.grammars.items()):  # the next position's mask follows this draft
        if j + 1 >= int(choice.num_draft[b]) or not follows(matcher, int(drafter.d2t[ids[b]])):
            del choice.grammars[b]
    if choice.penalties is not None:
        choice.penalties = add_tokens(choice.penalties, choice.draft_ids[penalised, j])
    return ids


def propose(drafter: ModelDrafter, works: list[DraftRowWork], first_logits: torch.Tensor):
    """Choose num_draft drafts per row (`choose`), one batched forward per position.

    first_logits: (B, V_draft), the logits after each row's last fed token (changed in place).
    Returns draft_ids (B, K) int64 in draft vocabulary (-1 past a row's num_draft) and the
    processed probs (B, K, V_draft) each draft was drawn from (None when all rows are greedy;
    meaningless past a row's num_draft and for greedy rows, which take the argmax).
    """
    B, K = len(works), max(work.num_draft for work in works)
    assert first_logits.shape == (B, drafter.draft_vocab_size), first_logits.shape
    choice = start_choice(drafter, works)
    slots = slot_tensor(works)
    logits = first_logits
    for j in range(K):
        ids = choose(drafter, choice, logits, j)
        if j + 1 < K:
            feeding = j + 1 < choice.num_draft  # (B,) rows that need another draft
            logits = forward_last(drafter, slots, ids.view(B, 1), feeding.long())
            for work, token, fed in zip(works, ids.tolist(), feeding.tolist()):
                if fed:
                    work.state.token_ids.append(token)
    return choice.draft_ids, choice.probs


def sparse_supports(drafter: VocabularyDrafter, probs: torch.Tensor):
    """The supports of draft distributions probs (N, V_draft), in target ids.

    Returns ids (N, S) int64 (-1 padding), probs (N, S) (0 at padding) and sizes (N,): draft
    ids sharing a target id are summed (scatter-add), ids ascending within each row.
    """
    N = probs.shape[0]
    target = probs.new_zeros(N, drafter.target_vocab_size).index_add_(1, drafter.d2t, probs)  # (N, V)
    positive = target > 0
    sizes = positive.sum(1)
    rows, cols = positive.nonzero(as_tuple=True)  # row-major: ids ascending within a row
    slot = torch.arange(rows.numel()) - (sizes.cumsum(0) - sizes)[rows]  # index within the row's support
    ids = torch.full((N, int(sizes.max())), PAD_TOKEN_ID, dtype=torch.int64)
    ids[rows, slot] = cols
    values = probs.new_zeros(ids.shape)
    values[rows, slot] = target[rows, cols]
    return ids, values, sizes


def draft_results(drafter: VocabularyDrafter, works: list[DraftRowWork], draft_ids: torch.Tensor,
                  probs: torch.Tensor | None) -> dict[str, DraftResult]:
    """request_id -> DraftResult for rows that drafted: draft_ids (B, K) in draft ids (-1 past a
    row's num_draft) mapped to target ids with d2t; greedy and Gumbel-coupled rows send a point
    mass, sampled rows the sparse support (target ids) of the probs (B, K, V_draft) they were drawn
    from. A row that
    stopped early (mask_by_grammar) delivers the drafts it has: its work's num_draft is set to them."""
    for work, row_ids in zip(works, draft_ids):
        work.num_draft = int((row_ids[:work.num_draft] != PAD_TOKEN_ID).sum())
    target_ids = drafter.d2t[draft_ids.clamp_min(0)].to(torch.int32).numpy()  # (B, K)
    # Gumbel-coupled rows send point masses: their acceptance reads no draft law (coupling.py)
    sampled = [b for b, work in enumerate(works) if not work.greedy and not work.row.sampling.gumbel and work.num_draft]
    proposals = {}
    if sampled:
        B, K, V = probs[sampled].shape
        ids, values, sizes = (t.view(B, K, -1) for t in sparse_supports(drafter, probs[sampled].view(B * K, V)))
        for i, b in enumerate(sampled):
            n = works[b].num_draft
            width = int(sizes[i, :n].max())
            proposals[b] = Proposal(kind="sparse", ids=ids[i, :n, :width].to(torch.int32).numpy(),
                                    probs=values[i, :n, :width].numpy())
    drafter.counters["draft_tokens"] += sum(work.num_draft for work in works)
    return {work.row.request_id: DraftResult(request_id=work.row.request_id,
                                             draft_token_ids=target_ids[b, :work.num_draft],
                                             proposal=proposals.get(b, Proposal()))
            for b, work in enumerate(works)}


@torch.inference_mode()
def run_model(drafter: ModelDrafter, works: list[DraftRowWork]) -> dict[str, DraftResult]:
    """Feed every row, then propose for the rows that want drafts: request_id -> DraftResult."""
    first_logits = feed(drafter, works)
    results = {}
    drafting = []
    for work, logits in zip(works, first_logits):
        if work.num_draft == 0:
            continue
        plan = tree_plan(work, drafter.cache.max_seq_len - work.start,
                         drafter.cache.max_seq_len - len(work.state.token_ids), model_tree_columns)
        if plan is None:
            drafting.append((work, logits))
        else:
            results[work.row.request_id] = draft_model_tree(drafter, work, logits, *plan)
    if not drafting:
        return results
    draft_works = [work for work, _ in drafting]
    draft_ids, probs = propose(drafter, draft_works, torch.stack([logits for _, logits in drafting]))
    return results | draft_results(drafter, draft_works, draft_ids, probs)


def draft_batch(drafter: Drafter, request: DraftRequest, now: float | None = None) -> DraftResponse:
    """Answer one DraftRequest with any drafter kind (gpu_worker/drafter/drafter_protocol.py: its
    check, the releases and idle evictions, its prepare per row, its propose; the model
    drafter's steps are the module docstring's). Raises SpecbusError naming the field for a bad
    row (nothing changed then). `now` is time.monotonic(), for idle tests."""
    now = time.monotonic() if now is None else now
    drafter.check(request)
    release(drafter, [(request.scheduler_id, request_id) for request_id in request.release])
    evict_idle(drafter, now)
    batch_keys = {(request.scheduler_id, row.request_id) for row in request.rows}
    prepared = [drafter.prepare(request.scheduler_id, row, batch_keys, now) for row in request.rows]
    works = [item for item in prepared if not isinstance(item, DraftResult)]
    try:
        drafts = drafter.propose(works)
    except Exception:
        # Slots half-fed by a failed forward no longer match their records: drop them (resync).
        for work in works:
            free_request(drafter, (request.scheduler_id, work.row.request_id), "dropped_on_error")
        raise
    results = []
    for row, item in zip(request.rows, prepared):
        if isinstance(item, DraftResult):
            results.append(item)
        else:
            results.append(drafts.get(row.request_id) or DraftResult(request_id=row.request_id))
    drafter.counters["batches"] += 1
    drafter.counters["rows"] += len(request.rows)
    return DraftResponse(batch_id=request.batch_id, drafter_id=drafter.instance_id, rows=results)


def heartbeat(drafter: Drafter, interval_s: float) -> Heartbeat:
    return instance_heartbeat(drafter, "drafter", interval_s)
