"""Scheduler logic without NATS: the core the scheduler's step loops drive, and the collaborators
it hands each job to.

`SchedulerState` is driven by the scheduler's step loops (services/scheduler/scheduler.py), one
step at a time per lane: boundary, plan_step, draft_batches / apply_draft, verify_batches /
apply_verify, end_step. The loop, lanes and in-flight rule are told once, in
docs/ARCHITECTURE.md#the-step-loop. The core owns the tables the collaborators read (the running
requests, those in a step now, the counters) and is the only one that changes them
(docs/ARCHITECTURE.md#one-owner-per-table): a collaborator gets what it reads as arguments and
returns `Changes` (scheduler_types.py), which `SchedulerState.apply` applies. It delegates:
- admission.py `Admission`: the queue, fair share, the checks a request passes to join it;
- placement.py `Placement`: instances, heartbeats, the one with the most room for a pin;
- step_planner.py `StepPlanner`: the rows of each step, decode rows first, each row's k;
- batch_builder.py `BatchBuilder`: a plan's draft and verify batches within one payload room;
- commits.py `Committer`: verified rows into commits, and how a request ends;
- recovery.py `Recovery`: dead or failing instances replaced, commits replayed, migrations;
- slot_release.py `SlotReleases`: the slots each instance is told to free.

Every method returns an `Outbox` (scheduler_types.py) of Commits (to a postprocessor) and
StreamChunks and Admitted answers (straight to a client inbox). Deadlines are wall-clock
`time.time()` seconds, as on the wire; liveness uses the registry's monotonic clock.
Interpretations of the contract (docs/PROTOCOL.md) are listed in `SchedulerState`'s docstring.
"""

import time
from collections import Counter
from collections.abc import Callable

import structlog

from schemas.config import SchedulerConfig
from schemas.bus.control import Heartbeat
from schemas.errors import ErrorCode, SpecbusError
from schemas.generation import GenerateRequest
from schemas.steps import DraftRequest, DraftResponse, VerifyRequest, VerifyResponse
from schemas.streams import Admitted
from schemas.bus.wire import Error, FinishReason
from services.scheduler.admission import Admission
from services.scheduler.batch_builder import BatchBuilder
from services.scheduler.commits import Committer
from services.scheduler.drafts.draft_method import drafted, pin_drafter
from services.scheduler.placement import Placement
from services.scheduler.drafts.prefix_hints import PrefixHints, cache_salt
from services.scheduler.recovery import Recovery
from services.scheduler.scheduler_types import Changes, Outbox, Request, StepPlan
from services.scheduler.slot_release import SlotReleases
from services.scheduler.step_planner import StepPlanner
from services.runtime.metrics import SchedulerMetrics
from text.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

QUEUE_BUCKETS = (0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)  # seconds queued
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)  # tokens of a verify batch
STEP_GAUGES = ("step_token_budget", "step_rows_fit")  # stats() keys that are gauges, beside the shared SCHEDULER_GAUGES


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
      every step takes k); rejection-sampled rows always take k (step_planner.py says why).
      usage.speculative_lengths counts decode steps by the drafts they verified (a tree's nodes).
    - Such a row may instead take drafts from this scheduler's suffix index of its tenant's
      earlier requests (suffix_index.py), where suffix_choice.py measures they beat its drafter's;
      every request's prompt and output join the index as it runs and when it ends.
    - With max_tree_nodes, such a row may ask a tree of drafts instead of a chain, where
      tree_choice.py measures it pays (docs/PROTOCOL.md#tree-drafts).
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
    - Postprocessor lost: its requests' commits of the last 2 x heartbeat_timeout_s (at least
      the last REPLAY_COMMITS) are replayed to a new one (recovery.py).
    - A running request whose client was sent nothing for heartbeat_interval_s (a long prefill,
      a slow verifier, a wait for a verifier) is sent Admitted `started` again (keepalives), so
      a client never takes a live request's silence for lost output
      (docs/PROTOCOL.md#scheduler-failover). Time queued counts against the deadline and is
      observed at the start (metric queue_seconds).
    """

    def __init__(self, config: SchedulerConfig, tokenizer: Tokenizer, tokenizer_hash: str,
                 monotonic: Callable[[], float] = time.monotonic):
        self.config = config
        self.tokenizer = tokenizer
        self.tokenizer_hash = tokenizer_hash
        self.monotonic = monotonic
        self.placement = Placement(config.heartbeat_timeout_s, tokenizer_hash, monotonic)
        self.running: dict[str, Request] = {}  # in start order: decode order within a step
        self.in_flight: set[str] = set()  # ids of requests in a step now in flight (any lane)
        self.counters: Counter = Counter()
        self.metrics = SchedulerMetrics()  # histograms and acceptance by mode; the service exposes counters too
        self.max_payload: int | None = None  # the NATS server's, set by the service; None: unchecked
        self.releases = SlotReleases(self.placement)
        self.admission = Admission(config, tokenizer, self.placement, self.metrics, monotonic)
        self.waiting = self.admission.waiting  # the queue, Admission's: read here
        self.planner = StepPlanner(config, self.placement)
        self.hints = PrefixHints()
        self.committer = Committer(config, self.placement, self.releases, self.metrics, monotonic, tokenizer.eos_ids,
                                   self.hints)
        self.recovery = Recovery(config, self.placement, self.releases)
        self.builder = BatchBuilder(config, self.placement, self.planner.budget, self.releases)
        self.queue_seconds = self.metrics.histogram(
            "queue_seconds", "admission to start: time a request waited in the queue (it counts against its "
            "deadline)", QUEUE_BUCKETS)
        self.step_tokens = self.metrics.histogram(
            "step_tokens", "new tokens of one verify batch, by row kind: decode (1 + drafts per row) or prefill",
            TOKEN_BUCKETS, ("kind",))
        self.last_step_budget = 0  # the step budget of the last verifier planned (step_budget.py)

    # ------------------------------------------------------------------ instances and requests

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

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def admit(self, request: GenerateRequest, client_inbox: str, prompt_ids: list[int], now: float) -> Request:
        """Queue a valid request, or raise SpecbusError before any work (admission.py)."""
        state, changes = self.admission.admit(request, client_inbox, prompt_ids, now, self.running, self.max_payload)
        self.apply(changes, now)
        return state

    def admitted(self, request_id: str, *, started: bool, v: int) -> Admitted:
        """The answer to the client that its request is here (queued) or running (started), in
        its request's version v."""
        return Admitted(request_id=request_id, scheduler_id=self.config.instance_id, started=started, v=v)

    def cancel(self, request_id: str, owner_inbox: str | None = None) -> bool:
        """Mark for the next step boundary; False when this scheduler does not own the request.
        owner_inbox: the cancelling user's inbox prefix; SpecbusError `forbidden` when the
        request streams to another inbox (another client user's request)."""
        request = self.running.get(request_id) or self.admission.queued(request_id)
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
            self.releases.forget(instance.instance_id)
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
                if request.speculative.num_speculative_tokens > 0 and not self.placement.alive(request.drafter_id):
                    # another drafter (draft_method.py), which gets the whole history
                    new_id = pin_drafter(self.placement, self.pinned_count, request)
                    request.drafter_id = self.placement.count_pin(new_id)
                    request.restart_drafter()
                outbox.extend(self.apply(self.recovery.replace_dead(request, self.pinned_count), now))
        outbox.extend(self.apply(self.recovery.replay_lost_finals(self.committer.finishing, now, self.pinned_count),
                                 now))
        return outbox.extend(self.start_queued(now))

    def start_queued(self, now: float) -> Outbox:
        """End the queued requests that end now (Admission.sweep), then start the others in the
        queue's order while there is room; each started one's client hears Admitted `started`."""
        outbox = Outbox()
        for request, reason, error in self.admission.sweep(now, self.running):
            outbox.extend(self.end(request, reason, now, error=error))
        for request in self.admission.start_order(self.running):
            if self.start(request):
                self.admission.started(request)
                self.running[request.request_id] = request
                self.counters["started"] += 1
                request.told_at = self.monotonic()
                self.queue_seconds.observe(request.told_at - request.admitted_at)
                outbox.acks.append((request.client_inbox,
                                    self.admitted(request.request_id, started=True, v=request.client_version)))
        return outbox

    def keepalives(self) -> Outbox:
        """Admitted `started` again to the client of each running request (in a step or not)
        that was sent nothing for heartbeat_interval_s: it lives, however long its next chunk
        takes (class docstring)."""
        now, outbox = self.monotonic(), Outbox()
        for request in self.running.values():
            if now - request.told_at >= self.config.heartbeat_interval_s:
                request.told_at = now
                outbox.acks.append((request.client_inbox,
                                    self.admitted(request.request_id, started=True, v=request.client_version)))
        return outbox

    def start(self, request: Request) -> bool:
        """Pin a verifier, a postprocessor and (when it wants drafts) a drafter; False: wait."""
        verifier_id = self.placement.pick("verifier", self.pinned_count)
        postprocessor_id = self.placement.pick("postprocessor", self.pinned_count)
        if verifier_id is None or postprocessor_id is None:
            return False
        if not self.planner.budget.room(verifier_id, self.pinned_count(verifier_id)) and \
                any(r.user == request.user and r.verifier_id == verifier_id for r in self.running.values()):
            # the requests running there fill its step time (step_budget.py, step rows); a user
            # with none there starts one all the same: another's requests never keep it out
            return False
        request.verifier_id = self.placement.count_pin(verifier_id)
        request.postprocessor_id = self.placement.count_pin(postprocessor_id)
        if request.logprobs.prompt_logprobs is None and self.placement.keeps_prefixes(verifier_id):
            # its first chunk takes what the verifier's prefix cache is expected to give (step_planner.py step 4)
            request.hit_run = self.hints.expected(verifier_id, cache_salt(self.config, request.user), request.history)
        limit = self.placement.max_seq_len()
        if limit is not None and request.prompt_len + request.sampling.max_tokens > limit:
            # Generation stops at max_seq_len with finish_reason "length", as at max_tokens.
            capped = limit - request.prompt_len
            request.sampling = request.sampling.model_copy(update={"max_tokens": capped})
            self.counters["max_tokens_capped"] += 1
        if request.speculative.num_speculative_tokens > 0:
            request.drafter_id = self.placement.count_pin(pin_drafter(self.placement, self.pinned_count, request))
        lane_sizes = Counter(r.lane for r in self.running.values())
        request.lane = min(range(self.config.lanes), key=lambda lane: lane_sizes[lane])
        return True

    # ------------------------------------------------------------------ one step

    def plan_step(self, now: float, lane: int | None = None) -> StepPlan:
        """Rows per verifier for the lane's requests (None: every lane's) not in a step already
        (step_planner.py). The planned requests are in flight until end_step(plan)."""
        plan = self.planner.plan(self.running.values(), self.in_flight, lane)
        self.in_flight.update(plan.request_ids())
        for budget in plan.budgets.values():
            self.last_step_budget = budget
        return plan

    def end_step(self, plan: StepPlan) -> None:
        """The plan's step is over (committed, failed or cancelled): its requests may be planned,
        ended or moved again."""
        self.in_flight.difference_update(plan.request_ids())

    def draft_batches(self, plan: StepPlan, now: float) -> dict[str, DraftRequest]:
        batches, changes = self.builder.draft_batches(plan, now, self.max_payload)
        self.apply(changes, now)
        return batches

    def apply_draft(self, plan: StepPlan, drafter_id: str, request: DraftRequest,
                    response: DraftResponse | None) -> None:
        self.apply(self.builder.apply_draft(plan, drafter_id, request, response), time.time())

    def verify_batches(self, plan: StepPlan, now: float) -> dict[str, VerifyRequest]:
        """The plan's VerifyRequests (batch_builder.py); their tokens by row kind are observed.
        Requests ended while building them (too large) leave their messages in plan.outbox."""
        plan.outbox.extend(self.apply(self.builder.verify_batches(plan, now, self.max_payload), now))
        batches = plan.verify_requests
        for rows in plan.rows.values():
            decode = sum(1 + p.num_draft for p in rows if p.decode)
            prefill = sum(p.end - p.cached_len for p in rows if not p.decode)
            for kind, tokens in (("decode", decode), ("prefill", prefill)):
                if tokens:
                    self.step_tokens.labels(kind).observe(tokens)
        return batches

    def apply_verify(self, plan: StepPlan, verifier_id: str, response: VerifyResponse | Error | None,
                     now: float) -> Outbox:
        """Commit a verifier's answer (commits.py). None (no answer after the retry): migrate its
        requests (recovery.py). An Error reply: its requests end with "error"."""
        message = plan.verify_requests[verifier_id]
        if response is None or isinstance(response, Error):
            self.releases.restore(verifier_id, message.release)
        outbox = Outbox()
        if response is None:
            running = list(self.running.values())
            for changes in self.recovery.verifier_failed(verifier_id, now, plan, running, self.in_flight,
                                                         self.pinned_count):
                outbox.extend(self.apply(changes, now))
            return outbox
        for changes in self.committer.commit_batch(plan, verifier_id, response, now, self.running):
            outbox.extend(self.apply(changes, now))
        return outbox

    def apply(self, changes: Changes, now: float) -> Outbox:
        """Apply what a collaborator decided (scheduler_types.Changes), in its order, and return
        the messages to send. A verified row: its acceptance for adaptive k and for draft_method
        "auto" (which may move it to another drafter); a row of suffix drafts is counted
        (suffix_rows, suffix_drafts, suffix_drafts_accepted)."""
        self.counters.update(changes.counts)
        self.in_flight.difference_update(changes.left_step)
        for planned, result in changes.verified:
            self.planner.verified(planned, result)
            if planned.suffix is not None:
                self.counters.update({"suffix_rows": 1, "suffix_drafts": planned.num_draft,
                                      "suffix_drafts_accepted": result.drafts_accepted})
            if planned.drafted_by is not None:
                request = planned.request
                switch = drafted(self.placement, self.pinned_count, request, planned.drafted_by,
                                 result.drafts_accepted)
                self.counters.update(switch.counts)
                if switch.drafter_id is not None:
                    self.releases.release(request.drafter_id, request.request_id)
                    request.drafter_id = self.placement.count_pin(switch.drafter_id)
                    request.restart_drafter()
        self.committer.forget(changes.forget)
        outbox = changes.outbox
        for ending in changes.ended:
            outbox.extend(self.end(ending.request, ending.reason, now, **ending.final))
        return outbox

    def draft_timed(self, drafter_id: str, message: DraftRequest, response: DraftResponse | None,
                    seconds: float) -> None:
        self.planner.draft_timed(drafter_id, message, response, seconds)

    def verify_timed(self, verifier_id: str, message: VerifyRequest, response: VerifyResponse | Error | None,
                     seconds: float, commit_s: float, retried: bool, answered_at: float | None = None) -> None:
        self.planner.verify_timed(verifier_id, message, response, seconds, commit_s, retried, answered_at)

    def step_timed(self, plan: StepPlan, responses: dict[str, VerifyResponse | Error | None], seconds: float) -> None:
        """A lane's step took seconds from its drafts to its commits (step_planner.py step_timed)."""
        self.planner.step_timed(plan, responses, seconds)

    # ------------------------------------------------------------------ ending

    def end(self, request: Request, reason: FinishReason | None, now: float, **final) -> Outbox:
        """End a request: out of the running table, its id kept from reuse a while (admission.py),
        its prompt and output into the suffix index, its final commit sent (commits.Committer.end;
        final: the final commit's fields)."""
        self.running.pop(request.request_id, None)
        self.admission.recent.remember(request.request_id)
        self.planner.suffix_ended(request)
        return self.apply(self.committer.end(request, reason, now, **final), now)

    def drain(self, now: float) -> Outbox:
        """On shutdown: every running and queued request ends with finish_reason "error", code
        `shutting_down`: a hand-over, not a verdict (the client sends it to another scheduler,
        resuming after the tokens it read)."""
        outbox = Outbox()
        for request in [*self.running.values(), *self.waiting]:
            error = Error(code=ErrorCode.shutting_down, request_id=request.request_id,
                          message=f"scheduler {self.config.instance_id} is stopping; send the request again")
            outbox.extend(self.end(request, "error", now, error=error))
        self.admission.clear()
        return outbox

    def stats(self) -> dict:
        return {"running": len(self.running), "queued": len(self.waiting), "step_token_budget": self.last_step_budget,
                "step_rows_fit": round(min(self.planner.budget.rows_fit.values(), default=0.0), 1),
                **self.counters}
