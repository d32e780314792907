"""Bus helpers against a real nats-server: typed request errors, bounded handlers, micro
registration, heartbeats and the instance registry."""

import asyncio
import json
import time
from collections import Counter

import nats
import pytest
from structlog.testing import capture_logs

from schemas.bus.clock import MAX_CLOCK_SKEW_S
from schemas.bus.codec import decode, decode_any, encode
from schemas.config import BusConfig
from schemas.bus.control import Heartbeat
from schemas.errors import ErrorCode
from schemas.bus.wire import Error
from services.launch.natsserver import NatsServer, NatsServerConfig
from services.scheduler.placement import InstanceRegistry
from services.runtime.auth import PermissionDenied, generate_credentials, password_env, users_from_env
from services.runtime.bus import (
    BusDeadlineExpired,
    BusError,
    BusNoResponders,
    BusPayloadTooLarge,
    BusTimeout,
    BusClient,
    BusUnavailable,
    Endpoint,
    add_micro_service,
    connect,
    connect_service,
    expired,
    heartbeat_loop,
    payload_limit,
    permission_watch,
    publish,
    request,
    respond,
    serve,
    tls_context,
)
from tests.services.launch.test_natsserver import self_signed_cert


async def collect(nc, subject):
    """Subscribe and return the list every message's data lands in."""
    seen = []

    async def on_msg(msg):
        seen.append(msg.data)

    await nc.subscribe(subject, cb=on_msg)
    await nc.flush(timeout=2)
    return seen


async def echo(msg):
    await msg.respond(b"echo:" + msg.data)


async def test_request_round_trip(nc):
    await serve(nc, "svc.echo", echo)
    reply = await request(nc, "svc.echo", b"hi", timeout_s=2)
    assert reply.data == b"echo:hi"


async def test_request_deadline_hits_a_real_timeout(nc):
    silent = await collect(nc, "svc.silent")  # subscribed, never answers
    started = time.monotonic()
    with pytest.raises(BusTimeout, match="svc.silent"):
        await request(nc, "svc.silent", b"x", timeout_s=30, deadline=time.time() + 0.3)
    elapsed = time.monotonic() - started
    assert 0.25 <= elapsed < 2.0
    assert silent == [b"x"]


async def test_request_timeout_shorter_than_deadline_wins(nc):
    await collect(nc, "svc.silent")
    started = time.monotonic()
    with pytest.raises(BusTimeout):
        await request(nc, "svc.silent", b"x", timeout_s=0.2, deadline=time.time() + 30)
    assert time.monotonic() - started < 2.0


async def test_no_responders(nc):
    started = time.monotonic()
    with pytest.raises(BusNoResponders, match="nobody.home"):
        await request(nc, "nobody.home", b"x", timeout_s=5)
    assert time.monotonic() - started < 1.0


def test_a_deadline_set_elsewhere_is_expired_only_past_the_clock_skew():
    """A receiver whose clock runs MAX_CLOCK_SKEW_S ahead of the sender's still takes the work;
    past that, it refuses it, naming the deadline."""
    deadline = 1000.0
    assert expired(deadline, now=deadline + MAX_CLOCK_SKEW_S - 0.001, skew_s=MAX_CLOCK_SKEW_S) is None
    late = expired(deadline, now=deadline + MAX_CLOCK_SKEW_S + 1.0, skew_s=MAX_CLOCK_SKEW_S)
    assert late.code == ErrorCode.timeout and late.field == "deadline"
    assert expired(deadline, now=deadline + 0.001).field == "deadline"  # its own deadline: no allowance


async def test_expired_deadline_is_not_sent(nc):
    seen = await collect(nc, "svc.late")
    with pytest.raises(BusDeadlineExpired, match="not sent"):
        await request(nc, "svc.late", b"x", deadline=time.time() - 0.01)
    await nc.publish("svc.late", b"marker")
    await nc.flush(timeout=2)
    await asyncio.sleep(0.05)
    assert seen == [b"marker"]


async def test_request_without_any_timeout_is_refused(nc):
    with pytest.raises(ValueError, match="timeout_s or deadline"):
        await request(nc, "svc.echo", b"x")


async def test_payload_too_large_is_refused_before_sending(nc):
    seen = await collect(nc, "svc.big")
    too_big = b"\0" * (nc.max_payload + 1)
    with pytest.raises(BusPayloadTooLarge, match="max_payload"):
        await request(nc, "svc.big", too_big, timeout_s=2)
    with pytest.raises(BusPayloadTooLarge, match="max_payload"):
        await publish(nc, "svc.big", too_big)
    fits_without_headers = b"\0" * (nc.max_payload - 10)
    with pytest.raises(BusPayloadTooLarge, match="max_payload"):
        await publish(nc, "svc.big", fits_without_headers, headers={"request-id": "r1"})
    await publish(nc, "svc.big", b"marker")
    await nc.flush(timeout=2)
    await asyncio.sleep(0.05)
    assert seen == [b"marker"]
    assert nc.is_connected  # the server never saw an oversized message, so it kept us


def test_bus_errors_carry_wire_codes():
    codes = {cls: cls("m").code.value for cls in (BusTimeout, BusNoResponders, BusPayloadTooLarge, BusDeadlineExpired)}
    assert codes == {
        BusTimeout: "timeout",
        BusNoResponders: "unavailable",
        BusPayloadTooLarge: "too_large",
        BusDeadlineExpired: "timeout",
    }
    assert all(issubclass(cls, BusError) for cls in codes)


async def test_connect_to_nothing_fails_within_its_timeout():
    server = NatsServer().start()
    url = server.url
    server.stop()  # a port nobody listens on any more
    started = time.monotonic()
    with pytest.raises(BusUnavailable, match="cannot connect"):
        await connect(url, "pytest", initial_connect_timeout_s=0.5, reconnect_time_wait_s=0.05)
    assert time.monotonic() - started < 3.0


async def test_the_connection_carries_its_cap_its_watch_and_its_siblings(nats_server):
    nc = await connect(nats_server.url, "pytest-capped", max_payload=1000, initial_connect_timeout_s=5.0)
    bounded = await serve(nc, "svc.own", lambda msg: msg.respond(b"ok"))
    try:
        assert isinstance(nc, BusClient) and payload_limit(nc) == 1000 and permission_watch(nc) is nc.permissions
        sibling = bounded.connection  # the subscription's own connection, with nc's settings
        assert isinstance(sibling, BusClient) and sibling is not nc
        assert sibling.options["name"] == "pytest-capped.svc.own"
        assert payload_limit(sibling) == 1000 and sibling.permissions is not nc.permissions
        assert (await request(nc, "svc.own", b"", timeout_s=5)).data == b"ok"
    finally:
        await bounded.stop()
        await nc.close()
    assert sibling.is_closed  # stop() closes the subscription's connection


async def test_a_plain_nats_client_works_uncapped_unwatched_and_without_siblings(nats_server):
    plain = await nats.connect(nats_server.url)
    bounded = await serve(plain, "svc.plain", lambda msg: msg.respond(b"ok"))
    try:
        assert payload_limit(plain) == plain.max_payload and bounded.connection is None
        assert permission_watch(plain).counts == {}
        assert (await request(plain, "svc.plain", b"", timeout_s=5)).data == b"ok"
    finally:
        await bounded.stop()
        await plain.close()


async def test_serve_runs_handlers_concurrently(nc):
    num_running = 0
    all_arrived = asyncio.Event()

    async def handler(msg):
        nonlocal num_running
        num_running += 1
        if num_running == 4:
            all_arrived.set()
        # Serialized handling would deadlock here: only concurrent handlers reach 4.
        await asyncio.wait_for(all_arrived.wait(), timeout=5)
        await msg.respond(b"ok")

    bounded = await serve(nc, "svc.slow", handler, max_concurrency=4, max_pending=4)
    replies = await asyncio.gather(*(request(nc, "svc.slow", b"", timeout_s=5) for _ in range(4)))
    assert [r.data for r in replies] == [b"ok"] * 4
    assert bounded.stats()["completed"] == 4


async def test_serve_refuses_beyond_max_pending(nc):
    release = asyncio.Event()

    async def handler(msg):
        await asyncio.wait_for(release.wait(), timeout=5)
        await msg.respond(b"ok")

    async def refuse(msg):
        await msg.respond(b"overloaded")

    bounded = await serve(nc, "svc.busy", handler, max_concurrency=1, max_pending=2, on_overload=refuse)
    with capture_logs() as logs:
        pending = [asyncio.create_task(request(nc, "svc.busy", bytes([i]), timeout_s=5)) for i in range(5)]
        while bounded.num_refused < 3:
            await asyncio.sleep(0.01)
        release.set()
        replies = [r.data for r in await asyncio.gather(*pending)]
    await bounded.stop(timeout_s=5)
    assert sorted(replies) == [b"ok"] * 2 + [b"overloaded"] * 3
    stats = bounded.stats()
    assert stats == {"received": 5, "completed": 2, "failed": 0, "refused": 3, "cancelled": 0, "in_flight": 0}
    assert [e["event"] for e in logs].count("handler_overloaded") == 3


async def test_handler_exception_is_logged_counted_and_survived(nc):
    async def handler(msg):
        if msg.data == b"boom":
            raise RuntimeError("handler bug")
        await msg.respond(b"fine")

    bounded = await serve(nc, "svc.flaky", handler)
    with capture_logs() as logs:
        with pytest.raises(BusTimeout):
            await request(nc, "svc.flaky", b"boom", timeout_s=0.3)
        for _ in range(600):  # the failure is counted by progress, not by the request's short timeout
            if bounded.num_failed:
                break
            await asyncio.sleep(0.05)
    assert (await request(nc, "svc.flaky", b"next", timeout_s=30)).data == b"fine"
    assert bounded.num_failed == 1
    failure = next(e for e in logs if e["event"] == "handler_failed")
    assert failure["log_level"] == "error" and failure["exc_info"] is True


async def test_stop_drains_in_flight_handlers(nc):
    started = asyncio.Event()
    finished = []

    async def handler(msg):
        started.set()
        await asyncio.sleep(0.2)
        finished.append(msg.data)

    bounded = await serve(nc, "svc.drain", handler)
    await nc.publish("svc.drain", b"in flight")
    await asyncio.wait_for(started.wait(), timeout=2)
    await bounded.stop(timeout_s=5)
    await bounded.stop(timeout_s=5)
    assert finished == [b"in flight"]
    with pytest.raises(BusNoResponders):
        await request(nc, "svc.drain", b"after stop", timeout_s=1)


async def test_micro_service_answers_srv_ping_info_stats(nc):
    async def handler(req):
        await req.respond(b"pong:" + req.data)

    service = await add_micro_service(
        nc,
        "specbus-test",
        "0.1.0",
        "test service",
        endpoints={"echo": Endpoint(subject="svc.micro.echo", handler=handler)},
        metadata={"worker_id": "w1"},
        stats_data=lambda endpoint_stats: {"queue_depth": 0},
    )
    ping = json.loads((await request(nc, "$SRV.PING.specbus-test", b"", timeout_s=2)).data)
    assert (ping["name"], ping["version"], ping["metadata"]) == ("specbus-test", "0.1.0", {"worker_id": "w1"})
    assert (await request(nc, "svc.micro.echo", b"x", timeout_s=2)).data == b"pong:x"
    info = json.loads((await request(nc, f"$SRV.INFO.specbus-test.{service.id}", b"", timeout_s=2)).data)
    assert [e["subject"] for e in info["endpoints"]] == ["svc.micro.echo"]
    stats = json.loads((await request(nc, "$SRV.STATS.specbus-test", b"", timeout_s=2)).data)
    assert stats["endpoints"][0]["num_requests"] == 1
    assert stats["endpoints"][0]["data"] == {"queue_depth": 0}
    await service.stop()
    with pytest.raises(BusNoResponders):
        await request(nc, "$SRV.PING.specbus-test", b"", timeout_s=1)


async def test_micro_service_name_is_checked(nc):
    with pytest.raises(ValueError, match="Invalid name"):
        await add_micro_service(nc, "bad name!", "0.1.0")


async def test_heartbeat_registry_marks_a_stopped_instance_dead(nc):
    died = []
    registry = InstanceRegistry(timeout_s=0.3, on_dead=died.append)

    async def on_heartbeat(msg):
        beat = decode(msg.data, Heartbeat)
        registry.observe(beat.instance_id, beat, role=beat.role)

    def beat_of(instance_id, role):
        return lambda: encode(
            Heartbeat(instance_id=instance_id, role=role, capacity=8, load=0, sent_at=time.time(), interval_s=0.05)
        )

    await nc.subscribe("specbus.heartbeat", cb=on_heartbeat)
    await nc.flush(timeout=2)
    beats = {
        instance_id: asyncio.create_task(heartbeat_loop(nc, "specbus.heartbeat", beat_of(instance_id, role), 0.05))
        for instance_id, role in (("d1", "drafter"), ("v1", "verifier"))
    }

    async def until(condition):
        while not condition():
            registry.reap()
            await asyncio.sleep(0.02)

    await asyncio.wait_for(until(lambda: len(registry.alive()) == 2), timeout=5)
    assert [i.instance_id for i in registry.alive(role="verifier")] == ["v1"]
    assert registry.alive(role="verifier")[0].info.capacity == 8
    beats["v1"].cancel()
    await asyncio.wait_for(until(lambda: died), timeout=5)
    assert [i.instance_id for i in died] == ["v1"]
    assert not registry.is_alive("v1")
    assert [i.instance_id for i in registry.alive()] == ["d1"]
    beats["d1"].cancel()


async def test_closed_connection_is_unavailable(nats_server):
    client = await connect(nats_server.url, "pytest", initial_connect_timeout_s=5.0)
    await client.close()
    with pytest.raises(BusUnavailable, match="ConnectionClosedError"):
        await publish(client, "svc.any", b"x")
    with pytest.raises(BusUnavailable, match="ConnectionClosedError"):
        await request(client, "svc.any", b"x", timeout_s=1)


async def test_respond_replaces_an_oversized_reply_and_counts_what_cannot_go_out(nc):
    counters = Counter()

    async def answer(msg):
        await respond(nc, msg, b"x" * (nc.max_payload + 1), counters)

    await nc.subscribe("svc.big", cb=answer)
    reply = decode_any((await request(nc, "svc.big", b"q", timeout_s=5.0)).data)
    assert isinstance(reply, Error) and reply.code == ErrorCode.too_large
    done = asyncio.Event()

    async def answer_unanswerable(msg):
        await respond(nc, msg, b"ok", counters)
        done.set()

    await nc.subscribe("svc.fire-and-forget", cb=answer_unanswerable)
    await nc.publish("svc.fire-and-forget", b"no reply subject")
    await asyncio.wait_for(done.wait(), timeout=5)
    assert counters == {"reply_too_large": 1, "reply_failed": 1}


def test_no_tls_files_means_no_tls():
    assert tls_context() is None and tls_context(None, "", None) is None


async def test_connect_service_logs_in_as_the_configs_user_over_tls(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    credentials = generate_credentials(["client"])
    users = tuple(users_from_env(credentials))
    async with NatsServer(NatsServerConfig(users=users, tls_cert=cert, tls_key=key)) as server:
        config = BusConfig(nats_url=server.url, nats_user="drafter", nats_password=credentials[password_env("drafter")],
                           tls_ca=str(cert), connect_timeout_s=2.0)
        nc = await connect_service(config, "pytest-drafter", initial_connect_timeout_s=5.0)
        try:
            assert nc.new_inbox().startswith("_INBOX.drafter.")  # the only inbox its user may read
            started = time.monotonic()
            with pytest.raises(PermissionDenied, match="publish to 'specbus.verify.v0'"):
                await request(nc, "specbus.verify.v0", b"x", timeout_s=30.0)
            assert time.monotonic() - started < 2.0  # refused at once, not timed out
            assert permission_watch(nc).counts == {("publish", "specbus.verify.v0"): 1}
        finally:
            await nc.close()
        with pytest.raises(BusUnavailable, match="(?i)authorization"):
            await connect_service(BusConfig(nats_url=server.url, nats_user="drafter", nats_password="Wrong-password-1",
                                            tls_ca=str(cert)), "pytest-wrong", initial_connect_timeout_s=2.0)
