"""The step planner: which rows a lane's next step gives each verifier, and each decode row's k.
No NATS, no awaits, no clocks: services/scheduler/scheduler_core.py owns one `StepPlanner` and
asks it once per step (the running requests and the ids in flight as arguments, read only; the
plan it returns is the step's), and tells it what each verified row accepted and what each batch
cost.

Per verifier, of the lane's requests that are not in a step already and whose verifier and
postprocessor are alive (the others wait: see recovery.py), decode first (vLLM's decode
priority with a token budget, SGLang's chunked prefill: a long prompt never stalls the rows
already decoding):
1. rows: the decoding requests that waited longest for a row, then the prefilling ones, up to
   max_batch_rows in all, one row kept for a prefill while any waits;
2. decode rows: 1 new token + its drafts each, every one within max_step_tokens;
3. prefill rows: chunks of the verifier's step budget (step_budget.py: the tokens that fit in
   target_step_s at its measured pace) less the decode rows' tokens, and at least as many
   tokens as the decode rows took and MIN_STEP_TOKENS (decode rows that fill the budget alone
   leave prompts an equal share, so queued requests keep starting under load), at most what
   max_step_tokens leaves. That room is split between the client users with prompts waiting
   (fair_share.py: weighted max-min fair by what they ask, each user's at most the other
   users' decode tokens in the step, or MIN_STEP_TOKENS, while they have any: prefill parity;
   a prompt that ends within MIN_STEP_TOKENS counts as decode rows), a user's requests taking
   its part oldest first. While the step holds more than one user's rows, the side-channel
   bytes a prompt-logprobs chunk adds (payload.py's estimate) are split by the same rule, the
   room being as many plain logprob positions (SIDE_POSITION_BYTES) as tokens, so a tenant's
   prompt logprobs cost its own share, not another tenant's step. A request with completion tokens (resumed, or
   re-prefilled after a migration or resync) stops its prefill one token short, so its next
   token comes from a decode step at the same position as in the interrupted run
   (docs/PROTOCOL.md#scheduler-failover).
4. a prefill row whose latest chunks its verifier's prefix cache gave whole (VerifyResult.
   cached_tokens: nothing computed) takes that many tokens more than its share: a history the
   cache holds (a chat's next turn) is passed in a few steps, not one budget's worth a step,
   while what a step computes past its budget is bounded by the tokens just found cached (and by
   max_step_tokens) should the cache end inside the larger chunk. A new request's first chunk
   likewise takes, past its share, the prefix its scheduler expects the cache to hold
   (prefix_hints.py: Request.hit_run set at its start).
A decode row's drafts may come from the scheduler's own suffix index instead of its drafter, where
suffix_choice.py measures they pay (greedy and Gumbel-coupled rows of draft_method "auto" or
"suffix"); such a row is sent to no drafter. A decode row's k: a greedy or Gumbel-coupled row takes adaptive_k.py's when the scheduler's
adaptive_k is on (docs/PROTOCOL.md#adaptive-k), a rejection-sampled row always its own k. With
max_tree_nodes, a greedy or Gumbel-coupled row without structured outputs may instead ask a tree
of up to max_tree_nodes nodes (the step's budget permitting) as deep as its k: where
tree_choice.py prefers it, or in every step with adaptive_k off (docs/PROTOCOL.md#tree-drafts).
"""

from collections import Counter
from collections.abc import Iterable, Set

import numpy as np

from schemas.config import SchedulerConfig
from schemas.draft_kinds import proposes_in_scheduler
from schemas.steps import DraftRequest, DraftResponse, DraftTokens, VerifyRequest, VerifyResponse, VerifyResult
from schemas.bus.wire import Error
from services.scheduler.drafts.adaptive_k import AdaptiveK
from services.scheduler.budget.fair_share import parse_user_weights, prefill_caps, split_fairly
from services.scheduler.budget.payload import SIDE_POSITION_BYTES, side_position_bytes
from services.scheduler.placement import Placement
from services.scheduler.scheduler_types import PlannedRow, Request, StepPlan
from services.scheduler.budget.step_budget import MIN_STEP_TOKENS, StepBudget
from services.scheduler.drafts.suffix_choice import SuffixChoice
from services.scheduler.drafts.suffix_index import SuffixPools
from services.scheduler.drafts.tree_choice import RowPlace, TreeChoice, tree_sizes


class StepPlanner:
    """Plans steps (module docstring); `adaptive` is None with adaptive_k off, `trees` None with
    it off or max_tree_nodes 0, `budget` holds the verifiers' measured paces."""

    def __init__(self, config: SchedulerConfig, placement: Placement):
        self.config = config
        self.placement = placement
        self.adaptive = AdaptiveK(config.adaptive_k_probe_steps) if config.adaptive_k else None
        use_trees = self.adaptive is not None and config.max_tree_nodes > 0
        self.trees = TreeChoice(self.adaptive, config.adaptive_k_probe_steps) if use_trees else None
        pools = SuffixPools(config.suffix_max_tokens, config.suffix_shared) if config.suffix_max_tokens else None
        self.suffix = None if pools is None else SuffixChoice(pools, self.adaptive, config.adaptive_k_probe_steps)
        self.budget = StepBudget(config.target_step_s, config.max_step_tokens, config.verify_timeout_s, config.lanes)
        self.weights = parse_user_weights(config.user_weights)
        self.num_plans = 0

    def plan(self, requests: Iterable[Request], in_flight: Set[str], lane: int | None = None) -> StepPlan:
        """Rows per verifier for the lane's requests (None: every lane's) not in a step already
        (in_flight: the core's ids in a step now; module docstring). The core puts the planned
        requests in flight (StepPlan.request_ids) until its end_step."""
        draft_rows: dict[str, list[PlannedRow]] = {}
        by_verifier: dict[str, list[Request]] = {}
        for request in requests:
            # A lane's own requests are never in a step when it plans (its steps run one at a time).
            ours = request.lane == lane if lane is not None else request.request_id not in in_flight
            # else it waits for a postprocessor, or for a verifier (see recovery.py), or its deadline
            if ours and self.placement.alive(request.postprocessor_id) and self.placement.alive(request.verifier_id):
                by_verifier.setdefault(request.verifier_id, []).append(request)
        self.num_plans += 1
        rows, budgets = {}, {}
        for verifier_id, waiting in by_verifier.items():
            budgets[verifier_id] = self.budget.step_tokens(verifier_id)
            planned = self.plan_verifier(waiting, budgets[verifier_id], draft_rows)
            for row in planned:
                row.request.last_planned = self.num_plans
            if planned:
                rows[verifier_id] = planned
        return StepPlan(rows, draft_rows, budgets=budgets)

    def plan_verifier(self, requests: list[Request], step_tokens: int,
                      draft_rows: dict[str, list[PlannedRow]]) -> list[PlannedRow]:
        """One verifier's rows (module docstring, steps 1-3) under its step budget step_tokens;
        decode rows with drafts are added to draft_rows by drafter."""
        limit, rows = self.config.max_step_tokens, self.config.max_batch_rows
        oldest_first = sorted(requests, key=lambda r: r.last_planned)
        prefill = [r for r in oldest_first if r.pending_len > 1 or (r.scoring and r.pending_len >= 1)]
        decode = [r for r in oldest_first if r.pending_len == 1 and not r.scoring]
        decode = decode[:rows - 1] if prefill and rows > 1 else decode[:rows]
        prefill = prefill[:rows - len(decode)]
        planned: list[PlannedRow] = []
        used = 0
        for index, request in enumerate(decode):
            if used >= limit:
                break
            base_k = max((r.num_draft for r in draft_rows.get(request.drafter_id, [])), default=0)
            later = len(decode) - index - 1  # the decode rows planned after it: one token each at least
            row = self.plan_decode_row(request, limit - used, used + later, base_k,
                                       alone=len(decode) + len(prefill) == 1, others=len(decode) - 1)
            used += 1 + row.draft_room
            planned.append(row)
            if row.num_draft and row.suffix is None:
                draft_rows.setdefault(request.drafter_id, []).append(row)
        room = min(limit - used, max(step_tokens - used, used, MIN_STEP_TOKENS))
        shares, side_shares = self.prefill_shares(planned, prefill, room)
        for request in prefill:
            if used >= limit:
                break
            if shares[request.user] < 1:
                continue
            pending = request.pending_len - (len(request.completion) > 0)  # one token short: step 3
            hits = request.hit_run_at(request.verifier_len)  # step 4
            chunk = min(pending, shares[request.user] + hits, limit - used)
            side = side_position_bytes(request.row_logprobs(), prompt=True) if side_shares is not None else 0
            if side:  # its prompt logprobs' bytes: step 3
                chunk = min(chunk, side_shares[request.user] // side)
                if chunk < 1:
                    continue
                side_shares[request.user] -= chunk * side
            end = request.verifier_len + chunk
            planned.append(PlannedRow(request, request.verifier_len, end,
                                      emit=end == len(request.history) and not request.scoring, num_draft=0))
            shares[request.user] -= max(chunk - hits, 0)
            used += chunk
        return planned

    def prefill_shares(self, decode_rows: list[PlannedRow], prefill: list[Request],
                       room: int) -> tuple[dict[str, int], dict[str, int] | None]:
        """The prefill tokens of a step's room each user may take, and the side-channel bytes its
        prompt logprobs may add (None: unbudgeted, one user alone in the step) (step 3): split
        fairly between the users by what their prompts ask, each capped by prefill parity while
        another user's rows decode in the step, or its prompt ends within MIN_STEP_TOKENS (its
        first token is as much a latency as a decode row's: fair_share.py `split_fairly`,
        `prefill_caps`). Bytes are counted as payload.py estimates them (`side_position_bytes`),
        the room being as many SIDE_POSITION_BYTES as tokens, the floor MIN_STEP_TOKENS of them,
        and a decode row's position counting at least SIDE_POSITION_BYTES (parity holds beside
        rows that ask no side channel)."""
        demands: Counter = Counter()
        decode_tokens: Counter = Counter()  # a prompt's last MIN_STEP_TOKENS count as decode rows
        side_demands: Counter = Counter()
        decode_side: Counter = Counter()
        for request in prefill:
            pending = max(request.pending_len - (len(request.completion) > 0), 0)
            side = side_position_bytes(request.row_logprobs(), prompt=True)
            demands[request.user] += pending
            side_demands[request.user] += pending * side
            if pending <= MIN_STEP_TOKENS:
                decode_tokens[request.user] += pending
                decode_side[request.user] += pending * max(side, SIDE_POSITION_BYTES)
        for row in decode_rows:
            tokens = 1 + row.draft_room
            decode_tokens[row.request.user] += tokens
            side = side_position_bytes(row.request.row_logprobs(), prompt=False)
            decode_side[row.request.user] += tokens * max(side, SIDE_POSITION_BYTES)
        shares = prefill_caps(split_fairly(demands, self.weights, room), decode_tokens, MIN_STEP_TOKENS)
        if len(set(demands) | set(decode_tokens)) < 2:
            return shares, None  # work conserving: a user alone in a step is priced by its tokens only
        side_shares = split_fairly(side_demands, self.weights, room * SIDE_POSITION_BYTES)
        return shares, prefill_caps(side_shares, decode_side, MIN_STEP_TOKENS * SIDE_POSITION_BYTES)

    def plan_decode_row(self, request: Request, budget: int, base_tokens: int = 0, base_k: int = 0,
                        alone: bool = True, others: int = 0) -> PlannedRow:
        """A decode row with up to the request's k drafts (fewer near max_tokens or the budget);
        for a greedy or Gumbel-coupled row the k of adaptive_k, given the base_tokens new tokens
        of its verifier's other rows planned so far (one for each decode row still to plan), the
        base_k drafts its drafter is already asked for, whether it is alone in its verify batch and
        the others decode rows beside it, or a tree (tree_nodes). A rejection-sampled row always
        takes its k: its draws depend on k, and a seeded request must draw the same tokens again,
        after a failover too, where the new scheduler knows nothing of the acceptance the old one
        measured (docs/PROTOCOL.md#adaptive-k)."""
        remaining = request.sampling.max_tokens - len(request.completion)
        wanted = max(min(request.speculative.num_speculative_tokens, remaining - 1, budget - 1), 0)
        alive = self.placement.alive(request.drafter_id)
        place = RowPlace(request.verifier_id, request.drafter_id or "", base_tokens, base_k, alone, others,
                         self.num_plans)
        chosen = None if self.suffix is None else self.suffix.choose(request, wanted, place, alive,
                                                                     self.prior_key(request))
        if chosen is not None:  # the suffix index's drafts (suffix_choice.py): no drafter asked
            drafts, step = chosen
            return PlannedRow(request, request.verifier_len, len(request.history), emit=True, num_draft=len(drafts),
                              decode=True, draft=DraftTokens(draft_token_ids=np.asarray(drafts, dtype=np.int32)),
                              suffix=step)
        if proposes_in_scheduler(request.speculative.draft_method):
            wanted = 0  # no drafter: the index's drafts or none
        nodes = 0
        if alive and wanted and self.config.max_tree_nodes:  # trees off (the default): nothing more per row
            nodes = self.tree_nodes(request, wanted, budget, place)
        if wanted and alive and not nodes and self.adaptive_row(request):
            wanted = self.adaptive.choose(request.adaptive, self.prior_key(request), wanted, request.verifier_id,
                                          base_tokens, request.drafter_id, base_k, alone, others, self.num_plans)
        row = PlannedRow(request, request.verifier_len, len(request.history), emit=True,
                         num_draft=min(wanted, nodes) if nodes else wanted, decode=True, max_nodes=nodes)
        if row.num_draft and not alive:
            row.num_draft = 0
            row.degraded.append("draft_timeout")
        return row

    def tree_nodes(self, request: Request, wanted: int, budget: int, place: RowPlace) -> int:
        """The nodes of the tree a decode row asks, 0 for a chain: the size tree_choice.py prefers
        among `tree_sizes` (with adaptive_k off, max_tree_nodes), within the step's budget and the
        verifiers' max_seq_len (a verifier refuses a tree past it, where a chain's drafts stay
        within max_tokens), for a greedy or Gumbel-coupled row that wants drafts and has no
        structured outputs (the verifier follows a grammar along one path)."""
        sampling = request.sampling
        if not (wanted and (sampling.greedy or sampling.gumbel)) or sampling.structured_outputs is not None:
            return 0
        limit = self.placement.max_seq_len()
        room = budget - 1 if limit is None else min(budget - 1, limit - len(request.history))
        nodes = min(self.config.max_tree_nodes, room)
        if nodes <= 0:
            return 0
        if self.trees is None:
            return nodes
        sizes = tree_sizes(self.config.max_tree_nodes, request.speculative.num_speculative_tokens)
        return min(self.trees.choose(request.adaptive, request.tree, self.prior_key(request), min(wanted, nodes),
                                     sizes, place), nodes)

    def suffix_ended(self, request: Request) -> None:
        """A request left the scheduler: its prompt and output join its tenant's suffix index."""
        if self.suffix is not None:
            self.suffix.ended(request)

    def adaptive_row(self, request: Request) -> bool:
        """Whether the request's k per step is adaptive_k's: greedy and Gumbel-coupled rows, whose
        tokens do not depend on k, when the scheduler's adaptive_k is on."""
        return self.adaptive is not None and (request.sampling.greedy or request.sampling.gumbel)

    @staticmethod
    def prior_key(request: Request) -> tuple[str, str]:
        """Whose history a request's acceptance starts from: its drafter's, for its acceptance rule."""
        rule = "greedy" if request.sampling.greedy else "gumbel"
        return request.drafter_id or "", f"{rule}/{request.speculative.draft_mode}"

    def verified(self, planned: PlannedRow, result: VerifyResult) -> None:
        """A row's verified drafts, for adaptive_k (a chain's) and tree_choice (a decode row's), or
        for suffix_choice (the suffix index's)."""
        request = planned.request
        if planned.suffix is not None:
            self.suffix.verified(planned.suffix, result.drafts_accepted)
            return
        if not self.adaptive_row(request):
            return
        if self.trees is not None and planned.decode:
            nodes = None if planned.drafted_by is None else planned.num_draft
            self.trees.verified(request.tree, self.prior_key(request), request.tree.asked if planned.max_nodes else 0,
                                nodes, result.drafts_accepted)
        if planned.num_draft and not planned.max_nodes:
            self.adaptive.verified(request.adaptive, self.prior_key(request), planned.num_draft, result.drafts_accepted)

    def draft_timed(self, drafter_id: str, message: DraftRequest, response: DraftResponse | None,
                    seconds: float) -> None:
        """A draft batch's round trip, for adaptive_k (by its largest k). An unanswered batch is
        left out: a dead drafter is placement's business, and its timeout says nothing of drafting.
        So is one that feeds a row's whole history (cached_len 0: a new request's prompt), a
        one-time cost that would pass for the cost of every step at that k."""
        if self.adaptive is not None and message.rows and response is not None and \
                all(r.cached_len for r in message.rows):
            self.adaptive.draft_timed(drafter_id, max(r.num_draft for r in message.rows), seconds)

    def step_timed(self, plan: StepPlan, responses: dict[str, VerifyResponse | Error | None], seconds: float) -> None:
        """A lane's step took seconds from its drafts to its commits: the rows its verifiers' steps
        fit (step_budget.py, step rows), from each verifier answered without a retry."""
        for verifier_id, rows in plan.rows.items():
            response = responses.get(verifier_id)
            if isinstance(response, VerifyResponse) and verifier_id not in plan.retried:
                prefill = sum(p.end - p.cached_len for p in rows if not p.decode) - \
                    sum(r.cached_tokens for r in response.rows)
                self.budget.step_timed(verifier_id, sum(p.decode for p in rows), prefill, seconds)

    def verify_timed(self, verifier_id: str, message: VerifyRequest, response: VerifyResponse | Error | None,
                     seconds: float, commit_s: float, retried: bool, answered_at: float | None = None) -> None:
        """A verify batch's round trip (answered at monotonic answered_at), for the verifier's pace
        (step_budget.py) and adaptive_k (by its new tokens computed, drafts included, a batch with a
        tree row apart), and the commit after it; a batch that needed a retry or got no answer is
        left out."""
        if not isinstance(response, VerifyResponse) or retried:
            return
        # what the prefix cache gave was copied, not computed: the pace is of the tokens computed
        tokens = sum(len(r.new_token_ids) + len(r.draft_token_ids) for r in message.rows) - \
            sum(r.cached_tokens for r in response.rows)
        self.budget.timed(verifier_id, tokens, seconds, answered_at)
        if self.adaptive is not None and message.rows:
            tree = any(row.parents is not None for row in message.rows)
            self.adaptive.verify_timed(verifier_id, tokens, seconds, commit_s, tree)
