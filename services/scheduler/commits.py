"""Commits: what a verified step appends to a request and tells its postprocessor, and how a
request ends. No NATS, no awaits: services/scheduler/scheduler_core.py owns one `Committer`.

- `cut_tokens`: the emitted tokens kept, cut at max_tokens, an EOS or a stop token id.
- `Committer.commit_batch` / `commit_result`: a verifier's answer into the history, one numbered
  Commit per request that got tokens (or finished); a row's error, an inconsistent result or an
  Error reply for the whole batch ends those requests with "error".
- `Committer.end`: the final commit of a request the core ends (SchedulerState.end takes it out
  of the running table): its slots are released with the next batches, and its final commit
  goes to its postprocessor (or, with none alive, a final chunk straight to its client,
  `direct_final_chunk`). Each request keeps its recent commits (`Request.sent`) for a replay to
  a replacement postprocessor (services/scheduler/recovery.py).

The core owns the running table and the counters (docs/ARCHITECTURE.md#one-owner-per-table):
each method returns `Changes` (scheduler_types.py) saying what to count, which rows were
verified and which requests end, and the core applies them.
"""

from collections import Counter
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import structlog

from schemas.config import SchedulerConfig
from schemas.errors import ErrorCode
from schemas.commits import Commit
from schemas.generation import SamplingParams
from schemas.steps import VerifyResponse, VerifyResult
from schemas.streams import StreamChunk
from schemas.bus.wire import Error, FinishReason
from services.scheduler import features
from services.scheduler.placement import Placement
from services.scheduler.drafts.prefix_hints import PrefixHints, cache_salt
from services.scheduler.scheduler_types import (Changes, Ending, PlannedRow, Request, StepPlan, client_error,
                                                internal_error)
from services.scheduler.slot_release import SlotReleases
from services.runtime.metrics import SchedulerMetrics

log = structlog.get_logger(__name__)

REPLAY_COMMITS = 32  # commits kept per request to replay to a replacement postprocessor, at least


def cut_tokens(tokens: list[int], num_completion: int, sampling: SamplingParams,
               eos_ids: tuple[int, ...]) -> tuple[list[int], FinishReason | None]:
    """Emitted tokens kept and why the request ends: cut at max_tokens ("length"), after an EOS
    ("eos", unless ignore_eos) or after a stop token ("stop"). The EOS / stop token itself is
    kept in token_ids (its text is the postprocessor's business: special tokens decode to "").
    Under structured outputs an EOS ends the request even with ignore_eos: the grammar allowed it
    only where it is complete, and after it nothing is allowed (docs/PROTOCOL.md#structured-outputs)."""
    stop_ids = set(sampling.stop_token_ids.tolist())
    kept: list[int] = []
    for token in tokens:
        if num_completion + len(kept) >= sampling.max_tokens:
            return kept, "length"
        kept.append(token)
        if token in eos_ids and (not sampling.ignore_eos or sampling.structured_outputs is not None):
            return kept, "eos"
        if token in stop_ids:
            return kept, "stop"
    return kept, "length" if num_completion + len(kept) >= sampling.max_tokens else None


def direct_final_chunk(request: Request, reason: FinishReason, error: Error | None = None) -> StreamChunk:
    """A request ending with no live postprocessor: the client still gets a final chunk.
    A cancelled one (often still queued, so it never had a postprocessor) ends as a running
    one does, with no error: the client asked for it, and an error would make the client
    library raise for a cancel that worked."""
    code = {"timeout": ErrorCode.timeout, "cancelled": ErrorCode.cancelled}.get(reason, ErrorCode.unavailable)
    if error is None and reason != "cancelled":
        error = Error(code=code, message=f"request ended ({reason}) with no postprocessor available",
                      request_id=request.request_id)
    chunk = StreamChunk(request_id=request.request_id, seq=request.seq, finish_reason=reason, error=error,
                        usage=request.usage(), v=request.client_version)
    request.seq += 1
    return chunk


def count_degraded(request: Request, reasons: list[str], counts: Counter) -> None:
    """A step's degraded reasons, each once, into the request's usage and counts (degraded_<reason>)."""
    for reason in set(reasons):
        request.degraded_steps[reason] += 1
        counts[f"degraded_{reason}"] += 1


class Committer:
    """Commits and final commits (module docstring). `finishing` holds ended requests whose final
    commit went to a postprocessor, by monotonic end time, for as long as that postprocessor could
    die unnoticed (recovery.py replays them; the core forgets those it needs no more)."""

    def __init__(self, config: SchedulerConfig, placement: Placement, releases: SlotReleases,
                 metrics: SchedulerMetrics, monotonic: Callable[[], float], eos_ids: tuple[int, ...],
                 hints: PrefixHints):
        self.config = config
        self.placement = placement
        self.releases = releases
        self.metrics = metrics
        self.monotonic = monotonic
        self.eos_ids = eos_ids
        self.hints = hints
        self.finishing: dict[str, tuple[Request, float]] = {}

    def end(self, request: Request, reason: FinishReason | None, now: float, *, batch_id: int | None = None,
            tokens: list[int] = (), num_draft: int = 0, num_accepted: int = 0, degraded: list[str] = (),
            expect_side_channel: bool = False, error: Error | None = None) -> Changes:
        """A request the core took out of its running table: free its slots on the next batches,
        and send its final commit (reason None: a StopNotice ended it, nothing is sent). error:
        the reason the client must read, carried by the final commit into the final chunk. With
        no live postprocessor the final chunk goes straight to the client."""
        self.releases.release(request.verifier_id, request.request_id)
        self.releases.release(request.drafter_id, request.request_id)
        if reason != "error" and self.placement.keeps_prefixes(request.verifier_id):  # its slot becomes an entry
            self.hints.record(request.verifier_id, cache_salt(self.config, request.user),
                              request.history[:request.verifier_len])
        changes = Changes(counts=Counter({f"finished_{reason or 'stop_notice'}": 1}))
        if reason is None:
            return changes
        if reason == "error" and error is None:
            error = internal_error(request.request_id, "the request failed in the scheduler (see its log)")
        alive = self.placement.alive(request.postprocessor_id)
        # its postprocessor died (the other not picked yet, or a restart coming): the final commit
        # waits, up to the deadline, to be replayed to one (recovery.py replay_lost_finals)
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
                    changes.outbox.commits.append((request.postprocessor_id, commit))
                    return changes
                request.awaiting_postprocessor = True
                changes.counts["postprocessor_awaited"] += 1
                return changes
        changes.outbox.chunks.append((request.client_inbox, direct_final_chunk(request, reason, error)))
        return changes

    def forget(self, request_ids: list[str]) -> None:
        """Ended requests no longer kept for a replay (recovery.py replay_lost_finals)."""
        for request_id in request_ids:
            del self.finishing[request_id]

    def commit(self, request: Request, batch_id: int, tokens: list[int], num_draft: int, num_accepted: int,
               degraded: list[str], finish_reason: FinishReason | None, expect_side_channel: bool,
               error: Error | None = None) -> Commit:
        """The Commit for tokens already appended to the history (seq numbered here)."""
        first = request.seq == 0
        completion_len = len(request.completion) - len(tokens)
        # in the client's version; sent in one its postprocessor speaks too (scheduler.send)
        commit = Commit(v=request.client_version, request_id=request.request_id, batch_id=batch_id, step=request.step,
                        seq=request.seq,
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
        now = request.told_at = self.monotonic()
        request.sent.append((commit, completion_len, now))
        while len(request.sent) > REPLAY_COMMITS and request.sent[0][2] < now - 2 * self.config.heartbeat_timeout_s:
            request.sent.popleft()
        if tokens:
            since_last = None if request.last_token_at is None else now - request.last_token_at
            self.metrics.committed(len(tokens), now - request.admitted_at, since_last)
            request.last_token_at = now
        return commit

    def commit_batch(self, plan: StepPlan, verifier_id: str, response: VerifyResponse | Error, now: float,
                     running: Mapping[str, Request]) -> Iterator[Changes]:
        """Commit a verifier's answer to the plan's batch, one `Changes` per row in row order (the
        first: the step counted), each applied by the core before the next row is committed.
        running: the core's running requests (a row's request ended meanwhile is skipped). An
        Error reply (the verifier refused the message itself): its requests end with "error"."""
        request_message = plan.verify_requests[verifier_id]
        if isinstance(response, Error):
            log.error("verify_batch_refused", verifier_id=verifier_id, batch_id=request_message.batch_id,
                      code=response.code.value, field=response.field, message=response.message)
            for planned in plan.rows.get(verifier_id, []):
                yield Changes(ended=[Ending(planned.request, "error", {"error": client_error(
                    response, planned.request.request_id, planned.request.seq == 0)})])
            return
        yield Changes(counts=Counter({"steps": int(bool(plan.rows.get(verifier_id)))}))
        results = {r.request_id: r for r in response.rows}
        for planned in plan.rows.get(verifier_id, []):
            request = planned.request
            if request.request_id not in running:  # ended while the step ran (cannot today; cheap guard)
                continue
            result = results.get(request.request_id)
            request.last_batch_id = request_message.batch_id
            if result is None or result.step != request.step:
                log.warning("verify_result_missing", request_id=request.request_id, verifier_id=verifier_id,
                            batch_id=request_message.batch_id)
                request.step += 1
                yield Changes(counts=Counter({"dropped_missing_results": 1}))
                continue
            try:
                changes = self.commit_result(planned, result, request_message.batch_id, verifier_id in plan.retried,
                                             now)
            except Exception:  # this request's bug ends this request; the batch's other rows go on
                log.exception("commit_result_failed", request_id=request.request_id)
                changes = Changes(ended=[Ending(request, "error", {"error": internal_error(
                    request.request_id, "the scheduler failed to commit a step (see its log)")})])
            yield changes

    def commit_result(self, planned: PlannedRow, result: VerifyResult, batch_id: int, retried: bool,
                      now: float) -> Changes:
        """One row's result: a row error ends the request, need_resync re-prefills it, else the
        tokens kept (cut_tokens) are appended and committed, the final commit when it finishes
        (Changes.ended); a consistent row is reported verified (adaptive k, draft method)."""
        request = planned.request
        request.step += 1
        request.num_steps += 1
        degraded = planned.degraded + (["verifier_retry"] if retried else [])
        changes = Changes()
        if result.error is not None:
            log.warning("verify_row_failed", request_id=request.request_id, code=result.error.code.value,
                        field=result.error.field, message=result.error.message)
            error = client_error(result.error, request.request_id, first=request.seq == 0)
            changes.ended.append(Ending(request, "error", {"batch_id": batch_id, "degraded": degraded,
                                                           "error": error}))
            return changes
        if result.need_resync:
            request.verifier_len = 0
            request.carried_degraded += [*degraded, "resync"]
            count_degraded(request, [*degraded, "resync"], changes.counts)
            return changes
        if planned.features_from is not None and not features.receive(request, result.features):
            changes.counts["features_dropped"] += 1
        tokens = result.token_ids.tolist()
        if planned.emit != bool(tokens) or result.num_draft != planned.num_draft:
            changes.counts["bad_verify_results"] += 1
            log.warning("verify_result_inconsistent", request_id=request.request_id, emit=planned.emit,
                        num_tokens=len(tokens), num_draft=result.num_draft, planned=planned.num_draft)
            changes.ended.append(Ending(request, "error", {"batch_id": batch_id, "degraded": degraded,
                                                           "error": internal_error(
                request.request_id, f"the verifier's result does not match the step ({len(tokens)} tokens, "
                                    f"{result.num_draft} drafts for {planned.num_draft} planned)")}))
            return changes
        request.verifier_len = planned.end + result.num_accepted
        drafted = planned.num_draft + result.num_forced  # the drafter's drafts and the grammar's forced tokens
        request.num_draft_proposed += drafted
        request.num_draft_accepted += result.num_accepted
        request.cached_tokens += result.cached_tokens
        if planned.decode:
            request.speculative_lengths[planned.num_draft] += 1
        else:  # the run of its chunks the prefix cache gave whole (step_planner.py step 4)
            whole = result.cached_tokens >= planned.end - planned.cached_len
            request.hit_run = request.hit_run_at(planned.cached_len) + result.cached_tokens if whole else 0
            request.hit_run_end = planned.end
        changes.verified.append((planned, result))
        self.metrics.verified(request.sampling.greedy, request.speculative.draft_mode,
                              drafted, result.num_accepted)
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
            count_degraded(request, degraded, changes.counts)
            return changes
        count_degraded(request, degraded, changes.counts)
        degraded = request.carried_degraded + degraded
        request.carried_degraded = []
        expect_side = request.logprobs.wants_side_channel and (bool(kept) or request.awaits_prompt_logprobs)
        num_accepted = min(result.num_accepted, len(kept))
        if finish_reason is not None:
            changes.ended.append(Ending(request, finish_reason, {
                "batch_id": batch_id, "tokens": kept, "num_draft": drafted, "num_accepted": num_accepted,
                "degraded": degraded, "expect_side_channel": expect_side}))
            return changes
        changes.outbox.commits.append((request.postprocessor_id, self.commit(
            request, batch_id, kept, drafted, num_accepted, degraded, None, expect_side)))
        return changes
