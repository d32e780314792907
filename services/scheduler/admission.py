"""Admission: whether a GenerateRequest may queue at this scheduler, and which queued request
starts next. No NATS, no awaits: services/scheduler/scheduler_core.py owns one `Admission` and
asks it on every GenerateRequest and at every step boundary.

- Refused before any work, with the field named: `overloaded` beyond max_running + max_queue
  (with the fair share of services/scheduler/budget/fair_share.py: a user under its share takes the
  place of the newest queued request of the user most over it), `duplicate_request_id` for an
  id running, queued or finished in the last FINISHED_ID_TTL_S (a postprocessor drops commits
  for an id it finished that long, so a reused id would wait out its timeout), `invalid_field`
  for a reply subject over MAX_INBOX_LEN, max_tokens over the cap (the least of max_tokens_cap and
  the verifiers' max_seq_len), a token id outside the vocabulary wherever the request names one,
  a prompt that leaves no room in the verifiers' max_seq_len, or a resume that leaves nothing of
  max_tokens, `too_large` for a first commit
  over max_payload.
- The queue is in arrival order; at a boundary its cancelled, refused and expired requests
  leave it (`sweep`), and the others start fairest first (`start_order`) while fewer than
  max_running run.

The queue is Admission's own table; the core's running requests are an argument, read only, and
what an admission counts comes back as `Changes` (scheduler_types.py) for the core to apply.
"""

import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping

import structlog

from text.chat_template import ChatTemplateError, render_chat
from text.grammar import Grammars, llg_tokenizer
from text.tokenizer import Tokenizer, check_in_vocabulary
from schemas.bus.codec import encode
from schemas.config import FINISHED_ID_TTL_S, SchedulerConfig
from schemas.errors import ErrorCode, SpecbusError
from schemas.commits import Commit
from schemas.generation import GenerateRequest, StructuredOutputs, check_limits
from schemas.bus.protocol import MAX_INBOX_LEN
from schemas.streams import Usage
from schemas.bus.wire import Error, FinishReason
from services.scheduler.budget.fair_share import most_over_share, parse_user_weights, share, start_order_key, user_of_inbox
from services.scheduler.budget.payload import first_commit_bytes
from services.scheduler.placement import Placement
from services.scheduler.scheduler_types import Changes, Request
from services.runtime.metrics import SchedulerMetrics

log = structlog.get_logger(__name__)

MAX_RECENT_IDS = 1 << 16  # finished ids remembered at most (the oldest are forgotten first)


def prompt_field(request: GenerateRequest) -> str:
    if request.messages is not None:
        return "messages"
    return "prompt" if request.prompt is not None else "prompt_token_ids"


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


class RecentIds:
    """Request ids that finished in the last FINISHED_ID_TTL_S (monotonic seconds), oldest first."""

    def __init__(self, monotonic: Callable[[], float]):
        self.monotonic = monotonic
        self.ended_at: dict[str, float] = {}

    def remember(self, request_id: str) -> None:
        self.ended_at.pop(request_id, None)
        self.ended_at[request_id] = self.monotonic()

    def __contains__(self, request_id: str) -> bool:
        expiry = self.monotonic() - FINISHED_ID_TTL_S
        recent = self.ended_at
        while recent and (len(recent) > MAX_RECENT_IDS or next(iter(recent.values())) < expiry):
            del recent[next(iter(recent))]
        return request_id in recent


class Admission:
    """The queue (`waiting`, in arrival order) and the checks a request passes to join it
    (module docstring). `running`, where an argument, is the core's table of running requests,
    read for the loads."""

    def __init__(self, config: SchedulerConfig, tokenizer: Tokenizer, placement: Placement,
                 metrics: SchedulerMetrics, monotonic: Callable[[], float]):
        self.config = config
        self.tokenizer = tokenizer
        self.placement = placement
        self.metrics = metrics
        self.monotonic = monotonic
        self.user_weights = parse_user_weights(config.user_weights)
        self.waiting: deque[Request] = deque()
        self.recent = RecentIds(monotonic)
        self.max_token_chars: int | None = None  # characters of the vocabulary's longest token, once needed
        self.grammars: Grammars | None = None  # compiled structured outputs, made on first use

    @property
    def capacity(self) -> int:
        return self.config.max_running + self.config.max_queue

    def admit(self, request: GenerateRequest, client_inbox: str, prompt_ids: list[int], now: float,
              running: Mapping[str, Request], max_payload: int | None) -> tuple[Request, Changes]:
        """Queue a valid request (deadline: now + timeout_s, so time queued counts against it)
        and count it, or raise SpecbusError before any work (module docstring); max_payload: the
        bus's (None: unchecked)."""
        user = user_of_inbox(client_inbox)
        victim = self.check_capacity(user, running)
        self.check_request_id(request.request_id, running)
        if len(client_inbox) > MAX_INBOX_LEN:
            raise SpecbusError(ErrorCode.invalid_field, f"the reply subject is {len(client_inbox)} characters, "
                                                        f"at most {MAX_INBOX_LEN}", "reply_subject")
        length_error = self.check_prompt(len(prompt_ids), request.sampling.max_tokens, prompt_field(request))
        if length_error is not None:
            raise length_error
        resumed = self.check_resume(request)
        self.check_first_commit(request, client_inbox, prompt_ids, max_payload)
        state = Request(request_id=request.request_id, client_inbox=client_inbox, history=[*prompt_ids, *resumed],
                        prompt_len=len(prompt_ids), sampling=request.sampling, logprobs=request.logprobs,
                        speculative=request.speculative, stream=request.stream, deadline=now + request.timeout_s,
                        admitted_at=self.monotonic(), resumed_len=len(resumed), user=user, client_version=request.v)
        changes = Changes()
        if victim is not None:  # refused in the newcomer's place, at the next boundary
            victim.end_reason = "error"
            victim.end_error = Error(code=ErrorCode.overloaded, request_id=victim.request_id,
                                     message=f"refused for fair share: client user {victim.user!r} is over its share "
                                             f"of {self.capacity} requests")
            changes.counts["refused_fair_share"] += 1
            self.metrics.requests_by_user.labels(victim.user, "fair_share").inc()
        self.waiting.append(state)
        changes.counts["admitted"] += 1
        self.metrics.requests_by_user.labels(user, "admitted").inc()
        return state, changes

    def user_loads(self, running: Mapping[str, Request]) -> Counter:
        """Requests running or queued per client user, those already refused left out."""
        return Counter(r.user for r in [*running.values(), *self.waiting] if r.end_error is None)

    def check_capacity(self, user: str, running: Mapping[str, Request]) -> Request | None:
        """None when there is room; else the queued request to refuse in favour of user, who is
        under its fair share (fair_share.py). SpecbusError overloaded when user is at or over its
        share, or nothing queued can be refused."""
        loads = self.user_loads(running)
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

    def check_request_id(self, request_id: str, running: Mapping[str, Request]) -> None:
        """SpecbusError duplicate_request_id for an id in use or finished in the last FINISHED_ID_TTL_S."""
        if request_id in running or self.queued(request_id) is not None:
            raise SpecbusError(ErrorCode.duplicate_request_id, f"request {request_id} is already running",
                               "request_id")
        if request_id in self.recent:
            raise SpecbusError(ErrorCode.duplicate_request_id,
                               f"request {request_id} finished less than {FINISHED_ID_TTL_S:.0f} s ago; "
                               f"use a fresh request_id", "request_id")

    def check_prompt(self, prompt_len: int, max_tokens: int, field_name: str) -> SpecbusError | None:
        """The error for a prompt that leaves no room in max_seq_len (None while no verifier is
        known; the start checks again): a generating request needs one position past its prompt."""
        limit = self.placement.max_seq_len()
        if limit is None or prompt_len + (max_tokens > 0) <= limit:
            return None
        room = "" if max_tokens == 0 else " and at least one generated token"
        return SpecbusError(ErrorCode.invalid_field, f"the prompt is {prompt_len} tokens; max_seq_len {limit} "
                                                     f"holds the prompt{room}", field_name)

    def check_request(self, request: GenerateRequest) -> None:
        """The checks a decoded request passes before its prompt is tokenized: max_tokens within
        the cap (the least of max_tokens_cap and max_seq_len, schemas.generation.check_limits),
        every token id it names in the vocabulary, as prompt ids are (stop_token_ids, logit_bias,
        logprob_token_ids: refused here, not first by a verifier mid-request) and a text prompt
        that can fit (check_prompt_text). The grammar is check_grammar's (in a worker thread)."""
        check_limits(request, max_tokens_cap=self.config.max_tokens_cap, max_model_len=self.placement.max_seq_len())
        vocab_size = self.tokenizer.vocab_size
        check_in_vocabulary(request.sampling.stop_token_ids, vocab_size, "sampling.stop_token_ids")
        if request.sampling.logit_bias is not None:
            check_in_vocabulary(request.sampling.logit_bias.token_ids, vocab_size, "sampling.logit_bias")
        check_in_vocabulary(request.logprobs.logprob_token_ids, vocab_size, "logprobs.logprob_token_ids")
        self.check_prompt_text(request)

    def check_grammar(self, request: GenerateRequest) -> None:
        """A structured output's grammar compiles within text/grammar.py's LIMITS and a fresh
        matcher takes its first tokens (text/grammar.py `probe`: bounded time and memory), else
        SpecbusError naming the field. Thread-safe: the scheduler calls it in a worker thread."""
        if request.sampling.structured_outputs is not None:
            self.compiled_grammars().check(request.sampling.structured_outputs, self.tokenizer.vocab_size)

    def compiled_grammars(self) -> Grammars:
        """The compiled grammars, made (the tokenizer's grammar view, a first compile) on first use."""
        if self.grammars is None:
            grammars = Grammars(llg_tokenizer(self.tokenizer, self.tokenizer.vocab_size))
            grammars.check(StructuredOutputs(json_object=True), self.tokenizer.vocab_size)
            self.grammars = grammars
        return self.grammars

    def warm_grammars(self) -> None:
        """compiled_grammars before the scheduler serves, so no request pays for them; a tokenizer
        llguidance cannot read is logged once here (a request with a grammar then fails alone)."""
        started = time.monotonic()
        try:
            self.compiled_grammars()
        except Exception as exc:
            log.warning("grammars_unavailable", error=f"{type(exc).__name__}: {exc}")
            return
        log.info("grammars_warmed", seconds=round(time.monotonic() - started, 3))

    def check_prompt_text(self, request: GenerateRequest) -> None:
        """Refuse a text prompt or chat that cannot fit in max_seq_len before tokenizing it
        (tokenizing holds the event loop, and megabytes of text take the tokenizer long): no
        token covers more than max_token_chars characters, so a text over twice max_token_chars
        per position is too long whatever the tokenizer's normalizer does (the factor 2 leaves
        room for one that drops characters). A chat's contents are part of its rendered text,
        so their sum bounds it."""
        limit = self.placement.max_seq_len()
        if (request.prompt is None and request.messages is None) or limit is None:
            return
        if self.max_token_chars is None:
            self.max_token_chars = max(map(len, self.tokenizer.hf.get_vocab()), default=1)
        most = 2 * self.max_token_chars * limit
        chars = len(request.prompt) if request.prompt is not None else sum(len(m.content) for m in request.messages)
        if chars > most:
            raise SpecbusError(ErrorCode.invalid_field, f"{chars} characters of text; "
                                                        f"max_seq_len {limit} holds at most {most}",
                               prompt_field(request))

    def check_first_commit(self, request: GenerateRequest, client_inbox: str, prompt_ids: list[int],
                           max_payload: int | None) -> None:
        """SpecbusError too_large when the first commit (it carries the prompt, and a replay also
        the completion) or its prompt logprobs could not fit in one NATS message of max_payload."""
        if max_payload is None:
            return
        commit = Commit(request_id=request.request_id, batch_id=0, step=0, seq=0, scheduler_id=self.config.instance_id,
                        client_inbox=client_inbox, prompt_token_ids=prompt_ids, logprobs=request.logprobs,
                        stop=request.sampling.stop, usage=Usage())
        size = first_commit_bytes(len(encode(commit)), request.sampling.max_tokens, len(prompt_ids), request.logprobs)
        if size > max_payload:
            raise SpecbusError(ErrorCode.too_large, f"a prompt of {len(prompt_ids)} tokens needs messages of about "
                                                    f"{size} bytes, over the bus's max_payload of {max_payload}",
                               prompt_field(request))

    def queued(self, request_id: str) -> Request | None:
        return next((r for r in self.waiting if r.request_id == request_id), None)

    def started(self, request: Request) -> None:
        """A queued request the core started: it leaves the queue."""
        self.waiting.remove(request)

    def clear(self) -> None:
        """The queue emptied (the core ended every queued request: shutdown)."""
        self.waiting.clear()

    def sweep(self, now: float, running: Mapping[str, Request]) -> list[tuple[Request, FinishReason, Error | None]]:
        """Take out of the queue, and return with the reason each ends with, the queued requests
        that end at this boundary (now: time.time()): cancelled or refused for fair share,
        past their deadline, or, when one could start, with a prompt the verifiers known now
        cannot hold."""
        ended = []
        for request in list(self.waiting):
            if request.end_reason is not None or now >= request.deadline:
                ended.append((request, request.end_reason or "timeout", request.end_error))
            elif len(running) < self.config.max_running and (length_error := self.check_prompt(
                    request.prompt_len, request.sampling.max_tokens, "prompt_token_ids")) is not None:
                ended.append((request, "error", Error.from_exception(length_error, request.request_id)))
            else:
                continue
            self.waiting.remove(request)
        return ended

    def start_order(self, running: Mapping[str, Request]) -> Iterator[Request]:
        """The queued requests that may start now, fairest first (fair_share.start_order_key over
        the requests running at each pick; arrival order between equals), while fewer than
        max_running run (running: the core's running requests, read at each pick). The caller
        starts each (or leaves it queued) before taking the next."""
        candidates = list(self.waiting)
        while candidates and len(running) < self.config.max_running:
            fairness = start_order_key(Counter(r.user for r in running.values()), self.user_weights)
            request = min(candidates, key=lambda r: fairness(r.user))
            candidates.remove(request)
            yield request
