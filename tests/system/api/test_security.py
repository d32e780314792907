"""NATS auth end to end: the embedded stack with auth on (its default), every
service a process logged in as its role's user, tiny random checkpoints. Clients alice and bob.

services/runtime/auth.py's own tests check each permission against a bare nats-server; these check that
the real services work under them and that what a client is refused reaches it as an error.
"""

import asyncio
import json
import time

import pytest
import pytest_asyncio

from schemas.bus.codec import decode, encode
from schemas.errors import ErrorCode
from schemas.generation import CancelRequest
from schemas.bus.wire import Error
from services.runtime.auth import PermissionDenied
from services.runtime.bus import connect, permission_watch, request
from services.client import Client, RequestError, make_request

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [3, 14, 15, 9, 26, 5, 35, 8]
REFUSED_WITHIN_S = 2.0  # a refusal is one round trip; anything near a timeout is a hang


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(start_stack, model_dirs):
    role_args = {"scheduler": ["--draft-timeout-s", "5"], "verifier": ["--max-seq-len", "128"],
                 "drafter": ["--max-seq-len", "128"]}
    async with start_stack(model_dirs["target"], model_dirs["draft"], client_users=("alice", "bob"),
                           ready_timeout_s=90, role_args=role_args) as running:
        assert running.config.auth
        yield running


def greedy(max_tokens=8, **options):
    return make_request(PROMPT, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, num_speculative_tokens=2,
                        timeout_s=60, **options)


async def micro_stats(stack, role: str) -> dict:
    """The custom stats of the role's first endpoint, asked as the stack's "monitor" user."""
    reply = await request(stack.nc, f"$SRV.STATS.{role}", b"", timeout_s=5.0)
    return json.loads(reply.data)["endpoints"][0]["data"]


async def test_a_generation_works_with_every_service_under_its_own_user(stack):
    async with stack.client("alice") as alice:
        result = await alice.generate(greedy(logprobs=1))
    assert result.finish_reason == "length" and len(result.token_ids) == 8
    assert result.usage.draft_tokens_proposed > 0  # the drafter answered the scheduler
    assert None not in result.logprobs  # side records went verifier -> postprocessor
    assert result.degraded == []
    for role in ("drafter", "verifier", "postprocessor", "scheduler"):  # $SRV as the monitor user
        assert isinstance(await micro_stats(stack, role), dict)
    for process in stack.processes.values():
        assert "nats_permission_denied" not in process.log_tail(1_000_000), process.instance_id
    assert (stack.credentials_path.stat().st_mode & 0o777) == 0o600


async def test_the_stack_refuses_a_connection_without_a_password(stack):
    with pytest.raises(Exception, match="(?i)authorization"):
        async with Client(stack.url, connect_timeout_s=2.0):
            pass


async def test_a_client_publishing_to_a_verify_subject_gets_an_error_at_once(stack):
    before = await micro_stats(stack, "verifier")
    nc = await connect(stack.url, "alice-raw", **stack.client_login("alice"))
    try:
        started = time.monotonic()
        with pytest.raises(PermissionDenied, match="publish to 'specbus.verify.verifier-0'"):
            await request(nc, stack.subjects.verify("verifier-0"), b"\x80", timeout_s=30.0)
        assert time.monotonic() - started < REFUSED_WITHIN_S
        assert permission_watch(nc).counts[("publish", "specbus.verify.verifier-0")] == 1
    finally:
        await nc.close()
    after = await micro_stats(stack, "verifier")
    assert after["received"] == before["received"]  # nothing reached the verifier


async def test_a_client_using_a_subject_it_may_not_gets_a_forbidden_error_not_a_hang(stack):
    async with Client(stack.url, prefix="elsewhere", **stack.client_login("alice")) as alice:
        started = time.monotonic()
        with pytest.raises(RequestError, match="elsewhere.generate") as refused:
            await alice.generate(greedy())
    assert refused.value.code == ErrorCode.forbidden
    assert time.monotonic() - started < REFUSED_WITHIN_S


async def test_a_client_cannot_subscribe_to_another_clients_stream(stack):
    async with stack.client("bob") as bob, stack.client("alice") as alice:
        stream = await bob.open_stream(greedy(max_tokens=16))
        async with stream:
            bob_inbox = stream.subscription.subject
            assert bob_inbox.startswith("_INBOX.bob.")
            watch = permission_watch(alice.nc)
            for subject in (bob_inbox, "_INBOX.bob.>", "_INBOX.>"):
                subscription = await alice.nc.subscribe(subject)
                started = time.monotonic()
                with pytest.raises(PermissionDenied, match="subscribe to"):
                    await watch.guard(subscription.next_msg(timeout=30.0), subscribe=[subject])
                assert time.monotonic() - started < REFUSED_WITHIN_S
                assert subscription.pending_msgs == 0
            chunks = [chunk async for chunk in stream]
    assert chunks[-1].finish_reason == "length" and sum(len(c.token_ids) for c in chunks) == 16
    assert [chunk.seq for chunk in chunks] == list(range(len(chunks)))


async def poll_stats(stack, role: str, done, timeout_s: float = 60.0) -> dict:
    """The role's stats once done(stats) holds (AssertionError with the last ones after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while not done(stats := await micro_stats(stack, role)):
        assert time.monotonic() < deadline, f"{role} stats after {timeout_s} s: {stats}"
        await asyncio.sleep(0.05)
    return stats


@pytest.mark.parametrize("aim", ["a service", "another client's inbox"])
async def test_a_client_cannot_aim_a_stream_anywhere_but_its_own_inbox(stack, aim):
    """alice publishes a valid request whose reply subject is the verifier's subject or bob's
    inbox: the scheduler refuses it (counted), runs nothing and sends nothing there."""
    refused = "refused_generate_reply_not_own_inbox"
    before = await micro_stats(stack, "scheduler")
    bob = await connect(stack.url, "bob-raw", **stack.client_login("bob"))
    alice = await connect(stack.url, "alice-raw", **stack.client_login("alice"))
    try:
        bob_inbox = await bob.subscribe("_INBOX.bob.>")
        await bob.flush(timeout=5)
        reply = stack.subjects.verify("verifier-0") if aim == "a service" else "_INBOX.bob.redirected"
        await alice.publish(stack.subjects.generate_for("alice"), encode(greedy()), reply=reply)
        await alice.flush(timeout=5)
        after = await poll_stats(stack, "scheduler", lambda s: s.get(refused, 0) > before.get(refused, 0))
        # The scheduler handled it and answered nobody; give a stray chunk a round trip to show.
        await bob.flush(timeout=5)
        assert bob_inbox.pending_msgs == 0
    finally:
        await alice.close()
        await bob.close()
    assert after[refused] == before.get(refused, 0) + 1
    assert after["admitted"] == before.get("admitted", 0) and after["running"] == 0 and after["queued"] == 0


async def test_a_client_cannot_cancel_another_clients_request(stack):
    """alice learns the id of bob's running request and cancels it: refused with a typed error,
    counted, and bob's request runs to its end."""
    async with stack.client("bob") as bob:
        stream = await bob.open_stream(greedy(max_tokens=100))
        async with stream:
            chunks = [await anext(stream)]  # running now, and until 100 tokens are out
            alice = await connect(stack.url, "alice-raw", **stack.client_login("alice"))
            try:
                cancel = CancelRequest(request_id=stream.request.request_id)
                # as the client library sends it, then asking for the answer
                await alice.publish(stack.subjects.cancel_for("alice"), encode(cancel))
                reply = await request(alice, stack.subjects.cancel_for("alice"), encode(cancel), timeout_s=30.0)
                # nor may she use bob's own cancel subject
                with pytest.raises(PermissionDenied, match="publish to 'specbus.cancel.bob'"):
                    await request(alice, stack.subjects.cancel_for("bob"), encode(cancel), timeout_s=30.0)
            finally:
                await alice.close()
            chunks += [chunk async for chunk in stream]
    error = decode(reply.data, Error)
    assert (error.code, error.field) == (ErrorCode.forbidden, "request_id") and "another client user" in error.message
    assert chunks[-1].finish_reason == "length" and sum(len(c.token_ids) for c in chunks) == 100
    stats = await poll_stats(stack, "scheduler", lambda s: s.get("refused_cancel_not_owner", 0) >= 2)
    assert stats["refused_cancel_not_owner"] == 2 and stats.get("finished_cancelled", 0) == 0
