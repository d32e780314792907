"""Overload with a slow verifier: a real multi-process stack with the tiny models (models/tiny),
far more concurrent requests than the scheduler admits, and its only verifier frozen (SIGSTOP)
while every admitted request is in it, for longer than a verify try (verify_timeout_s) and
than the clients' idle_timeout_s, though well under heartbeat_timeout_s: slow, not dead.

What overload promises: every admitted request finishes, whole and unflagged (its scheduler
waits for the slow verifier instead of sending a batch twice, and keeps its clients alive, so
none of them fails over and is refused on the way back); every other request is refused
`overloaded` at once; nothing times out.

Nothing depends on the machine's speed: the freeze starts once the scheduler's $SRV.STATS
show every admitted request running or queued and every running stream has a chunk (long
ignore_eos requests, still running then), and lasts FREEZE_S, a span chosen against the
settings (verify_timeout_s and idle_timeout_s below it, heartbeat_timeout_s far above), not
against the machine.
"""

import asyncio
import json
import signal
import time

import pytest
import pytest_asyncio

from schemas.config import TINY_DRAFT, TINY_TARGET
from schemas.errors import ErrorCode
from services.client import Overloaded, make_request

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MAX_RUNNING, MAX_QUEUE = 8, 8
NUM_REQUESTS = 6 * (MAX_RUNNING + MAX_QUEUE)  # 96: five in six are refused
MAX_TOKENS = 600  # long enough to be running when the freeze starts
FREEZE_S = 6.0
VERIFY_TIMEOUT_S = 2.0  # a try runs out during the freeze; 4 tries outlast it
IDLE_TIMEOUT_S = 4.0  # the client's: a silence this long without keepalives would fail over
HEARTBEAT_TIMEOUT_S = 12.0  # the frozen verifier stays alive to the scheduler
HEARTBEAT_S = "0.2"
TIMEOUT_S = 300.0  # generous: a request's deadline must never be what ends it here
WAIT_S = 120.0  # bound of every wait for a condition


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(start_stack):
    beat = ["--heartbeat-interval-s", HEARTBEAT_S]
    # a generous draft timeout: the drafter is not what is slowed here, but on two busy cores (the
    # thawed verifier catching up) a draft batch may pass the default 0.5 s, and its rows would
    # then be flagged draft_timeout (same tokens): a measure of the machine, not of overload
    role_args = {"scheduler": ["--max-running", str(MAX_RUNNING), "--max-queue", str(MAX_QUEUE),
                               "--draft-timeout-s", "10",
                               "--verify-timeout-s", str(VERIFY_TIMEOUT_S), "--verify-retries", "3",
                               "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S), *beat],
                 "verifier": beat, "drafter": beat, "postprocessor": beat}
    async with start_stack(TINY_TARGET, TINY_DRAFT, role_args=role_args) as running:
        yield running


async def scheduler_stats(stack) -> dict:
    reply = await stack.nc.request("$SRV.STATS.scheduler", b"", timeout=5)
    return json.loads(reply.data)["endpoints"][0]["data"]


async def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not await condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        await asyncio.sleep(0.05)


async def read(client, index: int, chunks: dict) -> tuple[str, object, float]:
    """("done", its chunks' flags, when) or ("refused", the error, when) for one request."""
    request = make_request(list(range(10 + index % 7, 30 + index % 7)), request_id=f"load-{index}",
                           max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, num_speculative_tokens=2,
                           timeout_s=TIMEOUT_S)
    stream = await client.open_stream(request)
    try:
        async for chunk in stream:
            chunks.setdefault(index, []).append(chunk)
    except Overloaded as exc:
        return "refused", exc, time.monotonic()
    finally:
        await stream.close()
    return "done", chunks[index], time.monotonic()


async def test_admitted_requests_finish_through_a_slow_verifier_and_the_rest_are_refused_at_once(stack):
    verifier = stack.by_role("verifier")[0].instance_id
    before = await scheduler_stats(stack)
    chunks: dict[int, list] = {}
    async with stack.client(idle_timeout_s=IDLE_TIMEOUT_S) as client:
        tasks = [asyncio.create_task(read(client, i, chunks)) for i in range(NUM_REQUESTS)]

        async def all_in_and_streaming():
            stats = await scheduler_stats(stack)
            admitted = stats.get("admitted", 0) - before.get("admitted", 0)
            return admitted == MAX_RUNNING + MAX_QUEUE and stats["running"] == MAX_RUNNING and \
                sum(1 for got in chunks.values() if got) >= MAX_RUNNING

        await wait_until(all_in_and_streaming, "every admitted request in, the running ones streaming")
        stack.kill(verifier, signal.SIGSTOP)
        try:
            await asyncio.sleep(FREEZE_S)
        finally:
            stack.kill(verifier, signal.SIGCONT)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), timeout=TIMEOUT_S)
    after = await scheduler_stats(stack)

    done = [(flags, at) for kind, flags, at in outcomes if kind == "done"]
    refused = [(exc, at) for kind, exc, at in outcomes if kind == "refused"]
    assert len(done) == MAX_RUNNING + MAX_QUEUE and len(refused) == NUM_REQUESTS - len(done)
    assert all(exc.code == ErrorCode.overloaded for exc, _ in refused)
    assert max(at for _, at in refused) < min(at for _, at in done)  # refused at once, before any finished
    for got in (flags for flags, _ in done):
        assert sum(len(c.token_ids) for c in got) == MAX_TOKENS and got[-1].finish_reason == "length"
        assert not any(c.degraded for c in got), [c.degraded for c in got if c.degraded]  # no failover, no retry
    counts = {key: after.get(key, 0) - before.get(key, 0) for key in (
        "admitted", "refused_overloaded", "finished_length", "finished_timeout", "verify_failures",
        "verify_waits_past_timeout", "queue_seconds_count")}
    assert counts["admitted"] == counts["finished_length"] == len(done) == counts["queue_seconds_count"]
    assert counts["refused_overloaded"] == len(refused)  # each refused once: nothing came back after a failover
    assert counts["finished_timeout"] == 0 and counts["verify_failures"] == 0
    assert counts["verify_waits_past_timeout"] >= 1  # the freeze outlasted a try, and it was waited out
