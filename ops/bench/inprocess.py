"""The specbus decoding loop in ONE process, with direct calls and no NATS: the baseline that
prices the bus.

The same objects the services run, driven by plain calls in the order the scheduler's step loop
makes them (services/scheduler/scheduler.py `Scheduler.step`):

    state.boundary -> state.plan_step -> state.draft_batches    scheduler    ("schedule")
    draft_batch(drafter, message) -> state.apply_draft           drafter      ("draft")
    state.verify_batches -> verify_batch(verifier, message)      verifier     ("verify")
    state.apply_verify -> postprocessor.on_side / on_commit      commit       ("commit")

Each stage's wall time is summed per step, so a run says where a step's time goes. With
codec=True every message is also encoded and decoded once (schemas.bus.codec), as the bus does, and
that time is a stage of its own ("codec"): the part of the bus that is not transport.

    loop = load_inprocess("models/tiny/target", "models/tiny/draft")
    run = run_requests(loop, [make_request([1, 2, 3], max_tokens=16, ignore_eos=True)], concurrency=1)
    run.chunks[request_id]   # the StreamChunks a client would have read, in seq order
"""

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from gpu_worker.drafter.drafter_core import ModelDrafter, draft_batch, load_drafter
from gpu_worker.drafter.drafter_core import heartbeat as drafter_heartbeat
from text.tokenizer import load_tokenizer, tokenizer_id
from gpu_worker.verifier.verifier_core import Verifier, load_verifier, verify_batch
from schemas.bus.codec import decode, encode
from schemas.config import DrafterConfig, SchedulerConfig, VerifierConfig, load_config
from schemas.bus.control import Heartbeat
from schemas.generation import GenerateRequest
from schemas.streams import StreamChunk
from services.scheduler.admission import prompt_token_ids
from services.postprocessor.postprocessor_core import ChunkToClient, Postprocessor
from services.scheduler.scheduler_core import SchedulerState
from services.verifier.verifier import heartbeat as verifier_heartbeat

STAGES = ("schedule", "draft", "verify", "commit", "codec")
POSTPROCESSOR_ID = "postprocessor-inprocess"
HEARTBEAT_INTERVAL_S = 0.5  # only a field of the heartbeats fed to the scheduler: nothing waits on it


@dataclass
class InProcess:
    state: SchedulerState
    drafter: ModelDrafter
    verifier: Verifier
    post: Postprocessor


@dataclass
class InProcessRun:
    """chunks: request_id -> its StreamChunks in seq order. stage_s: seconds per stage summed
    over the run; steps: scheduler steps that verified something."""

    chunks: dict[str, list[StreamChunk]]
    wall_s: float
    steps: int
    stage_s: Counter = field(default_factory=Counter)


def load_inprocess(target_dir: str, draft_dir: str, device: str = "cpu", max_slots: int = 64) -> InProcess:
    """The verifier, drafter, scheduler state and postprocessor of one stack, in this process,
    with the same configuration defaults the services take (env SPECBUS_* included)."""
    verifier = load_verifier(load_config(VerifierConfig, target_model=target_dir, device=device, max_slots=max_slots,
                                         instance_id="verifier-inprocess"))
    drafter = load_drafter(load_config(DrafterConfig, draft_model=draft_dir, device=device, max_slots=max_slots,
                                       instance_id="drafter-inprocess"))
    config = load_config(SchedulerConfig, tokenizer=target_dir, instance_id="scheduler-inprocess",
                         max_running=max_slots)
    tokenizer = load_tokenizer(target_dir)
    state = SchedulerState(config, tokenizer, tokenizer_id(target_dir))
    post = Postprocessor(tokenizer, POSTPROCESSOR_ID)
    return InProcess(state, drafter, verifier, post)


def observe_instances(loop: InProcess) -> None:
    """Fresh heartbeats of the three instances, as the scheduler hears them every interval."""
    post_beat = Heartbeat(instance_id=POSTPROCESSOR_ID, role="postprocessor", capacity=loop.post.max_requests,
                          load=loop.post.load, free_slots=max(0, loop.post.max_requests - loop.post.load),
                          model_ids={"tokenizer": loop.state.tokenizer_hash}, sent_at=time.time(),
                          interval_s=HEARTBEAT_INTERVAL_S)
    for beat in (verifier_heartbeat(loop.verifier, HEARTBEAT_INTERVAL_S),
                 drafter_heartbeat(loop.drafter, HEARTBEAT_INTERVAL_S), post_beat):
        loop.state.observe(beat)


def run_requests(loop: InProcess, requests: list[GenerateRequest], concurrency: int,
                 codec: bool = False) -> InProcessRun:
    """Every request to its final chunk, at most `concurrency` admitted at once (a new one is
    admitted as soon as one finishes, as concurrent clients would)."""
    state, post = loop.state, loop.post
    waiting = list(requests)
    chunks: dict[str, list[StreamChunk]] = {r.request_id: [] for r in requests}
    in_flight: set[str] = set()
    run = InProcessRun(chunks, 0.0, 0)

    def roundtrip(message):
        """The message as a receiver decodes it (codec=True), its cost counted."""
        if not codec:
            return message
        with timed(run.stage_s, "codec"):
            return decode(encode(message), type(message))

    def deliver(outs) -> None:
        for out in outs:
            if isinstance(out, ChunkToClient):
                chunk = roundtrip(out.chunk)
                chunks[chunk.request_id].append(chunk)
                if chunk.final:
                    in_flight.discard(chunk.request_id)

    start = time.perf_counter()
    while waiting or in_flight:
        while waiting and len(in_flight) < concurrency:
            request = roundtrip(waiting.pop(0))
            with timed(run.stage_s, "schedule"):
                state.admit(request, f"inbox.{request.request_id}", prompt_token_ids(request, state.tokenizer),
                            time.time())
            in_flight.add(request.request_id)
        with timed(run.stage_s, "schedule"):
            observe_instances(loop)
            outbox = state.boundary(time.time())
            plan = state.plan_step(time.time())
            drafts = state.draft_batches(plan, time.time())
        for drafter_id, message in drafts.items():
            message = roundtrip(message)
            with timed(run.stage_s, "draft"):
                reply = draft_batch(loop.drafter, message)
            reply = roundtrip(reply)
            with timed(run.stage_s, "schedule"):
                state.apply_draft(plan, drafter_id, message, reply)
        with timed(run.stage_s, "schedule"):
            verifies = state.verify_batches(plan, time.time())
        replies = []
        for verifier_id, message in verifies.items():
            message = roundtrip(message)
            with timed(run.stage_s, "verify"):
                response, records = verify_batch(loop.verifier, message)
            replies.append((verifier_id, roundtrip(response), [roundtrip(r) for _, r in records]))
        run.steps += not plan.empty
        outs = []
        with timed(run.stage_s, "commit"):
            # heartbeats arrive every interval in a stack, also while a model works: a verify
            # longer than heartbeat_timeout_s (a real model on a loaded CPU) must not make the
            # instances look dead to the commit
            observe_instances(loop)
            for verifier_id, response, records in replies:
                outbox.extend(state.apply_verify(plan, verifier_id, response, time.time()))
                for record in records:
                    outs += post.on_side(record, time.monotonic())
            state.end_step(plan)
        deliver(outs)
        for _, commit in outbox.commits:
            commit = roundtrip(commit)
            with timed(run.stage_s, "commit"):
                outs = post.on_commit(commit, time.monotonic())
            deliver(outs)
        deliver(ChunkToClient(inbox, chunk) for inbox, chunk in outbox.chunks)
        # a release-only batch (the slot a new request waits for) is progress too
        if plan.empty and in_flight and not drafts and not verifies and not outbox.commits and not outbox.chunks:
            raise RuntimeError(f"in-process loop stalled with {len(in_flight)} requests in flight "
                               f"(scheduler counters {dict(state.counters)})")
    run.wall_s = time.perf_counter() - start
    return run


@contextmanager
def timed(stage_s: Counter, stage: str) -> Iterator[None]:
    """Adds the block's wall time to stage_s[stage]."""
    start = time.perf_counter()
    try:
        yield
    finally:
        stage_s[stage] += time.perf_counter() - start
