"""services/runtime/tasks.py: a service's loops are supervised (a dead lane left a
scheduler that exited 0, or one that looked alive and stepped nothing)."""

import asyncio

import pytest

from services.runtime.tasks import TaskEnded, run_until_stopped


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
