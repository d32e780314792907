"""The `specbus` CLI as a user runs it: separate processes, real server, real signals."""

import asyncio
import signal
import subprocess
import sys

from services.bus import connect


def specbus(*args):
    return [sys.executable, "-m", "services.cli", *args]


def test_demo_round_trips_a_message_and_stops_the_server():
    done = subprocess.run(specbus("demo"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "round-tripped a GenerateRequest" in done.stdout and "identical" in done.stdout
    assert "$SRV.PING.specbus-demo answered" in done.stdout
    assert done.stdout.rstrip().endswith("stopped nats-server")


async def test_nats_command_serves_until_sigterm():
    process = await asyncio.create_subprocess_exec(
        *specbus("--log-json", "nats", "--port", "0"), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        url = (await asyncio.wait_for(process.stdout.readline(), timeout=30)).decode().strip()
        assert url.startswith("nats://127.0.0.1:")
        nc = await connect(url, "pytest", initial_connect_timeout_s=5.0)
        assert nc.is_connected
        await nc.close()
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), timeout=30) == 0
        assert b'"event": "nats_server_stopped"' in await process.stderr.read()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
