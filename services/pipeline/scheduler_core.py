"""Scheduler logic without NATS: request state, admission, pinning, batch building under a token
budget with chunked prefill, commit/finish rules, usage accounting and fallback decisions.

`SchedulerState` is driven by the scheduler's step loops (services/pipeline/scheduler.py), one
step at a time per lane: boundary, plan_step, draft_batches / apply_draft, verify_batches /
apply_verify, end_step. The loop, lanes and in-flight rule are told once, in
docs/ARCHITECTURE.md#the-step-loop; instances and pins are services/pipeline/placement.py's.

Every method returns an `Outbox` of Commits (to a postprocessor) and StreamChunks (straight to a
client inbox, used only when a request ends with no live postprocessor to tell it). Deadlines
are wall-clock `time.time()` seconds, as on the wire; liveness uses the registry's monotonic
clock. Interpretations of the contract (docs/PROTOCOL.md) are listed in `SchedulerState`'s docstring.
"""

import re
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import structlog

from text.chat_template import ChatTemplateError, render_chat
from text.tokenizer import Tokenizer, check_in_vocabulary
from schemas.codec import encode
from schemas.commits import Commit
from schemas.config import SchedulerConfig
from schemas.control import Heartbeat
from schemas.errors import ErrorCode, SpecbusError
from schemas.generation import GenerateRequest, LogprobOptions, SamplingParams, SpeculativeOptions
from schemas.protocol import MAX_BATCH_ROWS, MAX_DRAFT_SUPPORT, MAX_FEATURE_BLOCK_BYTES, MAX_INBOX_LEN
from schemas.steps import (DraftRequest, DraftResponse, DraftRow, DraftTokens, FeatureBlock, VerifyRequest,
                           VerifyResponse, VerifyRow)
from schemas.streams import Admitted, StreamChunk, Usage
from schemas.wire import Error, FinishReason
from services.pipeline import features
from services.pipeline.adaptive_k import AdaptiveK, RowState
from services.pipeline.draft_method import DraftTrial, drafted, pin_drafter
from services.pipeline.fair_share import most_over_share, parse_user_weights, share, start_order_key, user_of_inbox
from services.pipeline.placement import Placement
from services.runtime.metrics import SchedulerMetrics

log = structlog.get_logger(__name__)

REPLAY_COMMITS = 32  # commits kept per request to replay to a replacement postprocessor, at least
# A finished request's id is refused (duplicate_request_id) this long: a postprocessor ignores
# commits for a request it finished for its finished_ttl_s (60 s by default), so a reused id
# would otherwise wait out its timeout. At most MAX_RECENT_IDS ids are remembered.
RECENT_ID_TTL_S = 60.0
MAX_RECENT_IDS = 1 << 16
# Bytes a message needs beyond the arrays counted below (keys, ids, numbers, options): generous,
# so that an estimate under max_payload is never refused by the server.
MESSAGE_OVERHEAD_BYTES = 4096
ROW_OVERHEAD_BYTES = 1024


def client_error(row_error: Error, request_id: str, first: bool = True) -> Error:
    """A verifier's row error in the client's terms: "rows[0].logprobs.x" becomes the request's
    "logprobs.x", and before the first commit (first) the row's new tokens are the prompt, so
    "rows[0].new_token_ids" becomes "prompt_token_ids"."""
    field = row_error.field and re.sub(r"^rows\[\d+\]\.", "", row_error.field)
    field = "prompt_token_ids" if field == "new_token_ids" and first else field
    return row_error.model_copy(update={"field": field, "request_id": request_id})


def internal_error(request_id: str, message: str) -> Error:
    return Error(code=ErrorCode.internal, message=message, request_id=request_id)


def prompt_field(request: GenerateRequest) -> str:
    if request.messages is not None:
        return "messages"
    return "prompt" if request.prompt is not None else "prompt_token_ids"


def verify_row_bytes(row: VerifyRow) -> int:
    """An upper estimate of a VerifyRow's encoded size: its arrays plus ROW_OVERHEAD_BYTES."""
    proposal = row.proposal
    arrays = (row.new_token_ids, row.draft_token_ids, row.logprobs.logprob_token_ids, proposal.ids, proposal.probs,
              *row.sampling.arrays())
    return ROW_OVERHEAD_BYTES + sum(a.nbytes for a in arrays if a is not None)


def prompt_token_ids(request: GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    """The prompt as token ids: given ids checked against the vocabulary, text encoded without BOS,
    messages rendered with the tokenizer's chat template (text/chat_template.py) then encoded."""
    if request.prompt_token_ids is not None:
        check_in_vocabulary(request.prompt_token_ids, tokenizer.vocab_size, "prompt_token_ids")
        return request.prompt_token_ids.tolist()
    text = request.prompt
    if request.messages is not None:
        try:
            text = render_chat(tokenizer, [message.model_dump() for message in request.messages])
        except ChatTemplateError as exc:
            raise SpecbusError(ErrorCode.invalid_field, str(exc), "messages") from None
    ids = tokenizer.encode(text)
    if not ids:
        field = "messages" if request.messages is not None else "prompt"
        raise SpecbusError(ErrorCode.invalid_field, "the prompt encodes to no tokens", field)
    return ids


@dataclass
class Request:
    """One admitted request. `history` is prompt + completion, append-only; verifier_len and
    drafter_len are how many history tokens the pinned verifier / drafter hold; features_end and
    feature_blocks: the target features on their way to an eagle drafter (features.py)."""

    request_id: str
    client_inbox: str
    history: list[int]
    prompt_len: int
    sampling: SamplingParams  # seed filled for sampled requests
    logprobs: LogprobOptions
    speculative: SpeculativeOptions
    stream: bool
    deadline: float  # time.time() seconds
    verifier_id: str | None = None
    drafter_id: str | None = None
    postprocessor_id: str | None = None
    verifier_len: int = 0
    drafter_len: int = 0
    step: int = 0  # the step number its next verify row carries; a retry repeats it
    seq: int = 0  # seq of its next Commit
    last_batch_id: int = 0
    last_planned: int = -1  # the plan number it last had a row in: fairness when rows are scarce
    num_draft_proposed: int = 0
    num_draft_accepted: int = 0
    num_steps: int = 0
    degraded_steps: Counter = field(default_factory=Counter)
    carried_degraded: list[str] = field(default_factory=list)  # from steps that committed nothing
    sent: deque = field(default_factory=deque)  # (commit, completion_len before, sent at monotonic)
    end_reason: FinishReason | None = None  # cancel, applied at the next step boundary
    stopped: bool = False  # a StopNotice came: end without any further commit
    admitted_at: float = 0.0  # SchedulerState.monotonic() at admission: time to first token
    last_token_at: float | None = None  # ... at its last commit with tokens: inter-token latency
    lane: int = 0  # the step loop that plans it (module docstring)
    resumed_len: int = 0  # completion tokens it came with (GenerateRequest.resume_token_ids)
    awaiting_verifier: bool = False  # its verifier died with no other to move to (migrate)
    user: str = ""  # the client user it streams to (fair_share.user_of_inbox)
    awaiting_postprocessor: bool = False  # ended with its postprocessor dead: the final commit waits for one
    end_error: Error | None = None  # why, with end_reason "error" (a queued request refused for fair share)
    adaptive: RowState = field(default_factory=RowState)  # its acceptance per draft position, its probes (adaptive_k)
    speculative_lengths: Counter = field(default_factory=Counter)  # k -> its decode steps that verified k drafts
    draft_trial: DraftTrial = field(default_factory=DraftTrial)  # draft_method "auto" (draft_method.py)
    features_end: int = 0  # the next verify row's features_from (features.py)
    feature_blocks: list[FeatureBlock] = field(default_factory=list)  # received, not yet delivered

    def restart_drafter(self) -> None:
        """Its drafter holds nothing of it (another drafter, or one that answered need_resync): the
        history and the target features go to it again from position 0."""
        self.drafter_len = 0
        self.features_end = 0
        self.feature_blocks = []

    @property
    def completion(self) -> list[int]:
        return self.history[self.prompt_len:]

    @property
    def pending_len(self) -> int:
        """History tokens the verifier has not seen; 1 for a request in its decode phase."""
        return len(self.history) - self.verifier_len

    @property
    def scoring(self) -> bool:
        return self.sampling.max_tokens == 0

    @property
    def awaits_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked and not delivered yet: the verifier accumulates them over the
        prefill chunks and sends them with the record of the row that completes the prompt."""
        return self.logprobs.prompt_logprobs is not None and self.seq == 0

    def row_logprobs(self) -> LogprobOptions:
        """What the verifier must compute: prompt logprobs only until the first commit delivered them."""
        if self.logprobs.prompt_logprobs is None or self.awaits_prompt_logprobs:
            return self.logprobs
        return self.logprobs.model_copy(update={"prompt_logprobs": None})

    def usage(self) -> Usage:
        proposed, accepted = self.num_draft_proposed, self.num_draft_accepted
        return Usage(prompt_tokens=self.prompt_len, completion_tokens=len(self.completion),
                     draft_tokens_proposed=proposed, draft_tokens_accepted=accepted,
                     acceptance_rate=accepted / proposed if proposed else 0.0, steps=self.num_steps,
                     degraded_steps=dict(self.degraded_steps),
                     speculative_lengths=[self.speculative_lengths[k] for k in range(max(self.speculative_lengths,
                                                                                         default=-1) + 1)])


@dataclass
class PlannedRow:
    """One request's part in a step: new_token_ids = history[cached_len:end]."""

    request: Request
    cached_len: int
    end: int
    emit: bool
    num_draft: int  # planned; set to what the drafter delivered once it answered
    decode: bool = False  # a decode row (plan_decode_row), not a prefill chunk
    draft: DraftTokens = field(default_factory=DraftTokens)
    degraded: list[str] = field(default_factory=list)
    drafted_by: str | None = None  # the drafter that answered for this row (draft_method.drafted)
    features_from: int | None = None  # what its verify row asked (features.py)
    features_sent: int | None = None  # the end of the features its draft row carried


@dataclass
class StepPlan:
    rows: dict[str, list[PlannedRow]]  # verifier_id -> rows
    draft_rows: dict[str, list[PlannedRow]]  # drafter_id -> rows to draft for
    verify_requests: dict[str, VerifyRequest] = field(default_factory=dict)
    retried: set[str] = field(default_factory=set)  # verifiers whose batch needed the retry
    outbox: "Outbox" = field(default_factory=lambda: Outbox())  # requests ended while building the batches

    @property
    def empty(self) -> bool:
        return not self.rows


@dataclass
class Outbox:
    commits: list[tuple[str, Commit]] = field(default_factory=list)  # (postprocessor_id, commit)
    chunks: list[tuple[str, StreamChunk]] = field(default_factory=list)  # (client inbox, chunk)
    acks: list[tuple[str, Admitted]] = field(default_factory=list)  # (client inbox, "started")

    def extend(self, other: "Outbox") -> "Outbox":
        self.commits += other.commits
        self.chunks += other.chunks
        self.acks += other.acks
        return self


def cut_tokens(tokens: list[int], num_completion: int, sampling: SamplingParams,
               eos_ids: tuple[int, ...]) -> tuple[list[int], FinishReason | None]:
    """Emitted tokens kept and why the request ends: cut at max_tokens ("length"), after an EOS
    ("eos", unless ignore_eos) or after a stop token ("stop"). The EOS / stop token itself is
    kept in token_ids (its text is the postprocessor's business: special tokens decode to "")."""
    stop_ids = set(sampling.stop_token_ids.tolist())
    kept: list[int] = []
    for token in tokens:
        if num_completion + len(kept) >= sampling.max_tokens:
            return kept, "length"
        kept.append(token)
        if token in eos_ids and not sampling.ignore_eos:
            return kept, "eos"
        if token in stop_ids:
            return kept, "stop"
    return kept, "length" if num_completion + len(kept) >= sampling.max_tokens else None


class SchedulerState:
    """Every request this scheduler owns, the instances it has heard of, and the step counters.

    Choices where the contract is silent (documented here once):
    - A request is pinned when it starts running (leaves the queue), not on arrival: the
      verifier with the most free slots (min of its reported free_slots and its capacity less
      our requests on it), a compatible drafter (of the request's draft_method: draft_method.py)
      and postprocessor likewise. Compatible = same protocol version and the same tokenizer hash
      as this scheduler's own tokenizer (so text prompts, EOS ids and every instance agree; an
      ngram drafter fits every tokenizer). No live verifier/postprocessor with room: the
      request waits in the queue until its deadline, then ends with `timeout` (a stack that is
      still starting, or a verifier that restarts, does not refuse work).
    - A request wanting drafts but without a live drafter runs k=0 flagged `draft_timeout`.
    - A request drafted by an eagle drafter asks its verify rows for the target's features and
      carries them to the drafter in its draft rows, as much as max_payload leaves room for
      (features.py, docs/PROTOCOL.md#feature-level-drafts); its drafter restarting from position
      0 (Request.restart_drafter) restarts the features with it.
    - A request's k is an upper bound: greedy and Gumbel-coupled rows take per step the k of
      adaptive_k.py (from timings the service reports: draft_timed, verify_timed; none reported,
      every step takes k); rejection-sampled rows always take k (plan_decode_row says why).
      usage.speculative_lengths counts decode steps by the drafts they verified.
    - Prompt logprobs are asked of the verifier until the first commit delivered them; after a
      migration the re-prefill does not recompute them.
    - Scoring (max_tokens=0): prefill with emit=False, then a final commit of zero tokens,
      finish "length".
    - Degraded reasons of a step that committed nothing (`resync`, `migrated`) travel on the
      request's next commit; usage.degraded_steps counts each reason once per step.
      usage.steps counts verify steps the request took part in, prefill chunks included.
      draft_tokens_accepted counts what the verifier accepted (before a max_tokens/EOS cut).
    - A verifier that failed a batch twice is avoided for heartbeat_timeout_s and all its
      requests move (not only those of the failed batch).
    - A StopNotice ends the request without a further commit; reason "error" too.
    - Postprocessor lost: commits are fire-and-forget, so the scheduler cannot know which ones
      reached the client. It replays the request's commits of the last 2 x heartbeat_timeout_s
      (at least the last REPLAY_COMMITS) to the new postprocessor, the first carrying
      resume_token_ids (the completion before it); the client
      drops the seqs it already has. Replays expect no side channel (the records went to the
      dead one): one that expected it is flagged logprobs_timeout.
    """

    def __init__(self, config: SchedulerConfig, tokenizer: Tokenizer, tokenizer_hash: str,
                 monotonic: Callable[[], float] = time.monotonic):
        self.config = config
        self.tokenizer = tokenizer
        self.tokenizer_hash = tokenizer_hash
        self.eos_ids = tokenizer.eos_ids
        self.monotonic = monotonic
        self.placement = Placement(config.heartbeat_timeout_s, tokenizer_hash, monotonic)
        self.user_weights = parse_user_weights(config.user_weights)
        self.running: dict[str, Request] = {}  # in start order: decode order within a step
        self.waiting: deque[Request] = deque()
        self.releases: dict[str, list[str]] = {}  # instance_id -> request ids whose slots to free
        # Ended requests whose final commit went to a postprocessor, by monotonic end time: if that
        # postprocessor turns out dead before it could have been noticed, the commits are replayed.
        self.finishing: dict[str, tuple[Request, float]] = {}
        self.in_flight: set[str] = set()  # ids of requests in a step now in flight (any lane)
        self.recent_ids: dict[str, float] = {}  # finished request id -> monotonic end time, oldest first
        self.max_payload: int | None = None  # the NATS server's, set by the service; None: unchecked
        self.max_token_chars: int | None = None  # characters of the vocabulary's longest token, once needed
        self.next_batch_id = 0
        self.num_plans = 0
        self.counters: Counter = Counter()
        self.metrics = SchedulerMetrics()  # histograms and acceptance by mode; the service exposes counters too
        self.adaptive = AdaptiveK(config.adaptive_k_probe_steps) if config.adaptive_k else None

    # ------------------------------------------------------------------ instances

    def observe(self, heartbeat: Heartbeat) -> bool:
        """Record a heartbeat (Placement.observe); True for an instance not known before. An
        instance that can never be used (another tokenizer or protocol version) is logged as a
        warning and counted (`instances_incompatible`) when it is first heard, so a misfit
        drafter is not only a `draft_timeout` flag on every chunk."""
        new = self.placement.observe(heartbeat)
        misfit = self.placement.misfit(heartbeat) if new else None
        if misfit is not None:
            self.counters["instances_incompatible"] += 1
            log.warning("instance_incompatible", instance_id=heartbeat.instance_id, role=heartbeat.role, why=misfit)
        return new

    def pinned_count(self, instance_id: str) -> int:
        """This scheduler's running requests pinned to instance_id (any role)."""
        return sum(instance_id in (r.verifier_id, r.drafter_id, r.postprocessor_id) for r in self.running.values())

    def live_releases(self, role: str) -> set[str]:
        """Live instances of role with slots to release."""
        return {i for i in self.releases if self.placement.alive(i) and self.placement.is_role(i, role)}

    # ------------------------------------------------------------------ admission

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def admit(self, request: GenerateRequest, client_inbox: str, prompt_ids: list[int], now: float) -> Request:
        """Queue a valid request, or raise SpecbusError before any work: `overloaded` beyond
        max_running + max_queue, `duplicate_request_id` for an id running, queued or finished in
        the last RECENT_ID_TTL_S, `invalid_field` for a reply subject or a prompt too long
        (check_prompt), `too_large` for a first commit over max_payload."""
        user = user_of_inbox(client_inbox)
        victim = self.check_capacity(user)
        self.check_request_id(request.request_id)
        if len(client_inbox) > MAX_INBOX_LEN:
            raise SpecbusError(ErrorCode.invalid_field, f"the reply subject is {len(client_inbox)} characters, "
                                                        f"at most {MAX_INBOX_LEN}", "reply_subject")
        length_error = self.check_prompt(len(prompt_ids), request.sampling.max_tokens, prompt_field(request))
        if length_error is not None:
            raise length_error
        resumed = self.check_resume(request)
        self.check_first_commit(request, client_inbox, prompt_ids)
        state = Request(request_id=request.request_id, client_inbox=client_inbox, history=[*prompt_ids, *resumed],
                        prompt_len=len(prompt_ids), sampling=request.sampling, logprobs=request.logprobs,
                        speculative=request.speculative, stream=request.stream, deadline=now + request.timeout_s,
                        admitted_at=self.monotonic(), resumed_len=len(resumed), user=user)
        if victim is not None:  # refused in the newcomer's place, at the next boundary
            victim.end_reason = "error"
            victim.end_error = Error(code=ErrorCode.overloaded, request_id=victim.request_id,
                                     message=f"refused for fair share: client user {victim.user!r} is over its share "
                                             f"of {self.capacity} requests")
            self.counters["refused_fair_share"] += 1
            self.metrics.requests_by_user.labels(victim.user, "fair_share").inc()
        self.waiting.append(state)
        self.counters["admitted"] += 1
        self.metrics.requests_by_user.labels(user, "admitted").inc()
        return state

    @property
    def capacity(self) -> int:
        return self.config.max_running + self.config.max_queue

    def user_loads(self) -> Counter:
        """Requests running or queued per client user, those already refused left out."""
        return Counter(r.user for r in [*self.running.values(), *self.waiting] if r.end_error is None)

    def check_capacity(self, user: str) -> Request | None:
        """None when there is room; else the queued request to refuse in favour of user, who is
        under its fair share (fair_share.py). SpecbusError overloaded when user is at or over its
        share, or nothing queued can be refused."""
        loads = self.user_loads()
        if sum(loads.values()) < self.capacity:
            return None
        fair = share(user, loads, self.user_weights, self.capacity)
        queued = [r for r in self.waiting if r.end_error is None and r.end_reason is None]
        over = most_over_share(user, loads, [r.user for r in queued], self.user_weights, self.capacity)
        if loads[user] >= fair or over is None:
            self.metrics.requests_by_user.labels(user, "overloaded").inc()
            raise SpecbusError(ErrorCode.overloaded,
                               f"{sum(loads.values())} requests running or queued, the limit is "
                               f"{self.config.max_running} running + {self.config.max_queue} queued; client user "
                               f"{user!r} has {loads[user]} of its share of {fair:.0f}")
        return next(r for r in reversed(queued) if r.user == over)

    def check_resume(self, request: GenerateRequest) -> list[int]:
        """The resumed completion (GenerateRequest.resume_token_ids), checked: in the vocabulary and
        short of max_tokens (a request that had them all was finished)."""
        if request.resume_token_ids is None:
            return []
        resumed = request.resume_token_ids.tolist()
        if len(resumed) >= request.sampling.max_tokens:
            raise SpecbusError(ErrorCode.invalid_field, f"{len(resumed)} tokens to resume from leave nothing of "
                                                        f"max_tokens {request.sampling.max_tokens}", "resume_token_ids")
        check_in_vocabulary(resumed, self.tokenizer.vocab_size, "resume_token_ids")
        return resumed

    def check_request_id(self, request_id: str) -> None:
        """SpecbusError duplicate_request_id for an id in use or finished in the last RECENT_ID_TTL_S."""
        expiry = self.monotonic() - RECENT_ID_TTL_S
        recent = self.recent_ids  # oldest first
        while recent and (len(recent) > MAX_RECENT_IDS or next(iter(recent.values())) < expiry):
            del recent[next(iter(recent))]
        if request_id in self.running or any(r.request_id == request_id for r in self.waiting):
            raise SpecbusError(ErrorCode.duplicate_request_id, f"request {request_id} is already running",
                               "request_id")
        if request_id in self.recent_ids:
            raise SpecbusError(ErrorCode.duplicate_request_id,
                               f"request {request_id} finished less than {RECENT_ID_TTL_S:.0f} s ago; "
                               f"use a fresh request_id", "request_id")

    def check_prompt(self, prompt_len: int, max_tokens: int, field_name: str) -> SpecbusError | None:
        """The error for a prompt that leaves no room in max_seq_len (None while no verifier is
        known; start() checks again): a generating request needs one position past its prompt."""
        limit = self.placement.max_seq_len()
        if limit is None or prompt_len + (max_tokens > 0) <= limit:
            return None
        room = "" if max_tokens == 0 else " and at least one generated token"
        return SpecbusError(ErrorCode.invalid_field, f"the prompt is {prompt_len} tokens; max_seq_len {limit} "
                                                     f"holds the prompt{room}", field_name)

    def check_prompt_text(self, request: GenerateRequest) -> None:
        """Refuse a text prompt or chat that cannot fit in max_seq_len before tokenizing it
        (tokenizing holds the event loop: megabytes of text take seconds): no token covers more
        than max_token_chars characters, so a text over twice max_token_chars per position is too
        long whatever the tokenizer's normalizer does (the factor 2 leaves room for one that drops
        characters). A chat's contents are part of its rendered text, so their sum bounds it."""
        limit = self.placement.max_seq_len()
        if (request.prompt is None and request.messages is None) or limit is None:
            return
        if self.max_token_chars is None:
            self.max_token_chars = max(map(len, self.tokenizer.hf.get_vocab()), default=1)
        most = 2 * self.max_token_chars * limit
        chars = len(request.prompt) if request.prompt is not None else sum(len(m.content) for m in request.messages)
        if chars > most:
            raise SpecbusError(ErrorCode.invalid_field, f"the {prompt_field(request)} is {chars} characters; "
                                                        f"max_seq_len {limit} holds at most {most} characters of text",
                               prompt_field(request))

    def check_first_commit(self, request: GenerateRequest, client_inbox: str, prompt_ids: list[int]) -> None:
        """SpecbusError too_large when the first commit (it carries the prompt, and a replay also
        the completion) or its prompt logprobs could not fit in one NATS message."""
        if self.max_payload is None:
            return
        commit = Commit(request_id=request.request_id, batch_id=0, step=0, seq=0, scheduler_id=self.config.instance_id,
                        client_inbox=client_inbox, prompt_token_ids=prompt_ids, logprobs=request.logprobs,
                        stop=request.sampling.stop, usage=Usage())
        size = len(encode(commit)) + 4 * request.sampling.max_tokens + MESSAGE_OVERHEAD_BYTES
        top_n = request.logprobs.prompt_logprobs
        if top_n is not None:  # per prompt position: logprob, rank, logz, top-n ids and values, requested ids
            per_position = ROW_OVERHEAD_BYTES // 8 + 12 + 8 * top_n + 4 * len(request.logprobs.logprob_token_ids)
            size += len(prompt_ids) * per_position
        if size > self.max_payload:
            raise SpecbusError(ErrorCode.too_large, f"a prompt of {len(prompt_ids)} tokens needs messages of about "
                                                    f"{size} bytes, over the bus's max_payload of {self.max_payload}",
                               prompt_field(request))

    def cancel(self, request_id: str, owner_inbox: str | None = None) -> bool:
        """Mark for the next step boundary; False when this scheduler does not own the request.
        owner_inbox: the cancelling user's inbox prefix; SpecbusError `forbidden` when the
        request streams to another inbox (another client user's request)."""
        request = self.running.get(request_id) or next((r for r in self.waiting if r.request_id == request_id), None)
        if request is None:
            return False
        if owner_inbox is not None and not request.client_inbox.startswith(owner_inbox):
            raise SpecbusError(ErrorCode.forbidden, f"request {request_id} belongs to another client user",
                               "request_id")
        request.end_reason = "cancelled"
        return True

    def stop_notice(self, request_id: str) -> bool:
        request = self.running.get(request_id)
        if request is None:
            return False
        request.stopped = True
        return True

    # ------------------------------------------------------------------ step boundary

    def boundary(self, now: float, lane: int | None = None) -> Outbox:
        """Between steps of `lane` (None: of every lane): apply cancels, stop notices and deadlines;
        replace dead instances; start queued requests while there is room. Requests in another
        lane's step in flight wait for that lane's own boundary."""
        outbox = Outbox()
        for instance in self.placement.reap():
            self.releases.pop(instance.instance_id, None)
        for request in list(self.running.values()):
            if request.request_id in self.in_flight and request.lane != lane:
                continue
            if request.stopped:
                self.end(request, None, now)
            elif request.end_reason is not None:
                outbox.extend(self.end(request, request.end_reason, now))
            elif now >= request.deadline:
                outbox.extend(self.end(request, "timeout", now))
            else:
                outbox.extend(self.replace_dead(request, now))
        outbox.extend(self.replay_lost_finals(now))
        candidates = []
        for request in self.waiting:
            if request.end_reason is not None or now >= request.deadline:
                reason = request.end_reason or "timeout"
                outbox.extend(self.end(request, reason, now, error=request.end_error))
            elif len(self.running) < self.config.max_running and (length_error := self.check_prompt(
                    request.prompt_len, request.sampling.max_tokens, "prompt_token_ids")) is not None:
                error = Error.from_exception(length_error, request.request_id)
                outbox.extend(self.end(request, "error", now, error=error))
            else:
                candidates.append(request)
        # the fairest first (fair_share.py); min() keeps arrival order between equals
        running_by_user = Counter(r.user for r in self.running.values())
        fairness = start_order_key(running_by_user, self.user_weights)
        waiting = list(candidates)
        while candidates and len(self.running) < self.config.max_running:
            request = min(candidates, key=lambda r: fairness(r.user))
            candidates.remove(request)
            if self.start(request):
                waiting.remove(request)
                self.running[request.request_id] = request
                running_by_user[request.user] += 1
                self.counters["started"] += 1
                outbox.acks.append((request.client_inbox, self.admitted(request.request_id, started=True)))
        self.waiting = deque(waiting)
        return outbox

    def admitted(self, request_id: str, *, started: bool) -> Admitted:
        """The answer to the client that its request is here (queued) or running (started)."""
        return Admitted(request_id=request_id, scheduler_id=self.config.instance_id, started=started)

    def start(self, request: Request) -> bool:
        """Pin a verifier, a postprocessor and (when it wants drafts) a drafter; False: wait."""
        verifier_id = self.placement.pick("verifier", self.pinned_count)
        postprocessor_id = self.placement.pick("postprocessor", self.pinned_count)
        if verifier_id is None or postprocessor_id is None:
            return False
        request.verifier_id = self.placement.count_pin(verifier_id)
        request.postprocessor_id = self.placement.count_pin(postprocessor_id)
        limit = self.placement.max_seq_len()
        if limit is not None and request.prompt_len + request.sampling.max_tokens > limit:
            # Generation stops at max_seq_len with finish_reason "length", as at max_tokens.
            capped = limit - request.prompt_len
            request.sampling = request.sampling.model_copy(update={"max_tokens": capped})
            self.counters["max_tokens_capped"] += 1
        if request.speculative.num_speculative_tokens > 0:
            request.drafter_id = pin_drafter(self, request)
        lane_sizes = Counter(r.lane for r in self.running.values())
        request.lane = min(range(self.config.lanes), key=lambda lane: lane_sizes[lane])
        return True

    def replace_dead(self, request: Request, now: float) -> Outbox:
        outbox = Outbox()
        if not self.placement.alive(request.postprocessor_id):
            outbox.commits += self.repin_postprocessor(request)
        if request.speculative.num_speculative_tokens > 0 and not self.placement.alive(request.drafter_id):
            request.drafter_id = pin_drafter(self, request)
            request.restart_drafter()
        if not self.placement.alive(request.verifier_id):
            outbox.extend(self.migrate(request, now))
        return outbox

    def repin_postprocessor(self, request: Request) -> list[tuple[str, Commit]]:
        """Move the request to a live postprocessor and replay its recent commits there; [] when
        there is none (it waits, up to its deadline)."""
        new_id = self.placement.pick("postprocessor", self.pinned_count)
        if new_id is None:
            return []
        log.warning("postprocessor_replaced", request_id=request.request_id, old=request.postprocessor_id,
                    new=new_id, replayed=len(request.sent))
        request.postprocessor_id = self.placement.count_pin(new_id)
        self.counters["postprocessor_repinned"] += 1
        return [(new_id, commit) for commit in self.replay(request)]

    def replay_lost_finals(self, now: float) -> Outbox:
        """A final commit sent just before its postprocessor died is lost with it, and a dead
        postprocessor is only noticed heartbeat_timeout_s later: keep ended requests that long
        (twice, for margin) and replay their commits to another postprocessor if need be. A
        request that ended with its postprocessor known dead waits for one up to its deadline
        (now: time.time()), then gets a final `timeout` chunk straight from here."""
        outbox = Outbox()
        window = 2 * self.config.heartbeat_timeout_s
        for request_id, (request, ended_at) in list(self.finishing.items()):
            if request.awaiting_postprocessor and now >= request.deadline:  # none came in time
                del self.finishing[request_id]
                outbox.chunks.append((request.client_inbox, self.direct_final_chunk(request, "timeout")))
            elif not request.awaiting_postprocessor and self.monotonic() - ended_at > window:
                del self.finishing[request_id]
            elif not self.placement.alive(request.postprocessor_id):
                replayed = self.repin_postprocessor(request)
                if replayed:
                    outbox.commits += replayed
                    del self.finishing[request_id]
        return outbox

    def replay(self, request: Request) -> list[Commit]:
        replays = []
        for index, (commit, completion_len, _) in enumerate(request.sent):
            update = {"expect_side_channel": False}
            if commit.expect_side_channel:
                update["degraded"] = list(dict.fromkeys([*commit.degraded, "logprobs_timeout"]))
            if index == 0:
                update["resume_token_ids"] = np.array(request.completion[:completion_len], dtype=np.int32)
            replays.append(commit.model_copy(update=update))
        return replays

    def migrate(self, request: Request, now: float) -> Outbox:
        """Move to another verifier, re-prefilled from history; none with room: start over on the
        same one while it still heartbeats (its replies were lost on the way, e.g. in a dead NATS
        node, more likely than the verifier), else wait, up to the deadline, for a verifier with
        room (under `specbus up`, the restart of a stack's only verifier): plan_step leaves a
        request whose verifier is dead alone, and each boundary tries again."""
        old_id = request.verifier_id
        new_id = self.placement.pick("verifier", self.pinned_count, exclude=old_id)
        new_id = new_id or (old_id if self.placement.alive(old_id) else None)
        # The failed step's number is never planned again: the old verifier may still run that
        # batch (frozen, then thawed) and would answer a new row of the same step with its stored
        # result; and whichever verifier runs the request next starts from cached_len 0.
        request.verifier_len = 0
        request.step += 1
        if new_id is None:
            if not request.awaiting_verifier:
                request.awaiting_verifier = True
                self.counters["verifier_awaited"] += 1
                log.warning("no_verifier_to_migrate_to", request_id=request.request_id, verifier_id=old_id)
            return Outbox()
        request.awaiting_verifier = False
        if new_id != old_id:
            self.release(old_id, request.request_id)
            request.verifier_id = self.placement.count_pin(new_id)
        request.carried_degraded.append("migrated")
        self.count_degraded(request, ["migrated"])
        self.counters["migrated"] += 1
        log.warning("request_migrated", request_id=request.request_id, old=old_id, new=new_id)
        return Outbox()

    def verifier_failed(self, verifier_id: str, now: float, plan: StepPlan) -> Outbox:
        """A batch was not answered after the retry: avoid that verifier for a while and move
        every request pinned to it, but those in another lane's step in flight (that lane moves
        them when its own batch fails)."""
        self.placement.avoid(verifier_id)
        ours = {planned.request.request_id for planned in plan.rows.get(verifier_id, [])}
        outbox = Outbox()
        for request in [r for r in self.running.values() if r.verifier_id == verifier_id
                        and (r.request_id in ours or r.request_id not in self.in_flight)]:
            if now >= request.deadline:
                outbox.extend(self.end(request, "timeout", now))
            else:
                outbox.extend(self.migrate(request, now))
        return outbox

    def release(self, instance_id: str | None, request_id: str) -> None:
        if instance_id is not None:
            self.releases.setdefault(instance_id, []).append(request_id)

    def take_releases(self, instance_id: str) -> list[str]:
        pending = self.releases.pop(instance_id, [])
        if len(pending) > MAX_BATCH_ROWS:
            self.releases[instance_id] = pending[MAX_BATCH_ROWS:]
        return pending[:MAX_BATCH_ROWS]

    def restore_releases(self, instance_id: str, request_ids: list[str]) -> None:
        """Releases whose batch got no answer go out again with the next one (receivers ignore
        unknown ids), unless the instance is gone."""
        if request_ids and self.placement.alive(instance_id):
            self.releases.setdefault(instance_id, [])[:0] = request_ids

    # ------------------------------------------------------------------ finishing

    def end(self, request: Request, reason: FinishReason | None, now: float, *, batch_id: int | None = None,
            tokens: list[int] = (), num_draft: int = 0, num_accepted: int = 0, degraded: list[str] = (),
            expect_side_channel: bool = False, error: Error | None = None) -> Outbox:
        """Remove the request, free its slots on the next batches, and send its final commit
        (reason None: a StopNotice ended it, nothing is sent). error: the reason the client must
        read, carried by the final commit into the final chunk. With no live postprocessor the
        final chunk goes straight to the client."""
        self.running.pop(request.request_id, None)
        self.release(request.verifier_id, request.request_id)
        self.release(request.drafter_id, request.request_id)
        self.recent_ids.pop(request.request_id, None)
        self.recent_ids[request.request_id] = self.monotonic()
        self.counters[f"finished_{reason or 'stop_notice'}"] += 1
        if reason is None:
            return Outbox()
        if reason == "error" and error is None:
            error = internal_error(request.request_id, "the request failed in the scheduler (see its log)")
        alive = self.placement.alive(request.postprocessor_id)
        # its postprocessor died (the other not picked yet, or a restart coming): the final commit
        # waits, up to the deadline, to be replayed to one (replay_lost_finals)
        wait = not alive and request.postprocessor_id is not None and now < request.deadline \
            and reason not in ("cancelled", "timeout")
        if alive or wait:
            try:
                commit = self.commit(request, batch_id if batch_id is not None else request.last_batch_id, tokens,
                                     num_draft, num_accepted, degraded, reason, expect_side_channel, error)
            except Exception:  # the request must still end: its client gets the final chunk directly
                log.exception("final_commit_failed", request_id=request.request_id)
                reason, error = "error", internal_error(request.request_id, "the final commit could not be built")
            else:
                self.finishing[request.request_id] = (request, self.monotonic())
                if alive:
                    return Outbox(commits=[(request.postprocessor_id, commit)])
                request.awaiting_postprocessor = True
                self.counters["postprocessor_awaited"] += 1
                return Outbox()
        return Outbox(chunks=[(request.client_inbox, self.direct_final_chunk(request, reason, error))])

    def direct_final_chunk(self, request: Request, reason: FinishReason, error: Error | None = None) -> StreamChunk:
        """A request ending with no live postprocessor: the client still gets a final chunk.
        A cancelled one (often still queued, so it never had a postprocessor) ends as a running
        one does, with no error: the client asked for it, and an error would make the client
        library raise for a cancel that worked."""
        code = {"timeout": ErrorCode.timeout, "cancelled": ErrorCode.cancelled}.get(reason, ErrorCode.unavailable)
        if error is None and reason != "cancelled":
            error = Error(code=code, message=f"request ended ({reason}) with no postprocessor available",
                          request_id=request.request_id)
        chunk = StreamChunk(request_id=request.request_id, seq=request.seq, finish_reason=reason, error=error,
                            usage=request.usage())
        request.seq += 1
        return chunk

    def commit(self, request: Request, batch_id: int, tokens: list[int], num_draft: int, num_accepted: int,
               degraded: list[str], finish_reason: FinishReason | None, expect_side_channel: bool,
               error: Error | None = None) -> Commit:
        """The Commit for tokens already appended to the history (seq numbered here)."""
        first = request.seq == 0
        completion_len = len(request.completion) - len(tokens)
        commit = Commit(request_id=request.request_id, batch_id=batch_id, step=request.step, seq=request.seq,
                        scheduler_id=self.config.instance_id, client_inbox=request.client_inbox, token_ids=tokens,
                        num_draft=num_draft, num_accepted=num_accepted, finish_reason=finish_reason,
                        degraded=list(dict.fromkeys(degraded)), expect_side_channel=expect_side_channel,
                        usage=request.usage() if finish_reason else None,
                        prompt_token_ids=request.history[:request.prompt_len] if first else None,
                        logprobs=request.logprobs, stop=request.sampling.stop, stream=request.stream, error=error,
                        # a resumed request: the postprocessor detokenizes from what the client has
                        resume_token_ids=np.array(request.completion[:completion_len], dtype=np.int32)
                        if first and request.resumed_len else None)
        request.seq += 1
        # Kept by time, not only by count: a postprocessor is found dead heartbeat_timeout_s after
        # its last beat, and on a fast machine far more than REPLAY_COMMITS commits go out in that
        # time; replaying fewer would leave the client a gap it can never fill.
        now = self.monotonic()
        request.sent.append((commit, completion_len, now))
        while len(request.sent) > REPLAY_COMMITS and request.sent[0][2] < now - 2 * self.config.heartbeat_timeout_s:
            request.sent.popleft()
        if tokens:
            since_last = None if request.last_token_at is None else now - request.last_token_at
            self.metrics.committed(len(tokens), now - request.admitted_at, since_last)
            request.last_token_at = now
        return commit

    def drain(self, now: float) -> Outbox:
        """On shutdown: every running and queued request ends with finish_reason "error", code
        `shutting_down`: a hand-over, not a verdict (the client sends it to another scheduler,
        resuming after the tokens it read)."""
        outbox = Outbox()
        for request in [*self.running.values(), *self.waiting]:
            error = Error(code=ErrorCode.shutting_down, request_id=request.request_id,
                          message=f"scheduler {self.config.instance_id} is stopping; send the request again")
            outbox.extend(self.end(request, "error", now, error=error))
        self.waiting.clear()
        return outbox

    # ------------------------------------------------------------------ building a step

    def plan_step(self, now: float, lane: int | None = None) -> StepPlan:
        """Rows per verifier for the lane's requests (None: every lane's) not in a step already:
        the max_batch_rows requests that waited longest for a row; among them decode rows first
        (1 new token + planned drafts each), then prefill rows get chunks of the tokens left in
        max_step_tokens. The planned requests are in flight until end_step(plan)."""
        rows: dict[str, list[PlannedRow]] = {}
        draft_rows: dict[str, list[PlannedRow]] = {}
        by_verifier: dict[str, list[Request]] = {}
        for request in self.running.values():
            # A lane's own requests are never in a step when it plans (its steps run one at a time).
            ours = request.lane == lane if lane is not None else request.request_id not in self.in_flight
            # else it waits for a postprocessor, or for a verifier (see migrate), or its deadline
            if ours and self.placement.alive(request.postprocessor_id) and self.placement.alive(request.verifier_id):
                by_verifier.setdefault(request.verifier_id, []).append(request)
        self.num_plans += 1
        for verifier_id, requests in by_verifier.items():
            budget = self.config.max_step_tokens
            planned: list[PlannedRow] = []
            requests = sorted(requests, key=lambda r: r.last_planned)[:self.config.max_batch_rows]
            decode = [r for r in requests if r.pending_len == 1 and not r.scoring]
            prefill = [r for r in requests if r.pending_len > 1 or (r.scoring and r.pending_len >= 1)]
            for request in decode:
                if budget < 1:
                    break
                base_k = max((r.num_draft for r in draft_rows.get(request.drafter_id, [])), default=0)
                row = self.plan_decode_row(request, budget, self.config.max_step_tokens - budget, base_k,
                                           alone=len(requests) == 1)
                budget -= 1 + row.num_draft
                planned.append(row)
                if row.num_draft:
                    draft_rows.setdefault(request.drafter_id, []).append(row)
            for request in prefill:
                if budget < 1:
                    break
                # A request with completion tokens (resumed, or migrated to a verifier that starts
                # from scratch) stops its prefill one token short: the next token then comes from
                # a decode step with drafts at the same position as in the interrupted run, so a
                # seeded sampled request draws the same tokens (docs/PROTOCOL.md#scheduler-failover).
                pending = request.pending_len - (len(request.completion) > 0)
                chunk = min(pending, budget)
                end = request.verifier_len + chunk
                planned.append(PlannedRow(request, request.verifier_len, end,
                                          emit=end == len(request.history) and not request.scoring, num_draft=0))
                budget -= chunk
            for row in planned:
                row.request.last_planned = self.num_plans
                self.in_flight.add(row.request.request_id)
            if planned:
                rows[verifier_id] = planned
        return StepPlan(rows, draft_rows)

    def end_step(self, plan: StepPlan) -> None:
        """The plan's step is over (committed, failed or cancelled): its requests may be planned,
        ended or moved again."""
        for planned_rows in plan.rows.values():
            for planned in planned_rows:
                self.in_flight.discard(planned.request.request_id)

    def plan_decode_row(self, request: Request, budget: int, base_tokens: int = 0, base_k: int = 0,
                        alone: bool = True) -> PlannedRow:
        """A decode row with up to the request's k drafts (fewer near max_tokens or the budget);
        for a greedy or Gumbel-coupled row the k of adaptive_k, given the base_tokens new tokens
        of the rows planned before it on its verifier, the base_k drafts its drafter is already
        asked for, and whether it is alone in its verify batch. A rejection-sampled row always
        takes its k: its draws depend on k, and a seeded request must draw the same tokens again,
        after a failover too, where the new scheduler knows nothing of the acceptance the old one
        measured (docs/PROTOCOL.md#adaptive-k)."""
        remaining = request.sampling.max_tokens - len(request.completion)
        wanted = max(min(request.speculative.num_speculative_tokens, remaining - 1, budget - 1), 0)
        alive = self.placement.alive(request.drafter_id)
        if wanted and alive and self.adaptive_row(request):
            wanted = self.adaptive.choose(request.adaptive, self.prior_key(request), wanted, request.verifier_id,
                                          base_tokens, request.drafter_id, base_k, alone)
        row = PlannedRow(request, request.verifier_len, len(request.history), emit=True, num_draft=wanted, decode=True)
        if row.num_draft and not alive:
            row.num_draft = 0
            row.degraded.append("draft_timeout")
        return row

    def adaptive_row(self, request: Request) -> bool:
        """Whether the request's k per step is adaptive_k's: greedy and Gumbel-coupled rows, whose
        tokens do not depend on k, when the scheduler's adaptive_k is on."""
        return self.adaptive is not None and (request.sampling.greedy or request.sampling.gumbel)

    @staticmethod
    def prior_key(request: Request) -> tuple[str, str]:
        """Whose history a request's acceptance starts from: its drafter's, for its acceptance rule."""
        rule = "greedy" if request.sampling.greedy else "gumbel"
        return request.drafter_id or "", f"{rule}/{request.speculative.draft_mode}"

    def draft_timed(self, drafter_id: str, message: DraftRequest, response: DraftResponse | None,
                    seconds: float) -> None:
        """A draft batch's round trip, for adaptive_k (by its largest k). An unanswered batch is
        left out: a dead drafter is placement's business, and its timeout says nothing of drafting.
        So is one that feeds a row's whole history (cached_len 0: a new request's prompt), a
        one-time cost that would pass for the cost of every step at that k."""
        if self.adaptive is not None and message.rows and response is not None and \
                all(r.cached_len for r in message.rows):
            self.adaptive.draft_timed(drafter_id, max(r.num_draft for r in message.rows), seconds)

    def verify_timed(self, verifier_id: str, message: VerifyRequest, response: VerifyResponse | Error | None,
                     seconds: float, commit_s: float, retried: bool) -> None:
        """A verify batch's round trip, for adaptive_k (by its new tokens, drafts included), and
        the commit after it; a batch that needed a retry or got no answer is left out."""
        if self.adaptive is not None and message.rows and isinstance(response, VerifyResponse) and not retried:
            tokens = sum(len(r.new_token_ids) + len(r.draft_token_ids) for r in message.rows)
            self.adaptive.verify_timed(verifier_id, tokens, seconds, commit_s)

    def new_batch_id(self) -> int:
        batch_id = self.next_batch_id
        self.next_batch_id += 1
        return batch_id

    def draft_batches(self, plan: StepPlan, now: float) -> dict[str, DraftRequest]:
        """One DraftRequest per drafter with rows, plus release-only batches for drafters with
        slots to free and nothing else to do. The request and its answer (MAX_DRAFT_SUPPORT
        ids per sampled draft at most) are kept under max_payload: rows past it run this step
        without drafts, flagged draft_timeout. A row carries its request's pending target
        features, as many as the request's room leaves (features.py)."""
        batches = {}
        deadline = now + self.config.draft_timeout_s
        drafters = set(plan.draft_rows) | self.live_releases("drafter")
        for drafter_id in sorted(drafters):
            release = self.take_releases(drafter_id)
            room = None if self.max_payload is None else \
                self.max_payload - MESSAGE_OVERHEAD_BYTES - ROW_OVERHEAD_BYTES // 8 * len(release)
            request_room = answer_room = room
            rows, kept = [], []
            for planned in plan.draft_rows.get(drafter_id, []):
                request = planned.request
                new_ids = request.history[request.drafter_len:]
                request_bytes = ROW_OVERHEAD_BYTES + 4 * len(new_ids) + sum(a.nbytes for a in request.sampling.arrays())
                sampled = request.speculative.draft_mode == "sample" and not request.sampling.greedy
                answer_bytes = ROW_OVERHEAD_BYTES + planned.num_draft * (4 + 8 * MAX_DRAFT_SUPPORT * sampled)
                if room is not None and (request_bytes > request_room or answer_bytes > answer_room):
                    planned.num_draft = 0
                    planned.degraded.append("draft_timeout")
                    self.counters["rows_undrafted_payload"] += 1
                    continue
                block = features.take(request.feature_blocks, MAX_FEATURE_BLOCK_BYTES if room is None
                                      else request_room - request_bytes)
                planned.features_sent = None if block is None else block.end
                if room is not None:
                    request_bytes += 0 if block is None else features.BLOCK_OVERHEAD_BYTES + len(block.data)
                    request_room, answer_room = request_room - request_bytes, answer_room - answer_bytes
                rows.append(DraftRow(request_id=request.request_id, row=len(rows), step=request.step,
                                     cached_len=request.drafter_len, new_token_ids=new_ids,
                                     num_draft=planned.num_draft, draft_mode=request.speculative.draft_mode,
                                     sampling=request.sampling.row_sampling(), prompt_len=request.prompt_len,
                                     features=block))
                kept.append(planned)
            if drafter_id in plan.draft_rows:
                plan.draft_rows[drafter_id] = kept
            batches[drafter_id] = DraftRequest(batch_id=self.new_batch_id(), scheduler_id=self.config.instance_id,
                                               deadline=deadline, rows=rows, release=release)
        return batches

    def apply_draft(self, plan: StepPlan, drafter_id: str, request: DraftRequest,
                    response: DraftResponse | None) -> None:
        """Drafts into the plan. No answer (late, dead, error reply): its rows run k=0 flagged
        draft_timeout; a need_resync row runs k=0 flagged resync and is resent whole next step."""
        if response is None:
            self.restore_releases(drafter_id, request.release)
        results = {} if response is None else {r.request_id: r for r in response.rows}
        for planned in plan.draft_rows.get(drafter_id, []):
            request = planned.request
            result = results.get(request.request_id)
            if result is None:
                planned.num_draft = 0
                planned.degraded.append("draft_timeout")
            elif result.need_resync:
                request.restart_drafter()
                planned.num_draft = 0
                planned.degraded.append("resync")
            else:
                request.drafter_len = len(request.history)  # unchanged since the draft batch was built
                if planned.features_sent is not None:
                    features.delivered(request, planned.features_sent)
                planned.drafted_by = drafter_id
                if len(result.draft_token_ids) > planned.num_draft:
                    self.counters["dropped_excess_drafts"] += 1
                    log.warning("drafts_over_plan", request_id=request.request_id, drafter_id=drafter_id,
                                num_draft=len(result.draft_token_ids), planned=planned.num_draft)
                    planned.num_draft = 0
                else:
                    planned.num_draft = len(result.draft_token_ids)
                    planned.draft = DraftTokens(draft_token_ids=result.draft_token_ids, proposal=result.proposal)

    def verify_batches(self, plan: StepPlan, now: float) -> dict[str, VerifyRequest]:
        """One VerifyRequest per verifier with rows (or only slots to release). The deadline
        covers the first try and the retries, so the retry can re-send the same message. A batch
        is kept under max_payload: rows past it wait for the next step (their drafts are
        dropped); a request whose row is too large alone ends with `too_large` (plan.outbox).
        A request drafted by an eagle drafter asks for the target's features from its
        features_end, unless the answer has no room for them left: then it asks next step
        (features.py)."""
        deadline = now + self.config.verify_timeout_s * (self.config.verify_retries + 1)
        verifiers = set(plan.rows) | self.live_releases("verifier")
        for verifier_id in sorted(verifiers):
            release = self.take_releases(verifier_id)
            budget = None if self.max_payload is None else \
                self.max_payload - MESSAGE_OVERHEAD_BYTES - ROW_OVERHEAD_BYTES // 8 * len(release)
            answer_room = None if self.max_payload is None else self.max_payload - MESSAGE_OVERHEAD_BYTES
            per_position = features.bytes_per_position(self.placement, verifier_id)
            rows, kept = [], []
            for planned in plan.rows.get(verifier_id, []):
                request = planned.request
                wants_side = request.logprobs.wants_side_channel
                features_from = request.features_end if features.drafted_by_eagle(self.placement, request) else None
                answer = ROW_OVERHEAD_BYTES + 4 * (planned.num_draft + 1)
                if features_from is not None:
                    feature_bytes = features.answer_bytes(features_from, planned.end, planned.num_draft, per_position)
                    if answer_room is not None and answer + feature_bytes > answer_room:
                        features_from = None
                        self.counters["features_deferred_payload"] += 1
                    else:
                        answer += feature_bytes
                row = VerifyRow(request_id=request.request_id, row=len(rows), step=request.step,
                                cached_len=planned.cached_len,
                                new_token_ids=request.history[planned.cached_len:planned.end],
                                draft_token_ids=planned.draft.draft_token_ids, proposal=planned.draft.proposal,
                                sampling=request.sampling.row_sampling(), logprobs=request.row_logprobs(),
                                postprocessor_id=request.postprocessor_id if wants_side else None,
                                prompt_len=request.prompt_len, emit=planned.emit, features_from=features_from)
                size = verify_row_bytes(row)
                if budget is not None and size > budget:
                    plan.outbox.extend(self.defer_oversized_row(planned, size, budget, now, alone=not rows))
                    continue
                budget = None if budget is None else budget - size
                answer_room = None if answer_room is None else answer_room - answer
                planned.features_from = features_from
                rows.append(row)
                kept.append(planned)
            if verifier_id in plan.rows:
                plan.rows[verifier_id] = kept
            plan.verify_requests[verifier_id] = VerifyRequest(
                batch_id=self.new_batch_id(), scheduler_id=self.config.instance_id, deadline=deadline, rows=rows,
                release=release)
        return plan.verify_requests

    def defer_oversized_row(self, planned: PlannedRow, size: int, budget: int, now: float, alone: bool) -> Outbox:
        """A row that does not fit in its batch's max_payload: it waits for the next step, or,
        when it does not fit even alone, its request ends with `too_large`."""
        request = planned.request
        self.in_flight.discard(request.request_id)
        if not alone:
            self.counters["rows_deferred_payload"] += 1
            log.info("row_deferred_payload", request_id=request.request_id, row_bytes=size, budget=budget)
            return Outbox()
        log.warning("row_too_large", request_id=request.request_id, row_bytes=size, max_payload=self.max_payload)
        return self.end(request, "error", now, error=Error(
            code=ErrorCode.too_large, request_id=request.request_id,
            message=f"one step of this request needs a {size}-byte message, over the bus's max_payload of "
                    f"{self.max_payload}"))

    # ------------------------------------------------------------------ committing a step

    def apply_verify(self, plan: StepPlan, verifier_id: str, response: VerifyResponse | Error | None,
                     now: float) -> Outbox:
        """Commit a verifier's answer. None (no answer after the retry): migrate its requests.
        An Error reply (the verifier refused the message itself): its requests end with "error"."""
        request_message = plan.verify_requests[verifier_id]
        if response is None:
            self.restore_releases(verifier_id, request_message.release)
            return self.verifier_failed(verifier_id, now, plan)
        if isinstance(response, Error):
            self.restore_releases(verifier_id, request_message.release)
            log.error("verify_batch_refused", verifier_id=verifier_id, batch_id=request_message.batch_id,
                      code=response.code.value, field=response.field, message=response.message)
            outbox = Outbox()
            for planned in plan.rows.get(verifier_id, []):
                outbox.extend(self.end(planned.request, "error", now, error=client_error(
                    response, planned.request.request_id, planned.request.seq == 0)))
            return outbox
        self.counters["steps"] += bool(plan.rows.get(verifier_id))
        results = {r.request_id: r for r in response.rows}
        outbox = Outbox()
        for planned in plan.rows.get(verifier_id, []):
            request = planned.request
            if request.request_id not in self.running:  # ended while the step ran (cannot today; cheap guard)
                continue
            result = results.get(request.request_id)
            request.last_batch_id = request_message.batch_id
            if result is None or result.step != request.step:
                self.counters["dropped_missing_results"] += 1
                log.warning("verify_result_missing", request_id=request.request_id, verifier_id=verifier_id,
                            batch_id=request_message.batch_id)
                request.step += 1
                continue
            try:
                outbox.extend(self.commit_result(planned, result, request_message.batch_id,
                                                 verifier_id in plan.retried, now))
            except Exception:  # this request's bug ends this request; the batch's other rows go on
                log.exception("commit_result_failed", request_id=request.request_id)
                outbox.extend(self.end(request, "error", now, error=internal_error(
                    request.request_id, "the scheduler failed to commit a step (see its log)")))
        return outbox

    def commit_result(self, planned: PlannedRow, result, batch_id: int, retried: bool, now: float) -> Outbox:
        request = planned.request
        request.step += 1
        request.num_steps += 1
        degraded = planned.degraded + (["verifier_retry"] if retried else [])
        if result.error is not None:
            log.warning("verify_row_failed", request_id=request.request_id, code=result.error.code.value,
                        field=result.error.field, message=result.error.message)
            error = client_error(result.error, request.request_id, first=request.seq == 0)
            return self.end(request, "error", now, batch_id=batch_id, degraded=degraded, error=error)
        if result.need_resync:
            request.verifier_len = 0
            request.carried_degraded += [*degraded, "resync"]
            self.count_degraded(request, [*degraded, "resync"])
            return Outbox()
        if planned.features_from is not None and not features.receive(request, result.features):
            self.counters["features_dropped"] += 1
        tokens = result.token_ids.tolist()
        if planned.emit != bool(tokens) or result.num_draft != planned.num_draft:
            self.counters["bad_verify_results"] += 1
            log.warning("verify_result_inconsistent", request_id=request.request_id, emit=planned.emit,
                        num_tokens=len(tokens), num_draft=result.num_draft, planned=planned.num_draft)
            return self.end(request, "error", now, batch_id=batch_id, degraded=degraded, error=internal_error(
                request.request_id, f"the verifier's result does not match the step ({len(tokens)} tokens, "
                                    f"{result.num_draft} drafts for {planned.num_draft} planned)"))
        request.verifier_len = planned.end + result.num_accepted
        request.num_draft_proposed += planned.num_draft
        request.num_draft_accepted += result.num_accepted
        if planned.decode:
            request.speculative_lengths[planned.num_draft] += 1
        if planned.num_draft and self.adaptive_row(request):
            self.adaptive.verified(request.adaptive, self.prior_key(request), planned.num_draft, result.num_accepted)
        self.metrics.verified(request.sampling.greedy, request.speculative.draft_mode, planned.num_draft,
                              result.num_accepted)
        if planned.drafted_by is not None:
            drafted(self, request, planned.drafted_by, result.num_accepted)
        if result.residual_fallback:
            degraded.append("residual_fallback")
        kept, finish_reason = [], None
        if tokens:
            kept, finish_reason = cut_tokens(tokens, len(request.completion), request.sampling, self.eos_ids)
        request.history += kept
        if finish_reason is None and request.scoring and request.pending_len == 0:
            finish_reason = "length"
        if finish_reason is None and now >= request.deadline:
            finish_reason = "timeout"
        if not kept and finish_reason is None:
            request.carried_degraded += degraded
            self.count_degraded(request, degraded)
            return Outbox()
        self.count_degraded(request, degraded)
        degraded = request.carried_degraded + degraded
        request.carried_degraded = []
        expect_side = request.logprobs.wants_side_channel and (bool(kept) or request.awaits_prompt_logprobs)
        num_accepted = min(result.num_accepted, len(kept))
        if finish_reason is not None:
            return self.end(request, finish_reason, now, batch_id=batch_id, tokens=kept, num_draft=planned.num_draft,
                            num_accepted=num_accepted, degraded=degraded, expect_side_channel=expect_side)
        return Outbox(commits=[(request.postprocessor_id, self.commit(
            request, batch_id, kept, planned.num_draft, num_accepted, degraded, None, expect_side))])

    def count_degraded(self, request: Request, reasons: list[str]) -> None:
        for reason in set(reasons):
            request.degraded_steps[reason] += 1
            self.counters[f"degraded_{reason}"] += 1

    def stats(self) -> dict:
        return {"running": len(self.running), "queued": len(self.waiting), **self.counters}
