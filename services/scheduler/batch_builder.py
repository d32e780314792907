"""Batch building: a step plan's rows as one DraftRequest per drafter and one VerifyRequest per
verifier, each within the bus's max_payload, and the drafters' answers back into the plan. No
NATS, no awaits: services/scheduler/scheduler_core.py owns one `BatchBuilder`.

- A batch carries its instance's pending slot releases (slot_release.py), and is sent to a
  live instance with releases even when it has no rows.
- Every batch's request and answer are kept within one `PayloadRoom` (payload.py): a draft row
  past it runs this step without drafts (`draft_timeout`); a verify row past it waits for the
  next step (its drafts are dropped), and a request whose verify row does not fit even alone
  ends with `too_large`.
- A request drafted by an eagle drafter asks its verify rows for the target's features and
  carries them to its drafter in its draft rows, as far as the room allows (features.py).
- A verify batch's deadline follows its tokens and its verifier's measured pace
  (step_budget.py): each try is waited for StepBudget.attempt_s, and VerifyRequest.deadline is
  that times (verify_retries + 1), so a retry can re-send the same message.
- Each verify row names its prefix cache (`cache_salt`, prefix_hints.py: the client user's own, or the shared one
  for users the operator lists; docs/PROTOCOL.md#prefix-caching).
- Drafts late, missing or refused: the rows run with k=0, flagged `draft_timeout`; a draft row
  answered need_resync runs k=0 flagged `resync`, and its whole history goes again next step.
- A row that asks a tree (PlannedRow.max_nodes, tree_choice.py) takes a tree answer of at most
  max_nodes nodes no deeper than num_draft, or a chain of at most num_draft, and its verify row
  carries the tree's parents; drafts over the plan (a tree asked of nobody included) are dropped
  and counted (`dropped_excess_drafts`), the row running k=0.
"""

import structlog

from schemas.config import SchedulerConfig
from schemas.errors import ErrorCode
from schemas.generation import draft_is_sampled
from schemas.bus.protocol import MAX_FEATURE_BLOCK_BYTES, MAX_SPECULATIVE_TOKENS
from schemas.steps import (DraftRequest, DraftResponse, DraftResult, DraftRow, DraftTokens, VerifyRequest, VerifyRow,
                           tree_depths)
from schemas.bus.wire import Error
from services.scheduler import features
from services.scheduler.budget.payload import (
    PayloadRoom,
    draft_answer_bytes,
    draft_row_bytes,
    verify_answer_bytes,
    verify_row_bytes,
)
from services.scheduler.placement import Placement
from services.scheduler.drafts.prefix_hints import cache_salt
from services.scheduler.scheduler_types import Changes, Ending, PlannedRow, StepPlan
from services.scheduler.slot_release import SlotReleases
from services.scheduler.budget.step_budget import StepBudget

log = structlog.get_logger(__name__)


def forced_room(planned: PlannedRow) -> int:
    """How many grammar-forced tokens the verifier may add after an emitting row's drafts
    (docs/PROTOCOL.md#structured-outputs): for a speculative request (num_speculative_tokens > 0)
    up to MAX_SPECULATIVE_TOKENS verified positions in all, its emitted tokens within max_tokens;
    0 for plain decoding. Forced tokens are not the drafter's guesses, so k does not bound them."""
    request = planned.request
    if not planned.emit or request.sampling.structured_outputs is None or not request.speculative.num_speculative_tokens:
        return 0
    left = request.sampling.max_tokens - len(request.completion) - 1
    return max(0, min(MAX_SPECULATIVE_TOKENS, left) - planned.num_draft)


def fits_plan(planned: PlannedRow, result: DraftResult) -> bool:
    """Whether a drafter's answer is within its row's plan: a chain of at most num_draft drafts, or,
    for a row that asked a tree, a tree of at most max_nodes nodes no deeper than num_draft."""
    num_nodes = len(result.draft_token_ids)
    if result.parents is None:
        return num_nodes <= planned.num_draft
    depth = int(tree_depths(result.parents).max()) if num_nodes else 0
    return num_nodes <= planned.max_nodes and depth <= planned.num_draft


class BatchBuilder:
    """Builds a plan's batches (module docstring); budget: the verifiers' paces (the step planner's)."""

    def __init__(self, config: SchedulerConfig, placement: Placement, budget: StepBudget, releases: SlotReleases):
        self.config = config
        self.placement = placement
        self.budget = budget
        self.releases = releases
        self.next_batch_id = 0

    def new_batch_id(self) -> int:
        batch_id = self.next_batch_id
        self.next_batch_id += 1
        return batch_id

    def draft_batches(self, plan: StepPlan, now: float,
                      max_payload: int | None) -> tuple[dict[str, DraftRequest], Changes]:
        """One DraftRequest per drafter with rows, plus release-only batches for drafters with
        slots to free and nothing else to do (module docstring)."""
        batches, changes = {}, Changes()
        deadline = now + self.config.draft_timeout_s
        for drafter_id in sorted(set(plan.draft_rows) | self.releases.live("drafter")):
            release = self.releases.take(drafter_id)
            room = PayloadRoom.of(max_payload, len(release))
            rows, kept = [], []
            for planned in plan.draft_rows.get(drafter_id, []):
                row = self.draft_row(planned, len(rows), room)
                if row is None:
                    planned.num_draft = 0
                    planned.degraded.append("draft_timeout")
                    changes.counts["rows_undrafted_payload"] += 1
                    continue
                rows.append(row)
                kept.append(planned)
            if drafter_id in plan.draft_rows:
                plan.draft_rows[drafter_id] = kept
            batches[drafter_id] = DraftRequest(batch_id=self.new_batch_id(), scheduler_id=self.config.instance_id,
                                               deadline=deadline, rows=rows, release=release)
        return batches, changes

    def draft_row(self, planned: PlannedRow, index: int, room: PayloadRoom) -> DraftRow | None:
        """The draft row of a planned row, with as many of its pending target features as the
        room leaves, its bytes taken from room; None when the row or its answer does not fit."""
        request = planned.request
        new_ids = request.history[request.drafter_len:]
        request_bytes = draft_row_bytes(len(new_ids), request.sampling)
        answer_bytes = draft_answer_bytes(planned.draft_room, draft_is_sampled(request.sampling,
                                                                               request.speculative.draft_mode),
                                          tree=planned.max_nodes > 0)
        if not room.fits(request_bytes, answer_bytes):
            return None
        block = features.take(request.feature_blocks, MAX_FEATURE_BLOCK_BYTES if room.request is None
                              else room.request - request_bytes)
        planned.features_sent = None if block is None else block.end
        request_bytes += 0 if block is None else features.BLOCK_OVERHEAD_BYTES + len(block.data)
        room.take(request_bytes, answer_bytes)
        return DraftRow(request_id=request.request_id, row=index, step=request.step, cached_len=request.drafter_len,
                        new_token_ids=new_ids, num_draft=planned.num_draft, max_nodes=planned.max_nodes,
                        draft_mode=request.speculative.draft_mode,
                        sampling=request.sampling.row_sampling(), prompt_len=request.prompt_len, features=block,
                        cache_salt=cache_salt(self.config, request.user))

    def apply_draft(self, plan: StepPlan, drafter_id: str, request: DraftRequest,
                    response: DraftResponse | None) -> Changes:
        """Drafts into the plan. No answer (late, dead, error reply): its rows run k=0 flagged
        draft_timeout; a need_resync row runs k=0 flagged resync and is resent whole next step."""
        changes = Changes()
        if response is None:
            self.releases.restore(drafter_id, request.release)
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
                if not fits_plan(planned, result):
                    changes.counts["dropped_excess_drafts"] += 1
                    log.warning("drafts_over_plan", request_id=request.request_id, drafter_id=drafter_id,
                                num_draft=len(result.draft_token_ids), tree=result.parents is not None,
                                planned=planned.num_draft, max_nodes=planned.max_nodes)
                    planned.num_draft = 0
                else:
                    planned.num_draft = len(result.draft_token_ids)
                    parents = result.parents if planned.num_draft else None  # no nodes: no tree
                    planned.draft = DraftTokens(draft_token_ids=result.draft_token_ids, parents=parents,
                                                proposal=result.proposal)
        return changes

    def verify_batches(self, plan: StepPlan, now: float, max_payload: int | None) -> Changes:
        """One VerifyRequest per verifier with rows (or only slots to release) into
        plan.verify_requests, its deadline by its tokens (module docstring; plan.attempt_s: a
        try's wait). Rows past the payload room wait (out of the step); one too large alone ends
        its request."""
        changes = Changes()
        for verifier_id in sorted(set(plan.rows) | self.releases.live("verifier")):
            release = self.releases.take(verifier_id)
            room = PayloadRoom.of(max_payload, len(release))
            per_position = features.bytes_per_position(self.placement, verifier_id)
            rows, kept = [], []
            for planned in plan.rows.get(verifier_id, []):
                row, answer = self.verify_row(planned, len(rows), room, per_position, changes)
                size = verify_row_bytes(row)
                if not room.fits(request=size):
                    self.defer_oversized_row(planned, size, room.request, max_payload, not rows, changes)
                    continue
                room.take(size, answer)
                planned.features_from = row.features_from
                rows.append(row)
                kept.append(planned)
            if verifier_id in plan.rows:
                plan.rows[verifier_id] = kept
            tokens = sum(len(row.new_token_ids) + len(row.draft_token_ids) for row in rows)
            attempt_s = plan.attempt_s[verifier_id] = self.budget.attempt_s(verifier_id, tokens)
            deadline = now + attempt_s * (self.config.verify_retries + 1)
            plan.verify_requests[verifier_id] = VerifyRequest(
                batch_id=self.new_batch_id(), scheduler_id=self.config.instance_id, deadline=deadline, rows=rows,
                release=release)
        return changes

    def verify_row(self, planned: PlannedRow, index: int, room: PayloadRoom, per_position: int,
                   changes: Changes) -> tuple[VerifyRow, int]:
        """The verify row of a planned row and the bytes of its answer. A request drafted by an
        eagle drafter asks for the target's features from its features_end, unless the answer
        has no room for them left: then it asks next step (features.py)."""
        request = planned.request
        features_from = request.features_end if features.drafted_by_eagle(self.placement, request) else None
        max_forced = forced_room(planned)
        answer = verify_answer_bytes(planned.num_draft + max_forced)
        if features_from is not None:
            feature_bytes = features.answer_bytes(features_from, planned.end, planned.num_draft, per_position)
            if room.fits(answer=answer + feature_bytes):
                answer += feature_bytes
            else:
                features_from = None
                changes.counts["features_deferred_payload"] += 1
        wants_side = request.logprobs.wants_side_channel
        row = VerifyRow(request_id=request.request_id, row=index, step=request.step, cached_len=planned.cached_len,
                        new_token_ids=request.history[planned.cached_len:planned.end],
                        draft_token_ids=planned.draft.draft_token_ids, parents=planned.draft.parents,
                        proposal=planned.draft.proposal,
                        sampling=request.sampling.row_sampling(), logprobs=request.row_logprobs(),
                        postprocessor_id=request.postprocessor_id if wants_side else None,
                        prompt_len=request.prompt_len, emit=planned.emit, features_from=features_from,
                        max_forced=max_forced, cache_salt=cache_salt(self.config, request.user))
        return row, answer

    def defer_oversized_row(self, planned: PlannedRow, size: int, room: int, max_payload: int | None, alone: bool,
                            changes: Changes) -> None:
        """A row that does not fit in its batch's room: its request leaves the step and waits for
        the next one, or, when it does not fit even alone, ends with `too_large` (changes: the
        batch's)."""
        request = planned.request
        changes.left_step.append(request.request_id)
        if not alone:
            changes.counts["rows_deferred_payload"] += 1
            log.info("row_deferred_payload", request_id=request.request_id, row_bytes=size, budget=room)
            return
        log.warning("row_too_large", request_id=request.request_id, row_bytes=size, max_payload=max_payload)
        changes.ended.append(Ending(request, "error", {"error": Error(
            code=ErrorCode.too_large, request_id=request.request_id,
            message=f"one step of this request needs a {size}-byte message, over the bus's max_payload of "
                    f"{max_payload}")}))
