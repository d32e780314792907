"""Supervision of a service's long-lived tasks (step loops, heartbeats, idle eviction).

A loop that ends while its service is meant to run (it raised, or returned) must not leave a
process that looks alive, answers heartbeats or holds requests, and steps nothing: the service
stops and its process exits non-zero (the `TaskEnded` raised here reaches `asyncio.run`), so
whoever supervises processes (`specbus up`, compose, systemd) sees the crash and acts.
"""

import asyncio
import signal
from collections.abc import Awaitable, Iterable

import structlog

log = structlog.get_logger(__name__)


class TaskEnded(RuntimeError):
    """A supervised task ended before the service was told to stop."""


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
