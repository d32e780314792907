"""Supervision of a service's long-lived tasks (step loops, heartbeats, idle eviction), and the
one lifecycle every service (scheduler, verifier, drafter, postprocessor, gateway) runs:
`serve_until_stopped(service, stop)`. A service is an async context manager whose entry connects,
subscribes and starts its loops and yields what it runs (`.tasks`), and whose exit stops admitting,
drains and closes, in the reverse order of entry (an AsyncExitStack inside); it serves until `stop`
is set, by SIGINT or SIGTERM (`shutdown_event`) where the caller passes none.

A loop that ends while its service is meant to run (it raised, or returned) must not leave a
process that looks alive, answers heartbeats or holds requests, and steps nothing: the service
stops and its process exits non-zero (the `TaskEnded` raised here reaches `asyncio.run`), so
whoever supervises processes (`specbus up`, compose, systemd) sees the crash and acts.
"""

import asyncio
import signal
from collections.abc import Awaitable, Iterable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)


class TaskEnded(RuntimeError):
    """A supervised task ended before the service was told to stop."""


class Supervised(Protocol):
    """What a service's context yields: the tasks that must run while it serves."""
    tasks: list[asyncio.Task]


@dataclass
class Serving:
    """A Supervised for a service whose context holds no object of its own to yield."""
    tasks: list[asyncio.Task]


async def serve_until_stopped(service: AbstractAsyncContextManager[Supervised],
                              stop: asyncio.Event | None = None) -> None:
    """Enter service, serve until stop is set (None: SIGINT or SIGTERM) or one of its tasks ends
    (TaskEnded, after the exit has run), then exit it."""
    stop = shutdown_event() if stop is None else stop
    async with service as running:
        await run_until_stopped(stop, running.tasks)


async def run_until_stopped(stop: asyncio.Event, tasks: Iterable[asyncio.Task]) -> None:
    """Wait until `stop` is set. A task in `tasks` ending first is logged (with its bounded
    traceback) and raised as TaskEnded; the caller's cleanup then runs as on a stop."""
    stop_wait = asyncio.create_task(stop.wait(), name="stop-wait")
    try:
        done, _ = await asyncio.wait({stop_wait, *tasks}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop_wait.cancel()
    ended = [task for task in done if task is not stop_wait]
    if not ended or stop.is_set():
        return
    task = ended[0]
    error = None if task.cancelled() else task.exception()
    log.error("task_ended", task=task.get_name(), error=repr(error) if error else "returned",
              exc_info=error if error is not None else None)
    raise TaskEnded(f"task {task.get_name()} ended while the service was running: {error!r}") from error


def shutdown_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM (call inside the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def until_stopped(awaitable: Awaitable, stop: asyncio.Event) -> bool:
    """Await awaitable unless stop is set first (then cancel it); True when it finished."""
    task = asyncio.ensure_future(awaitable)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if task in done:
        task.result()  # re-raise its error
        return True
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return False
