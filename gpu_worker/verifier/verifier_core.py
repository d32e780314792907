"""The verifier's step, NATS-free: one VerifyRequest against the target model and its KV cache.

`load_verifier(config) -> Verifier`; `verify_batch(verifier, request) -> (VerifyResponse,
[(postprocessor_id, SideChannelRecord)])`. In order (docs/PROTOCOL.md#receiver-rule-and-resync),
each step in the module that does it:

1. free the slots `request.release` names (idle slots: gpu_worker/batching/slots.py `evict_idle`, called
   by the service);
2. per row (gpu_worker/verifier/verifier_rows.py `prepare_row`): a row with the (request_id, step) of
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

import structlog

from gpu_worker.batching.prefix_cache import PrefixCache
from gpu_worker.batching.slots import load_model_and_cache, release, resolve_weights
from gpu_worker.verifier.verifier_drafts import verify_each
from gpu_worker.verifier.verifier_features import FEATURE_BYTES, feature_block
from gpu_worker.verifier.verifier_forwards import run_forwards
from gpu_worker.verifier.verifier_rows import prepare_row
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


def finish_row(verifier: Verifier, work: VerifyRowWork, batch_id: int,
               verified: Verified | None) -> tuple[VerifyResult, SideRecord | None]:
    """Trim the slot, store the prompt logprobs so far, build the result and side record."""
    row, state = work.row, work.state
    committed = work.start + work.num_new + (verified.num_accepted if verified is not None else 0)
    if verified is not None and verified.accepted_nodes is not None:
        keep_tree_path(verifier, work, verified)
    verifier.cache.truncate(state.slot, committed)
    del state.token_ids[committed:]
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
    features = feature_block(verifier, state, row.features_from, committed)
    if verified is None:
        return VerifyResult(request_id=row.request_id, step=row.step, features=features,
                            cached_tokens=work.cached), record
    verifier.counters["tokens_emitted"] += len(verified.token_ids)
    verifier.counters["drafts_proposed"] += work.num_draft
    verifier.counters["drafts_accepted"] += verified.num_accepted
    verifier.counters["residual_fallbacks"] += verified.residual_fallback
    return VerifyResult(request_id=row.request_id, step=row.step, token_ids=verified.token_ids.numpy(),
                        num_draft=work.num_draft - work.num_forced + work.num_replaced, num_forced=work.num_forced,
                        num_replaced=work.num_replaced,
                        num_accepted=verified.num_accepted,
                        residual_fallback=verified.residual_fallback, features=features,
                        cached_tokens=work.cached), record


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
        state = verifier.requests.get((request.scheduler_id, row.request_id))
        if state is not None and state.step == row.step and state.result is not None:
            verifier.counters["retries_answered"] += 1
            state.last_used = now
            results[row.request_id] = state.result
            records.extend([state.record] if state.record is not None else [])
            continue
        try:
            prepared = prepare_row(verifier, request.scheduler_id, index, row, now)
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
    run_forwards(verifier, chains)
    run_trees(verifier, trees)
    verified: dict[str, Verified | None] = {}
    for group in (chains, trees):
        emitting = [w for w in group if w.error is None and w.row.emit]
        verified.update(zip((w.row.request_id for w in emitting), verify_each(verifier, emitting) if emitting else []))
    for work in works:
        row = work.row
        if work.error is None:
            try:
                result, record = finish_row(verifier, work, request.batch_id, verified.get(row.request_id))
            except Exception as exc:
                log.exception("verify_finish_failed", request_id=row.request_id)
                work.error = Error.from_exception(exc, row.request_id)
        if work.error is not None:
            # the new tokens may be in the slot; the scheduler's next cached_len truncates them away
            results[row.request_id] = failed_result(verifier, row, work.error)
            continue
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
