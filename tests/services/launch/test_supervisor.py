"""The supervisor of `specbus up` (services/launch/supervisor.py): its backoff and crash-loop rule, and
restarts of real service processes of a Stack (torch-free postprocessors: they start in seconds).

The full-stack kills (drafter, verifier, postprocessor under 8 streams, restarted by the
supervisor) are in tests/system/faults/test_faults.py."""

import asyncio
import dataclasses
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from schemas.config import TINY_TARGET
from services.launch.stack import Stack, StackConfig
from services.launch.supervisor import CrashLoop, RestartPolicy, RoleRestarts, supervise

FAST = RestartPolicy(first_delay_s=0.05, max_delay_s=0.2, stable_s=5.0, max_crashes=3, window_s=120.0, poll_s=0.02)


def exited(started_at: float, returncode: int = -9):
    return SimpleNamespace(role="drafter", instance_id="drafter-3", started_at=started_at, log_path=Path("x.log"),
                           process=SimpleNamespace(returncode=returncode), log_tail=lambda: "last words")


def test_the_delay_doubles_per_crash_up_to_its_cap_and_resets_after_a_stable_run():
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=3.0, stable_s=30.0, max_crashes=100, window_s=60.0)
    restarts = RoleRestarts()
    delays = [restarts.exited(exited(started_at=now - 1.0), now, policy) for now in range(1000, 1006)]
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert restarts.exited(exited(started_at=1000.0), 1040.0, policy) == 0.5  # ran 40 s: stable


def test_max_crashes_within_the_window_is_a_crash_loop_and_older_ones_are_forgotten():
    policy = RestartPolicy(max_crashes=3, window_s=60.0)
    restarts = RoleRestarts()
    restarts.exited(exited(0.0), 1.0, policy)
    restarts.exited(exited(0.0), 30.0, policy)
    restarts.exited(exited(0.0), 70.0, policy)  # the first is out of the window: 2 in it
    with pytest.raises(CrashLoop, match=r"(?s)drafter exited 3 times within 60 s \(the last, drafter-3, with code "
                                        r"-9\).*last words"):
        restarts.exited(exited(0.0), 71.0, policy)


def postprocessors(tmp_path, count=2) -> StackConfig:
    return StackConfig(schedulers=0, verifiers=0, drafters=0, postprocessors=count, ready_timeout_s=60,
                       target_model=str(TINY_TARGET), log_dir=tmp_path)


async def wait_until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s"
        await asyncio.sleep(0.05)


async def test_a_killed_process_is_replaced_by_a_new_instance_that_heartbeats(tmp_path):
    async with Stack(postprocessors(tmp_path)) as stack:
        stop = asyncio.Event()
        supervisor = asyncio.create_task(supervise(stack, stop, FAST))
        survivor = stack.processes["postprocessor-1"].process.pid
        killed_at = time.monotonic()
        stack.kill("postprocessor-0", signal.SIGKILL)
        await wait_until(lambda: stack.heartbeat_seen_at.get("postprocessor-2", 0.0) > killed_at)
        stop.set()
        assert await supervisor == ["postprocessor-2"]
        assert stack.processes["postprocessor-1"].process.pid == survivor  # nothing else was touched
        assert [p.instance_id for p in stack.processes.values() if p.running] == ["postprocessor-1", "postprocessor-2"]
    assert not any(p.running for p in stack.processes.values())  # Stack.stop after the supervisor: none restarted


async def test_a_role_that_keeps_dying_on_start_is_a_crash_loop(tmp_path):
    async with Stack(postprocessors(tmp_path, count=1)) as stack:
        stack.config.role_args["postprocessor"] = ["--heartbeat-interval-s", "often"]  # every restart exits 2
        stop = asyncio.Event()
        supervisor = asyncio.create_task(supervise(stack, stop, FAST))
        stack.kill("postprocessor-0", signal.SIGKILL)
        with pytest.raises(CrashLoop, match=r"(?s)postprocessor exited 3 times .*postprocessor-2, with code 2.*"
                                            r"heartbeat_interval_s"):
            await asyncio.wait_for(supervisor, timeout=120)


async def test_a_replaced_gateway_listens_on_the_dead_ones_port(tmp_path):
    """A client of the OpenAI API keeps its base URL (client.env's OPENAI_BASE_URL) across a restart."""
    config = dataclasses.replace(postprocessors(tmp_path, count=1), gateways=1)
    async with Stack(config) as stack:
        port = stack.gateway_ports["gateway-0"]
        stop = asyncio.Event()
        supervisor = asyncio.create_task(supervise(stack, stop, FAST))
        stack.kill("gateway-0", signal.SIGKILL)
        await wait_until(lambda: "gateway-1" in stack.processes)
        replacement = stack.processes["gateway-1"]
        deadline = time.monotonic() + 60
        while not await stack.is_ready(replacement):
            assert replacement.running and time.monotonic() < deadline, replacement.log_tail()
            await asyncio.sleep(0.1)
        stop.set()
        assert await supervisor == ["gateway-1"]
        assert stack.gateway_ports["gateway-1"] == port
