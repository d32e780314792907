"""The verifier's rows before the model (stages 1 and 2 of gpu_worker/verifier/verifier_core.py,
whose verify_batch answers a retry itself): `check_row` checks every row before any state
changes (`check_fields`: token ids inside the vocabulary, proposal, room in the slot, a tree row
a decode step: `check_tree_row`) and builds its sampling tensors, penalties, draft
distributions and grammar step (a CheckedRow); `prepare_row` then applies the receiver rule
(gpu_worker/batching/receiver_rule.py), admits the request to a slot and reserves its KV, and
hands the forwards a VerifyRowWork.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.batching.prefix_cache import PREFIX_BLOCK, extend_keys, root_key
from gpu_worker.batching.receiver_rule import ReceiverVerdict, receiver_rule
from gpu_worker.batching.row_sampling import logit_bias_tensors, row_params, row_penalties
from gpu_worker.batching.slots import free_request
from gpu_worker.verifier.verifier_features import store_features
from gpu_worker.verifier.verifier_grammar import GrammarStep, row_grammar
from gpu_worker.verifier.verifier_side_channel import continue_prompt
from gpu_worker.verifier.verifier_state import Verifier, VerifierSlot, VerifyRowWork
from gpu_worker.runtime.kv_cache import CacheFullError, CacheMemoryError
from gpu_worker.sampling.rejection import proposal_to_draft_probs
from gpu_worker.sampling.sampler import Penalties, SamplingInputError, SamplingTensors
from text.tokenizer import check_in_vocabulary
from schemas.errors import ErrorCode, SpecbusError
from schemas.steps import VerifyResult, VerifyRow

# |sum - 1| allowed of a draft distribution: float16 probs round each value by at most 2**-11
# relative (4.9e-4 in the sum), float32 softmax sums are off by ~1e-6.
PROBS_SUM_TOLERANCE = 1e-3


def invalid(message: str, field_name: str) -> SpecbusError:
    return SpecbusError(ErrorCode.invalid_field, message, field_name)


def check_fields(verifier: Verifier, row: VerifyRow, verdict: ReceiverVerdict, prefix: str) -> None:
    """Everything about a row that can be wrong before touching any state; SpecbusError naming
    the field (prefix is "rows[i]"). verdict: the receiver rule's on the row (its room)."""
    V = verifier.vocab_size
    num_new, num_draft = len(row.new_token_ids), len(row.draft_token_ids)
    check_in_vocabulary(row.new_token_ids, V, f"{prefix}.new_token_ids")
    check_in_vocabulary(row.draft_token_ids, V, f"{prefix}.draft_token_ids")
    check_in_vocabulary(row.logprobs.logprob_token_ids, V, f"{prefix}.logprobs.logprob_token_ids")
    if row.sampling.logit_bias is not None:
        check_in_vocabulary(row.sampling.logit_bias.token_ids, V, f"{prefix}.sampling.logit_bias")
    if row.emit and num_new == 0:
        raise invalid("an emitting row needs at least one new token (the last one emitted)",
                      f"{prefix}.new_token_ids")
    if not row.emit and num_draft:
        raise invalid("a row with emit=False carries no drafts", f"{prefix}.draft_token_ids")
    if row.parents is not None:
        check_tree_row(row, prefix)
    if num_draft > verdict.room:
        raise invalid(f"cached_len {row.cached_len} + {num_new} new + {num_draft} draft tokens exceed "
                      f"max_seq_len {verifier.cache.max_seq_len}", f"{prefix}.new_token_ids")
    proposal = row.proposal
    if proposal.kind == "sparse":
        check_in_vocabulary(proposal.ids.reshape(-1), V, f"{prefix}.proposal.ids")
    if proposal.kind == "dense" and proposal.draft_vocab_size != V:
        raise invalid(f"a dense proposal over {proposal.draft_vocab_size} draft ids needs a d2t map; this "
                      f"verifier takes dense proposals over the target vocabulary ({V}) only",
                      f"{prefix}.proposal.draft_vocab_size")


def check_tree_row(row: VerifyRow, prefix: str) -> None:
    """A tree of drafts is verified on a decode step (gpu_worker/verifier/verifier_trees.py): an
    emitting row whose one new token is the root, without structured outputs (a grammar's masks
    follow one path)."""
    if not row.emit:
        raise invalid("a row with emit=False carries no tree of drafts", f"{prefix}.parents")
    if len(row.new_token_ids) != 1:
        raise invalid(f"a tree of drafts is verified on a decode step: one new token (the root, the last emitted "
                      f"token), got {len(row.new_token_ids)}", f"{prefix}.new_token_ids")
    if row.sampling.structured_outputs is not None:
        raise invalid("structured outputs follow a chain of drafts, not a tree", f"{prefix}.parents")


def sampling_params(verifier: Verifier, row: VerifyRow, prefix: str) -> SamplingTensors:
    """The row's sampling tensors; a value the kernels refuse fails this row, naming the field."""
    try:
        return row_params(row.sampling, verifier.model.embed.device)
    except SamplingInputError as exc:
        raise invalid(exc.message, f"{prefix}.sampling.{exc.field}") from None


def history_penalties(verifier: Verifier, row: VerifyRow, state: VerifierSlot | None, prefix: str) -> Penalties:
    """The row's logit_bias and penalties over its history before the first verify position:
    the first cached_len ids the slot holds, then new_token_ids. A value the kernels refuse
    fails this row, naming its field."""
    held = array("i") if state is None else state.token_ids[:row.cached_len]  # a copy: the slot's stays resizable
    history = torch.from_numpy(np.concatenate([np.frombuffer(held, dtype=np.int32), row.new_token_ids])
                               .astype(np.int64))
    bias_ids, bias_values = logit_bias_tensors(row.sampling)
    try:
        return row_penalties(row.sampling, verifier.vocab_size, history, row.prompt_len, bias_ids, bias_values,
                             device=verifier.model.embed.device)
    except SamplingInputError as exc:
        raise invalid(exc.message, f"{prefix}.sampling.{exc.field}") from None


def decode_proposal(verifier: Verifier, row: VerifyRow, prefix: str) -> torch.Tensor | None:
    """The row's draft_probs (k, V) in target space; None for a point mass or a greedy row.
    Each draft distribution must sum to 1 within PROBS_SUM_TOLERANCE: the rejection sampler's
    output has the target's law only if p_i is the law d_i was drawn from."""
    proposal = row.proposal
    if row.sampling.greedy or proposal.kind == "point_mass" or not len(row.draft_token_ids):
        return None
    sums = proposal.probs.sum(axis=1, dtype=np.float64)
    off = np.abs(sums - 1.0) > PROBS_SUM_TOLERANCE
    if off.any():
        position = int(np.argmax(off))
        raise invalid(f"the draft distribution at position {position} sums to {sums[position]:.6g}, not 1 "
                      f"(tolerance {PROBS_SUM_TOLERANCE})", f"{prefix}.proposal.probs")
    device = verifier.model.embed.device
    draft_ids = torch.from_numpy(row.draft_token_ids).long().to(device)[None]  # (1, k)
    if proposal.kind == "sparse":
        arrays = dict(sparse_ids=torch.from_numpy(proposal.ids).long().to(device)[None],
                      sparse_probs=torch.from_numpy(proposal.probs).float().to(device)[None])
    else:
        arrays = dict(dense_probs=torch.from_numpy(proposal.probs).float().to(device)[None])
    try:
        return proposal_to_draft_probs(proposal.kind, draft_ids, verifier.vocab_size, **arrays)[0]
    except SamplingInputError as exc:
        raise invalid(f"{exc.field}: {exc.message}", f"{prefix}.proposal") from None


def output_before(row: VerifyRow, state: VerifierSlot | None) -> list[int]:
    """The row's output tokens before its first verified position: the slot's first cached_len
    ids, then new_token_ids, from prompt_len on."""
    start = min(row.prompt_len, row.cached_len)  # the prompt's held ids are not listed
    held = [] if state is None else state.token_ids[start:row.cached_len].tolist()
    return (held + row.new_token_ids.tolist())[row.prompt_len - start:]


def point_mass_after(draft_probs: torch.Tensor | None, kept: int, forced: list[int],
                     vocab_size: int) -> torch.Tensor | None:
    """The laws of the kept drafts, draft_probs[:kept] of (k, V) (a Gumbel-coupled row's grammar
    may replace the rest), followed by the one-hot laws of the forced tokens (point-mass drafts);
    None stays None (the sampler then takes every draft as a point mass)."""
    if draft_probs is None:
        return None
    draft_probs = draft_probs[:kept]
    if not forced:
        return draft_probs
    one_hot = torch.zeros(len(forced), vocab_size, dtype=draft_probs.dtype, device=draft_probs.device)
    one_hot[torch.arange(len(forced)), torch.tensor(forced)] = 1.0
    return torch.cat([draft_probs, one_hot])


@dataclass
class CheckedRow:
    """A row past the check stage (`check_row`), nothing changed yet: its prefix ("rows[i]") in
    its request, key (scheduler_id, request_id), the slot state it has (None: a new request),
    the receiver rule's verdict, and what the kernels will take: draft_probs (k, V) or None,
    params, penalties, the grammar's step (None: no structured outputs, or a resync)."""

    row: VerifyRow
    prefix: str
    key: tuple[str, str]
    state: VerifierSlot | None
    verdict: ReceiverVerdict
    draft_probs: torch.Tensor | None
    params: SamplingTensors
    penalties: Penalties | None
    grammar: GrammarStep | None


def check_row(verifier: Verifier, scheduler_id: str, index: int, row: VerifyRow) -> CheckedRow:
    """Stage 1: everything about the row that can be wrong, before any state changes (a value the
    kernels refuse fails this row alone, naming its field; a row that then answers need_resync
    just wastes the work). The grammar's matcher, if the slot has one, is brought to the output."""
    prefix = f"rows[{index}]"
    key = (scheduler_id, row.request_id)
    state = verifier.requests.get(key)
    held = 0 if state is None else int(verifier.cache.lengths[state.slot])
    verdict = receiver_rule(held, row.cached_len, len(row.new_token_ids), verifier.cache.max_seq_len)
    check_fields(verifier, row, verdict, prefix)
    draft_probs = decode_proposal(verifier, row, prefix)
    params = sampling_params(verifier, row, prefix)
    penalties = history_penalties(verifier, row, state, prefix) if row.emit and row.sampling.penalties_on else None
    grammar = None
    if row.emit and row.sampling.structured_outputs is not None and not verdict.need_resync:
        grammar = row_grammar(verifier, row, None if state is None else state.grammar, output_before(row, state),
                              prefix, max(0, min(row.max_forced, verdict.room - len(row.draft_token_ids))),
                              replace=draft_probs is None or row.sampling.gumbel)
    return CheckedRow(row, prefix, key, state, verdict, draft_probs, params, penalties, grammar)


def prepare_row(verifier: Verifier, checked: CheckedRow, now: float) -> VerifyRowWork | VerifyResult:
    """Stage 2: the row's slot (the receiver rule, admission, KV room, its ids) and its
    VerifyRowWork for the forwards; a need_resync row's final VerifyResult instead."""
    row, key, state, verdict, grammar = checked.row, checked.key, checked.state, checked.verdict, checked.grammar
    drafts = row.draft_token_ids if grammar is None else row.draft_token_ids[:grammar.kept]
    forced = [] if grammar is None else grammar.forced
    length = row.cached_len + len(row.new_token_ids) + len(drafts) + len(forced)
    if state is not None:
        state.last_used = now
    if verdict.need_resync:
        verifier.counters["need_resync"] += 1
        return VerifyResult(request_id=row.request_id, step=row.step, need_resync=True)
    if state is None:
        state = admit(verifier, key, row, length, now)
    state.grammar = None if grammar is None else grammar.matcher
    try:  # growth: the request ends `overloaded` (its slot freed) when the budget is spent
        verifier.cache.reserve(state.slot, length)
    except CacheMemoryError as exc:
        free_request(verifier, key, "memory")
        raise SpecbusError(ErrorCode.overloaded, str(exc)) from None
    verifier.cache.truncate(state.slot, row.cached_len)
    # the same for the ids: the drafts are dropped again in commit_row (verifier_core.py) unless accepted
    tokens_np = np.concatenate([row.new_token_ids, drafts, np.array(forced, dtype=np.int32)]).astype(np.int32)
    del state.token_ids[row.cached_len:]
    state.token_ids.frombytes(tokens_np.tobytes())
    tokens = torch.from_numpy(tokens_np).long()
    num_new = len(row.new_token_ids)
    wants_prompt = row.logprobs.prompt_logprobs is not None and row.postprocessor_id is not None
    num_prompt = max(0, min(row.prompt_len - 1 - row.cached_len, num_new)) if wants_prompt else 0
    work = VerifyRowWork(row=row, state=state, tokens=tokens, start=row.cached_len, num_new=num_new,
                         num_draft=len(drafts) + len(forced), num_prompt=num_prompt,
                         params=checked.params,
                         draft_probs=point_mass_after(checked.draft_probs, len(drafts), forced, verifier.vocab_size),
                         penalties=checked.penalties, allowed=None if grammar is None else grammar.allowed,
                         num_forced=len(forced), num_replaced=len(row.draft_token_ids) - len(drafts),
                         parents=None if row.parents is None else torch.from_numpy(row.parents).long())
    if wants_prompt and row.cached_len < row.prompt_len:
        continue_prompt(verifier, work)
    take_hit(verifier, work)
    return work


def take_hit(verifier: Verifier, work: VerifyRowWork) -> None:
    """Copy into the row's slot the longest cached prefix of its history that ends inside its
    new tokens, up to its first position whose logits it wants (gpu_worker/batching/prefix_cache.py);
    the forwards then start after it (work.fed)."""
    state = work.state
    if verifier.prefix is None or state.prefix_root is None:
        return
    del state.block_keys[work.start // PREFIX_BLOCK:]  # blocks from here on may hold other tokens now
    limit = work.start + min(work.wanted, default=work.num_new)
    extend_keys(state.block_keys, state.prefix_root, state.token_ids, work.start + work.num_new)
    if limit <= work.start:  # a decode row, or one that wants its logits from the start
        return
    verifier.counters["prefix_tokens_looked_up"] += limit - work.start
    found = verifier.prefix.find(state.block_keys, state.token_ids, work.start, limit)
    if found is None:
        return
    entry, end = found
    verifier.cache.copy_prefix(state.slot, entry.keys, entry.values, end)
    if entry.features is not None:
        store_features(state, work.start, entry.features[work.start:end], verifier.cache)
    work.cached = work.fed = end - work.start
    verifier.counters["prefix_tokens_hit"] += work.cached


def admit(verifier: Verifier, key: tuple[str, str], row: VerifyRow, length: int, now: float) -> VerifierSlot:
    """A slot for a new request (key: (scheduler_id, request_id)) with room for its whole
    prompt, which the next steps feed: `no_capacity` with every slot taken, `overloaded` when
    the KV memory budget cannot hold it."""
    try:
        slot = verifier.cache.allocate(min(max(length, row.prompt_len), verifier.cache.max_seq_len))
    except CacheFullError as exc:
        raise SpecbusError(ErrorCode.no_capacity, str(exc)) from None
    except CacheMemoryError as exc:
        verifier.counters["refused_memory"] += 1
        raise SpecbusError(ErrorCode.overloaded, str(exc)) from None
    state = VerifierSlot(slot=slot, last_used=now)
    if verifier.prefix is not None and row.cache_salt is not None:
        state.prefix_root = root_key(verifier.model_ids["target"], verifier.cache.dtype, verifier.weights,
                                     row.cache_salt)
    verifier.requests[key] = state
    return state
