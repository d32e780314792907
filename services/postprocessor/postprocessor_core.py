"""Postprocessor logic without NATS (docs/PROTOCOL.md#side-channel-join, #replay-after-a-postprocessor-death).

`Postprocessor` turns the scheduler's Commits and the verifier's SideChannelRecords into the
StreamChunks a client reads. Its three entry points take the current `time.monotonic()` and
return what to send, in order (ChunkToClient to a client inbox, NoticeToScheduler to a scheduler):

    on_commit(commit, now)   a commit for seq n of a request
    on_side(record, now)     a side-channel record for (request_id, batch_id)
    on_tick(now)             timeouts: side channel late, commit gap never filled, expiry

Per request, commits are processed strictly in seq order (out-of-order ones wait, at most
gap_timeout_s). A commit with expect_side_channel waits for the record with its batch_id, at
most side_channel_timeout_s after the commit arrived; then its chunk goes out without logprobs,
flagged `logprobs_timeout`, and a record arriving afterwards is dropped and counted. Records may
come before their commit (even before the request's first commit): they are buffered, bounded
and with a TTL. Records of prefill chunks that emit nothing carry only prompt logprobs; they
are collected for the first chunk (seq 0), which waits until every prompt position is covered.

Its collaborators, each testable alone: the join (services/postprocessor/side_channel_join.py: which
record a commit gets, what is late, duplicate or stale), the text (services/postprocessor/text_stream.py:
incremental detokenization, stop strings, the held-back tail) and the logprob formatting
(services/postprocessor/logprob_format.py). A stop string match ends the request: final chunk with
finish_reason "stop" and usage, a StopNotice to the owning scheduler, later commits ignored
(counted).

A commit with resume_token_ids for an unknown request (the request moved here from a dead
postprocessor) replays those tokens through the detokenizer exactly as the old postprocessor
did, so the text continues where the old one stopped sending, and the stream continues at the
commit's seq.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields

import numpy as np
import structlog

from text.token_bytes import TokenBytes
from text.tokenizer import Tokenizer
from schemas.commits import Commit, SideChannelRecord, StopNotice
from schemas.config import FINISHED_ID_TTL_S
from schemas.errors import ErrorCode
from schemas.generation import LogprobOptions
from schemas.bus.protocol import MAX_TIMEOUT_S
from schemas.streams import StreamChunk, Usage
from schemas.bus.wire import Error
from services.postprocessor.logprob_format import prompt_logprobs, token_extras
from services.postprocessor.side_channel_join import DroppedRecord, EarlyRecords, RequestRecords, record_fits
from services.postprocessor.text_stream import TextStream

log = structlog.get_logger(__name__)


# `v` of an outgoing message: the version it goes out in, its commit's (the scheduler sends a
# commit in a version the client and this postprocessor both speak; docs/PROTOCOL.md#version-rule).
@dataclass
class ChunkToClient:
    inbox: str
    chunk: StreamChunk
    v: int


@dataclass
class NoticeToScheduler:
    scheduler_id: str
    notice: StopNotice
    v: int


Outgoing = ChunkToClient | NoticeToScheduler
FAILED_HERE = "the postprocessor failed on this request (see its log)"


@dataclass
class Counters:
    """Everything the postprocessor drops or degrades, for logs, heartbeats and $SRV.STATS."""

    late_records: int = 0  # came after their chunk was sent without them
    duplicate_records: int = 0
    unjoined_records: int = 0  # no commit ever claimed them (expired, stale, request finished)
    invalid_records: int = 0  # did not match their commit (tokens or parts missing)
    duplicate_commits: int = 0
    ignored_commits: int = 0  # for a request already finished (stop string, client gone, refused)
    missing_commits: int = 0  # a seq gap that never filled: the request ended with an error
    logprobs_timeouts: int = 0
    clients_gone: int = 0
    refused_requests: int = 0  # over max_requests
    duplicate_requests: int = 0  # a new request with the id of one running here (from another scheduler)
    failed_requests: int = 0  # ended with `internal` because the logic raised on one of their messages
    expired_requests: int = 0  # no commit for idle_ttl_s: their scheduler is gone
    bad_messages: int = 0  # undecodable commits/records (counted by the service)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class PendingCommit:
    commit: Commit
    arrived: float


@dataclass
class StreamState:
    """One request's stream: its text, its side of the join, the commits waiting for their turn
    and the tallies of its final Usage."""

    request_id: str
    scheduler_id: str
    client_inbox: str
    options: LogprobOptions
    stream: bool
    next_seq: int
    text: TextStream
    last_active: float
    version: int  # what its chunks and notices go out in: its commits' (ChunkToClient.v)
    prompt_token_ids: np.ndarray | None = None
    num_tokens: int = 0
    commits: dict[int, PendingCommit] = field(default_factory=dict)  # by seq, not yet processed
    records: RequestRecords = field(default_factory=RequestRecords)
    pieces: list[StreamChunk] = field(default_factory=list)  # stream=False: merged at the end
    steps: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    degraded_steps: Counter = field(default_factory=Counter)
    speculative_lengths: Counter = field(default_factory=Counter)  # drafts per commit after the first
    last_batch_id: int | None = None  # of the last commit processed
    last_step: int = 0
    finished_at: float | None = None


class Postprocessor:
    """Joins, formats and detokenizes; see the module docstring. Not thread-safe (one asyncio loop)."""

    def __init__(self, tokenizer: Tokenizer, instance_id: str, *, side_channel_timeout_s: float = 2.0,
                 max_requests: int = 1024, gap_timeout_s: float | None = None, record_ttl_s: float = 30.0,
                 finished_ttl_s: float = FINISHED_ID_TTL_S, idle_ttl_s: float = MAX_TIMEOUT_S):
        self.tokenizer = tokenizer
        self.token_bytes = TokenBytes(tokenizer)  # the text stream's view of each token's bytes
        self.instance_id = instance_id
        self.side_channel_timeout_s = side_channel_timeout_s
        self.max_requests = max_requests
        self.gap_timeout_s = gap_timeout_s if gap_timeout_s is not None else max(1.0, 2 * side_channel_timeout_s)
        self.record_ttl_s = record_ttl_s
        self.finished_ttl_s = finished_ttl_s
        self.idle_ttl_s = idle_ttl_s
        self.requests: dict[str, StreamState] = {}
        self.early = EarlyRecords()
        self.counters = Counters()

    @property
    def load(self) -> int:
        return sum(state.finished_at is None for state in self.requests.values())

    # ------------------------------------------------------------------ entry points

    def on_commit(self, commit: Commit, now: float) -> list[Outgoing]:
        state = self.requests.get(commit.request_id)
        if state is not None and commit.scheduler_id != state.scheduler_id and commit.seq == 0 \
                and commit.resume_token_ids is None:
            # Request ids are unique per scheduler only: another scheduler's new request with this id.
            if state.finished_at is None:
                return self._refuse_duplicate(commit, state)
            del self.requests[commit.request_id]
            state = None
        if state is None:
            if self.load >= self.max_requests:
                return self._refuse(commit, now)
            state = self._new_state(commit, now)
        elif state.finished_at is not None:
            self.counters.ignored_commits += 1
            log.warning("commit_after_finish", request_id=commit.request_id, seq=commit.seq,
                        ignored=self.counters.ignored_commits)
            return []
        if commit.seq < state.next_seq or commit.seq in state.commits:
            self.counters.duplicate_commits += 1
            log.warning("duplicate_commit", request_id=commit.request_id, seq=commit.seq,
                        duplicates=self.counters.duplicate_commits)
            return []
        state.commits[commit.seq] = PendingCommit(commit, now)
        state.last_active = now
        return self._advance(state, now)

    def on_side(self, record: SideChannelRecord, now: float) -> list[Outgoing]:
        state = self.requests.get(record.request_id)
        if state is None:
            self._count(self.early.add(record, now))
            return []
        if state.finished_at is not None:
            stray = state.records.stray_kind(record.batch_id, state.last_batch_id)
            self._count([DroppedRecord(record, stray or "unjoined_records")])
            return []
        self._add_record(state, record, now)
        return self._advance(state, now)

    def on_tick(self, now: float) -> list[Outgoing]:
        outs: list[Outgoing] = []
        for state in list(self.requests.values()):
            if state.finished_at is not None:
                if now - state.finished_at > self.finished_ttl_s:
                    del self.requests[state.request_id]
                continue
            outs += self._advance(state, now)
            if state.finished_at is None and state.commits:
                oldest = min(pending.arrived for pending in state.commits.values())
                if now - oldest > self.gap_timeout_s:
                    outs += self._missing_commit(state, now)
            if state.finished_at is None and now - state.last_active > self.idle_ttl_s:
                self.counters.expired_requests += 1
                log.warning("request_expired", request_id=state.request_id, idle_s=round(now - state.last_active, 1))
                self._finish(state, now)
        self._count(self.early.expire(now, self.record_ttl_s))
        return outs

    def request_failed(self, message: Commit | SideChannelRecord, now: float) -> list[Outgoing]:
        """The logic raised on this message (a bug): its request ends with an `internal` error
        and its scheduler is told, so the client does not wait out its timeout; others go on."""
        self.counters.failed_requests += 1
        state = self.requests.get(message.request_id)
        if state is not None and state.finished_at is None:
            return self._fail(state, state.next_seq, ErrorCode.internal, FAILED_HERE, now)
        if state is None and isinstance(message, Commit):
            return self._error_without_state(message, Error(code=ErrorCode.internal, message=FAILED_HERE,
                                                            request_id=message.request_id), message.seq)
        return []

    def client_gone(self, request_id: str, now: float) -> list[Outgoing]:
        """The client inbox has no subscriber: end the request and tell its scheduler."""
        state = self.requests.get(request_id)
        if state is None or state.finished_at is not None:
            return []
        self.counters.clients_gone += 1
        log.warning("client_gone", request_id=request_id, clients_gone=self.counters.clients_gone)
        self._finish(state, now)
        return [self._notice(state, "error")]

    # ------------------------------------------------------------------ requests

    def _new_state(self, commit: Commit, now: float) -> StreamState:
        resume = commit.resume_token_ids
        state = StreamState(
            request_id=commit.request_id, scheduler_id=commit.scheduler_id, client_inbox=commit.client_inbox,
            options=commit.logprobs, stream=commit.stream, next_seq=commit.seq if resume is not None else 0,
            text=TextStream.start(commit.prompt_token_ids, commit.stop), last_active=now,
            prompt_token_ids=commit.prompt_token_ids, version=commit.v)
        self.requests[commit.request_id] = state
        if resume is not None:
            self._resume(state, resume)
        for record, arrived in self.early.take(commit.request_id):
            self._add_record(state, record, arrived)
        return state

    def _resume(self, state: StreamState, resume_token_ids: np.ndarray) -> None:
        """Replay the tokens the old postprocessor streamed: same text, same held-back tail, so
        the client sees no gap and no repeat."""
        sent = state.text.replay(self.token_bytes, resume_token_ids)
        state.num_tokens = len(resume_token_ids)
        if not state.stream and len(resume_token_ids):
            state.pieces.append(StreamChunk(request_id=state.request_id, seq=0, token_ids=resume_token_ids, text=sent,
                                            from_draft=[False] * len(resume_token_ids)))
        log.info("request_resumed", request_id=state.request_id, seq=state.next_seq, tokens=state.num_tokens)

    def _refuse(self, commit: Commit, now: float) -> list[Outgoing]:
        self.counters.refused_requests += 1
        log.warning("request_refused", request_id=commit.request_id, load=self.load, max_requests=self.max_requests)
        state = self._new_state(commit, now)
        state.last_batch_id, state.last_step = commit.batch_id, commit.step
        return self._fail(state, commit.seq, ErrorCode.overloaded,
                          f"postprocessor {self.instance_id} is at its limit of {self.max_requests} requests", now)

    def _refuse_duplicate(self, commit: Commit, running: StreamState) -> list[Outgoing]:
        """A new request (another scheduler's) whose id a running request here already has: the
        newcomer ends with `duplicate_request_id`; the running one is not disturbed."""
        self.counters.duplicate_requests += 1
        log.warning("duplicate_request_id", request_id=commit.request_id, scheduler_id=commit.scheduler_id,
                    running_scheduler_id=running.scheduler_id)
        error = Error(code=ErrorCode.duplicate_request_id, field="request_id", request_id=commit.request_id,
                      message=f"request {commit.request_id} is already streaming through postprocessor "
                              f"{self.instance_id}; use a fresh request_id")
        return self._error_without_state(commit, error, 0)

    def _error_without_state(self, commit: Commit, error: Error, seq: int) -> list[Outgoing]:
        """A final error chunk to the commit's client and a StopNotice to its scheduler, for a
        request this postprocessor keeps no state of."""
        chunk = StreamChunk(request_id=commit.request_id, seq=seq, finish_reason="error", error=error)
        notice = StopNotice(request_id=commit.request_id, batch_id=commit.batch_id, step=commit.step,
                            postprocessor_id=self.instance_id, reason="error")
        return [ChunkToClient(commit.client_inbox, chunk, commit.v), NoticeToScheduler(commit.scheduler_id, notice, commit.v)]

    def _missing_commit(self, state: StreamState, now: float) -> list[Outgoing]:
        self.counters.missing_commits += 1
        log.warning("commit_never_arrived", request_id=state.request_id, seq=state.next_seq,
                    buffered=sorted(state.commits))
        return self._fail(state, state.next_seq, ErrorCode.unavailable,
                          f"commit {state.next_seq} of the stream never reached the postprocessor", now)

    def _fail(self, state: StreamState, seq: int, code: ErrorCode, message: str, now: float) -> list[Outgoing]:
        error = Error(code=code, message=message, request_id=state.request_id)
        chunk = StreamChunk(request_id=state.request_id, seq=0 if not state.stream else seq, text="",
                            finish_reason="error", error=error)
        self._finish(state, now)
        return [ChunkToClient(state.client_inbox, chunk, state.version), self._notice(state, "error")]

    def _finish(self, state: StreamState, now: float) -> None:
        state.finished_at = now
        state.commits.clear()
        state.pieces.clear()
        self._count(state.records.clear())

    def _notice(self, state: StreamState, reason: str, stop: str | None = None,
                text_offset: int = 0) -> NoticeToScheduler:
        notice = StopNotice(request_id=state.request_id, batch_id=state.last_batch_id or 0, step=state.last_step,
                            postprocessor_id=self.instance_id, reason=reason, stop=stop,
                            text_offset=text_offset, num_tokens=state.num_tokens)
        return NoticeToScheduler(state.scheduler_id, notice, state.version)

    # ------------------------------------------------------------------ side-channel records

    def _add_record(self, state: StreamState, record: SideChannelRecord, arrived: float) -> None:
        self._count(state.records.add(record, arrived, last_batch_id=state.last_batch_id,
                                      first_chunk_sent=state.next_seq > 0))

    def _count(self, dropped: list[DroppedRecord]) -> None:
        """Count and log each record the join dropped."""
        for drop in dropped:
            count = getattr(self.counters, drop.counter) + 1
            setattr(self.counters, drop.counter, count)
            log.warning(drop.event or f"{drop.counter.removesuffix('s')}_dropped", request_id=drop.record.request_id,
                        batch_id=drop.record.batch_id, **{drop.counter: count})

    # ------------------------------------------------------------------ commits -> chunks

    def _advance(self, state: StreamState, now: float) -> list[Outgoing]:
        """Process buffered commits in seq order while each has what it waits for."""
        outs: list[Outgoing] = []
        while state.finished_at is None and state.next_seq in state.commits:
            pending = state.commits[state.next_seq]
            commit = pending.commit
            entry = state.records.waiting.get(commit.batch_id)
            complete = entry is not None and state.records.prompt_covered(commit, state.options)
            if commit.expect_side_channel and not complete and now - pending.arrived < self.side_channel_timeout_s:
                break
            del state.commits[state.next_seq]
            state.next_seq += 1
            record = entry[0] if commit.expect_side_channel and entry is not None else None
            outs += self._emit(state, commit, record, commit.expect_side_channel and not complete, now)
        return outs

    def _emit(self, state: StreamState, commit: Commit, record: SideChannelRecord | None, timed_out: bool,
              now: float) -> list[Outgoing]:
        degraded = list(commit.degraded)
        self._count(state.records.settle(commit, record))
        if timed_out:
            self.counters.logprobs_timeouts += 1
            degraded.append("logprobs_timeout")
            log.warning("logprobs_timeout", request_id=state.request_id, batch_id=commit.batch_id,
                        timeouts=self.counters.logprobs_timeouts)
        if record is not None and not record_fits(record, commit):
            self.counters.invalid_records += 1
            log.warning("record_does_not_match_commit", request_id=state.request_id, batch_id=commit.batch_id)
            record = None
            degraded.append("logprobs_invalid")

        final = commit.finish_reason is not None
        num_kept, match = state.text.feed(self.token_bytes, commit.token_ids, final)
        self._tally(state, commit, num_kept, degraded)
        finish_reason = "stop" if match is not None else commit.finish_reason
        done = finish_reason is not None
        kept = commit.token_ids[:num_kept]
        chunk = StreamChunk(
            request_id=state.request_id, seq=commit.seq, token_ids=kept, text=state.text.take(done),
            from_draft=[i < commit.num_accepted for i in range(num_kept)], degraded=list(dict.fromkeys(degraded)),
            finish_reason=finish_reason, usage=self._usage(state, commit, num_kept) if done else None,
            error=commit.error if final else None, scheduler_id=commit.scheduler_id,
            **token_extras(state.options, record, kept, self.tokenizer), **self._prompt_extras(state, commit))
        outs = self._deliver(state, chunk)
        if match is not None and not final:
            position, stop = match
            outs.append(self._notice(state, "stop", stop, position))
        if done:
            self._finish(state, now)
        return outs

    def _tally(self, state: StreamState, commit: Commit, num_kept: int, degraded: list[str]) -> None:
        """What the commit adds to the request's usage, num_kept of its tokens kept."""
        state.num_tokens += num_kept
        state.last_batch_id, state.last_step = commit.batch_id, commit.step
        state.steps += 1
        state.draft_tokens_proposed += commit.num_draft
        state.draft_tokens_accepted += min(commit.num_accepted, num_kept)
        if commit.prompt_token_ids is None:  # the first commit is the prefill's
            state.speculative_lengths[commit.num_draft] += 1
        state.degraded_steps.update(set(degraded))

    def _prompt_extras(self, state: StreamState, commit: Commit) -> dict:
        """The first chunk's prompt_token_ids and, when asked, prompt_logprobs; {} for the others."""
        if commit.seq != 0 or commit.prompt_token_ids is None:
            return {}
        extras: dict = {"prompt_token_ids": commit.prompt_token_ids}
        if state.options.prompt_logprobs is not None:
            extras["prompt_logprobs"] = prompt_logprobs(state.options, state.records.prompt, commit.prompt_token_ids,
                                                        self.tokenizer)
        state.records.prompt.clear()
        return extras

    def _usage(self, state: StreamState, commit: Commit, num_kept: int) -> Usage:
        """The scheduler's usage when the commit has it (less the accepted drafts a stop string
        cut from it, num_kept of its tokens kept); else (a stop string ended the request early)
        the tallies of the commits seen here. completion_tokens counts what was kept."""
        degraded_steps = dict(state.degraded_steps)
        if commit.usage is not None:
            usage = commit.usage.model_copy(deep=True)
            usage.draft_tokens_accepted -= commit.num_accepted - min(commit.num_accepted, num_kept)
            proposed = usage.draft_tokens_proposed
            usage.acceptance_rate = usage.draft_tokens_accepted / proposed if proposed else 0.0
            for reason in ("logprobs_timeout", "logprobs_invalid"):
                if reason in degraded_steps:
                    usage.degraded_steps[reason] = degraded_steps[reason]
        else:
            proposed, accepted = state.draft_tokens_proposed, state.draft_tokens_accepted
            lengths = state.speculative_lengths
            usage = Usage(prompt_tokens=0 if state.prompt_token_ids is None else len(state.prompt_token_ids),
                          draft_tokens_proposed=proposed, draft_tokens_accepted=accepted,
                          acceptance_rate=accepted / proposed if proposed else 0.0, steps=state.steps,
                          degraded_steps=degraded_steps,
                          speculative_lengths=[lengths[k] for k in range(max(lengths, default=-1) + 1)])
        usage.completion_tokens = state.num_tokens
        return usage

    def _deliver(self, state: StreamState, chunk: StreamChunk) -> list[Outgoing]:
        if state.stream:
            return [ChunkToClient(state.client_inbox, chunk, state.version)]
        state.pieces.append(chunk)
        if not chunk.final:
            return []
        return [ChunkToClient(state.client_inbox, merge_chunks(state.pieces), state.version)]


def merge_chunks(pieces: list[StreamChunk]) -> StreamChunk:
    """The single chunk of a stream=False request (seq 0). Logprobs/masks are kept only when
    every piece with tokens has them (a list cannot hold a hole)."""
    first, last = pieces[0], pieces[-1]
    with_tokens = [piece for piece in pieces if len(piece.token_ids)]

    def joined(name: str) -> list | None:
        parts = [getattr(piece, name) for piece in with_tokens]
        if not parts or any(part is None for part in parts):
            return None
        return [entry for part in parts for entry in part]

    degraded = list(dict.fromkeys(reason for piece in pieces for reason in piece.degraded))
    return StreamChunk(
        request_id=last.request_id, seq=0,
        token_ids=np.concatenate([piece.token_ids for piece in pieces]),
        text="".join(piece.text for piece in pieces),
        from_draft=[flag for piece in pieces for flag in piece.from_draft],
        logprobs=joined("logprobs"), sampling_masks=joined("sampling_masks"), degraded=degraded,
        finish_reason=last.finish_reason, usage=last.usage, error=last.error,
        prompt_token_ids=first.prompt_token_ids, prompt_logprobs=first.prompt_logprobs)
