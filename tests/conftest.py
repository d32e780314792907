"""Shared fixtures: a real nats-server per test (own free port, own temp dir) and a client."""

import asyncio

import pytest
import pytest_asyncio

from schemas.codec import decode
from schemas.messages import Heartbeat
from schemas.subjects import DEFAULT_CLIENT_USER, Subjects
from services.auth import inbox_prefix
from services.bus import connect
from services.natsserver import NatsServer, NatsServerConfig


@pytest.fixture
def nats_server():
    """A fresh embedded nats-server (max_payload 8 MiB) on a port it picked itself."""
    with NatsServer(NatsServerConfig()) as server:
        yield server


@pytest.fixture
async def nc(nats_server):
    """A client connected to `nats_server` with the default client user's inbox prefix, as a
    Client without a login has; reconnects quickly so restart tests stay short."""
    client = await connect(nats_server.url, "pytest", initial_connect_timeout_s=5.0, reconnect_time_wait_s=0.1,
                           inbox_prefix=inbox_prefix(DEFAULT_CLIENT_USER))  # a scheduler answers only there
    yield client
    await client.close()


async def wait_for_heartbeats(nc, instance_ids, timeout_s: float = 60.0) -> None:
    """Until each of instance_ids has published a heartbeat (default subject prefix)."""
    seen: set[str] = set()
    beats = await nc.subscribe(Subjects().heartbeat)
    try:
        async with asyncio.timeout(timeout_s):
            while not set(instance_ids) <= seen:
                seen.add(decode((await beats.next_msg(timeout=timeout_s)).data, Heartbeat).instance_id)
    finally:
        await beats.unsubscribe()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(stack):
    """A Client logged in to the module's own `stack` fixture (each stack module defines one)."""
    async with stack.client() as connected:
        yield connected
