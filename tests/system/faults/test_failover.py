"""Scheduler failover: two schedulers, each a separate process, and the one running
most of NUM_REQUESTS streams SIGKILLed once every stream has FAULT_AFTER_CHUNKS chunks (stream
progress, not wall time). Half the requests are greedy, half seeded sampled; half of each ask for
logprobs.

The client notices the death by the scheduler's heartbeats falling silent for
heartbeat_timeout_s (not by idle_timeout_s, which is far longer here), and sends each of its
requests again with the completion it has as `resume_token_ids`; the other scheduler re-prefills
and continues at the same positions with the same seed. What a user checks: every stream is
whole (seqs 0..n, text == decode(tokens)), token for token the undisturbed run's output, sampled
ones included, logprobs too; the failed-over streams are flagged `failover`; none waited for the
idle timeout.
"""

import asyncio
import contextlib
import signal
import time

import pytest
import pytest_asyncio

from schemas.bus.codec import decode
from schemas.generation import GenerateRequest
from schemas.bus.subjects import SCHEDULER_QUEUE_GROUP
from services.client import make_request
from services.launch.stack import Stack
from services.launch.supervisor import RestartPolicy
from services.runtime.bus import connect
from tests.system.faults.test_faults import (
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    K,
    Load,
    Streamed,
    check_whole,
    replacement,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MAX_TOKENS = 96
TIMEOUT_S = 120.0
IDLE_TIMEOUT_S = 60.0  # the client's: a failover must not wait for it
# Generous draft and verify timeouts: a k=0 step (drafter late) takes another path through the
# seeds, so on a busy machine it would change a sampled output with or without a failover.
SCHEDULER_ARGS = ["--heartbeat-interval-s", str(HEARTBEAT_INTERVAL_S), "--heartbeat-timeout-s",
                  str(HEARTBEAT_TIMEOUT_S), "--draft-timeout-s", "10", "--verify-timeout-s", "20"]


def failover_settings(schedulers: int, dtype: str | None = None) -> dict:
    """start_stack settings: `schedulers` schedulers with SCHEDULER_ARGS, the fault tests' heartbeats."""
    beat = ["--heartbeat-interval-s", str(HEARTBEAT_INTERVAL_S)]
    return dict(schedulers=schedulers, dtype=dtype,
                role_args={"scheduler": SCHEDULER_ARGS, "verifier": [*beat, "--max-seq-len", "512"],
                           "drafter": [*beat, "--max-seq-len", "512"], "postprocessor": beat})


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["float32", "bfloat16"])
async def stack(start_stack, noisy_pair, request):
    """Two schedulers, once per dtype: a failover keeps outputs and logprobs bit for bit in both."""
    async with start_stack(*noisy_pair, **failover_settings(2, request.param)) as running:
        yield running


@contextlib.asynccontextmanager
async def connected_client(stack: Stack, num_schedulers: int):
    """A client that has heard every scheduler, so a death before the first chunk counts too."""
    async with stack.client(idle_timeout_s=IDLE_TIMEOUT_S, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as client:
        async with asyncio.timeout(30):
            while len(client.live_schedulers()) < num_schedulers:
                await asyncio.sleep(0.05)
        yield client


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(stack):
    async with connected_client(stack, 2) as client:
        yield client


def requests(prompts, name: str, with_sampled: bool = True) -> list:
    """Greedy and (with_sampled) seeded sampled, each with and without logprobs (top 3)."""
    out = []
    for index, prompt in enumerate(prompts):
        sampled, logprobs = with_sampled and index % 2 == 1, index % 4 >= 2
        options = dict(temperature=0.8, top_p=0.95, seed=1000 + index, draft_mode="sample") if sampled \
            else dict(temperature=0.0)
        out.append(make_request(prompt, request_id=f"{name}-{index}-{time.monotonic_ns()}", max_tokens=MAX_TOKENS,
                                ignore_eos=True, num_speculative_tokens=K, timeout_s=TIMEOUT_S,
                                logprobs=3 if logprobs else None, **options))
    return out


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(client, prompts) -> list[Streamed]:
    """The same requests, undisturbed."""
    streams = await Load(client, requests(prompts, "reference")).finish()
    for got in streams:
        assert got.error is None and got.finish_reason == "length" and len(got.token_ids) == MAX_TOKENS
    return streams


def logprobs(got: Streamed) -> list:
    return [entry for _, chunk in got.chunks for entry in (chunk.logprobs or [])]


def check_unchanged(streams: list[Streamed], reference: list[Streamed], tokenizer, with_logprobs: bool = True) -> None:
    """Every stream whole and token for token the undisturbed run's (none lost, none repeated),
    text and (with_logprobs) logprobs too."""
    for index, (got, expected) in enumerate(zip(streams, reference)):
        assert got.error is None, f"request {index}: {got.error!r}"
        check_whole(got, tokenizer)
        assert got.finish_reason == "length", index
        diverged = next((i for i, (a, b) in enumerate(zip(got.token_ids, expected.token_ids)) if a != b), None)
        assert got.token_ids == expected.token_ids, (f"request {index}: output changed at token {diverged}; "
                                                     f"chunks {chunk_log(got)}; reference {chunk_log(expected)}")
        assert got.text == expected.text, index
        if not with_logprobs:
            continue
        got_logprobs, expected_logprobs = logprobs(got), logprobs(expected)
        assert len(got_logprobs) == len(expected_logprobs), index
        for ours, theirs in zip(got_logprobs, expected_logprobs):
            assert ours.token_id == theirs.token_id and ours.top_ids.tolist() == theirs.top_ids.tolist(), index
            assert ours.logprob == theirs.logprob and ours.top_logprobs.tolist() == theirs.top_logprobs.tolist(), index


def chunk_log(got: Streamed) -> list:
    """(seq, number of tokens, degraded, scheduler) per chunk: where a changed output came from."""
    return [(chunk.seq, len(chunk.token_ids), chunk.degraded, chunk.scheduler_id) for _, chunk in got.chunks]


def handed_over(owned: list[Streamed], victim: str) -> list[Streamed]:
    """The streams of `owned` that another scheduler finished: one the victim finished before it
    died (the tiny pair is fast: between a stream's third chunk and the signal it may end) had
    nothing to hand over."""
    return [got for got in owned if got.chunks[-1][1].scheduler_id != victim]


def check_failed_over(moved: list[Streamed], killed_at: float, stack: Stack) -> None:
    """Flagged `failover`, continued by a live scheduler, noticed by heartbeats: the first chunk
    after the kill came well before the idle timeout."""
    for got in moved:
        assert "failover" in got.degraded(since=killed_at), (got.request.request_id, killed_at, chunk_log(got))
        # from the first chunk of the new run on (chunks the dead one sent may still arrive after the kill)
        first_new = next(i for i, (at, chunk) in enumerate(got.chunks)
                         if at >= killed_at and "failover" in chunk.degraded)
        assert {chunk.scheduler_id for _, chunk in got.chunks[first_new:]} - {None} <= \
            {p.instance_id for p in stack.by_role("scheduler") if p.running}, got.request.request_id
        first_after = min(at for at, _ in got.chunks if at >= killed_at)
        assert first_after - killed_at < IDLE_TIMEOUT_S / 2, got.request.request_id


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
async def test_a_killed_or_stopped_scheduler_hands_every_stream_to_the_other_with_outputs_unchanged(
        sig, stack, client, prompts, reference, tokenizer):
    """SIGKILL: the client notices the silence; SIGTERM: the scheduler ends its requests with
    `shutting_down` and the client hands each over at once (before the process has exited)."""
    load = await Load.start(client, requests(prompts, f"failover-{sig.name}"))
    owners = [got.chunks[-1][1].scheduler_id for got in load.streams]
    victim = max(set(owners), key=owners.count)
    signalled_at = time.monotonic()
    stack.kill(victim, sig)
    assert await stack.wait_exit(victim, timeout_s=60) == (-signal.SIGKILL if sig == signal.SIGKILL else 0)
    # From the signal on: a stopped one hands over while it stops, and on a loaded machine the
    # client may fail a killed one's streams over before wait_exit returns (only a live scheduler
    # flags `failover`, so a killed one's last chunks, arriving after the kill, do not count).
    killed_at = signalled_at
    streams = await load.finish()

    moved = handed_over([got for got, owner in zip(streams, owners) if owner == victim], victim)
    print(f"\n{victim} got {sig.name}, owning {owners.count(victim)} of {len(streams)} streams, {len(moved)} moved")
    check_unchanged(streams, reference, tokenizer)
    assert moved, "the victim owned no stream"
    check_failed_over(moved, killed_at, stack)
    assert all("failover" not in got.degraded() for got, owner in zip(streams, owners) if owner != victim)

    await stack.start_instance("scheduler")


async def test_a_request_lost_before_any_scheduler_saw_it_is_sent_again_with_outputs_unchanged(
        stack, client, prompts, reference, tokenizer):
    """A GenerateRequest lost on the way (inside a dying NATS node, say): a subscriber that joins
    the schedulers' queue group and drops what it gets plays the loss, leaving as soon as it got
    one. The client hears no Admitted within admission_timeout_s and sends the request again;
    the streams come out unchanged, the resent ones flagged `failover`. The queue group picks its
    member at random, so rounds of the 8 requests are sent until one was dropped (each request
    has a 1 in 3 chance; 8 rounds all missing is (2/3)^64, about 5e-12)."""
    dropped: list[str] = []
    lossy = await connect(stack.url, "pytest-lost-requests", **stack.login("scheduler"))

    async def drop(msg) -> None:
        dropped.append(decode(msg.data, GenerateRequest).request_id)
        if len(dropped) == 1:
            await hole.unsubscribe()  # those already on the way to it are dropped too

    try:
        hole = await lossy.subscribe(f"{stack.subjects.generate}.*", queue=SCHEDULER_QUEUE_GROUP, cb=drop)
        await lossy.flush(timeout=10)
        for round_ in range(8):
            streams = await Load(client, requests(prompts, f"lost-{round_}")).finish()
            if dropped:
                break
    finally:
        await lossy.close()
    print(f"\ndropped {len(dropped)} of {len(streams)} requests in round {round_}")
    check_unchanged(streams, reference, tokenizer)
    assert dropped, "the lossy subscriber never got a request"
    for got in streams:
        assert ("failover" in got.degraded()) == (got.request.request_id in dropped), got.request.request_id


async def test_a_restarted_nats_server_loses_no_stream(stack, client, prompts, tokenizer):
    """The one nats-server restarted under 8 streams: every connection reconnects, and what the
    server dropped meanwhile is recovered by the client's failover (every scheduler's heartbeats
    stopped with it) and the schedulers' fallbacks: every stream whole and unchanged. Greedy
    streams only: a draft reply lost in the restart makes that step run without drafts
    (`draft_timeout`), which changes which seeded draws a sampled stream uses
    (docs/OPERATIONS.md#guarantees, first row)."""
    reference = await Load(client, requests(prompts, "restart-reference", with_sampled=False)).finish()
    load = await Load.start(client, requests(prompts, "nats-restart", with_sampled=False))
    await asyncio.to_thread(stack.server.restart)
    check_unchanged(await load.finish(), reference, tokenizer)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def supervised(start_stack, noisy_pair, prompts):
    """One instance per role (float32), supervised as `specbus up` does, with restarts held back
    well past the heartbeat timeout; and the undisturbed outputs of `requests`, taken on it before
    any kill. Shared by the three kills below (one stack start and one reference instead of three):
    each test ends only once its role's replacement heartbeats and nothing else was restarted, so
    the next one starts on a whole stack, and every kill's streams still compare with the outputs
    of the stack as it first came up."""
    held_back = RestartPolicy(first_delay_s=4 * HEARTBEAT_TIMEOUT_S)
    async with start_stack(*noisy_pair, supervised=held_back, **failover_settings(1)) as running:
        async with connected_client(running, 1) as client:
            reference = await Load(client, requests(prompts, "only-reference")).finish()
        yield running, reference


def running_ids(stack: Stack) -> set[str]:
    return {p.instance_id for p in stack.processes.values() if p.running}


@pytest.mark.parametrize("role", ["scheduler", "verifier", "postprocessor"])
async def test_the_only_instance_of_a_role_killed_under_supervision_loses_no_stream(
        role, supervised, prompts, tokenizer):
    """One instance per role, supervised as `specbus up` does: when it is SIGKILLed, the streams
    wait for the restarted one (a new instance id) and go on, token for token unchanged: the
    client fails over to the new scheduler, the scheduler moves requests to the new verifier,
    and re-pins and replays them to the new postprocessor (replayed chunks come without their
    logprobs, `logprobs_timeout`). The restart is held back well past the heartbeat timeout,
    so the death is noticed with no instance of that role to go to. Greedy and seeded sampled
    streams: the restarted scheduler admits only once it heard the drafter (a step without
    drafts would take other seeded draws). Each role on the module's `supervised` stack, after
    the earlier roles' replacements took over: the replacement is `<role>-1` and the only process
    restarted (what the supervisor's list of replacements showed when each kill had its own stack)."""
    running, reference = supervised
    before = running_ids(running)
    async with connected_client(running, 1) as client:
        load = await Load.start(client, requests(prompts, f"only-{role}"))
        [victim] = [p.instance_id for p in running.by_role(role) if p.running]
        killed_at = time.monotonic()  # as in the test above: a failover may come before wait_exit returns
        running.kill(victim, signal.SIGKILL)
        assert await running.wait_exit(victim) == -signal.SIGKILL
        streams = await load.finish()
        check_unchanged(streams, reference, tokenizer, with_logprobs=role != "postprocessor")
        if role == "scheduler":
            check_failed_over(handed_over(streams, victim), killed_at, running)
        elif role == "verifier":
            assert all("migrated" in got.degraded(since=killed_at) for got in streams)
    new = await replacement(running, role, victim)
    assert new == f"{role}-1" and running_ids(running) == before - {victim} | {new}
