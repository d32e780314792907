"""The specbus client library: send a GenerateRequest, read its StreamChunks.

    async with Client("nats://127.0.0.1:4222") as client:
        async for chunk in client.stream(make_request("def main():", max_tokens=32)):
            print(chunk.text, end="", flush=True)
        result = await client.generate(make_request("x = 1", max_tokens=8, logprobs=5))
        answer = await client.generate(make_request(messages=[{"role": "user", "content": "Hi!"}]))
        scores = await client.generate(score_request([5, 17, 42, 9]))  # prompt logprobs only
        print(json.dumps(result.to_json()))

Protocol (docs/PROTOCOL.md#ordering): subscribe a fresh inbox (`_INBOX.<user>.<random>`), publish the
request to `<p>.generate.<user>` with reply=inbox, read StreamChunks until the final one; a
cancel goes to `<p>.cancel.<user>`. `<user>` is the NATS login (DEFAULT_CLIENT_USER "client"
without one): the only subjects the server lets that user use, and how the scheduler knows whose
request it is. Chunks are reordered by seq,
duplicates dropped, and a final chunk that arrives with earlier seqs missing waits `gap_grace_s`
for them, then raises StreamBroken. Every wait is bounded: the whole request by timeout_s +
timeout_margin_s, the silence of a started request by idle_timeout_s (chunks and Admitted
both break it: its scheduler sends Admitted `started` again while the request runs, so only a
request no scheduler runs any more falls silent); a timeout raises StreamTimeout and sends a
CancelRequest. An Error chunk raises RequestError
(Overloaded when the scheduler refused the request for lack of room); a request or inbox the
NATS server refuses this user raises RequestError with code `forbidden` at once.
Beside the chunks the scheduler answers Admitted: on arrival (queued) and when the request
starts (and again, as a keepalive, while it runs); from the start on, idle_timeout_s also
bounds the wait for the first chunk.

Failover (docs/PROTOCOL.md#scheduler-failover; `failover=False` turns it off): the client reads
the schedulers' heartbeats. When the scheduler running a request is silent for
heartbeat_timeout_s, or the stream lost something on the way (a gap before the final chunk, an
`unavailable` error chunk that names no scheduler: a lost commit, nothing for idle_timeout_s),
the request is sent again as a new run resuming after the tokens already read (same seed, same
positions: the same output), at most MAX_FAILOVERS times in a row (`Stream.num_failovers`); only
then do the errors above apply.
A request no scheduler acknowledged within admission_timeout_s (it, or the answer, was lost in a
dying NATS node) is sent again the same way, and so is one whose scheduler stops (SIGTERM: an
error chunk `shutting_down`), to another scheduler.
A request whose scheduler died waits (up to its deadline) until another scheduler heartbeats, so
the supervised restart of a stack's only scheduler takes it over too.
"""

from __future__ import annotations

import asyncio
import math
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import numpy as np
import structlog

from schemas.bus.codec import decode_any, decode_heartbeat, encode
from schemas.config import DEFAULT_NATS_URL, HEARTBEAT_TIMEOUT_S, BusConfig, load_config
from schemas.errors import CodecError, ErrorCode, SpecbusError
from schemas.generation import CancelRequest, GenerateRequest
from schemas.streams import Admitted, SamplingMask, StreamChunk, TokenLogprob, Usage
from schemas.bus.subjects import DEFAULT_CLIENT_USER, DEFAULT_PREFIX, Subjects
from schemas.bus.versions import WINDOW, Window
from schemas.bus.wire import Error
from services.client_requests import make_request, score_request  # the library's API, as before
from services.runtime.auth import CLIENT_MAX_PAYLOAD, PermissionDenied, inbox_prefix
from services.runtime.bus import NO_RESPONDERS_STATUS, BusError, connect, permission_watch, publish, tls_context

log = structlog.get_logger(__name__)

MAX_BUFFERED_CHUNKS = 1024  # out-of-order chunks held while waiting for a missing seq
SCHEDULER_POLL_S = 0.05  # how often a failover waiting for a live scheduler looks again
MAX_FAILOVERS = 3  # failovers in a row (Stream.num_failovers) before a request fails with StreamBroken
NO_RESPONDERS_RETRY_S = 1.0  # before sending again when live schedulers did not listen
MAX_RUN_ID_STEM = 110  # a failover run's id is <stem>.failover<n>, within RequestId's 128 characters


class ClientError(SpecbusError):
    """Base of the errors the client library raises."""


class RequestError(ClientError):
    """The service ended the request with an Error (StreamChunk.error). `partial` is what
    generate() had collected before it (None from stream())."""

    def __init__(self, code: ErrorCode | str, message: str, field: str | None = None, request_id: str | None = None):
        super().__init__(code, message, field)
        self.request_id = request_id
        self.partial: GenerationResult | None = None

    @classmethod
    def from_error(cls, error: Error, request_id: str) -> RequestError:
        kind = Overloaded if error.code == ErrorCode.overloaded else RequestError
        return kind(error.code, error.message, error.field, request_id)


class Overloaded(RequestError):
    """The scheduler's queue is full; retry later."""


class StreamTimeout(ClientError):
    def __init__(self, message: str):
        super().__init__(ErrorCode.timeout, message)


class StreamBroken(ClientError):
    """The stream cannot be completed: chunks missing before the final one."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.internal, message)


# ---------------------------------------------------------------------------------------------
# results


@dataclass
class GenerationResult:
    """Everything a request produced, gathered from its chunks. Per completion token:
    token_ids, from_draft, and (when asked) logprobs / sampling_masks, None where a chunk came
    without them (flagged `logprobs_timeout` in degraded)."""

    request_id: str
    requested_ids: list[int] = field(default_factory=list)  # the request's logprob_token_ids
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    sampling_masks: list[SamplingMask | None] | None = None
    from_draft: list[bool] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    degraded: list[str] = field(default_factory=list)  # every reason seen, in order
    num_chunks: int = 0

    def add(self, chunk: StreamChunk) -> None:
        num_before, num_new = len(self.token_ids), len(chunk.token_ids)
        self.logprobs = extend_per_token(self.logprobs, chunk.logprobs, num_before, num_new)
        self.sampling_masks = extend_per_token(self.sampling_masks, chunk.sampling_masks, num_before, num_new)
        self.token_ids += chunk.token_ids.tolist()
        self.from_draft += chunk.from_draft
        self.text += chunk.text
        self.degraded += [reason for reason in chunk.degraded if reason not in self.degraded]
        if chunk.prompt_token_ids is not None:
            self.prompt_token_ids = chunk.prompt_token_ids.tolist()
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        if chunk.final:
            self.finish_reason, self.usage = chunk.finish_reason, chunk.usage
        self.num_chunks += 1

    def to_json(self) -> dict:
        """The CLI's `--json` shape (plain JSON: a logprob of -inf, i.e. outside the
        candidate set, is written as null):

        {"request_id", "text", "token_ids", "prompt_token_ids", "finish_reason",
         "logprobs": [{"token_id", "token", "logprob", "rank",
                       "top": [{"token_id", "logprob"}, ...],
                       "requested": [{"token_id", "logprob"}, ...]} or null, ...] or null,
         "prompt_logprobs": [null, {...same...}, ...] or null,
         "sampling_masks": [{"all", "size", "truncated", "token_ids"} or null, ...] or null,
         "from_draft": [bool, ...], "degraded": [str, ...], "usage": {Usage fields} or null}
        """
        return {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_token_ids": self.prompt_token_ids,
            "finish_reason": self.finish_reason,
            "logprobs": self._entries_json(self.logprobs),
            "prompt_logprobs": self._entries_json(self.prompt_logprobs),
            "sampling_masks": None if self.sampling_masks is None else [
                None if mask is None else {"all": mask.all_tokens, "size": mask.size, "truncated": mask.truncated,
                                           "token_ids": mask.token_ids.tolist()}
                for mask in self.sampling_masks],
            "from_draft": self.from_draft,
            "degraded": self.degraded,
            "usage": None if self.usage is None else self.usage.model_dump(mode="json"),
        }

    def _entries_json(self, entries: list[TokenLogprob | None] | None) -> list | None:
        if entries is None:
            return None
        return [None if entry is None else {
            "token_id": entry.token_id,
            "token": entry.token,
            "logprob": json_logprob(entry.logprob),
            "rank": entry.rank,
            "top": [{"token_id": i, "logprob": json_logprob(v)} for i, v in entry.top],
            "requested": [{"token_id": i, "logprob": json_logprob(v)}
                          for i, v in zip(self.requested_ids, entry.requested_logprobs.tolist())],
        } for entry in entries]


def extend_per_token(existing: list | None, new: list | None, num_before: int, num_new: int) -> list | None:
    """Append a chunk's per-token list; a chunk without one contributes None per token."""
    if existing is None and new is None:
        return None
    existing = [None] * num_before if existing is None else existing
    return existing + (list(new) if new is not None else [None] * num_new)


def json_logprob(value: float, infinite: float | None = None) -> float | None:
    """A logprob for JSON, which has no infinity: -inf (a token outside the candidate set in
    logprobs_mode "processed") becomes `infinite`, null in `specbus generate --json`; the gateway
    passes vLLM's -9999.0 (services/gateway/responses.py). The one owner of that rule."""
    return infinite if math.isinf(value) else value


# ---------------------------------------------------------------------------------------------
# the stream of one request


def lost_on_the_way(chunk: StreamChunk) -> bool:
    """Whether an error chunk is not the request's verdict but a loss on the bus: `unavailable`
    naming no scheduler (the postprocessor giving up on a commit lost in a dead NATS node, or the
    scheduler finding no postprocessor); a new run resuming after the tokens read recovers it."""
    return chunk.error.code == ErrorCode.unavailable and chunk.scheduler_id is None


class Stream:
    """The chunks of one request, in seq order: `async for chunk in stream`. Made by
    Client.open_stream (subscribed and request sent); `close()` unsubscribes and, if the
    stream did not finish, cancels the request."""

    def __init__(self, client: Client, request: GenerateRequest, subscription: Any):
        self.client = client
        self.request = request
        self.subscription = subscription
        # What the server may refuse this stream: reported asynchronously (PermissionWatch), so
        # refusals are counted from here on and watched while waiting for the first chunk.
        self.publishes, self.subscribes = [client.generate_subject], [subscription.subject]
        self.refusals_at_open = self.num_refusals()
        self.deadline = time.monotonic() + request.timeout_s + client.timeout_margin_s
        self.next_seq = 0
        self.buffered: dict[int, StreamChunk] = {}
        self.final_seq: int | None = None
        self.final_arrived = 0.0
        # The run now in progress: sent at `sent_at`; `heard` once an Admitted or a chunk of it
        # came; `started` once it runs (idle_timeout_s applies from `last_heard_at`).
        self.sent_at = time.monotonic()
        self.heard = self.started = self.ever_heard = False  # ever_heard: by any run of it
        self.last_heard_at: float | None = None
        self.finished = False  # the final chunk (or an Error) has been read
        self.closed = False
        self.num_duplicates = 0
        self.num_ignored = 0
        # Scheduler failover (Client docstring): the request running now is `run_id`, its chunks'
        # seqs start at `base_seq` of this stream; `delivered` are the completion tokens read so far.
        self.run_id = request.request_id
        self.base_seq = 0
        self.delivered: list[int] = []
        self.owner: str | None = None  # the scheduler named by the run's chunks
        self.schedulers_at_send = client.live_schedulers()
        self.num_runs = 0  # runs sent after the first: failovers and resends after `no responders`
        self.blamed: list[tuple[frozenset[str], float]] = []  # counted failovers: (schedulers, when)
        self.delivered_at_failover = 0  # tokens read at the last failover

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> StreamChunk:
        if self.finished:
            raise StopAsyncIteration
        while True:
            while self.next_seq not in self.buffered:
                await self._receive()
            chunk = self.buffered.pop(self.next_seq)
            if chunk.error is None or not await self._failover_after(chunk):
                break
        self.next_seq += 1
        self.delivered += chunk.token_ids.tolist()
        if chunk.error is not None:
            self.finished = True
            raise RequestError.from_error(chunk.error, self.request.request_id)
        self.finished = chunk.final
        return chunk

    async def _failover_after(self, chunk: StreamChunk) -> bool:
        """Fail over on an error chunk that is not the request's end (False: it is): its
        scheduler is stopping (`shutting_down`: wait for another one), or an `unavailable` error
        that names no scheduler, not the scheduler's verdict but the postprocessor giving up on
        a commit lost on the way (a dead NATS node), or the scheduler finding no postprocessor."""
        error = chunk.error
        if not self._may_fail_over():
            return False
        if error.code == ErrorCode.shutting_down:
            await self._until_a_scheduler_lives({chunk.scheduler_id or self.owner})
        elif not lost_on_the_way(chunk):
            return False
        return await self._failover(f"{error.code.value}: {error.message}")

    async def _receive(self) -> None:
        """Wait for one more message within the tightest bound that applies, and buffer it."""
        now = time.monotonic()
        waits = {"deadline": self.deadline - now}
        if not self.heard and self.client.failover:
            waits["admission"] = self.sent_at + self.client.admission_timeout_s - now
        if self.started:
            waits["idle"] = self.last_heard_at + self.client.idle_timeout_s - now
        if self.final_seq is not None:
            waits["gap"] = self.final_arrived + self.client.gap_grace_s - now
        elif (owner_dead_at := self.owner_dead_at()) is not None:
            waits["owner"] = owner_dead_at - now
        bound = min(waits, key=waits.get)
        try:
            if waits[bound] <= 0:
                raise nats.errors.TimeoutError
            msg = await self._next_msg(waits[bound])
        except nats.errors.TimeoutError:
            if bound == "owner":
                if self.owner_dead_at() > time.monotonic():
                    return  # a beat came while waiting
                dead = set(self.schedulers_at_send if self.owner is None else [self.owner])
                await self._until_a_scheduler_lives(dead, silent=True)
                if await self._failover(f"scheduler {self.owner or '(not known yet)'} silent"):
                    return
                self.finished = True
                raise StreamBroken(f"request {self.request.request_id}: its scheduler died after "
                                   f"{MAX_FAILOVERS} failovers") from None
            final = self.buffered.get(self.final_seq) if bound == "gap" else None
            if final is not None and (final.error is None or lost_on_the_way(final)) and await self._failover(
                    f"seqs before the final {self.final_seq} never arrived"):
                return  # chunks lost in a dead NATS node: a new run sends those tokens again
            if bound == "idle" and await self._failover(f"no chunk for {self.client.idle_timeout_s} s"):
                return  # the rest (its final chunk, say) lost on the way: run it again from here
            if bound == "admission" and await self._failover(
                    f"no scheduler acknowledged it within {self.client.admission_timeout_s} s"):
                return  # the request (or its acknowledgement) lost on the way: send it again
            raise await self._timeout_error(bound) from None
        except PermissionDenied as exc:
            self.finished = True
            raise RequestError(ErrorCode.forbidden, exc.message, request_id=self.request.request_id) from None
        if msg.headers and msg.headers.get("Status") == NO_RESPONDERS_STATUS:
            # No scheduler listened (reconnecting after a NATS node died, or all dead and restarting):
            # a request a scheduler ever had waits for a beat and goes again uncounted (its deadline
            # bounds it); one never admitted tries MAX_FAILOVERS times, then is refused (a 503).
            if self.ever_heard:
                await self._until_a_scheduler_beats(since=time.monotonic())
            if self.ever_heard or self.schedulers_at_send:
                await asyncio.sleep(NO_RESPONDERS_RETRY_S)
                if await self._failover("no scheduler listened", counted=not self.ever_heard):
                    return
            self.finished = True
            raise RequestError(ErrorCode.unavailable, f"no scheduler listens on {self.client.generate_subject!r}",
                               request_id=self.request.request_id)
        try:
            message = decode_any(msg.data, window=self.client.window)
            if not isinstance(message, (StreamChunk, Admitted)):
                raise CodecError(ErrorCode.wrong_message_type, f"a {message.type} message on a stream inbox", "type")
        except CodecError as exc:
            self.num_ignored += 1
            log.warning("bad_chunk_ignored", request_id=self.request.request_id, error=str(exc))
            return
        if isinstance(message, Admitted):
            self._admitted(message)
        else:
            self._buffer(message)

    async def _next_msg(self, timeout_s: float) -> Any:
        """The next message; until the first chunk, PermissionDenied as soon as the server
        refuses the request's publish or the inbox subscription (else the wait would end only
        at the timeout). Once the scheduler answered, both went through."""
        if self.heard:
            return await self.subscription.next_msg(timeout=timeout_s)
        watch = permission_watch(self.client.nc)
        if self.num_refusals() > self.refusals_at_open:
            raise PermissionDenied(f"the server refused this connection a publish to {self.publishes[0]!r} or "
                                   f"the subscription to its inbox {self.subscribes[0]!r}")
        return await watch.guard(self.subscription.next_msg(timeout=timeout_s), publish=self.publishes,
                                 subscribe=self.subscribes)

    def num_refusals(self) -> int:
        """Refusals the server reported so far for this stream's subjects (on this connection)."""
        counts = permission_watch(self.client.nc).counts
        return sum(counts[("publish", s.lower())] for s in self.publishes) + \
            sum(counts[("subscribe", s.lower())] for s in self.subscribes)

    def owner_dead_at(self) -> float | None:
        """When the scheduler running this request counts as dead (time.monotonic()): its last
        heartbeat + heartbeat_timeout_s; before the first chunk names it, the earliest such time
        of the schedulers alive when the request was sent. None: no failover (off, or no
        heartbeats seen)."""
        beats = self.client.scheduler_beats
        owners = [self.owner] if self.owner is not None else self.schedulers_at_send
        seen = [beats[owner] for owner in owners if owner in beats]
        return min(seen) + self.client.heartbeat_timeout_s if seen else None

    async def _until_a_scheduler_lives(self, dead: set[str], silent: bool = False) -> None:
        """Wait, polling heartbeats up to the deadline, for a live scheduler other than the dead
        ones: with one scheduler, `specbus up` restarts it under a new instance id, and the
        request goes on there instead of meeting `no responders` while it starts. silent: the
        dead ones were found silent, so one that beats again counts too (it was cut off by a
        partition, now healed); a stopping one beats while it drains, and does not."""
        since = time.monotonic()
        beats = self.client.scheduler_beats
        while time.monotonic() < self.deadline and not any(
                name not in dead or (silent and beats.get(name, since) > since) for name in self.client.live_schedulers()):
            await asyncio.sleep(SCHEDULER_POLL_S)

    async def _until_a_scheduler_beats(self, since: float) -> None:
        """Wait, polling heartbeats up to the deadline, for any scheduler's beat after `since`."""
        while time.monotonic() < self.deadline and max(self.client.scheduler_beats.values(), default=since) <= since:
            await asyncio.sleep(SCHEDULER_POLL_S)

    @property
    def num_failovers(self) -> int:
        """Counted failovers in a row: since the last run that read a token, less those whose
        blamed scheduler beat again afterwards (cut off by a partition, not killed): a request that
        kills every scheduler it meets stops at MAX_FAILOVERS, one that makes progress goes on."""
        beats = self.client.scheduler_beats
        return sum(1 for names, at in self.blamed if not any(beats.get(name, at) > at for name in names))

    def _may_fail_over(self, counted: bool = True) -> bool:
        """Failover is on and, for a counted one, fewer than MAX_FAILOVERS are counted."""
        if len(self.delivered) > self.delivered_at_failover:  # the last run made progress
            self.blamed, self.delivered_at_failover = [], len(self.delivered)
        return self.client.failover and (not counted or self.num_failovers < MAX_FAILOVERS)

    async def _failover(self, why: str, counted: bool = True) -> bool:
        """Send the request again, as a new run with the completion read so far as
        resume_token_ids and the same seed, so another scheduler continues it token for token:
        its scheduler died (or, before the first chunk, one that may have had it), or the stream
        lost a chunk or a commit (`why`). The new run's chunks continue this stream's seqs, the
        first flagged `failover`; chunks of the old run not read yet are dropped (the new run
        sends those tokens again). False: failover is off or MAX_FAILOVERS were spent. counted
        False: a resend after `no responders`, which MAX_FAILOVERS does not count."""
        if not self._may_fail_over(counted):
            return False
        if counted:
            self.blamed.append((frozenset([self.owner] if self.owner else self.schedulers_at_send), time.monotonic()))
        self.num_runs += 1
        old_run, old_subscription = self.run_id, self.subscription
        logprobs = self.request.logprobs
        if self.next_seq > 0:  # the first chunk, with the prompt logprobs, was read
            logprobs = logprobs.model_copy(update={"prompt_logprobs": None})
        self.run_id = f"{self.request.request_id[:MAX_RUN_ID_STEM]}.failover{self.num_runs}"
        remaining_s = max(self.deadline - self.client.timeout_margin_s - time.monotonic(), 1.0)
        run = self.request.model_copy(update={
            "request_id": self.run_id, "logprobs": logprobs, "timeout_s": remaining_s,
            "resume_token_ids": np.asarray(self.delivered, dtype=np.int32) if self.delivered else None})
        log.warning("failover", request_id=self.request.request_id, why=why, old_run=old_run, new_run=self.run_id,
                    resumed_tokens=len(self.delivered), seq=self.next_seq)
        self.buffered.clear()
        self.final_seq = None
        self.base_seq, self.owner = self.next_seq, None
        self.sent_at, self.heard, self.started, self.last_heard_at = time.monotonic(), False, False, None
        self.schedulers_at_send = self.client.live_schedulers()
        self.subscription = await self.client.nc.subscribe(self.client.nc.new_inbox())
        self.subscribes = [self.subscription.subject]
        try:
            await old_subscription.unsubscribe()
        except nats.errors.Error as exc:
            log.warning("unsubscribe_failed", request_id=self.request.request_id, error=type(exc).__name__)
        await self.client.cancel(old_run)  # in case it lives on after all
        await publish(self.client.nc, self.client.generate_subject, encode(run, self.client.version()),
                      reply=self.subscription.subject)
        return True

    def _ignore(self, chunk: StreamChunk) -> None:
        self.num_ignored += 1
        log.warning("foreign_chunk_ignored", request_id=self.request.request_id, chunk_request_id=chunk.request_id,
                    seq=chunk.seq)

    def _heard(self, started: bool) -> None:
        """The run now in progress answered: an Admitted or a chunk (which means it started)."""
        self.heard, self.ever_heard, self.started = True, True, self.started or started
        self.last_heard_at = time.monotonic()

    def _admitted(self, admitted: Admitted) -> None:
        if admitted.request_id != self.run_id:
            self.num_ignored += 1  # an earlier run's, answered after its failover
            return
        self.owner = admitted.scheduler_id
        self._heard(admitted.started)

    def _buffer(self, chunk: StreamChunk) -> None:
        if chunk.request_id != self.run_id:
            return self._ignore(chunk)
        if chunk.scheduler_id is not None:
            self.owner = chunk.scheduler_id
        self._heard(started=True)
        if self.run_id != self.request.request_id:  # a failover run: this stream's id and seqs
            degraded = ["failover", *chunk.degraded] if chunk.seq == 0 else chunk.degraded
            chunk = chunk.model_copy(update={"request_id": self.request.request_id, "seq": self.base_seq + chunk.seq,
                                             "degraded": degraded})
        if self.final_seq is not None and chunk.seq > self.final_seq:
            return self._ignore(chunk)
        if chunk.seq < self.next_seq or chunk.seq in self.buffered:
            self.num_duplicates += 1
            log.warning("duplicate_chunk_dropped", request_id=self.request.request_id, seq=chunk.seq)
            return
        if len(self.buffered) >= MAX_BUFFERED_CHUNKS:
            self.finished = True
            raise StreamBroken(f"request {self.request.request_id}: more than {MAX_BUFFERED_CHUNKS} chunks arrived "
                               f"while waiting for seq {self.next_seq}")
        self.buffered[chunk.seq] = chunk
        if chunk.final or chunk.error is not None:
            self.final_seq, self.final_arrived = chunk.seq, self.last_heard_at

    async def _timeout_error(self, bound: str) -> ClientError:
        """The error for a wait that ran out; a timed-out request is cancelled first."""
        request_id = self.request.request_id
        if bound == "gap":
            missing = sorted(set(range(self.next_seq, self.final_seq)) - set(self.buffered))
            final = self.buffered[self.final_seq]
            self.finished = True
            if final.error is not None:
                return RequestError.from_error(final.error, request_id)
            return StreamBroken(f"request {request_id}: the stream ended at seq {self.final_seq} but seqs "
                                f"{missing[:10]} never arrived")
        await self.close()
        if bound == "idle":
            return StreamTimeout(f"request {request_id}: no chunk for {self.client.idle_timeout_s} s "
                                 "(idle timeout); cancelled")
        if bound == "admission":
            return StreamTimeout(f"request {request_id}: no scheduler acknowledged it within "
                                 f"{self.client.admission_timeout_s} s, {MAX_FAILOVERS} times; cancelled")
        return StreamTimeout(f"request {request_id}: not finished within timeout_s {self.request.timeout_s} s + "
                             f"{self.client.timeout_margin_s} s; cancelled")

    async def close(self) -> None:
        """Unsubscribe; cancel the request if it did not finish. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            await self.subscription.unsubscribe()
        except nats.errors.Error as exc:
            log.warning("unsubscribe_failed", request_id=self.request.request_id, error=type(exc).__name__)
        if not self.finished:
            await self.client.cancel(self.run_id)

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


# ---------------------------------------------------------------------------------------------
# the client


class Client:
    """A connection to a specbus deployment: `async with Client(url) as client: ...`."""

    def __init__(self, url: str | list[str] = DEFAULT_NATS_URL, *, prefix: str = DEFAULT_PREFIX,
                 user: str | None = None, password: str | None = None, tls: ssl.SSLContext | None = None,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 name: str = "specbus-client", connect_timeout_s: float = 5.0, timeout_margin_s: float = 5.0,
                 idle_timeout_s: float = 30.0, gap_grace_s: float = 1.0, failover: bool = True,
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S, admission_timeout_s: float = 5.0,
                 window: Window = WINDOW):
        self.url = url
        self.subjects = Subjects(prefix)
        self.user, self.password = user, password
        # The login names the client's subjects and inbox (module docstring).
        self.generate_subject = self.subjects.generate_for(user or DEFAULT_CLIENT_USER)
        self.cancel_subject = self.subjects.cancel_for(user or DEFAULT_CLIENT_USER)
        self.tls = tls if tls is not None else tls_context(tls_ca, tls_cert, tls_key)
        self.name = name
        self.connect_timeout_s = connect_timeout_s
        self.timeout_margin_s = timeout_margin_s
        self.idle_timeout_s = idle_timeout_s
        self.gap_grace_s = gap_grace_s
        self.failover = failover
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.admission_timeout_s = admission_timeout_s
        self.scheduler_beats: dict[str, float] = {}  # scheduler instance id -> time.monotonic() of its last beat
        self.window = window  # the protocol versions this client speaks (version())
        self.scheduler_highs: dict[str, int] = {}  # scheduler instance id -> the high end of its version window
        self.nc = None

    @classmethod
    def from_config(cls, config: BusConfig, **options: Any) -> Client:
        """A client for the deployment a BusConfig names (url, prefix, user, password, TLS
        files, connect timeout: what `load_config(BusConfig)` reads from SPECBUS_* variables)."""
        return cls(config.nats_url, prefix=config.prefix, user=config.nats_user, password=config.nats_password,
                   tls_ca=config.tls_ca, tls_cert=config.tls_cert, tls_key=config.tls_key,
                   connect_timeout_s=config.connect_timeout_s, **options)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **options: Any) -> Client:
        """A client for the deployment the SPECBUS_* variables name (env, default os.environ):
        SPECBUS_NATS_URL (every node's URL, comma separated), SPECBUS_NATS_USER / _PASSWORD, the
        TLS files, as `specbus up --log-dir DIR` writes them to DIR/client.env."""
        return cls.from_config(load_config(BusConfig, env), **options)

    async def __aenter__(self) -> Client:
        self.nc = await connect(self.url, self.name, connect_timeout_s=self.connect_timeout_s,
                                initial_connect_timeout_s=self.connect_timeout_s, user=self.user,
                                password=self.password, tls=self.tls, max_payload=CLIENT_MAX_PAYLOAD,
                                inbox_prefix=inbox_prefix(self.user or DEFAULT_CLIENT_USER))
        if self.failover:
            await self.nc.subscribe(self.subjects.heartbeat, cb=self.on_heartbeat)
        return self

    async def on_heartbeat(self, msg: Any) -> None:
        try:
            beat = decode_heartbeat(msg.data, self.window)
        except CodecError:
            return  # the services count bad heartbeats; a client only needs the good ones
        if beat is not None and beat.role == "scheduler":
            self.scheduler_beats[beat.instance_id] = time.monotonic()
            self.scheduler_highs[beat.instance_id] = beat.protocol_version

    def version(self) -> int:
        """The version to send a request or cancel in: the highest this client and every live
        scheduler speak (any of them may take it), the window's low end before one is heard
        (or without failover, which is what reads their heartbeats)."""
        live = self.live_schedulers()
        return self.window.toward(*(self.scheduler_highs[i] for i in live)) if live else self.window.low

    def live_schedulers(self) -> list[str]:
        """Schedulers heard from within heartbeat_timeout_s."""
        now = time.monotonic()
        return [i for i, seen in self.scheduler_beats.items() if now - seen <= self.heartbeat_timeout_s]

    async def __aexit__(self, *exc_info: object) -> None:
        nc, self.nc = self.nc, None
        if nc is not None:
            await nc.close()

    async def open_stream(self, request: GenerateRequest) -> Stream:
        """Subscribe a fresh inbox and send the request; the caller iterates and closes
        (`async with await client.open_stream(request) as stream:`)."""
        inbox = self.nc.new_inbox()
        subscription = await self.nc.subscribe(inbox)
        stream = Stream(self, request, subscription)
        try:
            await publish(self.nc, self.generate_subject, encode(request, self.version()), reply=inbox)
        except BaseException:
            stream.finished = True  # never sent: nothing to cancel
            await stream.close()
            raise
        return stream

    async def stream(self, request: GenerateRequest) -> AsyncIterator[StreamChunk]:
        """The request's chunks in order, the final one last. Leaving the loop early cancels
        the request (wrap in contextlib.aclosing to make that immediate)."""
        async with await self.open_stream(request) as stream:
            async for chunk in stream:
                yield chunk

    async def generate(self, request: GenerateRequest) -> GenerationResult:
        """Run the request to its end and gather the result. A RequestError carries what
        was gathered before it as `.partial`."""
        result = GenerationResult(request.request_id, requested_ids=request.logprobs.logprob_token_ids.tolist())
        async with await self.open_stream(request) as stream:
            try:
                async for chunk in stream:
                    result.add(chunk)
            except RequestError as exc:
                exc.partial = result
                raise
        return result

    async def cancel(self, request_id: str) -> None:
        """Ask the schedulers to stop a request (best effort: a failure to send is logged)."""
        try:
            await publish(self.nc, self.cancel_subject, encode(CancelRequest(request_id=request_id), self.version()))
        except BusError as exc:
            log.warning("cancel_not_sent", request_id=request_id, error=str(exc))
