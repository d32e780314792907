"""The verifier's step, NATS-free: one VerifyRequest against the target model and its KV cache.

`load_verifier(config) -> Verifier`; `verify_batch(verifier, request) -> (VerifyResponse,
[(postprocessor_id, SideChannelRecord)])`. In order (docs/PROTOCOL.md#receiver-rule-and-resync):

1. free the slots `request.release` names (idle slots: gpu_worker/roles/slots.py `evict_idle`, called
   by the service);
2. per row: a row with the (request_id, step) of the stored answer is a retry and gets that
   answer and side record again. Otherwise the row is checked (token ids inside the
   vocabulary, proposal, room in the slot) and the receiver rule applied: an unknown request
   with cached_len > 0, or a slot holding fewer than cached_len tokens, answers need_resync;
   else the slot is truncated to cached_len. KV memory (gpu_worker/runtime/kv_cache.py): a new request
   is admitted with room for its prompt, a running one grows as it needs; either failing is an
   `overloaded` row error (a running request's slot is then freed). A row that fails gets its
   own `error`; the other rows go on;
3. feed new_token_ids then the draft tokens through the target, in chunks of prefill_chunk
   tokens. Chunks of similar length share one padded forward; a short decode chunk never pads
   up to a long prefill chunk: on this CPU a forward costs ~7-20 ms per call plus ~0.7 ms per
   token (10-layer target), so one padded forward of a 5-token row next to a 200-token row
   (~160 ms more padding) loses to two forwards (one more call). `logits_index` asks only
   for the positions needed: the last k+1 (last new token, each draft) of emitting rows, and
   prompt positions when prompt logprobs are asked;
4. emitting rows, batched: logit_bias and penalties (`penalise`: verified position t counts
   the request's output then drafts 0..t-1, the history the target's distribution there is
   conditioned on; the output comes from the tokens the slot holds, which the receiver rule
   keeps equal to the scheduler's history, so a resync or a migration rebuilds it with the
   cache), target distributions and samples (`sample`, row params, uniforms
   STREAM_TARGET at the absolute position each sampled token would occupy), proposal ->
   draft_probs, `rejection_sample` (STREAM_ACCEPT / STREAM_RESIDUAL at the draft positions;
   greedy rows take the argmax path and use no uniform; a batch of greedy rows computes
   nothing but the argmaxes), then the slot is trimmed to
   cached_len + len(new) + num_accepted: the last emitted token is not in the cache yet;
5. logprobs of the emitted tokens (with the K the sampler used), prompt logprobs (the logprob
   of prompt token j given tokens < j, for j = 1..prompt_len-1, computed chunk by chunk and
   kept in the request's state until the row that completes the prompt) and sampling masks
   become one SideChannelRecord per row that wants the side channel;
6. target features (docs/PROTOCOL.md#feature-level-drafts): every forward also returns the
   final-normed hidden states of every position it computes (`forward(return_hidden=True)`), and
   each row's are kept, as bf16, in its slot's feature buffer (`store_features`), whether the row
   asked or not (a request whose drafter changes to an eagle one later needs the positions
   computed before). A row with features_from gets the block of positions features_from .. its
   committed length - 1 from the buffer (`feature_block`, at most MAX_FEATURE_BLOCK_BYTES: the
   scheduler asks the rest next step). Nothing else reads them: tokens and logprobs are the
   same with and without.

Logprob values follow LogprobArrays: raw mode = log_softmax(logits) of the model's logits;
processed mode = log_softmax(logits / T) of the penalised logits with logz_k, the reader
subtracting logz_k (ids outside K are -inf). Prompt logprobs score the prompt without logit_bias
or penalties: those shape what is generated.
"""

from __future__ import annotations

import bisect
import functools
import time
from array import array
from dataclasses import dataclass, field

import numpy as np
import structlog
import torch

from gpu_worker.runtime.checkpoint import model_id
from gpu_worker.sampling.coupling import gumbel_argmax
from gpu_worker.runtime.eagle import pack_features
from gpu_worker.runtime.kv_cache import CacheFullError, CacheMemoryError, KVCache
from gpu_worker.sampling.logprobs import TokenLogprobs, gather_logprobs
from gpu_worker.runtime.model import Model, forward
from gpu_worker.sampling.rejection import RejectionResult, greedy_accepted, proposal_to_draft_probs, rejection_sample
from gpu_worker.sampling.sampler import (STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_TARGET, Penalties, ProcessedLogits,
                                 SamplingInputError, SamplingTensors, check, make_uniforms, penalise, row_seed,
                                 sample)
from gpu_worker.roles.slots import SlotOwner, free_request, load_model_and_cache, release
from text.tokenizer import check_in_vocabulary, tokenizer_id
from schemas.commits import LogprobArrays, SideChannelRecord
from schemas.config import VerifierConfig
from schemas.errors import ErrorCode, SpecbusError
from schemas.generation import RowSampling
from schemas.protocol import MAX_FEATURE_BLOCK_BYTES
from schemas.steps import FeatureBlock, VerifyRequest, VerifyResponse, VerifyResult, VerifyRow
from schemas.streams import SamplingMask
from schemas.wire import Error

log = structlog.get_logger(__name__)

# Chunks share a padded forward while the padding stays under this many tokens plus a quarter
# of the real ones (see step 3 of the module docstring for the measurement behind it).
FREE_PADDING_TOKENS = 32
FEATURE_BYTES = 2  # a feature value is kept as bfloat16
# |sum - 1| allowed of a draft distribution: float16 probs round each value by at most 2**-11
# relative (4.9e-4 in the sum), float32 softmax sums are off by ~1e-6.
PROBS_SUM_TOLERANCE = 1e-3

SideRecord = tuple[str, SideChannelRecord]  # (postprocessor_id, record)


@dataclass
class VerifierSlot:
    """One request's cache slot and what the verifier remembers about it.

    token_ids: the ids the slot holds, position by position (4 bytes each, at most max_seq_len),
    from which the penalties count the output. step / result / record: the last answered step,
    for retries. prompt_logprobs covers prompt positions prompt_offset.. (the request asked for
    prompt logprobs and the prompt is not complete yet); prompt_logits (V,) are the logits at
    the last position fed, which give the logprob of the first token of the next chunk
    (position prompt_offset + n). features (capacity, E) bf16: row t is the target's feature at
    position t, valid below the slot's cache length (`store_features`).
    """

    slot: int
    last_used: float  # time.monotonic()
    token_ids: array = field(default_factory=lambda: array("i"))
    step: int | None = None
    result: VerifyResult | None = None
    record: SideRecord | None = None
    prompt_logprobs: LogprobArrays | None = None
    prompt_offset: int = 1
    prompt_logits: torch.Tensor | None = None
    features: torch.Tensor | None = None

    @property
    def prompt_end(self) -> int:
        """The first prompt position not covered yet."""
        return self.prompt_offset + (0 if self.prompt_logprobs is None else self.prompt_logprobs.n)


@dataclass(kw_only=True)
class Verifier(SlotOwner):
    model: Model
    prefill_chunk: int

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_feature_rows(self) -> int:
        """Positions of one FeatureBlock at most (MAX_FEATURE_BLOCK_BYTES of bf16)."""
        return MAX_FEATURE_BLOCK_BYTES // (FEATURE_BYTES * self.model.config.hidden_size)


@dataclass
class VerifyRowWork:
    """A row going through the model this step.

    tokens (n_new + k,) int64 CPU: new_token_ids then draft tokens; tokens[t] lands at absolute
    position start + t. Logits are wanted at offsets [0, num_prompt) (prompt logprobs) and, for
    emitting rows, [num_new - 1, num_new + num_draft) (verify positions).
    """

    row: VerifyRow
    state: VerifierSlot
    tokens: torch.Tensor
    start: int
    num_new: int
    num_draft: int
    num_prompt: int
    params: SamplingTensors  # one row
    draft_probs: torch.Tensor | None  # (k, V), None for a point mass (or a greedy row)
    penalties: Penalties | None = None  # one row, over the history before the first verify position
    fed: int = 0
    verify_logits: list[torch.Tensor] = field(default_factory=list)  # pieces of (m, V)
    prompt_pieces: list[LogprobArrays] = field(default_factory=list)  # consecutive prompt positions
    prompt_offset: int = 1  # the prompt position of prompt_pieces' first entry
    next_prompt_logits: torch.Tensor | None = None  # (V,): predict the next step's first token
    error: Error | None = None

    @property
    def wanted(self) -> list[int]:
        """Offsets whose logits this row needs, ascending (the two ranges may share one)."""
        verify = range(self.num_new - 1, self.num_new + self.num_draft) if self.row.emit else range(0)
        return sorted(set(range(self.num_prompt)) | set(verify))

    @property
    def completes_prompt(self) -> bool:
        return self.start < self.row.prompt_len <= self.start + self.num_new


# ---------------------------------------------------------------------------------------------
# loading


def load_verifier(config: VerifierConfig) -> Verifier:
    """Load the target model (device/dtype from config) and allocate its KV cache."""
    model, cache = load_model_and_cache(config.target_model, config, side_bytes_per_value=FEATURE_BYTES)
    # max_seq_len: schedulers cap max_tokens and refuse prompts by the smallest one they hear of;
    # hidden_size: they size the feature blocks they ask for by it (2 bytes a value)
    model_ids = {"target": model_id(config.target_model), "tokenizer": tokenizer_id(config.target_model),
                 "max_seq_len": str(config.max_seq_len), "hidden_size": str(model.config.hidden_size)}
    return Verifier(instance_id=config.instance_id, model=model, cache=cache, model_ids=model_ids,
                    prefill_chunk=config.prefill_chunk, slot_idle_ttl_s=config.slot_idle_ttl_s)


# ---------------------------------------------------------------------------------------------
# step 2: check rows, apply the receiver rule


def invalid(message: str, field_name: str) -> SpecbusError:
    return SpecbusError(ErrorCode.invalid_field, message, field_name)


def check_row(verifier: Verifier, row: VerifyRow, prefix: str) -> None:
    """Everything about a row that can be wrong before touching any state; SpecbusError naming
    the field (prefix is "rows[i]")."""
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
    if row.cached_len + num_new + num_draft > verifier.cache.max_seq_len:
        raise invalid(f"cached_len {row.cached_len} + {num_new} new + {num_draft} draft tokens exceed "
                      f"max_seq_len {verifier.cache.max_seq_len}", f"{prefix}.new_token_ids")
    proposal = row.proposal
    if proposal.kind == "sparse":
        check_in_vocabulary(proposal.ids.reshape(-1), V, f"{prefix}.proposal.ids")
    if proposal.kind == "dense" and proposal.draft_vocab_size != V:
        raise invalid(f"a dense proposal over {proposal.draft_vocab_size} draft ids needs a d2t map; this "
                      f"verifier takes dense proposals over the target vocabulary ({V}) only",
                      f"{prefix}.proposal.draft_vocab_size")


def row_params(row: VerifyRow, device, prefix: str) -> SamplingTensors:
    """The row's sampling tensors; a value the kernels refuse fails this row, naming the field."""
    s = row.sampling
    try:
        return params_of(s.temperature, s.top_k, s.top_p, s.min_p, device)
    except SamplingInputError as exc:
        raise invalid(exc.message, f"{prefix}.sampling.{exc.field}") from None


def row_penalties(verifier: Verifier, row: VerifyRow, state: VerifierSlot | None, prefix: str) -> Penalties:
    """The row's logit_bias and penalties over its history before the first verify position:
    the first cached_len ids the slot holds, then new_token_ids. A value the kernels refuse
    fails this row, naming its field."""
    s = row.sampling
    held = array("i") if state is None else state.token_ids[:row.cached_len]  # a copy: the slot's stays resizable
    history = torch.from_numpy(np.concatenate([np.frombuffer(held, dtype=np.int32), row.new_token_ids])
                               .astype(np.int64))
    bias = s.logit_bias
    try:
        return Penalties.build(verifier.vocab_size, history, row.prompt_len,
                               bias_ids=None if bias is None else torch.from_numpy(bias.token_ids.astype(np.int64)),
                               bias_values=None if bias is None else torch.from_numpy(bias.bias),
                               repetition=s.repetition_penalty, frequency=s.frequency_penalty,
                               presence=s.presence_penalty, device=verifier.model.embed.device)
    except SamplingInputError as exc:
        raise invalid(exc.message, f"{prefix}.sampling.{exc.field}") from None


@functools.lru_cache(maxsize=1024)
def params_of(temperature: float, top_k: int, top_p: float, min_p: float, device) -> SamplingTensors:
    """One row's SamplingTensors, built once per distinct setting: building and checking the four
    tensors costs ~0.2 ms on this CPU, per row and step otherwise. Nothing mutates them."""
    return SamplingTensors.build([temperature], [top_k], [top_p], [min_p], device=device)


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


def prepare_row(verifier: Verifier, scheduler_id: str, index: int, row: VerifyRow,
                now: float) -> VerifyRowWork | VerifyResult:
    """A VerifyRowWork for a row that goes through the model, else its final VerifyResult."""
    prefix = f"rows[{index}]"
    check_row(verifier, row, prefix)
    draft_probs = decode_proposal(verifier, row, prefix)
    params = row_params(row, verifier.model.embed.device, prefix)
    key = (scheduler_id, row.request_id)
    state = verifier.requests.get(key)
    # before any state changes, so a value the kernels refuse leaves none behind (a row that
    # then answers need_resync just wastes it)
    penalties = row_penalties(verifier, row, state, prefix) if row.emit and row.sampling.penalised else None
    length = row.cached_len + len(row.new_token_ids) + len(row.draft_token_ids)
    if state is None:
        if row.cached_len > 0:
            verifier.counters["need_resync"] += 1
            return VerifyResult(request_id=row.request_id, step=row.step, need_resync=True)
        try:  # admission: room for the whole prompt, which the next steps feed
            slot = verifier.cache.allocate(min(max(length, row.prompt_len), verifier.cache.max_seq_len))
        except CacheFullError as exc:
            raise SpecbusError(ErrorCode.no_capacity, str(exc)) from None
        except CacheMemoryError as exc:
            verifier.counters["refused_memory"] += 1
            raise SpecbusError(ErrorCode.overloaded, str(exc)) from None
        state = VerifierSlot(slot=slot, last_used=now)
        verifier.requests[key] = state
    state.last_used = now
    if int(verifier.cache.lengths[state.slot]) < row.cached_len:
        verifier.counters["need_resync"] += 1
        return VerifyResult(request_id=row.request_id, step=row.step, need_resync=True)
    try:  # growth: the request ends `overloaded` (its slot freed) when the budget is spent
        verifier.cache.reserve(state.slot, length)
    except CacheMemoryError as exc:
        free_request(verifier, key, "memory")
        raise SpecbusError(ErrorCode.overloaded, str(exc)) from None
    verifier.cache.truncate(state.slot, row.cached_len)
    # the same for the ids: the drafts are dropped again in finish_row unless accepted
    tokens_np = np.concatenate([row.new_token_ids, row.draft_token_ids]).astype(np.int32)
    del state.token_ids[row.cached_len:]
    state.token_ids.frombytes(tokens_np.tobytes())
    tokens = torch.from_numpy(tokens_np).long()
    num_new = len(row.new_token_ids)
    wants_prompt = row.logprobs.prompt_logprobs is not None and row.postprocessor_id is not None
    num_prompt = max(0, min(row.prompt_len - 1 - row.cached_len, num_new)) if wants_prompt else 0
    work = VerifyRowWork(row=row, state=state, tokens=tokens, start=row.cached_len, num_new=num_new,
                   num_draft=len(row.draft_token_ids), num_prompt=num_prompt,
                   params=params, draft_probs=draft_probs, penalties=penalties)
    if wants_prompt and row.cached_len < row.prompt_len:
        continue_prompt(verifier, work)
    return work


def continue_prompt(verifier: Verifier, work: VerifyRowWork) -> None:
    """Start this step's prompt logprobs from what the request's state holds: positions
    1..start-1 and the logits that give position `start` (the chunk went on where the last
    one stopped), or logprobs already past `start` (the slot was rewound). Otherwise the
    logprob of position `start` cannot be had any more: counted, and the record starts after it."""
    state, start, row = work.state, work.start, work.row
    if start == 0:
        return
    stored = state.prompt_logprobs
    if state.prompt_end == start and state.prompt_logits is not None:
        first_id = work.tokens[:1].to(state.prompt_logits.device)
        piece, _ = logprob_arrays(row, state.prompt_logits[None], first_id, work.params, None,
                                  row.logprobs.prompt_logprobs, with_masks=False)
        work.prompt_pieces = ([] if stored is None else [stored]) + [piece]
        work.prompt_offset = state.prompt_offset
    elif stored is not None and state.prompt_offset <= start + 1 <= state.prompt_end:
        kept = start + 1 - state.prompt_offset
        work.prompt_pieces = [slice_arrays(stored, kept)] if kept else []
        work.prompt_offset = state.prompt_offset
    else:
        verifier.counters["prompt_logprobs_lost"] += 1
        log.warning("prompt_logprob_lost", request_id=row.request_id, position=start)
        work.prompt_offset = start + 1


# ---------------------------------------------------------------------------------------------
# step 3: forwards


def pack_chunks(chunks: list[tuple[VerifyRowWork, int, int]]) -> list[list[tuple[VerifyRowWork, int, int]]]:
    """Group (work, begin, end) chunks into forwards: sorted by length, a chunk joins the
    current group while the group's padding stays within FREE_PADDING_TOKENS + real / 4."""
    groups: list[list[tuple[VerifyRowWork, int, int]]] = []
    real = 0
    for chunk in sorted(chunks, key=lambda c: c[2] - c[1]):
        length = chunk[2] - chunk[1]
        if groups:
            padded = (len(groups[-1]) + 1) * length
            if padded - (real + length) <= FREE_PADDING_TOKENS + (real + length) // 4:
                groups[-1].append(chunk)
                real += length
                continue
        groups.append([chunk])
        real = length
    return groups


def forward_group(verifier: Verifier, group: list[tuple[VerifyRowWork, int, int]]) -> None:
    """One padded forward of the chunks in group; hands each row the logits it wants."""
    device = verifier.model.embed.device
    T = max(end - begin for _, begin, end in group)
    token_ids = torch.zeros(len(group), T, dtype=torch.long)
    wanted = []
    for b, (work, begin, end) in enumerate(group):
        token_ids[b, :end - begin] = work.tokens[begin:end]
        wanted.append([o - begin for o in work.wanted if begin <= o < end])
    M = max(map(len, wanted))
    # rows wanting fewer positions repeat their last one (or 0); the extra logits are dropped
    logits_index = torch.tensor([w + [w[-1] if w else 0] * (M - len(w)) for w in wanted], dtype=torch.long)
    slots = torch.tensor([work.state.slot for work, _, _ in group], dtype=torch.long)
    num_new = torch.tensor([end - begin for _, begin, end in group], dtype=torch.long)
    logits, hidden = forward(verifier.model, verifier.cache, slots, token_ids.to(device), num_new, logits_index,
                             return_hidden=True)  # (B, M, V), (B, T, E)
    for b, (work, begin, end) in enumerate(group):
        offsets = [begin + o for o in wanted[b]]
        take_logits(verifier, work, offsets, logits[b, :len(offsets)])
        store_features(work.state, work.start + begin, hidden[b, :end - begin], verifier.cache)
        work.fed = end


def store_features(state: VerifierSlot, start: int, hidden: torch.Tensor, cache: KVCache) -> None:
    """Keep hidden (n, E), the target's features at positions start..start+n-1, in the slot's
    bf16 buffer, which grows as the slot's cache does (`cache.capacity_for`: the cache's memory
    budget pays for these rows, `load_verifier`)."""
    end, E = start + hidden.shape[0], hidden.shape[1]
    buffer = state.features
    if buffer is None or buffer.shape[0] < end:
        grown = hidden.new_empty((cache.capacity_for(end), E), dtype=torch.bfloat16)
        if buffer is not None:
            grown[:buffer.shape[0]] = buffer
        state.features = buffer = grown
    buffer[start:end] = hidden


def feature_block(verifier: Verifier, state: VerifierSlot, features_from: int | None,
                  committed: int) -> FeatureBlock | None:
    """The features of positions features_from .. committed - 1 the slot holds, at most
    max_feature_rows of them; None when none is asked or there are none."""
    if features_from is None or features_from >= committed:
        return None
    stop = min(committed, features_from + verifier.max_feature_rows)
    rows = state.features[features_from:stop]  # (n, E): every position below committed was computed here
    verifier.counters["feature_rows_sent"] += stop - features_from
    return FeatureBlock(start=features_from, shape=list(rows.shape), data=pack_features(rows))


def take_logits(verifier: Verifier, work: VerifyRowWork, offsets: list[int], logits: torch.Tensor) -> None:
    """Split a chunk's logits (m, V) at offsets into prompt logprobs (computed now, so a long
    prompt never holds all its logits) and verify logits (kept for sampling)."""
    # offsets ascend (VerifyRowWork.wanted): the prompt ones lead, the verify ones end the list, so
    # both are slices (views, no copy)
    num_prompt = bisect.bisect_left(offsets, work.num_prompt)
    if work.row.emit:
        work.verify_logits.append(logits[bisect.bisect_left(offsets, work.num_new - 1):])
    if not num_prompt:
        return
    prompt_logits = logits[:num_prompt]  # (p, V): offset o predicts tokens[o + 1]
    predicted = [o + 1 for o in offsets[:num_prompt]]
    if predicted[-1] == work.num_new:  # predicts the next step's first token: kept for then
        work.next_prompt_logits = prompt_logits[-1]
        prompt_logits, predicted = prompt_logits[:-1], predicted[:-1]
    if predicted:
        next_ids = work.tokens[predicted].to(prompt_logits.device)
        work.prompt_pieces.append(logprob_arrays(work.row, prompt_logits, next_ids, work.params, None,
                                                 work.row.logprobs.prompt_logprobs, with_masks=False)[0])


def run_forwards(verifier: Verifier, works: list[VerifyRowWork]) -> None:
    """Feed every row's tokens, chunk by chunk; a failed forward fails only its rows."""
    pending = [w for w in works if len(w.tokens)]
    while pending:
        chunks = [(w, w.fed, min(len(w.tokens), w.fed + verifier.prefill_chunk)) for w in pending]
        for group in pack_chunks(chunks):
            try:
                forward_group(verifier, group)
            except Exception as exc:
                log.exception("verify_forward_failed", rows=len(group))
                for work, _, _ in group:
                    work.error = Error.from_exception(exc, work.row.request_id)
        pending = [w for w in pending if w.error is None and w.fed < len(w.tokens)]


# ---------------------------------------------------------------------------------------------
# steps 4-5: sampling, rejection, logprobs


@dataclass
class Verified:
    """Sampling output of one emitting row: emitted token ids, and what its logprobs need."""

    token_ids: torch.Tensor  # (n,) int64: accepted drafts, then the recovered or bonus token
    num_accepted: int
    residual_fallback: bool
    logits: torch.Tensor  # (n, V): the logits each emitted token was drawn from (penalised)
    raw_logits: torch.Tensor | None  # (n, V): the model's, for a row with logit_bias or penalties
    # [1, n, ...] slices of the sampler's output; None for a greedy batch, whose K (the argmax)
    # gather_logprobs recomputes from the logits as it does for prompt positions
    processed: ProcessedLogits | None


def verify_drafts(verifier: Verifier, works: list[VerifyRowWork]) -> list[Verified]:
    """Steps 4 for emitting rows, batched: target samples, rejection sampler, in works' order."""
    V = verifier.vocab_size
    device = verifier.model.embed.device
    K = max(w.num_draft for w in works)
    logits = []
    for w in works:
        row_logits = torch.cat(w.verify_logits)  # (k+1, V)
        logits.append(torch.cat([row_logits, row_logits[-1:].expand(K - w.num_draft, V)]))
    logits = torch.stack(logits)  # (B, K+1, V); slots past a row's drafts repeat its last logits
    draft_ids = torch.full((len(works), K), -1, dtype=torch.long)
    for b, w in enumerate(works):
        draft_ids[b, :w.num_draft] = w.tokens[w.num_new:]
    draft_ids = draft_ids.to(device)
    raw_logits, logits = logits, penalised_logits(works, logits, draft_ids)
    if all(w.row.sampling.greedy for w in works):
        token_ids, num_accepted = verify_greedy(logits, draft_ids)
        residual_fallback, processed = [False] * len(works), None
    else:
        result, processed = verify_sampled(works, logits, draft_ids)
        token_ids, num_accepted = result.token_ids, result.num_accepted.tolist()
        residual_fallback = result.residual_fallback.tolist()
    token_ids = token_ids.cpu()
    verified = []
    for b in range(len(works)):
        n = num_accepted[b] + 1
        rows = slice(b, b + 1)
        verified.append(Verified(
            token_ids=token_ids[b, :n], num_accepted=n - 1, residual_fallback=residual_fallback[b],
            logits=logits[b, :n], raw_logits=None if works[b].penalties is None else raw_logits[b, :n],
            processed=None if processed is None else
            ProcessedLogits(processed.probs[rows, :n], processed.candidate_ids[rows, :n],
                            processed.num_candidates[rows, :n])))
    return verified


def penalised_logits(works: list[VerifyRowWork], logits: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """logits (B, K+1, V) with each penalised row's logit_bias and penalties applied (float32),
    verify position t counting drafts 0..t-1; the same tensor when no row has any.
    draft_ids (B, K), -1 padded."""
    rows = [b for b, w in enumerate(works) if w.penalties is not None]
    if not rows:
        return logits
    out = logits.to(torch.float32, copy=True)
    index = torch.tensor(rows, device=logits.device)
    out[index] = penalise(logits[index], Penalties.cat([works[b].penalties for b in rows]), draft_ids[index])
    return out


def verify_greedy(logits: torch.Tensor, draft_ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """rejection_sample's greedy path without the distributions, uniforms and checks it does not
    need (~2 ms a step at batch 1 on this CPU): a draft is accepted while it equals the target's
    argmax (lowest id on ties, as process_logits), so the emitted tokens are the argmaxes at
    positions 0..num_accepted.

    logits (B, K+1, V); draft_ids (B, K) int64, -1 past a row's drafts (never an argmax).
    Returns the argmaxes (B, K+1) int64 and num_accepted per row.
    """
    B, K = draft_ids.shape
    assert logits.shape[:2] == (B, K + 1), (logits.shape, draft_ids.shape)
    # amax propagates NaN: the same check (and error) as process_logits
    check(bool(torch.isfinite(logits.amax(-1)).all()), "logits", "a row has NaN, +inf or no finite value")
    target_ids = logits.argmax(-1)
    return target_ids, greedy_accepted(draft_ids, target_ids).tolist()


def verify_sampled(works: list[VerifyRowWork], logits: torch.Tensor,
                   draft_ids: torch.Tensor) -> tuple[RejectionResult, ProcessedLogits]:
    """Target samples and the rejection sampler for a batch with sampled rows (greedy rows in it
    take the sampler's argmax path). logits (B, K+1, V); draft_ids (B, K), -1 padded."""
    (B, K), V, device = draft_ids.shape, logits.shape[-1], logits.device
    params = SamplingTensors(*(torch.cat([getattr(w.params, name) for w in works])
                               for name in ("temperature", "top_k", "top_p", "min_p")))
    seeds = torch.tensor([row_seed(w.row.sampling) for w in works], dtype=torch.long,
                         device=device)
    first = torch.tensor([w.start + w.num_new for w in works], dtype=torch.long, device=device)
    positions = first[:, None] + torch.arange(K + 1, device=device)  # (B, K+1): where each sample lands
    processed, target_ids = sample(logits, params, make_uniforms(seeds, positions, STREAM_TARGET))
    # Gumbel-coupled rows: the target's draw is the Gumbel-max one and a draft is accepted iff it
    # equals it, which is the greedy rule over these draws (gpu_worker/sampling/coupling.py)
    gumbel = torch.tensor([w.row.sampling.gumbel for w in works], device=device)
    if bool(gumbel.any()):
        target_ids[gumbel] = gumbel_argmax(processed.probs[gumbel], seeds[gumbel], positions[gumbel])
    num_draft = torch.tensor([w.num_draft for w in works], dtype=torch.long, device=device)
    draft_probs = None
    if any(w.draft_probs is not None for w in works):
        one_hot = torch.zeros(B, K, V, device=device)
        one_hot.scatter_(-1, draft_ids.clamp_min(0)[..., None], 1.0)
        draft_probs = torch.stack([one_hot[b] if w.draft_probs is None else
                                   torch.cat([w.draft_probs, one_hot[b, w.num_draft:]])
                                   for b, w in enumerate(works)])  # (B, K, V)
    result = rejection_sample(draft_ids, num_draft, draft_probs, processed.probs, target_ids, params.greedy | gumbel,
                              uniforms=make_uniforms(seeds, positions[:, :K], STREAM_ACCEPT),
                              residual_uniforms=make_uniforms(seeds, positions[:, :K], STREAM_RESIDUAL))
    return result, processed


def verify_each(verifier: Verifier, works: list[VerifyRowWork]) -> list[Verified | None]:
    """verify_drafts for all rows at once; if that fails, row by row, so one bad row (e.g.
    non-finite logits) fails alone."""
    try:
        return verify_drafts(verifier, works)
    except Exception:
        log.exception("verify_batch_sampling_failed", rows=len(works))
    verified: list[Verified | None] = []
    for work in works:
        try:
            verified.append(verify_drafts(verifier, [work])[0])
        except Exception as exc:
            log.exception("verify_row_failed", request_id=work.row.request_id)
            work.error = row_failure(exc, work.row)
            verified.append(None)
    return verified


def row_failure(exc: Exception, row: VerifyRow) -> Error:
    """The error of one row the sampler failed on: a sampling value names its field in the
    batch ("rows[i].sampling.top_p"); any other kernel input (e.g. non-finite logits from the
    model) is `internal`, with the kernel's message."""
    if isinstance(exc, SamplingInputError) and exc.field in RowSampling.model_fields:
        return Error(code=exc.code, message=exc.message, field=f"rows[{row.row}].sampling.{exc.field}",
                     request_id=row.request_id)
    if isinstance(exc, SamplingInputError):
        return Error(code=ErrorCode.internal, message=f"{exc.field}: {exc.message}", request_id=row.request_id)
    return Error.from_exception(exc, row.request_id)


def logprob_arrays(row: VerifyRow, logits: torch.Tensor, token_ids: torch.Tensor, params: SamplingTensors,
                   processed: ProcessedLogits | None, top_n: int, *, with_masks: bool,
                   raw_logits: torch.Tensor | None = None) -> tuple[LogprobArrays, list[SamplingMask] | None]:
    """LogprobArrays (and masks) for tokens (n,) drawn from logits (n, V) under the row's params.

    processed: the sampler's output at these positions (emitted tokens) or None (prompt
    positions and greedy batches: K from the sampler's own select_candidates). raw_logits
    (n, V): the model's logits where logits are penalised (raw mode reports those).
    """
    options = row.logprobs
    n = len(token_ids)
    requested = torch.from_numpy(options.logprob_token_ids).long().to(logits.device)
    _, _, lp = gather_logprobs(logits[None], token_ids[None], params, processed,
                               raw_logits=None if raw_logits is None else raw_logits[None],
                               mode=options.logprobs_mode, top_n=top_n, requested_ids=requested[None].expand(n, -1),
                               mask_cap=options.max_mask_size if with_masks else 1)
    processed_mode = options.logprobs_mode == "processed"
    # processed mode ships log_softmax(logits / T) and logz_k; the reader subtracts logz_k once
    shift = lp.logz_k[:, None] if processed_mode else 0.0
    token_values = lp.processed_logprobs + lp.logz_k if processed_mode else lp.raw_logprobs
    ranked = logits if processed_mode or raw_logits is None else raw_logits  # ranks in the reported distribution
    ranks = (ranked > ranked.gather(1, token_ids[:, None])).sum(-1) + 1
    arrays = LogprobArrays(
        token_logprobs=to_numpy(token_values, np.float32),
        top_ids=to_numpy(lp.top_ids, np.int32),
        top_logprobs=to_numpy(lp.top_logprobs + shift, np.float32),
        requested_logprobs=to_numpy(lp.requested_logprobs + shift, np.float32),
        ranks=to_numpy(ranks, np.int32),
        logz_k=to_numpy(lp.logz_k, np.float32) if processed_mode else None,
    )
    return arrays, masks_of(lp) if with_masks else None


def to_numpy(x: torch.Tensor, dtype) -> np.ndarray:
    return x.detach().cpu().numpy().astype(dtype)


def masks_of(lp: TokenLogprobs) -> list[SamplingMask]:
    candidate_ids = lp.candidate_ids.cpu().numpy()
    return [SamplingMask(token_ids=ids[ids >= 0].astype(np.int32), size=int(size), all_tokens=bool(everything))
            for ids, size, everything in zip(candidate_ids, lp.num_candidates.tolist(), lp.candidates_all.tolist())]


def slice_arrays(arrays: LogprobArrays, stop: int) -> LogprobArrays:
    """The first `stop` positions."""
    return LogprobArrays(**{name: None if getattr(arrays, name) is None else getattr(arrays, name)[:stop]
                            for name in LogprobArrays.model_fields})


def concat_arrays(pieces: list[LogprobArrays]) -> LogprobArrays:
    """Pieces over consecutive positions -> one LogprobArrays."""
    if len(pieces) == 1:
        return pieces[0]
    fields = {}
    for name in LogprobArrays.model_fields:
        values = [getattr(p, name) for p in pieces]
        fields[name] = None if values[0] is None else np.concatenate(values)
    return LogprobArrays(**fields)


def side_record(verifier: Verifier, work: VerifyRowWork, batch_id: int, verified: Verified | None,
                prompt: LogprobArrays | None, prompt_offset: int) -> SideChannelRecord:
    row = work.row
    options = row.logprobs
    logprobs = masks = None
    token_ids = np.zeros(0, np.int32)
    if verified is not None:
        token_ids = verified.token_ids.numpy().astype(np.int32)
        wants_logprobs = options.logprobs is not None or len(options.logprob_token_ids) > 0
        if wants_logprobs or options.sampling_mask:
            arrays, masks = logprob_arrays(row, verified.logits, verified.token_ids.to(verified.logits.device),
                                           work.params, verified.processed, options.logprobs or 0,
                                           with_masks=options.sampling_mask, raw_logits=verified.raw_logits)
            logprobs = arrays if wants_logprobs else None
    return SideChannelRecord(request_id=row.request_id, batch_id=batch_id, step=row.step,
                             verifier_id=verifier.instance_id, mode=options.logprobs_mode, token_ids=token_ids,
                             logprobs=logprobs, masks=masks, prompt_logprobs=prompt, prompt_offset=prompt_offset)


def finish_row(verifier: Verifier, work: VerifyRowWork, batch_id: int,
               verified: Verified | None) -> tuple[VerifyResult, SideRecord | None]:
    """Trim the slot, store the prompt logprobs so far, build the result and side record."""
    row, state = work.row, work.state
    committed = work.start + work.num_new + (verified.num_accepted if verified is not None else 0)
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
        return VerifyResult(request_id=row.request_id, step=row.step, features=features), record
    verifier.counters["tokens_emitted"] += len(verified.token_ids)
    verifier.counters["drafts_proposed"] += work.num_draft
    verifier.counters["drafts_accepted"] += verified.num_accepted
    verifier.counters["residual_fallbacks"] += verified.residual_fallback
    return VerifyResult(request_id=row.request_id, step=row.step, token_ids=verified.token_ids.numpy(),
                        num_draft=work.num_draft, num_accepted=verified.num_accepted,
                        residual_fallback=verified.residual_fallback, features=features), record


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
        except SpecbusError as exc:
            results[row.request_id] = failed_result(verifier, row, Error.from_exception(exc, row.request_id))
            continue
        if isinstance(prepared, VerifyResult):
            results[row.request_id] = prepared
        else:
            works.append(prepared)

    run_forwards(verifier, works)
    emitting = [w for w in works if w.error is None and w.row.emit]
    verified = dict(zip((w.row.request_id for w in emitting), verify_each(verifier, emitting) if emitting else []))
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
