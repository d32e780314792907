"""Shared fixtures: a real nats-server per test (own free port, own temp dir) and a client."""

import pytest

from services.bus import connect
from services.natsserver import NatsServer, NatsServerConfig


@pytest.fixture
def nats_server():
    """A fresh embedded nats-server (max_payload 8 MiB) on a port it picked itself."""
    with NatsServer(NatsServerConfig()) as server:
        yield server


@pytest.fixture
async def nc(nats_server):
    """A client connected to `nats_server`; reconnects quickly so restart tests stay short."""
    client = await connect(nats_server.url, "pytest", initial_connect_timeout_s=5.0, reconnect_time_wait_s=0.1)
    yield client
    await client.close()
