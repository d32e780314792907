"""Service processes and readiness alone (services/launch/processes.py, services/launch/health.py),
with real child processes: what a process gets, how it is stopped, what a failed start says."""

import asyncio
import os
import signal
import sys
import time
from types import SimpleNamespace

import pytest

from schemas.bus.codec import encode
from schemas.bus.control import Heartbeat
from services.launch.health import HeartbeatWatch, wait_ready
from services.launch.processes import (PARENT_PID_ENV, StackError, start_service_process, stop_in_order,
                                       stop_service_process)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


async def test_a_process_logs_to_its_file_with_the_stack_env_and_its_own(tmp_path):
    code = f"import os; print(os.environ[{PARENT_PID_ENV!r}], os.environ['EXTRA'], os.environ['PYTHONUNBUFFERED'])"
    proc = await start_service_process("drafter", "drafter-0", python(code), {"EXTRA": "yes"}, tmp_path / "d.log")
    assert await asyncio.wait_for(proc.process.wait(), 60) == 0 and not proc.running
    assert proc.log_tail().split() == [str(os.getpid()), "yes", "1"] and proc.started_at <= time.monotonic()


async def test_stop_is_sigterm_then_sigkill(tmp_path):
    polite = await start_service_process("verifier", "verifier-0", python("import time; time.sleep(60)"), {},
                                         tmp_path / "v.log")
    await stop_service_process(polite, timeout_s=30)
    assert polite.process.returncode == -signal.SIGTERM
    code = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up'); time.sleep(60)"
    stubborn = await start_service_process("verifier", "verifier-1", python(code), {}, tmp_path / "s.log")
    while "up" not in stubborn.log_tail():  # its SIGTERM handler is in place
        await asyncio.sleep(0.01)
    await stop_service_process(stubborn, timeout_s=0.2)
    assert stubborn.process.returncode == -signal.SIGKILL
    await stop_service_process(stubborn, timeout_s=0.2)  # not running: nothing to do


async def test_stop_in_order_stops_upstream_first(tmp_path):
    order = tmp_path / "order"
    code = ("import signal, sys, time\n"
            "def bye(*_):\n    open(sys.argv[1], 'a').write(sys.argv[2] + '\\n'); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, bye); print('up', flush=True); time.sleep(60)")
    procs = [await start_service_process(role, f"{role}-0", python(code) + [str(order), role], {},
                                         tmp_path / f"{role}.log")
             for role in ("postprocessor", "verifier", "scheduler", "gateway")]
    for proc in procs:
        while "up" not in proc.log_tail():
            await asyncio.sleep(0.01)
    await stop_in_order(procs, timeout_s=30)
    assert order.read_text().split() == ["gateway", "scheduler", "verifier", "postprocessor"]


async def test_a_process_that_exits_while_starting_fails_with_its_log(tmp_path):
    proc = await start_service_process("scheduler", "scheduler-0", python("print('bad flag'); raise SystemExit(2)"),
                                       {}, tmp_path / "s.log")

    async def never(_):
        return False

    with pytest.raises(StackError, match=r"(?s)scheduler-0 exited with code 2 while starting.*bad flag"):
        await wait_ready([proc], never, timeout_s=60)


async def test_a_silent_process_fails_when_the_time_runs_out(tmp_path):
    proc = await start_service_process("drafter", "drafter-0", python("print('loading'); import time; time.sleep(60)"),
                                       {}, tmp_path / "d.log")
    try:
        async def never(_):
            return False

        with pytest.raises(StackError, match=r"(?s)no heartbeat from drafter-0 within 0 s.*"):
            await wait_ready([proc], never, timeout_s=0.1)
    finally:
        await stop_service_process(proc, timeout_s=30)


async def test_the_watch_keeps_the_last_beat_and_counts_bad_ones():
    watch = HeartbeatWatch()
    beat = Heartbeat(instance_id="drafter-0", role="drafter", capacity=4, load=0, sent_at=time.time(), interval_s=1.0)
    before = time.monotonic()
    await watch.on_heartbeat(SimpleNamespace(data=encode(beat)))
    await watch.on_heartbeat(SimpleNamespace(data=b"not msgpack"))
    assert watch.heartbeats["drafter-0"] == beat and watch.num_bad == 1
    assert watch.beat_since("drafter-0", before) and not watch.beat_since("drafter-0", time.monotonic() + 1)
    watch.forget("drafter-0")
    assert not watch.heartbeats and not watch.beat_since("drafter-0", before)
