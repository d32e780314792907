"""services/runtime/tasks.py: a service's loops are supervised (a dead lane left a
scheduler that exited 0, or one that looked alive and stepped nothing), and every service runs
one lifecycle: entered, served until SIGINT/SIGTERM or a crashed task, exited."""

import asyncio
import os
import signal
import sys

import pytest

from schemas.config import TINY_DRAFT, TINY_TARGET
from services.runtime.tasks import TaskEnded, run_until_stopped, serve_until_stopped
from tests.conftest import wait_for_heartbeats


async def test_a_crashed_loop_ends_the_service_with_an_error():
    async def lane():
        await asyncio.sleep(0.01)
        raise ValueError("client_inbox too long")

    stop = asyncio.Event()
    healthy = asyncio.create_task(asyncio.sleep(3600), name="heartbeat")
    with pytest.raises(TaskEnded, match="lane-0.*client_inbox too long") as info:
        await run_until_stopped(stop, [asyncio.create_task(lane(), name="lane-0"), healthy])
    assert isinstance(info.value.__cause__, ValueError)
    healthy.cancel()


async def test_a_loop_that_returns_early_is_a_crash_too():
    async def lane():
        return None

    with pytest.raises(TaskEnded, match="lane-1"):
        await run_until_stopped(asyncio.Event(), [asyncio.create_task(lane(), name="lane-1")])


async def test_a_stop_returns_normally():
    stop = asyncio.Event()
    loop = asyncio.create_task(asyncio.sleep(3600))
    asyncio.get_running_loop().call_later(0.01, stop.set)
    await run_until_stopped(stop, [loop])
    assert not loop.done()
    loop.cancel()


class Service:
    """A service as serve_until_stopped takes one: an async context manager with tasks."""

    def __init__(self, events: list, loop=None):
        self.events, self.loop, self.tasks = events, loop, []

    async def __aenter__(self):
        self.events.append("enter")
        self.tasks = [asyncio.create_task(self.loop() if self.loop else asyncio.sleep(3600), name="loop")]
        return self

    async def __aexit__(self, *exc_info):
        self.events.append("exit")
        for task in self.tasks:
            task.cancel()


async def test_a_service_enters_serves_and_exits_once_on_a_stop():
    events, stop = [], asyncio.Event()
    asyncio.get_running_loop().call_later(0.01, stop.set)
    await serve_until_stopped(Service(events), stop)
    assert events == ["enter", "exit"]


async def test_a_crashed_task_exits_the_service_then_raises():
    async def loop():
        raise ValueError("lane broke")

    events = []
    with pytest.raises(TaskEnded, match="lane broke"):
        await serve_until_stopped(Service(events, loop), asyncio.Event())
    assert events == ["enter", "exit"]


async def test_sigterm_stops_a_service_without_a_stop_event():
    events = []
    asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(serve_until_stopped(Service(events)), timeout=60)
    assert events == ["enter", "exit"]
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().remove_signal_handler(sig)


async def test_every_role_serves_until_sigterm_then_drains_and_exits_0(nats_server, nc):
    """`specbus serve <role>` for each role, real processes: each heartbeats (the gateway
    answers /health), then SIGTERM stops each through the one lifecycle, exit status 0."""
    env = {**os.environ, "SPECBUS_TARGET_MODEL": str(TINY_TARGET), "SPECBUS_TOKENIZER": str(TINY_TARGET),
           "SPECBUS_DRAFT_MODEL": str(TINY_DRAFT), "SPECBUS_NATS_URL": nats_server.url}
    roles = ("scheduler", "verifier", "drafter", "postprocessor")
    processes = {role: await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "--log-json", "serve", role, "--instance-id", f"{role}-0",
        *(["--no-auth", "true", "--http-port", "0"] if role == "gateway" else []),
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE) for role in (*roles, "gateway")}
    try:
        await wait_for_heartbeats(nc, [f"{role}-0" for role in roles], timeout_s=240)
        gateway = processes["gateway"].stderr
        async with asyncio.timeout(240):
            while b"gateway_listening" not in await gateway.readline():
                pass
        for process in processes.values():
            process.send_signal(signal.SIGTERM)
        for role, process in processes.items():
            _, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
            assert process.returncode == 0, (role, stderr.decode()[-2000:])
            assert b'"event": "serve_stopped"' in stderr, role
    finally:
        for process in processes.values():
            if process.returncode is None:
                process.kill()
                await process.wait()
