"""Fault injection: every service a separate process (services.launch.stack), a
real nats-server, and parts of the stack killed with SIGKILL or frozen with SIGSTOP while
NUM_REQUESTS greedy streaming requests run (the fault matrix's are half seeded samples coupled by
Gumbel noise). What a user checks: every stream is whole (seq 0, 1, 2, ... without gap or
duplicate, and its text is the decoding of its token ids), outputs equal an undisturbed run, the
degraded flags (docs/PROTOCOL.md#degraded-reasons) show where a fallback fired,
no request hangs, and the stack serves new requests afterwards.

One stack for the module (starting one takes tens of seconds on a busy machine): 1 scheduler,
2 verifiers, 1 drafter, 2 postprocessors, with heartbeat and verify timeouts short enough that
a fault is noticed within seconds, supervised as `specbus up` supervises it
(services/launch/supervisor.py): what a test kills comes back as a fresh instance by itself, and each
test waits for that before it ends. The checkpoints are tiny and random (greedy equality does not
depend on the weights); the draft is the target with noise added, so most drafts are accepted
and "the drafter is used again" shows as accepted draft tokens.

Nothing here depends on the machine's speed: a fault is injected once every stream has reached
FAULT_AFTER_CHUNKS chunks, a frozen process is thawed once the streams show what the freeze
caused, streams are long enough (ignore_eos) to outlive what they must show, and every wait polls
for a condition with a generous bound. A replacement is shown in use by requests sent after it
heartbeats, not by streams that must outlive its start (however long its imports take).
"""

import asyncio
import json
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
import pytest_asyncio

from schemas.generation import GenerateRequest
from schemas.streams import StreamChunk
from services.client import Client, ClientError, make_request
from services.launch.natsserver import NatsServerConfig
from services.launch.stack import Stack
from tests.services.scheduler.scheduler_harness import beat, new_state, step, submit

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MAX_TOKENS = 160
LONG_MAX_TOKENS = 480  # many steps left after a fault at FAULT_AFTER_CHUNKS chunks, even at k=0
FROZEN_CHUNKS = 20  # chunks every stream makes while the drafter is frozen
K = 4
TIMEOUT_S = 300.0  # generous: a request's deadline must never be what ends it here
FAULT_AFTER_CHUNKS = 3  # every stream has this many chunks when a fault is injected
WAIT_S = 120.0  # bound of every wait for a condition (a replacement's imports on a busy machine)
CLIENT_MARGIN_S = 5.0  # services.client.Client's timeout_margin_s default
HEARTBEAT_INTERVAL_S = 0.2
HEARTBEAT_TIMEOUT_S = 1.5
VERIFY_TIMEOUT_S = 2.0
DRAFT_TIMEOUT_S = 0.5


def fault_settings(heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S, **options) -> dict:
    """start_stack settings: the short heartbeat, verify and draft timeouts of these tests;
    options: instance counts and other StackConfig fields."""
    beat = ["--heartbeat-interval-s", str(HEARTBEAT_INTERVAL_S)]
    # adaptive k off: every step asks the drafter for K drafts, so a drafter's fault always shows
    # (with it on, the noisy draft, as large as the target, may not pay on a busy machine and
    # adaptive k stops asking: a frozen drafter then costs nothing and flags nothing).
    return dict(role_args={"scheduler": [*beat, "--heartbeat-timeout-s", str(heartbeat_timeout_s),
                                         "--adaptive-k", "false",
                                         "--verify-timeout-s", str(VERIFY_TIMEOUT_S),
                                         "--draft-timeout-s", str(DRAFT_TIMEOUT_S)],
                           "verifier": [*beat, "--max-seq-len", "512"], "drafter": [*beat, "--max-seq-len", "512"],
                           "postprocessor": beat}, **options)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(start_stack, noisy_pair):
    async with start_stack(*noisy_pair, supervised=True, **fault_settings(verifiers=2, postprocessors=2)) as running:
        yield running


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(stack):
    """The module's client: its idle bound outlasts a held scheduler (see the module docstring),
    and it does not fail over (services/client.py), so what these tests show is the services' own
    fallback, never a client resending around it (the fault matrix below tests the failover)."""
    async with stack.client(idle_timeout_s=WAIT_S, failover=False) as connected:
        yield connected


def greedy(prompt, name: str, **options) -> GenerateRequest:
    options = {"max_tokens": MAX_TOKENS, "timeout_s": TIMEOUT_S, **options}
    return make_request(prompt, request_id=f"{name}-{time.monotonic_ns()}", temperature=0.0, ignore_eos=True,
                        **{"num_speculative_tokens": K, **options})


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(client, prompts) -> list[list[int]]:
    """Greedy outputs of an undisturbed run, all requests at once (shorter requests compare
    with a prefix: greedy decoding of n tokens is the start of greedy decoding of more)."""
    results = await asyncio.gather(*(client.generate(greedy(p, f"reference-{i}", max_tokens=LONG_MAX_TOKENS))
                                     for i, p in enumerate(prompts)))
    assert all(r.finish_reason == "length" and len(r.token_ids) == LONG_MAX_TOKENS for r in results)
    assert sum(r.usage.draft_tokens_accepted for r in results) > 0  # the draft is good enough to show reuse
    return [r.token_ids for r in results]


# ---------------------------------------------------------------------------------------------
# streams under load


@dataclass
class Streamed:
    """One request's stream as the client saw it: (arrival time.monotonic(), chunk) in order."""

    request: GenerateRequest
    chunks: list[tuple[float, StreamChunk]] = field(default_factory=list)
    num_duplicates: int = 0
    error: ClientError | None = None

    @property
    def token_ids(self) -> list[int]:
        return [t for _, chunk in self.chunks for t in chunk.token_ids.tolist()]

    @property
    def text(self) -> str:
        return "".join(chunk.text for _, chunk in self.chunks)

    @property
    def finish_reason(self) -> str | None:
        return self.chunks[-1][1].finish_reason if self.chunks else None

    def degraded(self, since: float = 0.0) -> set[str]:
        return {reason for at, chunk in self.chunks if at >= since for reason in chunk.degraded}

    def accepted_since(self, since: float) -> int:
        return sum(sum(chunk.from_draft) for at, chunk in self.chunks if at >= since)


async def read(client: Client, got: Streamed) -> Streamed:
    async with await client.open_stream(got.request) as stream:
        try:
            async for chunk in stream:
                got.chunks.append((time.monotonic(), chunk))
        except ClientError as exc:
            got.error = exc
        got.num_duplicates = stream.num_duplicates
    return got


async def wait_until(condition, what: str, timeout_s: float = WAIT_S) -> None:
    """Poll condition() until it holds; AssertionError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.02)


class Load:
    """NUM_REQUESTS streams in flight: `await Load.start(...)` returns once every one has
    FAULT_AFTER_CHUNKS chunks (so a fault injected next hits requests mid-stream)."""

    def __init__(self, client: Client, requests: list[GenerateRequest]):
        self.streams = [Streamed(r) for r in requests]
        self.tasks = [asyncio.create_task(read(client, got)) for got in self.streams]

    @classmethod
    async def start(cls, client: Client, requests: list[GenerateRequest]) -> "Load":
        load = cls(client, requests)
        await load.until(lambda: all(len(got.chunks) >= FAULT_AFTER_CHUNKS or got.finish_reason
                                     for got in load.streams), f"every stream has {FAULT_AFTER_CHUNKS} chunks")
        return load

    async def until(self, condition, what: str) -> None:
        """Poll condition() (about the streams so far); a stream that ended with an error fails at once."""
        def holds() -> bool:
            errors = [got.error for got in self.streams if got.error is not None]
            assert not errors, f"a stream failed while waiting for {what}: {errors[0]!r}"
            return condition()
        await wait_until(holds, what)

    async def finish(self, bound_s: float | None = None) -> list[Streamed]:
        """Every stream's end. None may outlive its deadline (the client's timeout_s + margin,
        plus slack for a busy machine): a hang fails here."""
        bound_s = bound_s or max(got.request.timeout_s for got in self.streams) + CLIENT_MARGIN_S + 15.0
        return await asyncio.wait_for(asyncio.gather(*self.tasks), timeout=bound_s)


def check_whole(got: Streamed, tokenizer) -> None:
    """Seqs 0..n in order, exactly one final chunk (the last), text == decode(token_ids)."""
    seqs = [chunk.seq for _, chunk in got.chunks]
    assert seqs == list(range(len(seqs))), f"{got.request.request_id}: seqs {seqs}"
    assert [chunk.final for _, chunk in got.chunks[:-1]] == [False] * (len(seqs) - 1)
    assert got.text == tokenizer.decode(got.token_ids), got.request.request_id


def check_greedy(streams: list[Streamed], reference: list[list[int]], tokenizer) -> None:
    for index, (got, expected) in enumerate(zip(streams, reference)):
        assert got.error is None, f"request {index}: {got.error!r}"
        check_whole(got, tokenizer)
        assert got.finish_reason == "length", f"request {index}"
        assert got.token_ids == expected[:got.request.sampling.max_tokens], \
            f"request {index}, degraded {sorted(got.degraded())}"


def requests_for(prompts, name: str, **options) -> list[GenerateRequest]:
    return [greedy(p, f"{name}-{i}", **options) for i, p in enumerate(prompts)]


GUMBEL_SAMPLED = dict(temperature=0.8, top_p=0.95, draft_mode="sample", coupling="gumbel")


def mixed_requests(prompts, name: str, max_tokens: int) -> list[GenerateRequest]:
    """Greedy streams and (odd ones) seeded samples coupled by Gumbel noise, k=K: a sample's tokens
    depend on its seed and positions only, not on which steps lost their drafts
    (docs/PROTOCOL.md#drafter-invariant-sampling), so no fault may change them either."""
    return [make_request(p, request_id=f"{name}-{i}-{time.monotonic_ns()}", max_tokens=max_tokens, ignore_eos=True,
                         num_speculative_tokens=K, timeout_s=TIMEOUT_S,
                         **(dict(GUMBEL_SAMPLED, seed=500 + i) if i % 2 else dict(temperature=0.0)))
            for i, p in enumerate(prompts)]


def running(stack: Stack, role: str) -> list[str]:
    return [p.instance_id for p in stack.by_role(role) if p.running]


def pids(stack: Stack) -> dict[str, int]:
    return {p.instance_id: p.process.pid for p in stack.processes.values() if p.running}


async def kill(stack: Stack, instance_id: str) -> float:
    """SIGKILL and wait for the exit; returns when it died (time.monotonic())."""
    stack.kill(instance_id, signal.SIGKILL)
    assert await stack.wait_exit(instance_id) == -signal.SIGKILL
    return time.monotonic()


async def scheduler_stats(stack: Stack) -> dict:
    """The scheduler's counters from `$SRV.STATS.scheduler` (nats.micro)."""
    reply = await stack.nc.request("$SRV.STATS.scheduler", b"", timeout=5)
    return json.loads(reply.data)["endpoints"][0]["data"]


async def heartbeats_since(stack: Stack, instance_ids: list[str], since: float) -> None:
    """Until each instance has heartbeated after `since` (time.monotonic())."""
    await wait_until(lambda: all(stack.heartbeat_seen_at.get(i, -1.0) >= since for i in instance_ids),
                     f"heartbeats of {instance_ids}")


async def replacement(stack: Stack, role: str, killed: str) -> str:
    """The instance the supervisor started in place of `killed`, once it heartbeats."""
    def new_one() -> str | None:
        fresh = [p for p in stack.by_role(role) if p.running and p.started_at > stack.processes[killed].started_at
                 and stack.heartbeat_seen_at.get(p.instance_id, -1.0) >= p.started_at]
        return fresh[0].instance_id if fresh else None
    await wait_until(lambda: new_one() is not None, f"a {role} started and heartbeating in place of {killed}")
    return new_one()


async def still_serving(client: Client, prompts, reference) -> None:
    """A new request after the fault gives the undisturbed output."""
    result = await client.generate(greedy(prompts[0], "after-fault"))
    assert result.token_ids == reference[0][:MAX_TOKENS]


# ---------------------------------------------------------------------------------------------
# the faults


async def test_a_killed_drafter_is_replaced_and_used_again_with_outputs_unchanged(
        stack, client, prompts, reference, tokenizer):
    before = pids(stack)
    [drafter_id] = running(stack, "drafter")
    load = await Load.start(client, requests_for(prompts, "drafter-kill", max_tokens=LONG_MAX_TOKENS))
    killed_at = await kill(stack, drafter_id)
    # The scheduler goes on without drafts, whatever the supervisor's replacement takes to start.
    # Nothing is frozen to keep these streams alive until it comes: a stopped scheduler would
    # wake up to timers that all expired at once (its verifiers' heartbeats look stale).
    await load.until(lambda: any("draft_timeout" in got.degraded(since=killed_at) for got in load.streams),
                     "a step without drafts")
    new_drafter = await replacement(stack, "drafter", drafter_id)
    streams = await load.finish()
    check_greedy(streams, reference, tokenizer)

    # The replacement drafts for new requests, and its drafts are accepted.
    back_at = time.monotonic()
    after = await Load.start(client, requests_for(prompts, "after-drafter-kill"))
    check_greedy(await after.finish(), reference, tokenizer)
    assert sum(got.accepted_since(back_at) for got in after.streams) > 0
    # Nothing else was restarted, and the stack serves new requests.
    assert pids(stack) == {**{i: p for i, p in before.items() if i != drafter_id},
                           new_drafter: stack.processes[new_drafter].process.pid}
    await still_serving(client, prompts, reference)


async def test_a_killed_verifier_moves_its_requests_to_the_other_one(stack, client, prompts, reference, tokenizer):
    victim = running(stack, "verifier")[0]
    before = await scheduler_stats(stack)
    load = await Load.start(client, requests_for(prompts, "verifier-kill"))
    killed_at = await kill(stack, victim)
    streams = await load.finish()
    after = await scheduler_stats(stack)

    check_greedy(streams, reference, tokenizer)  # re-prefilled from the history: nothing lost or repeated
    moved = [got for got in streams if "migrated" in got.degraded(since=killed_at)]
    assert moved and after["migrated"] - before.get("migrated", 0) == len(moved)
    await replacement(stack, "verifier", victim)
    await still_serving(client, prompts, reference)


async def test_a_lost_postprocessor_is_replayed_every_commit_since_its_last_heartbeat(tokenizer):
    """The same hand-over on a machine fast enough to commit 100 steps between two heartbeats
    (scheduler logic only, no NATS): the replay reaches back to the first commit the dead
    postprocessor may have missed, or the client would be left a gap it can never fill."""
    state = new_state(tokenizer, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    request = submit(state, sampling={"max_tokens": 200})
    for _ in range(100):
        step(state)
    state.clock.now += 2 * HEARTBEAT_TIMEOUT_S  # p1 falls silent; p2 appears
    for instance_id, role in (("v1", "verifier"), ("d1", "drafter"), ("p2", "postprocessor")):
        beat(state, instance_id, role)
    _, _, outbox = step(state)
    replayed = [commit for postprocessor_id, commit in outbox.commits if postprocessor_id == "p2"]
    assert request.postprocessor_id == "p2" and [c.seq for c in replayed] == list(range(101))
    assert replayed[0].resume_token_ids.tolist() == []


async def test_a_killed_postprocessor_hands_its_streams_to_the_other_one(stack, client, prompts, reference,
                                                                        tokenizer):
    victim = running(stack, "postprocessor")[0]
    before = await scheduler_stats(stack)
    load = await Load.start(client, requests_for(prompts, "postprocessor-kill"))
    await kill(stack, victim)
    streams = await load.finish()
    after = await scheduler_stats(stack)

    check_greedy(streams, reference, tokenizer)  # text == decode(token_ids): no gap, no repeat
    assert after["postprocessor_repinned"] - before.get("postprocessor_repinned", 0) > 0
    # The new postprocessor replayed commits the client may have missed, from the detokenizer
    # state it rebuilt; the client dropped the seqs it had already.
    assert sum(got.num_duplicates for got in streams) > 0
    await replacement(stack, "postprocessor", victim)
    await still_serving(client, prompts, reference)


async def test_a_frozen_drafter_costs_drafts_not_time(stack, client, prompts, reference, tokenizer):
    [drafter_id] = running(stack, "drafter")
    load = await Load.start(client, requests_for(prompts, "drafter-freeze", max_tokens=LONG_MAX_TOKENS))
    stack.kill(drafter_id, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        # The streams do not wait for the drafter: each goes on, without drafts, for
        # FROZEN_CHUNKS chunks while it is frozen (a hang fails this wait).
        counts = [len(got.chunks) for got in load.streams]
        await load.until(lambda: all(len(got.chunks) >= n + FROZEN_CHUNKS or got.finish_reason
                                     for got, n in zip(load.streams, counts)),
                         f"{FROZEN_CHUNKS} more chunks in every stream with the drafter frozen")
    finally:
        stack.kill(drafter_id, signal.SIGCONT)
    thawed_at = time.monotonic()
    streams = await load.finish()

    check_greedy(streams, reference, tokenizer)
    assert any("draft_timeout" in got.degraded(since=frozen_at) for got in streams)
    # ... and once it was back, its drafts were used again (chunks from before the freeze may
    # arrive after it, so only accepted drafts after the thaw count).
    assert sum(got.accepted_since(thawed_at) for got in streams) > 0
    assert running(stack, "drafter") == [drafter_id]  # frozen, not dead: the supervisor left it alone


async def test_a_frozen_verifier_is_retried_then_left_for_the_other(stack, client, prompts, reference, tokenizer):
    victim = running(stack, "verifier")[0]
    before = await scheduler_stats(stack)
    load = await Load.start(client, requests_for(prompts, "verifier-freeze"))
    stack.kill(victim, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:  # until its requests moved: past the first try and the retry
        await load.until(lambda: any("migrated" in got.degraded(since=frozen_at) for got in load.streams),
                         "a request moved off the frozen verifier")
    finally:
        stack.kill(victim, signal.SIGCONT)
    thawed_at = time.monotonic()
    streams = await load.finish()
    after = await scheduler_stats(stack)

    check_greedy(streams, reference, tokenizer)
    assert after["verify_failures"] - before.get("verify_failures", 0) >= 2  # the try and its retry timed out
    await heartbeats_since(stack, [victim], thawed_at)  # frozen, not dead: it serves on
    assert victim in running(stack, "verifier")


async def test_with_every_verifier_frozen_requests_wait_for_one_and_finish_unchanged_or_at_their_deadline(
        stack, client, prompts, reference, tokenizer):
    verifiers = running(stack, "verifier")
    short_timeout_s = 4.0
    # All still running at the freeze, however fast the stack: the short ones end at their
    # deadline, never at max_tokens.
    requests = [greedy(p, f"all-frozen-{i}", max_tokens=LONG_MAX_TOKENS,
                       timeout_s=short_timeout_s if i % 2 else TIMEOUT_S) for i, p in enumerate(prompts)]
    long_ones = sum(r.timeout_s == TIMEOUT_S for r in requests)
    before = await scheduler_stats(stack)
    load = await Load.start(client, requests)
    for verifier_id in verifiers:
        stack.kill(verifier_id, signal.SIGSTOP)
    try:  # thawed once the short requests reached their deadline and the long ones wait for a verifier
        await load.until(lambda: all(got.finish_reason for got in load.streams if got.request.timeout_s != TIMEOUT_S),
                         "the short requests' deadlines")
        deadline = time.monotonic() + WAIT_S
        while (await scheduler_stats(stack)).get("verifier_awaited", 0) - before.get("verifier_awaited", 0) < long_ones:
            assert time.monotonic() < deadline, f"not within {WAIT_S} s: every long request waiting for a verifier"
            await asyncio.sleep(0.1)
    finally:
        for verifier_id in verifiers:
            stack.kill(verifier_id, signal.SIGCONT)
    streams = await load.finish()

    # No verifier to move to is not the end: the long requests waited for one (here the thawed
    # ones, under `specbus up` also a restarted one) and were re-prefilled there from their
    # history; the short ones ended at their deadline with the partial output kept.
    for index, (got, expected) in enumerate(zip(streams, reference)):
        check_whole(got, tokenizer)
        assert got.error is None, f"request {index}: {got.error!r}"
        if got.request.timeout_s == short_timeout_s:
            assert got.finish_reason == "timeout", index
            assert got.token_ids == expected[:len(got.token_ids)], index
        else:
            # (flagged `migrated` when a verify timed out on the way; a thawed verifier whose
            # slot survived goes on from it unflagged)
            assert got.finish_reason == "length" and got.token_ids == expected[:LONG_MAX_TOKENS], index
    result = await client.generate(greedy(prompts[0], "after-thaw"))
    assert result.token_ids == reference[0][:MAX_TOKENS]


async def test_a_restarted_nats_server_ends_no_stream_silently_and_serves_again(stack, client, prompts, reference,
                                                                               tokenizer):
    load = await Load.start(client, requests_for(prompts, "nats-restart", timeout_s=30.0))
    await asyncio.to_thread(stack.server.restart)
    restarted_at = time.monotonic()
    streams = await load.finish()  # each finished or ended with an error within its deadline

    for index, (got, expected) in enumerate(zip(streams, reference)):
        assert got.token_ids == expected[:len(got.token_ids)], index
        if got.error is not None:  # the client raised, with the reason
            assert got.error.message, index
            continue
        check_whole(got, tokenizer)  # a final chunk came: all of it, or the partial output and "error"
        # (or "timeout": a stream the restart held up past its deadline ends there, with what it has)
        assert got.finish_reason in ("length", "error", "timeout"), index
        assert got.finish_reason != "length" or len(got.token_ids) == MAX_TOKENS, index

    await heartbeats_since(stack, list(pids(stack)), restarted_at)
    again = await asyncio.gather(*(client.generate(r) for r in requests_for(prompts, "after-restart")))
    assert [r.token_ids for r in again] == [expected[:MAX_TOKENS] for expected in reference]


async def test_a_final_commit_lost_with_its_postprocessor_is_replayed(tokenizer):
    """A request whose last commit went to a postprocessor that died before anyone noticed
    (scheduler logic only, no NATS): the scheduler keeps the ended request for twice the
    heartbeat timeout and replays its commits, the final one included, to a live postprocessor."""
    state = new_state(tokenizer, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    request = submit(state, sampling={"max_tokens": 3})
    for _ in range(5):  # admission, prefill, then one token a step: the third commit is final
        step(state)
    assert request.request_id in state.committer.finishing
    state.clock.now += 1.5 * HEARTBEAT_TIMEOUT_S  # p1 falls silent right after the final commit
    for instance_id, role in (("v1", "verifier"), ("d1", "drafter"), ("p2", "postprocessor")):
        beat(state, instance_id, role)
    outbox = state.boundary(state.clock.now)
    replayed = [commit for postprocessor_id, commit in outbox.commits if postprocessor_id == "p2"]
    assert replayed and replayed[-1].finish_reason == "length"
    assert [c.seq for c in replayed] == list(range(len(replayed)))
    state.clock.now += 3 * HEARTBEAT_TIMEOUT_S
    assert not state.boundary(state.clock.now).commits and not state.committer.finishing  # replayed once, then forgotten


# ---------------------------------------------------------------------------------------------
# the fault matrix: each single-process kill against the same workload

MATRIX_MAX_TOKENS = 96
# A NATS node's death moves up to every process at once (on a loaded machine each reconnect can
# take a second); a heartbeat timeout of 1.5 s would then count a live verifier dead.
MATRIX_HEARTBEAT_TIMEOUT_S = 3.0
MATRIX_IDLE_TIMEOUT_S = 20.0  # a stream whose last chunk was lost fails over after this
MATRIX_FAULTS = ("scheduler", "verifier", "drafter", "postprocessor", "nats-0", "nats-1", "nats-2")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def matrix_stack(start_stack, noisy_pair):
    """Every role twice but the drafter (its death costs drafts, not output), a 3-node NATS
    cluster with monitoring on, supervised: every process there is something to kill."""
    settings = fault_settings(MATRIX_HEARTBEAT_TIMEOUT_S, schedulers=2, verifiers=2, postprocessors=2, nats_cluster=3,
                              nats=NatsServerConfig(http_port=0))
    async with start_stack(*noisy_pair, supervised=True, **settings) as running:
        yield running


async def inject(stack: Stack, fault: str, streams: list[Streamed]) -> str:
    """SIGKILL one process: a NATS node by index, else an instance of the role (the scheduler
    that runs most streams); returns what was killed."""
    if fault.startswith("nats-"):
        node = stack.server.nodes[int(fault.split("-")[1])]
        node.process.kill()
        await asyncio.to_thread(node.process.wait, 10)
        return node.config.server_name
    if fault == "scheduler":
        owners = [got.chunks[-1][1].scheduler_id for got in streams]
        victim = max(set(owners), key=owners.count)
    else:
        victim = running(stack, fault)[0]
    await kill(stack, victim)
    return victim


async def recover(stack: Stack, fault: str, victim: str, killed_at: float) -> None:
    """The killed node restarted (same ports: the routes find it again), or the supervisor's
    replacement heartbeating; then every process heard from since the kill."""
    if fault.startswith("nats-"):
        await asyncio.to_thread(stack.server.nodes[int(fault.split("-")[1])].restart)
    else:
        await replacement(stack, fault, victim)
    await heartbeats_since(stack, running(stack, "scheduler") + running(stack, "verifier") +
                           running(stack, "drafter") + running(stack, "postprocessor"), killed_at)


def matrix_row(fault: str, victim: str, streams: list[Streamed], reference: list[list[int]],
               killed_at: float) -> dict:
    """One fault's outcome, as the table shows it."""
    identical = [got.error is None and got.finish_reason == "length" and got.token_ids == expected
                 for got, expected in zip(streams, reference)]
    flags = Counter(reason for got in streams for reason in got.degraded(since=killed_at))
    return {"fault": f"{fault} ({victim})", "identical": sum(identical), "streams": len(streams),
            "errors": [repr(got.error) for got in streams if got.error is not None],
            "flagged": ", ".join(f"{reason} x{count}" for reason, count in sorted(flags.items())) or "-",
            "ended_s": max(got.chunks[-1][0] for got in streams if got.chunks) - killed_at}


def matrix_table(rows: list[dict]) -> str:
    lines = ["fault (killed)                  | identical | flagged chunks                         | last end (s)",
             "--------------------------------+-----------+----------------------------------------+-------------"]
    lines += [f"{row['fault']:<32}| {row['identical']:>3} of {row['streams']:<3}| {row['flagged']:<39}| "
              f"{row['ended_s']:>6.1f}" + (f"  errors: {row['errors']}" if row["errors"] else "") for row in rows]
    return "\n".join(lines)


async def test_fault_matrix_no_single_process_kill_changes_any_stream(matrix_stack, prompts, tokenizer):
    """The same NUM_REQUESTS streams, greedy and Gumbel-coupled seeded samples (mixed_requests),
    against each single-process SIGKILL (each role, each NATS node; at FAULT_AFTER_CHUNKS chunks
    per stream): every stream whole and identical to an undisturbed run, in float32
    (tests/system/faults/test_cluster.py runs the workload in bfloat16). Prints the table of outcomes per fault."""
    async with matrix_stack.client(idle_timeout_s=MATRIX_IDLE_TIMEOUT_S,
                                   heartbeat_timeout_s=MATRIX_HEARTBEAT_TIMEOUT_S) as client:
        undisturbed = await Load(client, mixed_requests(prompts, "matrix-reference", MATRIX_MAX_TOKENS)).finish()
        reference = [got.token_ids for got in undisturbed]
        assert all(len(tokens) == MATRIX_MAX_TOKENS for tokens in reference)
        rows, outcomes = [], []
        for fault in MATRIX_FAULTS:
            load = await Load.start(client, mixed_requests(prompts, f"matrix-{fault}", MATRIX_MAX_TOKENS))
            victim = await inject(matrix_stack, fault, load.streams)
            killed_at = time.monotonic()
            streams = await load.finish()
            rows.append(matrix_row(fault, victim, streams, reference, killed_at))
            outcomes.append(streams)
            await recover(matrix_stack, fault, victim, killed_at)
    print("\n" + matrix_table(rows))
    for fault, row, streams in zip(MATRIX_FAULTS, rows, outcomes):
        for got, expected in zip(streams, reference):
            assert got.token_ids == expected[:len(got.token_ids)], f"{row['fault']}: a wrong token"
            # A NATS node may hold every verifier's connection: while they reconnect, a scheduler
            # that hears none for heartbeat_timeout_s lets their requests wait for one.
            assert got.error is None, f"{row['fault']}: {got.error!r}\n{matrix_table(rows)}"
            check_whole(got, tokenizer)
        assert row["identical"] == row["streams"] - len(row["errors"]), f"{row['fault']}\n{matrix_table(rows)}"
    drafter_row = rows[MATRIX_FAULTS.index("drafter")]  # the kill reached the streams: steps ran without drafts
    assert "draft_timeout" in drafter_row["flagged"], matrix_table(rows)
