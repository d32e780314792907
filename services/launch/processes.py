"""A stack's service processes: start one with its own log file and environment, stop one
(SIGTERM, stop_timeout_s to exit by itself, then SIGKILL), stop them all upstream first
(STOP_ORDER), and build the CPU projection kernel before the model services start.

Knows nothing of NATS, credentials or ports: the Stack (services/launch/stack.py) gives each
process its argv and environment, and keeps the processes by instance id.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog

from gpu_worker.runtime import linear_kernel
from services.launch.natsserver import STDERR_TAIL_CHARS

log = structlog.get_logger(__name__)

# Set for every service: `specbus serve` stops by itself once that process is gone (a stack
# killed with SIGKILL cannot stop its children).
PARENT_PID_ENV = "SPECBUS_PARENT_PID"
# Role groups in stop order, upstream first: no new requests (gateways), then the schedulers
# finish their step in flight against live drafters and verifiers and send every final commit to
# a live postprocessor, which stops last.
STOP_ORDER = (("gateway",), ("scheduler",), ("drafter", "verifier"), ("postprocessor",))


class HostPlacement(Protocol):
    """Where a stack's processes run (ops/faults/netns.py: each in a network namespace of its own)."""

    def nats_nodes(self, size: int) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """Each NATS node's (host it listens on, argv prefix that runs it there)."""

    def exec_prefix(self, role: str, instance_id: str) -> tuple[str, ...]:
        """The argv prefix that runs one service instance where it belongs (it must exec, so
        the process's pid stays the service's)."""


class StackError(RuntimeError):
    """A service process died or stayed silent while the stack was starting."""


@dataclass
class ServiceProcess:
    role: str
    instance_id: str
    process: asyncio.subprocess.Process
    log_path: Path
    started_at: float  # time.monotonic()

    @property
    def running(self) -> bool:
        return self.process.returncode is None

    def log_tail(self, chars: int = STDERR_TAIL_CHARS) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return text if len(text) <= chars else text[-chars:].split("\n", 1)[-1]  # from a line start


async def start_service_process(role: str, instance_id: str, argv: list[str], env: Mapping[str, str],
                                log_path: Path) -> ServiceProcess:
    """Start argv with stdout and stderr appended to log_path, in a session of its own (Ctrl-C in
    a terminal reaches the stack only; it stops the children), with this process's environment,
    PYTHONUNBUFFERED, PARENT_PID_ENV and then env (which wins); does not wait for it."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_PID_ENV: str(os.getpid()), **env}
    with log_path.open("ab") as log_file:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=asyncio.subprocess.STDOUT, env=full_env,
            start_new_session=True,
        )
    return ServiceProcess(role, instance_id, process, log_path, time.monotonic())


async def stop_service_process(proc: ServiceProcess, timeout_s: float) -> None:
    """SIGTERM, up to timeout_s to exit, then SIGKILL (and up to timeout_s more); nothing when it
    is not running."""
    if not proc.running:
        return
    proc.process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.process.wait(), timeout=timeout_s)
    except asyncio.TimeoutError:
        log.warning("stack_process_killed", instance_id=proc.instance_id, after_s=timeout_s)
        proc.process.kill()
        await asyncio.wait_for(proc.process.wait(), timeout=timeout_s)
    log.info("stack_process_stopped", instance_id=proc.instance_id, returncode=proc.process.returncode)


async def stop_in_order(processes: Iterable[ServiceProcess], timeout_s: float) -> None:
    """Stop every process, one STOP_ORDER group at a time, each group's processes together."""
    processes = list(processes)
    for roles in STOP_ORDER:
        await asyncio.gather(*(stop_service_process(p, timeout_s) for p in processes if p.role in roles))


def free_port(taken: frozenset[int] | set[int] = frozenset()) -> int:
    """A TCP port free on loopback now (the OS picks it), none of `taken`: the ports handed out
    before and not bound yet, which the OS may pick again once their probe is closed."""
    for _ in range(64):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in taken:
            return port
    raise StackError(f"no free loopback port outside the {len(taken)} handed out")


async def build_linear_kernel() -> None:
    """Build the CPU projection kernel (gpu_worker/runtime/linear_kernel.py) before the model services
    start, once per checkout, so no verifier or drafter spends its ready_timeout_s compiling it.
    A build that fails or runs past BUILD_TIMEOUT_S is logged; the services then use oneDNN."""
    if linear_kernel.built() or linear_kernel.turned_off():
        return
    log.info("linear_kernel_building", path=str(linear_kernel.build_dir()))
    process = await asyncio.create_subprocess_exec(sys.executable, "-m", "gpu_worker.runtime.linear_kernel",
                                                   stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        _, stderr = await asyncio.wait_for(process.communicate(), linear_kernel.BUILD_TIMEOUT_S)
    except asyncio.TimeoutError:
        process.kill()
        await process.wait()
        stderr = b"timed out"
    if not linear_kernel.built():
        log.warning("linear_kernel_unavailable", stderr=stderr.decode(errors="replace")[-STDERR_TAIL_CHARS:])
