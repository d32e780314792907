"""Shared fixtures: a real nats-server per test (own free port, own temp dir) and a client; the
models tests run (TINY_PAIR, and the pulled SmolLM2 pair for `real_model` tests)."""

import asyncio
import os
from pathlib import Path

import pytest
import pytest_asyncio

from schemas.codec import decode
from schemas.config import DEFAULT_DRAFT, TINY_DRAFT, TINY_TARGET, default_target_model
from schemas.control import Heartbeat
from schemas.subjects import DEFAULT_CLIENT_USER, Subjects
from services.launch.natsserver import NatsServer, NatsServerConfig
from services.runtime.auth import inbox_prefix
from services.runtime.bus import connect


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


# Tests use the tiny pair (fast) and pass it explicitly: the services' default is SmolLM2. They run
# in float32 on every machine (dtype "auto" picks bf16 where the CPU has it), so their references
# hold; a test about another dtype passes it explicitly (a flag wins over SPECBUS_DTYPE).
TINY_PAIR = (TINY_TARGET, TINY_DRAFT)
os.environ.setdefault("SPECBUS_DTYPE", "float32")


@pytest.fixture(scope="session")
def smollm2_target() -> Path:
    """The pulled SmolLM2-135M-Instruct directory; skips the test when it is not pulled."""
    path = Path(default_target_model())
    if not (path / "config.json").exists():
        pytest.skip(f"SmolLM2 is not pulled into {path}: run `specbus models pull` (`make test` does)")
    return path


@pytest.fixture(scope="session")
def smollm2_draft() -> Path:
    """The shipped SmolLM2 draft (models/smollm2-draft); skips the test when it is missing."""
    if not (DEFAULT_DRAFT / "config.json").exists():
        pytest.skip(f"{DEFAULT_DRAFT} is missing (ops/distill_draft.py makes it)")
    return DEFAULT_DRAFT
