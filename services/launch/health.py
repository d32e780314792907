"""Waiting for a stack's services: the heartbeats it has seen, and readiness.

A service is ready once it has heartbeated since its process started (`HeartbeatWatch`, fed by
the stack's subscription to `<prefix>.heartbeat`); a gateway, a client with no heartbeat of its
own, once it accepts HTTP connections (`accepts_http`). `wait_ready` waits for a list of
processes and fails with StackError and the log tail of the first that exits first or is still
not ready when the time runs out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from schemas.bus.codec import decode_heartbeat
from schemas.bus.control import Heartbeat
from schemas.errors import SpecbusError
from services.launch.processes import ServiceProcess, StackError

log = structlog.get_logger(__name__)

READY_POLL_S = 0.05  # how often wait_ready looks


@dataclass
class HeartbeatWatch:
    """The last heartbeat of each instance id and when it came (time.monotonic())."""

    heartbeats: dict[str, Heartbeat] = field(default_factory=dict)
    seen_at: dict[str, float] = field(default_factory=dict)
    num_bad: int = 0

    async def on_heartbeat(self, msg) -> None:
        """The subscription callback: a beat that does not decode is counted and logged."""
        try:
            beat = decode_heartbeat(msg.data)
        except SpecbusError as exc:
            self.num_bad += 1
            log.warning("stack_bad_heartbeat", error=str(exc), count=self.num_bad)
            return
        if beat is None:  # the beat's copy for other versions
            return
        self.heartbeats[beat.instance_id] = beat
        self.seen_at[beat.instance_id] = time.monotonic()

    def forget(self, instance_id: str) -> None:
        """A new process takes this id: what the old one sent says nothing about it."""
        self.heartbeats.pop(instance_id, None)
        self.seen_at.pop(instance_id, None)

    def beat_since(self, instance_id: str, since: float) -> bool:
        """The instance heartbeated at or after `since` (time.monotonic())."""
        return self.seen_at.get(instance_id, -1.0) >= since


async def accepts_http(port: int) -> bool:
    """Something accepts TCP connections on 127.0.0.1:port (a gateway, once its NATS connections are up)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout=1.0)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


async def wait_ready(started: list[ServiceProcess], is_ready: Callable[[ServiceProcess], Awaitable[bool]],
                     timeout_s: float) -> None:
    """Until is_ready(p) for each process; StackError with its log tail when one exits first or
    the time runs out."""
    deadline = time.monotonic() + timeout_s
    waiting = list(started)
    while waiting:
        for proc in waiting:
            if not proc.running:
                raise StackError(f"{proc.instance_id} exited with code {proc.process.returncode} while "
                                 f"starting; its log ({proc.log_path}) ends with:\n{proc.log_tail()}")
        waiting = [p for p in waiting if not await is_ready(p)]
        if waiting and time.monotonic() > deadline:
            silent = waiting[0]
            raise StackError(f"no heartbeat from {', '.join(p.instance_id for p in waiting)} within "
                             f"{timeout_s:.0f} s; the log of {silent.instance_id} ({silent.log_path}) "
                             f"ends with:\n{silent.log_tail()}")
        await asyncio.sleep(READY_POLL_S)
    log.info("stack_ready", instances=sorted(p.instance_id for p in started))
