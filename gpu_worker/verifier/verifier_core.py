"""The verifier's step, NATS-free: one VerifyRequest against the target model and its KV cache.

`load_verifier(config) -> Verifier`; `verify_batch(verifier, request) -> (VerifyResponse,
[(postprocessor_id, SideChannelRecord)])`. The contract:

- the slots `request.release` names are freed first; then every row gets exactly one
  VerifyResult, in order. A row that fails (a bad token id or proposal, no room in its slot, KV
  memory that cannot hold it: `overloaded`, a running request's slot then freed) gets its own
  `error`, and the other rows go on;
- a row whose (request_id, step) is the stored answer's is a retry: it gets that answer and side
  record again, and nothing runs twice;
- the receiver rule (docs/PROTOCOL.md#receiver-rule-and-resync): an unknown request with
  cached_len > 0, or a slot holding fewer than cached_len tokens, answers need_resync; else the
  slot is truncated to cached_len before the row runs;
- an emitting row's tokens follow the speculative-decoding contract
  (docs/PROTOCOL.md#speculative-decoding-contract): the target's logits at each position are the
  same whatever the batch, its chunks, the prefix cache or the drafts, greedy rows take their
  argmaxes, sampled rows the row's law with seeded draws at absolute positions; afterwards its
  slot holds cached_len + new + accepted tokens (the last emitted token is not in the cache yet);
- a row that wants the side channel gets one SideChannelRecord (logprobs, prompt logprobs,
  masks) when it emits or completes its prompt; an earlier prefill chunk keeps its prompt
  logprobs for the chunk that completes it. Every row's final-normed hidden states are kept for
  feature-level drafters (docs/PROTOCOL.md#feature-level-drafts), and nothing else reads them.

A row passes each stage once, in order, each in its own module: check (verifier_rows.py
`check_row`, nothing changes), prepare (`prepare_row`, with gpu_worker/batching/receiver_rule.py
and prefix_cache.py), forward (verifier_forwards.py `run_forwards`, tree rows verifier_trees.py
`run_trees`), accept (verifier_drafts.py `verify_each` through gpu_worker/sampling/acceptance.py
`accept`, then `commit_row`), side record (`record_row`, verifier_side_channel.py, features
verifier_features.py) and result (`row_result`). The state they share (`Verifier`, `VerifierSlot`,
`VerifyRowWork`, `Verified`) is gpu_worker/verifier/verifier_state.py's.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

import structlog

from gpu_worker.batching.prefix_cache import PrefixCache
from gpu_worker.batching.slots import load_model_and_cache, release, resolve_weights
from gpu_worker.verifier.verifier_drafts import verify_each
from gpu_worker.verifier.verifier_features import FEATURE_BYTES, feature_block
from gpu_worker.verifier.verifier_forwards import run_forwards
from gpu_worker.verifier.verifier_rows import check_row, prepare_row
from gpu_worker.verifier.verifier_side_channel import concat_arrays, side_record
from gpu_worker.verifier.verifier_state import SideRecord, Verified, Verifier, VerifyRowWork
from gpu_worker.verifier.verifier_trees import keep_tree_path, run_trees
from gpu_worker.runtime.checkpoint import model_id
from text.tokenizer import tokenizer_id
from schemas.config import VerifierConfig
from schemas.errors import SpecbusError
from schemas.steps import VerifyRequest, VerifyResponse, VerifyResult, VerifyRow
from schemas.bus.wire import Error

__all__ = ["SideRecord", "Verifier", "load_verifier", "verify_batch"]

log = structlog.get_logger(__name__)
T = TypeVar("T")


def load_verifier(config: VerifierConfig) -> Verifier:
    """Load the target model (device/dtype from config) and allocate its KV cache."""
    model, cache = load_model_and_cache(config.target_model, config, side_bytes_per_value=FEATURE_BYTES)
    weights = resolve_weights(config.weights, config.target_model, cache.dtype, config.device, config.dtype)
    # max_seq_len: schedulers cap max_tokens and refuse prompts by the smallest one they hear of;
    # hidden_size: they size the feature blocks they ask for by it (2 bytes a value)
    model_ids = {"target": model_id(config.target_model), "tokenizer": tokenizer_id(config.target_model),
                 "max_seq_len": str(config.max_seq_len), "hidden_size": str(model.config.hidden_size),
                 "weights": weights}  # which model of the target it computes (/v1/models, `specbus up`)
    verifier = Verifier(instance_id=config.instance_id, model=model, cache=cache, model_ids=model_ids,
                        prefill_chunk=config.prefill_chunk, slot_idle_ttl_s=config.slot_idle_ttl_s, weights=weights,
                        tokenizer_dir=config.target_model)
    if config.prefix_caching:
        verifier.prefix = PrefixCache(cache, verifier.counters)
        # schedulers plan a new request's first chunk by what they expect it to hold (prefix_hints.py)
        model_ids["prefix_caching"] = "on"
    return verifier


def committed_length(work: VerifyRowWork, verified: Verified | None) -> int:
    """What the row's slot holds after this step: its new tokens and the accepted drafts (the
    last emitted token is not in the cache yet)."""
    return work.start + work.num_new + (verified.num_accepted if verified is not None else 0)


def commit_row(verifier: Verifier, work: VerifyRowWork, verified: Verified | None) -> None:
    """The accept stage's end: the slot keeps the new tokens and the accepted drafts (a tree row
    its accepted path), K/V and ids, and drops the rest."""
    state, committed = work.state, committed_length(work, verified)
    if verified is not None and verified.accepted_nodes is not None:
        keep_tree_path(verifier, work, verified)
    verifier.cache.truncate(state.slot, committed)
    del state.token_ids[committed:]


def record_row(verifier: Verifier, work: VerifyRowWork, batch_id: int, verified: Verified | None) -> SideRecord | None:
    """The side record stage: the prompt logprobs so far kept in the slot (published, then
    dropped, with the step that completes the prompt) and the row's SideChannelRecord, if it
    wants one."""
    row, state = work.row, work.state
    prompt = concat_arrays(work.prompt_pieces) if work.prompt_pieces else None
    state.prompt_logprobs, state.prompt_offset = prompt, work.prompt_offset
    state.prompt_logits = work.next_prompt_logits
    record = None
    wants_side = row.logprobs.wants_side_channel and row.postprocessor_id is not None
    if wants_side and (verified is not None or work.completes_prompt):
        published = prompt if work.completes_prompt else None
        record = (row.postprocessor_id, side_record(verifier, work, batch_id, verified, published, work.prompt_offset))
    if work.completes_prompt:
        state.prompt_logprobs, state.prompt_logits = None, None
    return record


def row_result(verifier: Verifier, work: VerifyRowWork, verified: Verified | None) -> VerifyResult:
    """The result stage: the row's VerifyResult, with the features it asked for."""
    row = work.row
    features = feature_block(verifier, work.state, row.features_from, committed_length(work, verified))
    if verified is None:
        return VerifyResult(request_id=row.request_id, step=row.step, features=features, cached_tokens=work.cached)
    verifier.counters["tokens_emitted"] += len(verified.token_ids)
    verifier.counters["drafts_proposed"] += work.num_draft
    verifier.counters["drafts_accepted"] += verified.num_accepted
    verifier.counters["residual_fallbacks"] += verified.residual_fallback
    return VerifyResult(request_id=row.request_id, step=row.step, token_ids=verified.token_ids.numpy(),
                        num_draft=work.num_draft - work.num_forced + work.num_replaced, num_forced=work.num_forced,
                        num_replaced=work.num_replaced,
                        num_accepted=verified.num_accepted,
                        residual_fallback=verified.residual_fallback, features=features,
                        cached_tokens=work.cached)


def each_row(works: list[VerifyRowWork], stage: Callable[[VerifyRowWork], T]) -> dict[str, T]:
    """stage(work) for every row not failed yet, keyed by request_id; a row it raises on fails
    alone (work.error) and skips the stages after."""
    out = {}
    for work in works:
        if work.error is None:
            try:
                out[work.row.request_id] = stage(work)
            except Exception as exc:
                log.exception("verify_finish_failed", request_id=work.row.request_id)
                work.error = Error.from_exception(exc, work.row.request_id)
    return out


def stored_answer(verifier: Verifier, scheduler_id: str, row: VerifyRow,
                  now: float) -> tuple[VerifyResult, SideRecord | None] | None:
    """A retry (the (request_id, step) of the slot's stored answer) gets that answer and side
    record again; None for any other row."""
    state = verifier.requests.get((scheduler_id, row.request_id))
    if state is None or state.step != row.step or state.result is None:
        return None
    verifier.counters["retries_answered"] += 1
    state.last_used = now
    return state.result, state.record


def failed_result(verifier: Verifier, row: VerifyRow, error: Error) -> VerifyResult:
    verifier.counters["rows_failed"] += 1
    return VerifyResult(request_id=row.request_id, step=row.step, error=error)


def verify_batch(verifier: Verifier, request: VerifyRequest,
                 now: float | None = None) -> tuple[VerifyResponse, list[SideRecord]]:
    """One VerifyRequest (see the module docstring); results keyed by request_id, in the
    request's row order. now: time.monotonic() (for tests)."""
    now = time.monotonic() if now is None else now
    release(verifier, [(request.scheduler_id, request_id) for request_id in request.release])
    results: dict[str, VerifyResult] = {}
    records: list[SideRecord] = []
    works: list[VerifyRowWork] = []
    for index, row in enumerate(request.rows):
        stored = stored_answer(verifier, request.scheduler_id, row, now)
        if stored is not None:
            results[row.request_id] = stored[0]
            records.extend([stored[1]] if stored[1] is not None else [])
            continue
        try:  # stages 1 and 2: check (nothing changes), then prepare (the slot)
            prepared = prepare_row(verifier, check_row(verifier, request.scheduler_id, index, row), now)
        except Exception as exc:  # the row's failure is its own: the batch's other rows go on
            if not isinstance(exc, SpecbusError):  # our bug: logged once, with the row's request id
                log.exception("verify_row_crashed", request_id=row.request_id)
            results[row.request_id] = failed_result(verifier, row, Error.from_exception(exc, row.request_id))
            continue
        if isinstance(prepared, VerifyResult):
            results[row.request_id] = prepared
        else:
            works.append(prepared)

    chains, trees = [w for w in works if w.parents is None], [w for w in works if w.parents is not None]
    run_forwards(verifier, chains)  # stage 3: forward
    run_trees(verifier, trees)
    verified: dict[str, Verified | None] = {}
    for group in (chains, trees):  # stage 4: accept, then the slot keeps what was accepted
        emitting = [w for w in group if w.error is None and w.row.emit]
        verified.update(zip((w.row.request_id for w in emitting), verify_each(verifier, emitting) if emitting else []))
    each_row(works, lambda w: commit_row(verifier, w, verified.get(w.row.request_id)))
    side = each_row(works, lambda w: record_row(verifier, w, request.batch_id,  # stage 5: side record
                                                verified.get(w.row.request_id)))
    done = each_row(works, lambda w: row_result(verifier, w, verified.get(w.row.request_id)))  # stage 6: result
    for work in works:
        row = work.row
        if work.error is not None:
            # the new tokens may be in the slot; the scheduler's next cached_len truncates them away
            results[row.request_id] = failed_result(verifier, row, work.error)
            continue
        result, record = done[row.request_id], side[row.request_id]
        work.state.step, work.state.result, work.state.record = row.step, result, record
        results[row.request_id] = result
        records.extend([record] if record is not None else [])

    errors = [r.error for r in results.values() if r.error is not None]
    if errors:  # one line per batch, however many rows failed
        log.warning("verify_rows_failed", count=len(errors), request_id=errors[0].request_id,
                    code=errors[0].code.value, field=errors[0].field, error=errors[0].message)
    verifier.counters["batches"] += 1
    verifier.counters["rows"] += len(request.rows)
    response = VerifyResponse(batch_id=request.batch_id, verifier_id=verifier.instance_id,
                              rows=[results[row.request_id] for row in request.rows])
    return response, records
