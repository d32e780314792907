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

Text: incremental detokenization (text.tokenizer.detokenize_step), one token at a time so
a stop string is located at the token that completes it. While a request has stop strings, the
last (longest stop - 1) characters are held back, so a stop string split across chunks is cut
exactly; the text never includes the stop string. A match ends the request: final chunk with
finish_reason "stop" and usage, a StopNotice to the owning scheduler, later commits ignored
(counted).

A commit with resume_token_ids for an unknown request (the request moved here from a dead
postprocessor) replays those tokens through the detokenizer exactly as the old postprocessor
did, so the text continues where the old one stopped sending, and the stream continues at the
commit's seq.
"""

import math
from collections import Counter
from dataclasses import dataclass, field, fields

import numpy as np
import structlog

from text.tokenizer import DetokenizerState, Tokenizer, detokenize_step, new_detokenizer_state
from schemas.commits import Commit, LogprobArrays, SideChannelRecord, StopNotice
from schemas.errors import ErrorCode
from schemas.generation import LogprobOptions
from schemas.protocol import MAX_TIMEOUT_S
from schemas.streams import SamplingMask, StreamChunk, TokenLogprob, Usage
from schemas.wire import Error

log = structlog.get_logger(__name__)

MAX_RECORDS_PER_REQUEST = 64  # records waiting for their commit; more means a broken sender
MAX_EARLY_RECORDS = 4096  # records for requests whose first commit has not come yet


@dataclass
class ChunkToClient:
    inbox: str
    chunk: StreamChunk


@dataclass
class NoticeToScheduler:
    scheduler_id: str
    notice: StopNotice


Outgoing = ChunkToClient | NoticeToScheduler


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
    """One request's stream. `text` is the completion text so far (cut at a stop string),
    `sent_chars` how much of it has been published."""

    request_id: str
    scheduler_id: str
    client_inbox: str
    options: LogprobOptions
    stop: list[str]
    stream: bool
    next_seq: int
    detok: DetokenizerState
    last_active: float
    prompt_token_ids: np.ndarray | None = None
    text: str = ""
    sent_chars: int = 0
    num_tokens: int = 0
    commits: dict[int, PendingCommit] = field(default_factory=dict)  # by seq, not yet processed
    records: dict[int, tuple[SideChannelRecord, float]] = field(default_factory=dict)  # by batch_id
    prompt_records: list[SideChannelRecord] = field(default_factory=list)  # until the first chunk
    joined_batches: set[int] = field(default_factory=set)
    timed_out_batches: set[int] = field(default_factory=set)
    pieces: list[StreamChunk] = field(default_factory=list)  # stream=False: merged at the end
    steps: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    degraded_steps: Counter = field(default_factory=Counter)
    speculative_lengths: Counter = field(default_factory=Counter)  # drafts per commit after the first
    last_batch_id: int | None = None  # of the last commit processed
    last_step: int = 0
    finished_at: float | None = None

    @property
    def holdback(self) -> int:
        return max(map(len, self.stop), default=1) - 1


class Postprocessor:
    """Joins, formats and detokenizes; see the module docstring. Not thread-safe (one asyncio loop)."""

    def __init__(self, tokenizer: Tokenizer, instance_id: str, *, side_channel_timeout_s: float = 2.0,
                 max_requests: int = 1024, gap_timeout_s: float | None = None, record_ttl_s: float = 30.0,
                 finished_ttl_s: float = 60.0, idle_ttl_s: float = MAX_TIMEOUT_S):
        self.tokenizer = tokenizer
        self.instance_id = instance_id
        self.side_channel_timeout_s = side_channel_timeout_s
        self.max_requests = max_requests
        self.gap_timeout_s = gap_timeout_s if gap_timeout_s is not None else max(1.0, 2 * side_channel_timeout_s)
        self.record_ttl_s = record_ttl_s
        self.finished_ttl_s = finished_ttl_s
        self.idle_ttl_s = idle_ttl_s
        self.requests: dict[str, StreamState] = {}
        self.early: dict[str, dict[int, tuple[SideChannelRecord, float]]] = {}
        self.num_early = 0
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
            self._buffer_early(record, now)
            return []
        if state.finished_at is not None:
            self._drop_record(record, self._stray_kind(state, record.batch_id) or "unjoined_records")
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
        for request_id in list(self.early):
            for batch_id, (record, arrived) in list(self.early[request_id].items()):
                if now - arrived > self.record_ttl_s:
                    self._forget_early(request_id, batch_id)
                    self._drop_record(record, "unjoined_records", "early_record_expired")
        return outs

    def request_failed(self, message: Commit | SideChannelRecord, now: float) -> list[Outgoing]:
        """The logic raised on this message (a bug): its request ends with an `internal` error
        and its scheduler is told, so the client does not wait out its timeout; others go on."""
        self.counters.failed_requests += 1
        state = self.requests.get(message.request_id)
        if state is not None and state.finished_at is None:
            return self._fail(state, state.next_seq, ErrorCode.internal,
                              "the postprocessor failed on this request (see its log)", now)
        if state is None and isinstance(message, Commit):
            error = Error(code=ErrorCode.internal, message="the postprocessor failed on this request (see its log)",
                          request_id=message.request_id)
            notice = StopNotice(request_id=message.request_id, batch_id=message.batch_id, step=message.step,
                                postprocessor_id=self.instance_id, reason="error")
            return [ChunkToClient(message.client_inbox, StreamChunk(request_id=message.request_id, seq=message.seq,
                                                               finish_reason="error", error=error)),
                    NoticeToScheduler(message.scheduler_id, notice)]
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
        prompt = commit.prompt_token_ids
        state = StreamState(
            request_id=commit.request_id, scheduler_id=commit.scheduler_id, client_inbox=commit.client_inbox,
            options=commit.logprobs, stop=list(commit.stop), stream=commit.stream,
            next_seq=commit.seq if resume is not None else 0,
            detok=new_detokenizer_state(prompt if prompt is not None else ()), last_active=now,
            prompt_token_ids=prompt)
        self.requests[commit.request_id] = state
        if resume is not None:
            self._resume(state, resume)
        for record, arrived in self.early.pop(commit.request_id, {}).values():
            self.num_early -= 1
            self._add_record(state, record, arrived)
        return state

    def _resume(self, state: StreamState, resume_token_ids: np.ndarray) -> None:
        """Replay tokens the way _detokenize did on the old postprocessor: same text, same
        held-back tail, so the client sees no gap and no repeat."""
        for token_id in resume_token_ids.tolist():
            state.detok, delta = detokenize_step(self.tokenizer, state.detok, [token_id])
            state.text += delta
        state.num_tokens = len(resume_token_ids)
        state.sent_chars = max(0, len(state.text) - state.holdback)
        if not state.stream and len(resume_token_ids):
            state.pieces.append(StreamChunk(request_id=state.request_id, seq=0, token_ids=resume_token_ids,
                                            text=state.text[:state.sent_chars],
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
        chunk = StreamChunk(request_id=commit.request_id, seq=0, finish_reason="error", error=error)
        notice = StopNotice(request_id=commit.request_id, batch_id=commit.batch_id, step=commit.step,
                            postprocessor_id=self.instance_id, reason="error")
        return [ChunkToClient(commit.client_inbox, chunk), NoticeToScheduler(commit.scheduler_id, notice)]

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
        return [ChunkToClient(state.client_inbox, chunk), self._notice(state, "error")]

    def _finish(self, state: StreamState, now: float) -> None:
        state.finished_at = now
        state.commits.clear()
        state.pieces.clear()
        state.prompt_records.clear()
        for record, _ in state.records.values():
            if len(record.token_ids):
                self._drop_record(record, "unjoined_records", "record_never_joined")
        state.records.clear()

    def _notice(self, state: StreamState, reason: str, stop: str | None = None, text_offset: int = 0) -> NoticeToScheduler:
        notice = StopNotice(request_id=state.request_id, batch_id=state.last_batch_id or 0, step=state.last_step,
                            postprocessor_id=self.instance_id, reason=reason, stop=stop,
                            text_offset=text_offset, num_tokens=state.num_tokens)
        return NoticeToScheduler(state.scheduler_id, notice)

    # ------------------------------------------------------------------ side-channel records

    def _buffer_early(self, record: SideChannelRecord, now: float) -> None:
        waiting = self.early.setdefault(record.request_id, {})
        if record.batch_id in waiting:
            self._drop_record(record, "duplicate_records")
            return
        if self.num_early >= MAX_EARLY_RECORDS:
            request_id, batch_id, (oldest, _) = min(
                ((rid, bid, entry) for rid, by_batch in self.early.items() for bid, entry in by_batch.items()),
                key=lambda item: item[2][1])
            self._forget_early(request_id, batch_id)
            self._drop_record(oldest, "unjoined_records", "early_record_evicted")
            waiting = self.early.setdefault(record.request_id, {})
        waiting[record.batch_id] = (record, now)
        self.num_early += 1

    def _forget_early(self, request_id: str, batch_id: int) -> None:
        del self.early[request_id][batch_id]
        self.num_early -= 1
        if not self.early[request_id]:
            del self.early[request_id]

    def _add_record(self, state: StreamState, record: SideChannelRecord, arrived: float) -> None:
        batch_id = record.batch_id
        stray = "duplicate_records" if batch_id in state.records else self._stray_kind(state, batch_id)
        if stray is not None:
            self._drop_record(record, stray)
            return
        if len(state.records) >= MAX_RECORDS_PER_REQUEST:
            self._drop_record(state.records.pop(min(state.records))[0], "unjoined_records", "record_evicted")
        if record.prompt_logprobs is not None and state.next_seq == 0:
            state.prompt_records.append(record)
        state.records[batch_id] = (record, arrived)

    def _stray_kind(self, state: StreamState, batch_id: int) -> str | None:
        """Why a record for this batch can no longer be used, as a Counters field (None: it can)."""
        if batch_id in state.joined_batches:
            return "duplicate_records"
        if batch_id in state.timed_out_batches or (state.last_batch_id is not None and batch_id <= state.last_batch_id):
            return "late_records"  # its chunk (or the first chunk, for prompt logprobs) is out
        return None

    def _drop_record(self, record: SideChannelRecord, counter: str, event: str | None = None) -> None:
        count = getattr(self.counters, counter) + 1
        setattr(self.counters, counter, count)
        log.warning(event or f"{counter.removesuffix('s')}_dropped", request_id=record.request_id,
                    batch_id=record.batch_id, **{counter: count})

    def _prompt_covered(self, state: StreamState, commit: Commit) -> bool:
        if commit.seq != 0 or state.options.prompt_logprobs is None or commit.prompt_token_ids is None:
            return True
        covered = set()
        for record in state.prompt_records:
            covered.update(range(record.prompt_offset, record.prompt_offset + record.prompt_logprobs.n))
        return covered.issuperset(range(1, len(commit.prompt_token_ids)))

    # ------------------------------------------------------------------ commits -> chunks

    def _advance(self, state: StreamState, now: float) -> list[Outgoing]:
        """Process buffered commits in seq order while each has what it waits for."""
        outs: list[Outgoing] = []
        while state.finished_at is None and state.next_seq in state.commits:
            pending = state.commits[state.next_seq]
            commit = pending.commit
            entry = state.records.get(commit.batch_id)
            complete = entry is not None and self._prompt_covered(state, commit)
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
        self._settle_records(state, commit, record)
        if timed_out:
            self.counters.logprobs_timeouts += 1
            degraded.append("logprobs_timeout")
            log.warning("logprobs_timeout", request_id=state.request_id, batch_id=commit.batch_id,
                        timeouts=self.counters.logprobs_timeouts)
        if record is not None and not self._record_fits(record, commit):
            self.counters.invalid_records += 1
            log.warning("record_does_not_match_commit", request_id=state.request_id, batch_id=commit.batch_id)
            record = None
            degraded.append("logprobs_invalid")

        final = commit.finish_reason is not None
        num_kept, match = self._detokenize(state, commit.token_ids, final)
        state.num_tokens += num_kept
        state.last_batch_id, state.last_step = commit.batch_id, commit.step
        state.steps += 1
        state.draft_tokens_proposed += commit.num_draft
        state.draft_tokens_accepted += min(commit.num_accepted, num_kept)
        if commit.prompt_token_ids is None:  # the first commit is the prefill's
            state.speculative_lengths[commit.num_draft] += 1
        state.degraded_steps.update(set(degraded))
        finish_reason = "stop" if match is not None else commit.finish_reason
        done = finish_reason is not None

        chunk = StreamChunk(
            request_id=state.request_id, seq=commit.seq, token_ids=commit.token_ids[:num_kept],
            text=self._take_text(state, done), from_draft=[i < commit.num_accepted for i in range(num_kept)],
            degraded=list(dict.fromkeys(degraded)), finish_reason=finish_reason,
            usage=self._usage(state, commit) if done else None, error=commit.error if final else None,
            scheduler_id=commit.scheduler_id, **self._token_extras(state, record, commit.token_ids[:num_kept]),
            **self._prompt_extras(state, commit))
        outs = self._deliver(state, chunk)
        if match is not None and not final:
            position, stop = match
            outs.append(self._notice(state, "stop", stop, position))
        if done:
            self._finish(state, now)
        return outs

    def _settle_records(self, state: StreamState, commit: Commit, record: SideChannelRecord | None) -> None:
        """Mark this commit's batch joined or timed out, and drop records of earlier batches:
        no later commit can claim them (batch ids increase with the steps of a request)."""
        if record is not None:
            state.joined_batches.add(commit.batch_id)
        elif commit.expect_side_channel:
            state.timed_out_batches.add(commit.batch_id)
        unused = state.records.pop(commit.batch_id, None)
        if record is None and unused is not None:  # the commit expects none (e.g. a replayed commit)
            self._drop_record(unused[0], "unjoined_records", "record_not_expected")
        for batch_id in [b for b in state.records if b < commit.batch_id]:
            stale, _ = state.records.pop(batch_id)
            if len(stale.token_ids):
                self._drop_record(stale, "unjoined_records", "stale_record")
            else:  # a prefill chunk's record: its prompt logprobs were collected already
                state.joined_batches.add(batch_id)

    def _record_fits(self, record: SideChannelRecord, commit: Commit) -> bool:
        num_tokens = len(commit.token_ids)
        options = commit.logprobs
        wants_logprobs = options.logprobs is not None or len(options.logprob_token_ids) > 0
        return (len(record.token_ids) >= num_tokens
                and np.array_equal(record.token_ids[:num_tokens], commit.token_ids)
                and (not num_tokens or not wants_logprobs or record.logprobs is not None)
                and (not num_tokens or not options.sampling_mask or record.masks is not None))

    def _detokenize(self, state: StreamState, token_ids: np.ndarray,
                    final: bool) -> tuple[int, tuple[int, str] | None]:
        """Feed tokens one at a time; returns (tokens kept, (stop position, stop string) or None).
        A stop match keeps the token that completed it and cuts the text at the match."""
        ids = token_ids.tolist()
        if final and not ids:
            state.detok, delta = detokenize_step(self.tokenizer, state.detok, [], final=True)
            return 0, self._append_text(state, delta)
        for index, token_id in enumerate(ids):
            last = final and index == len(ids) - 1
            state.detok, delta = detokenize_step(self.tokenizer, state.detok, [token_id], final=last)
            match = self._append_text(state, delta)
            if match is not None:
                return index + 1, match
        return len(ids), None

    def _append_text(self, state: StreamState, delta: str) -> tuple[int, str] | None:
        if not delta:
            return None
        start = max(0, len(state.text) - state.holdback)  # a match must end inside the new text
        state.text += delta
        match = find_stop(state.text, state.stop, start)
        if match is not None:
            state.text = state.text[:match[0]]
        return match

    def _take_text(self, state: StreamState, done: bool) -> str:
        end = len(state.text) if done else max(state.sent_chars, len(state.text) - state.holdback)
        text = state.text[state.sent_chars:end]
        state.sent_chars = end
        return text

    def _token_extras(self, state: StreamState, record: SideChannelRecord | None, token_ids: np.ndarray) -> dict:
        options = state.options
        wants_logprobs = options.logprobs is not None or len(options.logprob_token_ids) > 0
        if record is None or not (wants_logprobs or options.sampling_mask):
            return {}
        masks = None if record.masks is None else record.masks[:len(token_ids)]
        extras: dict = {}
        if options.sampling_mask:
            extras["sampling_masks"] = masks or []  # _record_fits: present when there are tokens
        if wants_logprobs:
            extras["logprobs"] = format_logprobs(
                record.logprobs, token_ids.tolist(), mode=record.mode, top_n=options.logprobs or 0,
                requested_ids=options.logprob_token_ids.tolist(), masks=masks, tokenizer=self.tokenizer)
        return extras

    def _prompt_extras(self, state: StreamState, commit: Commit) -> dict:
        if commit.seq != 0 or commit.prompt_token_ids is None:
            return {}
        extras: dict = {"prompt_token_ids": commit.prompt_token_ids}
        if state.options.prompt_logprobs is not None:
            prompt_ids = commit.prompt_token_ids.tolist()
            entries: list[TokenLogprob | None] = [None] * len(prompt_ids)
            for record in state.prompt_records:
                arrays, offset = record.prompt_logprobs, record.prompt_offset
                positions = [p for p in range(offset, offset + arrays.n) if 1 <= p < len(prompt_ids)]
                formatted = format_logprobs(
                    arrays, [prompt_ids[p] for p in positions], mode=record.mode,
                    top_n=state.options.prompt_logprobs, requested_ids=state.options.logprob_token_ids.tolist(),
                    rows=[p - offset for p in positions], tokenizer=self.tokenizer)
                for position, entry in zip(positions, formatted):
                    entries[position] = entry
            extras["prompt_logprobs"] = entries
        state.prompt_records.clear()
        return extras

    def _usage(self, state: StreamState, commit: Commit) -> Usage:
        """The scheduler's usage when the commit has it; else (a stop string ended the request
        early) the tallies of the commits seen here. completion_tokens counts what was kept."""
        degraded_steps = dict(state.degraded_steps)
        if commit.usage is not None:
            usage = commit.usage.model_copy(deep=True)
            for reason in ("logprobs_timeout", "logprobs_invalid"):
                if reason in degraded_steps:
                    usage.degraded_steps[reason] = degraded_steps[reason]
        else:
            proposed, accepted = state.draft_tokens_proposed, state.draft_tokens_accepted
            usage = Usage(prompt_tokens=0 if state.prompt_token_ids is None else len(state.prompt_token_ids),
                          draft_tokens_proposed=proposed, draft_tokens_accepted=accepted,
                          acceptance_rate=accepted / proposed if proposed else 0.0, steps=state.steps,
                          degraded_steps=degraded_steps, speculative_lengths=[
                              state.speculative_lengths[k] for k in range(max(state.speculative_lengths, default=-1) + 1)])
        usage.completion_tokens = state.num_tokens
        return usage

    def _deliver(self, state: StreamState, chunk: StreamChunk) -> list[Outgoing]:
        if state.stream:
            return [ChunkToClient(state.client_inbox, chunk)]
        state.pieces.append(chunk)
        if not chunk.final:
            return []
        return [ChunkToClient(state.client_inbox, merge_chunks(state.pieces))]


def find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """The earliest occurrence at or after `start` of any stop string: (position, stop)."""
    found = [(position, stop) for stop in stops if (position := text.find(stop, start)) >= 0]
    return min(found) if found else None


def format_logprobs(arrays: LogprobArrays, token_ids: list[int], *, mode: str, top_n: int, requested_ids: list[int],
                    tokenizer: Tokenizer, masks: list[SamplingMask] | None = None,
                    rows: list[int] | None = None) -> list[TokenLogprob]:
    """TokenLogprobs for token_ids from rows `rows` of arrays (default 0..len-1).

    mode "raw": values as they are. mode "processed": value - logz_k (LogprobArrays), and -inf
    for ids outside K when the position's mask lists K in full (the verifier already sends
    -inf for them; the mask check makes it hold for any sender). top-n drops -1 padding.
    """
    rows = list(range(len(token_ids))) if rows is None else rows
    assert len(rows) == len(token_ids), f"{len(rows)} rows for {len(token_ids)} tokens"
    out = []
    for index, (row, token_id) in enumerate(zip(rows, token_ids)):
        norm = float(arrays.logz_k[row]) if mode == "processed" else 0.0
        mask = masks[index] if masks is not None else None
        in_k = set(mask.token_ids.tolist()) if mode == "processed" and mask is not None and not (
            mask.all_tokens or mask.truncated) else None

        def value(id_: int, raw: float) -> float:
            return -math.inf if in_k is not None and id_ not in in_k else raw - norm

        top_ids = arrays.top_ids[row]
        keep = top_ids >= 0
        top_ids = top_ids[keep][:top_n]
        top_logprobs = [value(i, v) for i, v in zip(top_ids.tolist(), arrays.top_logprobs[row][keep][:top_n].tolist())]
        requested = [value(i, v) for i, v in zip(requested_ids, arrays.requested_logprobs[row].tolist())]
        out.append(TokenLogprob(
            token_id=token_id, logprob=value(token_id, float(arrays.token_logprobs[row])),
            rank=None if arrays.ranks is None else int(arrays.ranks[row]), token=tokenizer.decode([token_id]),
            top_ids=top_ids, top_logprobs=np.asarray(top_logprobs, np.float32),
            requested_logprobs=np.asarray(requested, np.float32)))
    return out


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
