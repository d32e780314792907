"""The verifier's step, NATS-free: one VerifyRequest against the target model and its KV cache.

`load_verifier(config) -> Verifier`; `verify_batch(verifier, request) -> (VerifyResponse,
[(postprocessor_id, SideChannelRecord)])`. A row passes each stage once, in order: check
(`check_row`, nothing changes), prepare (`prepare_row`), forward, accept (`verify_each`, then
`commit_row`), side record (`record_row`), result (`row_result`). In order
(docs/PROTOCOL.md#receiver-rule-and-resync), each step in the module that does it:

1. free the slots `request.release` names (idle slots: gpu_worker/batching/slots.py `evict_idle`, called
   by the service);
2. per row (gpu_worker/verifier/verifier_rows.py `check_row`, `prepare_row`): a row with the (request_id, step) of
   the stored answer is a retry and gets that answer and side record again. Otherwise the row is
   checked (token ids inside the vocabulary, proposal, room in the slot) and the receiver rule
   applied (gpu_worker/batching/receiver_rule.py): an unknown request with cached_len > 0, or a slot
   holding fewer than cached_len tokens, answers need_resync; else the slot is truncated to
   cached_len. KV memory (gpu_worker/runtime/kv_cache.py): a new request is admitted with room for
   its prompt, a running one grows as it needs; either failing is an `overloaded` row error (a
   running request's slot is then freed). A row that fails gets its own `error`; the other rows
   go on;
   Then the prefix cache (gpu_worker/batching/prefix_cache.py) gives what it holds of the row's new
   tokens, copied into its slot (`take_hit`; the result's cached_tokens), and released slots are
   kept there;
3. feed new_token_ids (those the prefix cache did not give) then the draft tokens through the target, in chunks of prefill_chunk
   tokens (gpu_worker/verifier/verifier_forwards.py `run_forwards`). Chunks of similar length share
   one padded forward; a short decode chunk never pads up to a long prefill chunk: a forward's
   cost is a fixed part per call plus a part per token, so beyond FREE_PADDING_TOKENS the padding
   costs more than another call (see ops/bench/RESULTS.md, Figures behind gpu_worker's choices).
   `logits_index` asks only for the positions needed: the last k+1 (last new token, each draft)
   of emitting rows, and prompt positions when prompt logprobs are asked. Tree rows (a decode
   step whose drafts have `parents`: the root, its one new token, then the nodes) go through
   `tree_forward` instead, rows of similar size together (gpu_worker/verifier/verifier_trees.py
   `run_trees`): every column's logits and hidden states those of decoding its path;
4. emitting rows, batched (gpu_worker/verifier/verifier_drafts.py `verify_each`): logit_bias and
   penalties (`penalise`: verified position t counts the request's output then drafts 0..t-1,
   the history the target's distribution there is conditioned on; the output comes from the
   tokens the slot holds, which the receiver rule keeps equal to the scheduler's history, so a
   resync or a migration rebuilds it with the cache), target distributions and samples (`sample`,
   row params, uniforms STREAM_TARGET at the absolute position each sampled token would occupy)
   and acceptance by the row's law, all in gpu_worker/sampling/acceptance.py `accept`, then the
   slot is trimmed to cached_len + len(new) + num_accepted: the last emitted token is not in the
   cache yet. Tree rows, batched apart, the same with each column's penalties over the output
   then its path and draws at the node's position (root + depth); `keep_tree_path`
   (verifier_trees.py) then keeps the root and the accepted path (K/V, ids, features) and drops
   the other nodes;
5. logprobs of the emitted tokens (with the K the sampler used), prompt logprobs (the logprob
   of prompt token j given tokens < j, for j = 1..prompt_len-1, computed chunk by chunk and
   kept in the request's state until the row that completes the prompt) and sampling masks
   become one SideChannelRecord per row that wants the side channel
   (gpu_worker/verifier/verifier_side_channel.py);
6. target features (docs/PROTOCOL.md#feature-level-drafts, gpu_worker/verifier/verifier_features.py):
   every forward also returns the final-normed hidden states of every position it computes
   (`forward(return_hidden=True)`), and each row's are kept, as bf16, in its slot's feature
   buffer (`store_features`), whether the row asked or not (a request whose drafter changes to
   an eagle one later needs the positions computed before). A row with features_from gets the
   block of positions features_from .. its committed length - 1 from the buffer
   (`feature_block`, at most MAX_FEATURE_BLOCK_BYTES: the scheduler asks the rest next step).
   Nothing else reads them: tokens and logprobs are the same with and without.

The state these steps share (`Verifier`, `VerifierSlot`, `VerifyRowWork`, `Verified`) is
gpu_worker/verifier/verifier_state.py's.
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
