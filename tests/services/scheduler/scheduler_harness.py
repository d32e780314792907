"""What the scheduler's tests without NATS share: a SchedulerState with instances heard (a
clock the test moves by hand), a request submitted, one whole step with the drafter's and
verifier's answers built as the real message types they send."""

import time

from schemas.config import SchedulerConfig, load_config
from schemas.bus.control import Heartbeat
from schemas.generation import GenerateRequest
from schemas.steps import DraftResponse, DraftResult, VerifyResponse, VerifyResult
from services.scheduler.drafts.adaptive_k import AcceptanceCounts
from services.scheduler.scheduler_core import SchedulerState

TOKENIZER_HASH = "0123456789abcdef"
EOS = 0  # the tokenizer fixture's (tests/services/conftest.py)


class Clock:
    """A monotonic clock the test moves by hand (heartbeat liveness)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def beat(state, instance_id, role, capacity=8, free_slots=None, tokenizer_hash=TOKENIZER_HASH, **model_ids):
    state.observe(Heartbeat(instance_id=instance_id, role=role, capacity=capacity, load=0, free_slots=free_slots,
                            model_ids={"tokenizer": tokenizer_hash, **model_ids}, sent_at=time.time(), interval_s=0.5))


def new_state(tokenizer, roles=(("v1", "verifier"), ("d1", "drafter"), ("p1", "postprocessor")), **overrides):
    # no suffix index unless a test asks for one: the tests of a drafter's k see only its drafts
    config = load_config(SchedulerConfig, env={}, instance_id="sched-1", **{"suffix_max_tokens": 0, **overrides})
    clock = Clock()
    state = SchedulerState(config, tokenizer, TOKENIZER_HASH, monotonic=clock)
    state.clock = clock
    for instance_id, role in roles:
        beat(state, instance_id, role)
    return state


def submit(state, request_id="r1", prompt_ids=(5, 6, 7), now=None, **fields):
    sampling = {"temperature": 0.0, "max_tokens": 8, **fields.pop("sampling", {})}
    generate = GenerateRequest(request_id=request_id, prompt_token_ids=list(prompt_ids), sampling=sampling, **fields)
    return state.admit(generate, f"_INBOX.{request_id}", list(prompt_ids), time.time() if now is None else now)


def step(state, drafts=None, tokens=None, num_accepted=None, draft_reply=True, verify_reply=True, cached=None,
         step_s=None, parents=None):
    """One step. drafts / tokens / num_accepted: request_id -> what the drafter proposes (cut to
    the row's num_draft, unless parents names the request: sent whole, a tree, or with None a
    chain) / the verifier emits / accepts (defaults: no drafts; each emitting row emits [9];
    accepted 0);
    cached: request_id -> the length of its history's prefix the verifier's prefix cache holds
    (default 0), of which a row's cached_tokens is what its new tokens cover, bar an emitting
    row's last one (gpu_worker/batching/prefix_cache.py); step_s: the seconds the step is said to
    have taken (SchedulerState.step_timed; None: not timed)."""
    drafts, tokens, num_accepted, cached, parents = drafts or {}, tokens or {}, num_accepted or {}, cached or {}, \
        parents or {}

    def cached_tokens(row):
        return max(0, min(cached.get(row.request_id, 0) - row.cached_len, len(row.new_token_ids) - row.emit))

    outbox = state.boundary(time.time())
    plan = state.plan_step(time.time())
    for drafter_id, message in state.draft_batches(plan, time.time()).items():
        reply = DraftResponse(batch_id=message.batch_id, drafter_id=drafter_id, rows=[
            DraftResult(request_id=r.request_id, draft_token_ids=drafts[r.request_id], parents=parents[r.request_id])
            if r.request_id in parents else
            DraftResult(request_id=r.request_id, draft_token_ids=drafts.get(r.request_id, [])[:r.num_draft])
            for r in message.rows]) if draft_reply else None
        state.apply_draft(plan, drafter_id, message, reply)
    verify_requests, replies = state.verify_batches(plan, time.time()), {}
    for verifier_id, message in verify_requests.items():
        reply = VerifyResponse(batch_id=message.batch_id, verifier_id=verifier_id, rows=[
            VerifyResult(request_id=r.request_id, step=r.step, num_draft=len(r.draft_token_ids),
                         num_accepted=num_accepted.get(r.request_id, 0) if r.emit else 0,
                         token_ids=tokens.get(r.request_id, [9]) if r.emit else [], cached_tokens=cached_tokens(r))
            for r in message.rows]) if verify_reply else None
        replies[verifier_id] = reply
        outbox.extend(state.apply_verify(plan, verifier_id, reply, time.time()))
    if step_s is not None:
        state.step_timed(plan, replies, step_s)
    state.end_step(plan)
    return plan, verify_requests, outbox


def commits_of(outbox, request_id="r1"):
    return [c for _, c in outbox.commits if c.request_id == request_id]


def verified(message, verifier_id="v1"):
    """The verifier's answer to a VerifyRequest: each emitting row emits [9], no draft accepted."""
    return VerifyResponse(batch_id=message.batch_id, verifier_id=verifier_id, rows=[
        VerifyResult(request_id=r.request_id, step=r.step, num_draft=len(r.draft_token_ids), num_accepted=0,
                     token_ids=[9] if r.emit else []) for r in message.rows])


def beat_verifier(state, instance_id="v1", max_seq_len=None):
    model_ids = {"tokenizer": TOKENIZER_HASH, **({"max_seq_len": str(max_seq_len)} if max_seq_len else {})}
    state.observe(Heartbeat(instance_id=instance_id, role="verifier", capacity=8, load=0, model_ids=model_ids,
                            sent_at=time.time(), interval_s=0.5))


def acceptance_history(rate: float, steps: int = 40, k: int = 4) -> AcceptanceCounts:
    """Adaptive k's counts of steps with k drafts, each position accepted with `rate` exactly in expectation."""
    counts = AcceptanceCounts(judged=[0.0] * k, accepted=[0.0] * k)
    reach = 1.0
    for i in range(k):
        counts.judged[i], counts.accepted[i] = steps * reach, steps * reach * rate
        reach *= rate
    return counts
