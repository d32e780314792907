"""NATS users and subject permissions (services/runtime/auth.py) against the real nats-server binary.

The expected permissions below are written out from the subject table (docs/PROTOCOL.md#subjects),
not derived from auth.role_permissions, so a wrong permission fails a test.
"""

import asyncio
import json
import os
import stat
import subprocess
import time
from pathlib import Path

import nats
import pytest

from schemas.bus.codec import decode, encode
from schemas.errors import SpecbusError
from schemas.streams import StreamChunk
from services.launch.natsserver import NatsServer, NatsServerConfig, find_nats_server_binary
from services.runtime.auth import (
    CLIENTS_ACCOUNT,
    SERVICES_ACCOUNT,
    AuthConfigError,
    NatsUser,
    PermissionDenied,
    PermissionWatch,
    env_file_text,
    env_password_users,
    generate_credentials,
    inbox_prefix,
    main,
    nats_user,
    password_env,
    read_env_file,
    render_server_config,
    users_from_env,
    write_secret,
)
from services.runtime.bus import Endpoint, add_micro_service, connect, request

REPO = Path(__file__).resolve().parents[3]
SETTLE_S = 0.3  # after a barrier: time for deliveries to other connections and -ERR replies
CLIENTS = ("alice", "bob")

# Concrete subjects of every kind (prefix "specbus"); ids d0, v0, pp0, s0.
PUBLISH_UNIVERSE = {
    "specbus.generate", "specbus.cancel", "specbus.generate.alice", "specbus.cancel.alice", "specbus.generate.bob",
    "specbus.cancel.bob", "specbus.draft.d0", "specbus.verify.v0", "specbus.post.pp0.commit",
    "specbus.post.pp0.side", "specbus.stop.s0", "specbus.heartbeat", "_INBOX.alice.x", "$SRV.PING.drafter",
}
MAY_PUBLISH = {
    "alice": {"specbus.generate.alice", "specbus.cancel.alice"},  # its own name only: who sent it
    "scheduler": {"specbus.draft.d0", "specbus.verify.v0", "specbus.post.pp0.commit", "specbus.heartbeat",
                  "_INBOX.alice.x"},
    "drafter": {"specbus.heartbeat"},
    "verifier": {"specbus.post.pp0.side", "specbus.heartbeat"},
    "postprocessor": {"_INBOX.alice.x", "specbus.stop.s0", "specbus.heartbeat"},
    "monitor": {"$SRV.PING.drafter"},
}
# (subject, queue group); "OWN" stands for the user's own inbox, "OTHER" for another user's.
SUBSCRIBE_UNIVERSE = {
    ("specbus.generate.alice", ""), ("specbus.generate.alice", "schedulers"), ("specbus.cancel.alice", ""),
    ("specbus.draft.d0", ""),
    ("specbus.verify.v0", ""), ("specbus.post.pp0.commit", ""), ("specbus.post.pp0.side", ""),
    ("specbus.stop.s0", ""), ("specbus.heartbeat", ""), ("OWN", ""), ("OTHER", ""), ("$SRV.PING", ""),
    ("$SRV.PING.drafter", ""),
}
MICRO = {("$SRV.PING", "")}
MAY_SUBSCRIBE = {
    "alice": {("specbus.heartbeat", ""), ("OWN", "")},  # heartbeats: scheduler failover
    "scheduler": {("specbus.generate.alice", "schedulers"), ("specbus.cancel.alice", ""), ("specbus.stop.s0", ""),
                  ("specbus.heartbeat", ""), ("OWN", ""), *MICRO},
    "drafter": {("specbus.draft.d0", ""), ("OWN", ""), ("$SRV.PING.drafter", ""), *MICRO},
    "verifier": {("specbus.verify.v0", ""), ("OWN", ""), *MICRO},
    "postprocessor": {("specbus.post.pp0.commit", ""), ("specbus.post.pp0.side", ""), ("OWN", ""), *MICRO},
    "monitor": {("specbus.heartbeat", ""), ("OWN", "")},
}


@pytest.fixture(scope="module")
def credentials() -> dict[str, str]:
    return generate_credentials(CLIENTS)


OBSERVERS = {"observer": SERVICES_ACCOUNT, "observer-clients": CLIENTS_ACCOUNT}


@pytest.fixture
def secured(credentials):
    """A nats-server with every role user, clients alice and bob, and an unrestricted observer in
    each account (the services' and the clients')."""
    users = (*users_from_env(credentials),
             *(NatsUser(name, f"{name}-pw", account=account) for name, account in OBSERVERS.items()))
    with NatsServer(NatsServerConfig(users=users)) as server:
        yield server


async def connect_observers(server: NatsServer) -> list:
    return [(await connect_as(server, name, f"{name}-pw"))[0] for name in OBSERVERS]


async def connect_as(server: NatsServer, user: str, password: str, errors: list[str] | None = None):
    """nats-py connection as `user` with its own inbox prefix; error_cb feeds a PermissionWatch."""
    watch = PermissionWatch()

    async def on_error(exc: Exception) -> None:
        watch.on_error(exc)
        if errors is not None:
            errors.append(str(exc))

    nc = await nats.connect(server.url, user=user, password=password, inbox_prefix=inbox_prefix(user),
                            error_cb=on_error, allow_reconnect=False, connect_timeout=2)
    return nc, watch


async def barrier(nc) -> None:
    """Until the server has processed everything nc sent. One flush is not enough: nats-py writes
    the PING straight to the socket, ahead of SUB/PUB still queued for its flusher task; the
    flusher runs during that round trip, so a second PING goes out behind them."""
    await nc.flush()
    await nc.flush()


def password(credentials, user: str) -> str:
    return credentials[password_env(user)]


# ---------------------------------------------------------------------------------------------
# credentials from the environment


def test_every_missing_password_is_named(credentials):
    for variable in [password_env(role) for role in ("scheduler", "verifier", "drafter", "postprocessor", "monitor")] \
            + [password_env(c) for c in CLIENTS]:
        env = {k: v for k, v in credentials.items() if k != variable}
        with pytest.raises(AuthConfigError, match=variable):
            users_from_env(env)


def test_empty_password_is_missing(credentials):
    with pytest.raises(AuthConfigError, match="SPECBUS_DRAFTER_NATS_PASSWORD"):
        users_from_env({**credentials, "SPECBUS_DRAFTER_NATS_PASSWORD": ""})


@pytest.mark.parametrize("bad", ["short-but-ok", "1234-abcd-efgh-ijkl", "abcdefgh ijklmnop",
                                 "abcdefgh#ijklmnop", "abcdefgh,ijklmnop"])
def test_passwords_nats_server_would_misread_are_refused(credentials, bad):
    with pytest.raises(AuthConfigError, match="SPECBUS_ALICE_NATS_PASSWORD: must be 16-128 characters"):
        users_from_env({**credentials, "SPECBUS_ALICE_NATS_PASSWORD": bad})


def test_no_client_users_is_an_error(credentials):
    with pytest.raises(AuthConfigError, match="SPECBUS_CLIENT_USERS"):
        users_from_env({k: v for k, v in credentials.items() if k != "SPECBUS_CLIENT_USERS"})


@pytest.mark.parametrize("clients, reason", [("scheduler", "clashes"), ("al ice", "not valid"),
                                             ("a-b,a_b", "repeat"), ("_INBOX.x", "not valid")])
def test_bad_client_user_names_are_refused(credentials, clients, reason):
    with pytest.raises(AuthConfigError, match=reason):
        users_from_env({**credentials, "SPECBUS_CLIENT_USERS": clients})


def test_generated_credentials_are_random_and_complete(credentials):
    users = users_from_env(credentials)
    assert [u.user for u in users] == ["scheduler", "verifier", "drafter", "postprocessor", "monitor", *CLIENTS]
    passwords = [u.password for u in users]
    assert len(set(passwords)) == len(passwords) and min(map(len, passwords)) >= 32
    assert generate_credentials(CLIENTS) != credentials


def test_empty_password_is_refused_by_the_embedded_server():
    with pytest.raises(ValueError, match="'alice' has an empty password"):
        NatsServerConfig(users=(NatsUser("alice", ""),))


def test_an_env_file_reads_back_as_written_and_as_people_write_it(tmp_path):
    values = {"SPECBUS_NATS_URL": "nats://a:1,nats://b:2", "OPENAI_API_KEY": "sk-x=y"}
    (tmp_path / "written.env").write_text(env_file_text(values))
    assert read_env_file(tmp_path / "written.env") == values
    (tmp_path / "hand.env").write_text("# a comment\n\nexport A='1'\nB=\"two words\"\nnot a line\n")
    assert read_env_file(tmp_path / "hand.env") == {"A": "1", "B": "two words"}


def test_secret_files_are_owner_only(tmp_path):
    path = tmp_path / "creds.env"
    path.write_text("old")
    path.chmod(0o644)
    write_secret(path, "SPECBUS_CLIENT_USERS=alice\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == "SPECBUS_CLIENT_USERS=alice\n"


# ---------------------------------------------------------------------------------------------
# the config file for docker compose


def test_ops_config_is_the_rendered_one():
    """ops/nats/nats-server.conf is generated: regenerate with `python -m services.runtime.auth config
    --out ops/nats/nats-server.conf` after changing the permissions."""
    assert (REPO / "ops/nats/nats-server.conf").read_text() == render_server_config(env_password_users())


def check_config(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(find_nats_server_binary()), "-t", "-c", str(path)], env=env,
                          capture_output=True, text=True, timeout=10)


def test_ops_config_needs_every_password_in_the_environment():
    env = {**os.environ, **generate_credentials()}
    assert check_config(REPO / "ops/nats/nats-server.conf", env).returncode == 0
    env.pop("SPECBUS_VERIFIER_NATS_PASSWORD")
    result = check_config(REPO / "ops/nats/nats-server.conf", env)
    assert result.returncode != 0
    assert "SPECBUS_VERIFIER_NATS_PASSWORD" in result.stdout + result.stderr


async def test_rendered_config_with_env_refs_runs_a_server_that_enforces_it(tmp_path, credentials):
    """The ops file format, started for real with passwords from the server's environment."""
    config = tmp_path / "nats.conf"
    config.write_text(render_server_config(env_password_users(CLIENTS), host="127.0.0.1", port=-1, http_port=None))
    alice_password = "Zz-9_9-zz-Q1w2e3r4"  # '-' and '_' survive nats-server's parsing of $VAR values
    credentials = {**credentials, password_env("alice"): alice_password}
    users_from_env(credentials)  # accepted here too
    server_env = {**os.environ, **credentials}
    process = subprocess.Popen([str(find_nats_server_binary()), "-c", str(config), "--ports_file_dir", str(tmp_path)],
                               env=server_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ports_file = next(iter(await wait_for_files(tmp_path, "*.ports")))
        url = json.loads(ports_file.read_text())["nats"][0]
        nc = await nats.connect(url, user="alice", password=alice_password,
                                inbox_prefix=inbox_prefix("alice"), allow_reconnect=False)
        await nc.close()
        with pytest.raises(nats.errors.Error, match="[Aa]uthorization"):
            await nats.connect(url, user="alice", password="wrong", allow_reconnect=False, max_reconnect_attempts=0)
    finally:
        process.terminate()
        process.wait(timeout=10)


async def wait_for_files(directory: Path, pattern: str, timeout_s: float = 10.0) -> list[Path]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [p for p in directory.glob(pattern) if p.stat().st_size > 0]
        if found:
            return found
        await asyncio.sleep(0.02)
    raise TimeoutError(f"no {pattern} in {directory} within {timeout_s} s")


def test_cli_writes_credentials_then_a_config_from_them(tmp_path, monkeypatch):
    assert main(["credentials", "--client-users", "alice", "--out", str(tmp_path / "creds.env")]) == 0
    env = dict(line.split("=", 1) for line in (tmp_path / "creds.env").read_text().splitlines())
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["config", "--from-env", "--out", str(tmp_path / "nats.conf")]) == 0
    text = (tmp_path / "nats.conf").read_text()
    assert env[password_env("alice")] in text and stat.S_IMODE((tmp_path / "nats.conf").stat().st_mode) == 0o600
    assert check_config(tmp_path / "nats.conf", {}).returncode == 0
    monkeypatch.delenv(password_env("monitor"))
    assert main(["config", "--from-env"]) == 2


# ---------------------------------------------------------------------------------------------
# the permission matrix over the real server


def concrete(subject: str, user: str) -> str:
    other = "bob" if user == "alice" else "alice"
    return {"OWN": f"{inbox_prefix(user)}.x", "OTHER": f"{inbox_prefix(other)}.x"}.get(subject, subject)


@pytest.mark.parametrize("user", list(MAY_PUBLISH))
async def test_each_user_publishes_exactly_what_its_role_needs(secured, credentials, user):
    observers = await connect_observers(secured)  # what reaches either account
    received: set[str] = set()

    async def record(msg):
        received.add(msg.subject)

    for observer in observers:
        await observer.subscribe(">", cb=record)
        await observer.subscribe("$SRV.>", cb=record)  # `>` does not match subjects starting with `$`
        await barrier(observer)
    nc, watch = await connect_as(secured, user, password(credentials, user))
    for subject in sorted(PUBLISH_UNIVERSE):
        await nc.publish(subject, b"probe")
    await barrier(nc)
    await asyncio.sleep(SETTLE_S)
    assert received == MAY_PUBLISH[user]
    refused = {subject for kind, subject in watch.counts if kind == "publish"}
    assert refused == {s.lower() for s in PUBLISH_UNIVERSE - MAY_PUBLISH[user]}
    await nc.close()
    for observer in observers:
        await observer.close()


@pytest.mark.parametrize("user", list(MAY_SUBSCRIBE))
async def test_each_user_subscribes_exactly_to_what_its_role_needs(secured, credentials, user):
    nc, watch = await connect_as(secured, user, password(credentials, user))
    received: set[tuple[str, str]] = set()
    for subject, queue in sorted(SUBSCRIBE_UNIVERSE):
        async def record(msg, key=(subject, queue)):
            received.add(key)

        await nc.subscribe(concrete(subject, user), queue=queue, cb=record)
    await barrier(nc)
    observers = await connect_observers(secured)  # each subject published in either account
    for observer in observers:
        for subject in {concrete(s, user) for s, _ in SUBSCRIBE_UNIVERSE}:
            await observer.publish(subject, b"probe")
        await barrier(observer)
    await asyncio.sleep(SETTLE_S)
    assert received == MAY_SUBSCRIBE[user]
    refused = {subject for kind, subject in watch.counts if kind == "subscribe"}
    allowed_subjects = {concrete(s, user).lower() for s, _ in MAY_SUBSCRIBE[user]}
    assert refused == {concrete(s, user).lower() for s, _ in SUBSCRIBE_UNIVERSE} - allowed_subjects \
        | ({"specbus.generate.alice"} if user == "scheduler" else set())  # only as a queue member
    await nc.close()
    for observer in observers:
        await observer.close()


# ---------------------------------------------------------------------------------------------
# what a client sees


async def test_client_request_to_a_verify_subject_fails_at_once(secured, credentials):
    verifier, _ = await connect_as(secured, "verifier", password(credentials, "verifier"))
    delivered = []

    async def answer(msg):
        delivered.append(msg)
        await msg.respond(b"reply")

    await verifier.subscribe("specbus.verify.v0", cb=answer)
    await barrier(verifier)
    client, watch = await connect_as(secured, "alice", password(credentials, "alice"))
    started = time.monotonic()
    with pytest.raises(PermissionDenied, match="publish to 'specbus.verify.v0'"):
        await watch.guard(client.request("specbus.verify.v0", b"x", timeout=5.0), publish=["specbus.verify.v0"])
    assert time.monotonic() - started < 1.0
    await asyncio.sleep(SETTLE_S)
    assert delivered == []
    assert not watch.waiters
    await client.close()
    await verifier.close()


async def test_client_cannot_read_another_clients_stream(secured, credentials):
    bob, _ = await connect_as(secured, "bob", password(credentials, "bob"))
    bob_inbox = bob.new_inbox()
    assert bob_inbox.startswith("_INBOX.bob.")
    bob_sub = await bob.subscribe(bob_inbox)
    await barrier(bob)
    alice, watch = await connect_as(secured, "alice", password(credentials, "alice"))
    refused_subs = []

    async def read_one(subject):
        """What a stream reader does: subscribe, then wait for the next message."""
        sub = await alice.subscribe(subject)
        refused_subs.append(sub)
        return await sub.next_msg(timeout=5.0)

    for subject in (bob_inbox, "_INBOX.bob.>", "_INBOX.>", ">"):
        started = time.monotonic()
        with pytest.raises(PermissionDenied, match=f"subscribe to '{subject.lower()}'"):
            await watch.guard(read_one(subject), subscribe=[subject])
        assert time.monotonic() - started < 1.0
    post, _ = await connect_as(secured, "postprocessor", password(credentials, "postprocessor"))
    await post.publish(bob_inbox, encode(StreamChunk(request_id="r-bob", seq=0, text="secret")))
    await barrier(post)
    msg = await bob_sub.next_msg(timeout=2.0)
    assert decode(msg.data, StreamChunk).text == "secret"
    await asyncio.sleep(SETTLE_S)
    assert [sub.pending_msgs for sub in refused_subs] == [0, 0, 0, 0]
    for nc in (alice, bob, post):
        await nc.close()


async def test_client_stream_round_trip_under_restricted_users(secured, credentials):
    """generate -> scheduler (queue group) answers into the client inbox; the postprocessor
    streams a chunk there too, and learns by a 503 bounce on its own inbox once the client is gone."""
    scheduler, _ = await connect_as(secured, "scheduler", password(credentials, "scheduler"))

    async def on_generate(msg):
        await scheduler.publish(msg.reply, encode(StreamChunk(request_id="r1", seq=0, text="from scheduler")))

    await scheduler.subscribe("specbus.generate.*", queue="schedulers", cb=on_generate)
    await barrier(scheduler)
    client, watch = await connect_as(secured, "alice", password(credentials, "alice"))
    inbox = client.new_inbox()
    sub = await client.subscribe(inbox)
    await client.publish("specbus.generate.alice", b"request", reply=inbox)
    first = await watch.guard(sub.next_msg(timeout=2.0), publish=["specbus.generate.alice"], subscribe=[inbox])
    assert decode(first.data, StreamChunk).text == "from scheduler"

    post, _ = await connect_as(secured, "postprocessor", password(credentials, "postprocessor"))
    bounce = post.new_inbox()
    assert bounce.startswith("_INBOX.postprocessor.")
    bounce_sub = await post.subscribe(bounce + ".>")
    await post.publish(inbox, encode(StreamChunk(request_id="r1", seq=1, text="from post")), reply=f"{bounce}.r1")
    assert decode((await sub.next_msg(timeout=2.0)).data, StreamChunk).text == "from post"
    await sub.unsubscribe()
    await barrier(client)
    await post.publish(inbox, encode(StreamChunk(request_id="r1", seq=2, text="lost")), reply=f"{bounce}.r1")
    status = await bounce_sub.next_msg(timeout=2.0)
    assert status.subject == f"{bounce}.r1" and status.headers.get("Status") == "503"
    for nc in (scheduler, client, post):
        await nc.close()


# ---------------------------------------------------------------------------------------------
# services under their own users: nats.micro and request/reply


ENDPOINTS = {"scheduler": "specbus.stop.s0", "drafter": "specbus.draft.d0", "verifier": "specbus.verify.v0",
             "postprocessor": "specbus.post.pp0.commit"}


async def test_services_answer_micro_and_requests_under_their_users(secured, credentials):
    services = {}
    for role, subject in ENDPOINTS.items():
        # services.runtime.bus.connect passes inbox_prefix through to nats-py, as a service would.
        nc = await connect(secured.url, role, user=role, password=password(credentials, role),
                           inbox_prefix=inbox_prefix(role), initial_connect_timeout_s=5.0)

        async def echo(req, role=role):
            await req.respond(f"{role}:".encode() + req.data)

        micro = await add_micro_service(nc, role, "0.1.0", endpoints={"work": Endpoint(subject, echo)})
        services[role] = (nc, micro)
    monitor = await connect(secured.url, "monitor", user="monitor", password=password(credentials, "monitor"),
                            inbox_prefix=inbox_prefix("monitor"), initial_connect_timeout_s=5.0)
    for role in ENDPOINTS:
        ping = json.loads((await request(monitor, f"$SRV.PING.{role}", b"", timeout_s=2.0)).data)
        assert ping["name"] == role
        stats = json.loads((await request(monitor, f"$SRV.STATS.{role}", b"", timeout_s=2.0)).data)
        assert [e["subject"] for e in stats["endpoints"]] == [ENDPOINTS[role]]
    scheduler = services["scheduler"][0]
    for role in ("drafter", "verifier"):
        reply = await request(scheduler, ENDPOINTS[role], b"step", timeout_s=2.0)
        assert reply.data == f"{role}:".encode() + b"step"
    for nc, micro in services.values():
        await micro.stop()
        await nc.close()
    await monitor.close()


# ---------------------------------------------------------------------------------------------
# PermissionWatch on its own


async def test_watch_ignores_other_errors_and_lets_calls_through():
    watch = PermissionWatch()
    assert not watch.on_error(Exception("nats: slow consumer"))
    assert watch.on_error(Exception('nats: permissions violation for publish to "specbus.verify.v0"'))
    assert await watch.guard(asyncio.sleep(0, result="ok"), publish=["specbus.generate"]) == "ok"
    assert watch.counts == {("publish", "specbus.verify.v0"): 1} and not watch.waiters
    with pytest.raises(ValueError, match="at least one subject"):
        await watch.guard(asyncio.sleep(0))


def test_permissions_bound_to_one_instance():
    drafter = nats_user("drafter", "drafter-0", "pw", instance_id="drafter-0")
    assert drafter.subscribe[0] == "specbus.draft.drafter-0"
    with pytest.raises(SpecbusError, match="instance_id"):
        nats_user("drafter", "drafter-0", "pw", instance_id="a.>")
    with pytest.raises(ValueError, match="unknown role 'admin'"):
        nats_user("admin", "root", "pw")
