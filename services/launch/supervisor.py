"""Keep a Stack's services running, as a process manager would (`specbus up`).

    restarts = await supervise(stack, stop)   # until stop is set; CrashLoop when a role keeps dying

A service process that exits while the stack runs (a crash, an OOM kill, a SIGKILL, or a clean
exit nobody asked for) is replaced by a fresh process of the same role with a new instance id
(`drafter-0` -> `drafter-1`; a gateway keeps its HTTP port): the scheduler sees a new instance
appear by its heartbeat and the old one fall silent, which is exactly the fallback path of docs/OPERATIONS.md#guarantees
(resync from the history, migration, postprocessor replay). A new id, not the old one, so a
restarted instance is never mistaken for the one whose state died with it.

Restarts of a role wait `first_delay_s`, doubling per consecutive crash up to `max_delay_s`; a
process that ran `stable_s` before it exited resets its role's delay. `max_crashes` exits of one
role within `window_s` is a crash loop (a bad model dir, a port taken, a bug on start): restarting
cannot help, so `supervise` raises CrashLoop with the last process's log tail and `up` stops
everything and exits 1. Processes the caller stopped on purpose (Stack.stop) are not restarted:
supervise returns as soon as `stop` is set, before Stack.stop runs.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

import structlog

from services.launch.processes import ServiceProcess
from services.launch.stack import Stack

log = structlog.get_logger(__name__)


class CrashLoop(RuntimeError):
    """A role exited too often too fast; the message names it and ends with its last log."""


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 0.5
    max_delay_s: float = 30.0
    stable_s: float = 30.0  # ran this long: its exit starts the backoff afresh
    max_crashes: int = 5  # exits of one role within window_s that make a crash loop
    window_s: float = 60.0
    poll_s: float = 0.1  # how often exits are looked for (a restart is seconds of imports anyway)


@dataclass
class RoleRestarts:
    """One role's recent exits (time.monotonic()) and the delay before its next restart."""

    exits: deque = field(default_factory=deque)
    delay_s: float = 0.0

    def exited(self, proc: ServiceProcess, now: float, policy: RestartPolicy) -> float:
        """Record an exit; the seconds to wait before the replacement. CrashLoop when this
        exit makes max_crashes within window_s."""
        self.exits.append(now)
        while self.exits and self.exits[0] < now - policy.window_s:
            self.exits.popleft()
        if len(self.exits) >= policy.max_crashes:
            raise CrashLoop(f"{proc.role} exited {len(self.exits)} times within {policy.window_s:.0f} s (the last, "
                            f"{proc.instance_id}, with code {proc.process.returncode}); its log ({proc.log_path}) "
                            f"ends with:\n{proc.log_tail()}")
        stable = now - proc.started_at >= policy.stable_s
        self.delay_s = policy.first_delay_s if stable or not self.delay_s else min(2 * self.delay_s,
                                                                                  policy.max_delay_s)
        return self.delay_s


async def supervise(stack: Stack, stop: asyncio.Event, policy: RestartPolicy = RestartPolicy()) -> list[str]:
    """Restart every service process of `stack` that exits, until `stop` is set (then return
    the instance ids started as replacements, in order). CrashLoop: see the module docstring."""
    restarts: dict[str, RoleRestarts] = {}
    seen_exits = {p.process.pid for p in stack.processes.values() if not p.running}  # before we watched
    due: list[tuple[float, ServiceProcess]] = []  # (time.monotonic() to replace it, the dead process)
    started: list[str] = []
    while not stop.is_set():
        now = time.monotonic()
        for proc in list(stack.processes.values()):
            if proc.running or proc.process.pid in seen_exits:
                continue
            seen_exits.add(proc.process.pid)
            delay_s = restarts.setdefault(proc.role, RoleRestarts()).exited(proc, now, policy)
            due.append((now + delay_s, proc))
            log.warning("stack_process_exited", instance_id=proc.instance_id, returncode=proc.process.returncode,
                        ran_s=round(now - proc.started_at, 1), restart_in_s=delay_s)
        for entry in [entry for entry in due if entry[0] <= now]:
            due.remove(entry)
            replacement = await stack.spawn_replacement(entry[1])  # inline: a stop never leaves one unregistered
            started.append(replacement.instance_id)
            log.warning("stack_process_restarted", role=replacement.role, instance_id=replacement.instance_id,
                        replaces=entry[1].instance_id)
        try:
            await asyncio.wait_for(stop.wait(), timeout=policy.poll_s)
        except asyncio.TimeoutError:
            pass
    return started
