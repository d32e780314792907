"""What keeps one sender's large messages from costing a service its connection: serve()'s own
connection and byte bound, and connect()'s own max_payload (a client user's account limit, which
the server enforces without announcing it). Against a real nats-server."""

import asyncio
import json
import urllib.request

import pytest
from structlog.testing import capture_logs

from services.launch.natsserver import NatsServer, NatsServerConfig
from services.runtime.auth import inbox_prefix
from services.runtime.bus import BusPayloadTooLarge, connect, publish, request, serve


@pytest.fixture
def monitored():
    with NatsServer(NatsServerConfig(http_port=0)) as server:
        yield server


def connection_names(server: NatsServer) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.monitoring_port}/connz", timeout=10) as reply:
        return sorted(c.get("name", "") for c in json.load(reply)["connections"] or [])


async def test_serve_reads_on_a_connection_of_its_own_and_closes_it_on_stop(monitored):
    nc = await connect(monitored.url, "svc", initial_connect_timeout_s=5.0, inbox_prefix=inbox_prefix("svc"))
    try:
        async def echo(msg):
            await nc.publish(msg.reply, b"echo:" + msg.data)  # replies on the service's own connection

        bounded = await serve(nc, "svc.echo", echo)
        assert (await request(nc, "svc.echo", b"x", timeout_s=10)).data == b"echo:x"
        assert connection_names(monitored) == ["svc", "svc.svc.echo"]
        await bounded.stop(timeout_s=5)
        for _ in range(600):  # the server notices the close a moment later
            if connection_names(monitored) == ["svc"]:
                break
            await asyncio.sleep(0.1)
        assert connection_names(monitored) == ["svc"]
    finally:
        await nc.close()


async def test_serve_refuses_past_its_byte_bound(nc):
    release = asyncio.Event()
    refused = []

    async def slow(msg):
        await release.wait()
        await msg.respond(b"ok")

    async def refuse(msg):
        refused.append(len(msg.data))
        await msg.respond(b"overloaded")

    bounded = await serve(nc, "svc.big", slow, max_concurrency=1, max_pending=64, on_overload=refuse,
                          max_pending_bytes=3 * 1024 * 1024)
    with capture_logs():
        pending = [asyncio.create_task(request(nc, "svc.big", bytes(1024 * 1024), timeout_s=30)) for _ in range(5)]
        async with asyncio.timeout(60):
            while len(refused) < 2:  # 1 MiB each: the first three fit in 3 MiB, the other two not
                await asyncio.sleep(0.01)
        release.set()
        replies = sorted(r.data for r in await asyncio.gather(*pending))
    await bounded.stop(timeout_s=5)
    assert replies == [b"ok"] * 3 + [b"overloaded"] * 2 and refused == [1024 * 1024] * 2
    assert bounded.pending_bytes == 0 and bounded.num_refused == 2


async def test_a_connections_own_max_payload_is_checked_before_sending(nats_server):
    nc = await connect(nats_server.url, "capped", initial_connect_timeout_s=5.0, max_payload=1000)
    try:
        assert nc.max_payload > 1000  # the server's, which is more than this connection may send
        with pytest.raises(BusPayloadTooLarge, match="max_payload of 1000"):
            await publish(nc, "anything", bytes(1001))
        await publish(nc, "anything", bytes(1000))
        await nc.flush(timeout=5)
        assert nc.is_connected
    finally:
        await nc.close()
