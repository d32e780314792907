"""The scheduler's typed state and outputs: one admitted `Request`, one request's `PlannedRow`
in a step, a `StepPlan` (rows per verifier, rows per drafter, the messages built for them), the
`Outbox` every decision returns (Commits to postprocessors, StreamChunks and Admitted answers
straight to client inboxes) and the `Changes` a collaborator returns for the core's tables (its
`Ending`s among them). Plain data, no NATS: services/scheduler/scheduler_core.py and its
collaborators fill them.
"""

import re
from collections import Counter, deque
from dataclasses import dataclass, field

from schemas.errors import ErrorCode
from schemas.commits import Commit
from schemas.generation import LogprobOptions, SamplingParams, SpeculativeOptions
from schemas.steps import DraftTokens, FeatureBlock, VerifyRequest, VerifyResult
from schemas.streams import Admitted, StreamChunk, Usage
from schemas.bus.versions import WINDOW
from schemas.bus.wire import Error, FinishReason
from services.scheduler.drafts.adaptive_k import RowState
from services.scheduler.drafts.draft_method import DraftTrial
from services.scheduler.drafts.suffix_choice import SuffixStep
from services.scheduler.drafts.tree_choice import TreeRow


def client_error(row_error: Error, request_id: str, first: bool = True) -> Error:
    """A verifier's row error in the client's terms: "rows[0].logprobs.x" becomes the request's
    "logprobs.x", and before the first commit (first) the row's new tokens are the prompt, so
    "rows[0].new_token_ids" becomes "prompt_token_ids"."""
    field = row_error.field and re.sub(r"^rows\[\d+\]\.", "", row_error.field)
    field = "prompt_token_ids" if field == "new_token_ids" and first else field
    return row_error.model_copy(update={"field": field, "request_id": request_id})


def internal_error(request_id: str, message: str) -> Error:
    return Error(code=ErrorCode.internal, message=message, request_id=request_id)


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
    admitted_at: float = 0.0  # SchedulerState.monotonic() at admission: time to first token, time queued
    told_at: float = 0.0  # ... when its client was last sent something (Admitted, a commit): keepalives
    last_token_at: float | None = None  # ... at its last commit with tokens: inter-token latency
    lane: int = 0  # the step loop that plans it (docs/ARCHITECTURE.md#the-step-loop)
    resumed_len: int = 0  # completion tokens it came with (GenerateRequest.resume_token_ids)
    awaiting_verifier: bool = False  # its verifier died with no other to move to (migrate)
    user: str = ""  # the client user it streams to (fair_share.user_of_inbox)
    awaiting_postprocessor: bool = False  # ended with its postprocessor dead: the final commit waits for one
    end_error: Error | None = None  # why, with end_reason "error" (a queued request refused for fair share)
    # the GenerateRequest's `v`: the version its client reads (docs/PROTOCOL.md#version-rule)
    client_version: int = WINDOW.low
    adaptive: RowState = field(default_factory=RowState)  # its acceptance per draft position, its probes (adaptive_k)
    tree: TreeRow = field(default_factory=TreeRow)  # its tree steps, its probes (tree_choice.py)
    speculative_lengths: Counter = field(default_factory=Counter)  # k -> its decode steps that verified k drafts
    draft_trial: DraftTrial = field(default_factory=DraftTrial)  # draft_method "auto" (draft_method.py)
    cached_tokens: int = 0  # history tokens its verifiers copied from their prefix caches
    # its latest prefill chunks that the verifier's prefix cache gave whole: their tokens, and the
    # verifier_len they ended at (step_planner.py sizes the next chunk by them); before its first
    # chunk, the prefix the cache is expected to hold (prefix_hints.py), ending at 0
    hit_run: int = 0
    hit_run_end: int = 0
    features_end: int = 0  # the next verify row's features_from (features.py)
    feature_blocks: list[FeatureBlock] = field(default_factory=list)  # received, not yet delivered

    def hit_run_at(self, position: int) -> int:
        """Its hit run's tokens if the run ends at position (its next chunk starts there), else 0:
        a verifier_len reset (migration, resync) ends the run."""
        return self.hit_run if self.hit_run_end == position else 0

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
                     cached_tokens=min(self.cached_tokens, self.prompt_len),
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
    num_draft: int  # planned (a tree's depth); set to what the drafter delivered once it answered (a tree's nodes)
    decode: bool = False  # a decode row (plan_decode_row), not a prefill chunk
    max_nodes: int = 0  # planned: the nodes of the tree it asks, 0 for a chain (tree_choice.py)
    draft: DraftTokens = field(default_factory=DraftTokens)
    degraded: list[str] = field(default_factory=list)
    drafted_by: str | None = None  # the drafter that answered for this row (draft_method.drafted)
    features_from: int | None = None  # what its verify row asked (features.py)
    features_sent: int | None = None  # the end of the features its draft row carried
    suffix: SuffixStep | None = None  # its drafts are the scheduler's suffix index's (suffix_choice.py)

    @property
    def draft_room(self) -> int:
        """The most draft tokens its verify row may carry: the nodes of the tree it asks, else num_draft."""
        return max(self.num_draft, self.max_nodes)


@dataclass
class StepPlan:
    rows: dict[str, list[PlannedRow]]  # verifier_id -> rows
    draft_rows: dict[str, list[PlannedRow]]  # drafter_id -> rows to draft for
    budgets: dict[str, int] = field(default_factory=dict)  # verifier_id -> its step budget (step_budget.py)
    verify_requests: dict[str, VerifyRequest] = field(default_factory=dict)
    attempt_s: dict[str, float] = field(default_factory=dict)  # verifier_id -> how long a try is waited for
    retried: set[str] = field(default_factory=set)  # verifiers whose batch needed the retry
    outbox: "Outbox" = field(default_factory=lambda: Outbox())  # requests ended while building the batches

    @property
    def empty(self) -> bool:
        return not self.rows

    def request_ids(self) -> list[str]:
        """The ids of the requests with a row in the plan: in flight while its step runs."""
        return [planned.request.request_id for rows in self.rows.values() for planned in rows]


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


@dataclass
class Ending:
    """A request a collaborator ends: SchedulerState.end(request, reason, now, **final), final
    being the final commit's fields (commits.Committer.end's keywords)."""

    request: Request
    reason: FinishReason | None
    final: dict = field(default_factory=dict)


@dataclass
class Changes:
    """What a collaborator decided for the tables SchedulerState owns (its running requests, the
    ids in a step now, its counters: docs/ARCHITECTURE.md#one-owner-per-table), returned for
    SchedulerState.apply to apply in this order: `counts` added to its counters; `left_step` ids
    out of the step in flight; `verified` rows told to the step planner and the draft method;
    `forget` ended requests no longer kept for a replay (Committer.finishing); `ended` requests
    ended (SchedulerState.end); then `outbox` goes out with the ended requests' messages."""

    counts: Counter = field(default_factory=Counter)
    left_step: list[str] = field(default_factory=list)
    verified: list[tuple[PlannedRow, VerifyResult]] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)
    ended: list[Ending] = field(default_factory=list)
    outbox: Outbox = field(default_factory=Outbox)
