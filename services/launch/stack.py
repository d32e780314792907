"""The embedded stack: a nats-server and every service, each a separate process.

    async with Stack(StackConfig(verifiers=1, drafters=1)) as stack:
        print(stack.url)                       # clients connect here
        stack.kill("drafter-0", signal.SIGKILL)  # fault injection
        await stack.start_instance("drafter")  # a fresh drafter-1, back once it heartbeats

Each service runs as `python -m services.cli serve <role> --instance-id <role>-<n> ...` (the
same command a container runs), with its stdout/stderr in a log file under `log_dir`.

NATS auth is on by default (services/runtime/auth.py): fresh random passwords per start, one user per
role with its subject permissions, each process given only its own role's login
(SPECBUS_NATS_USER/_PASSWORD), the stack's heartbeat watcher connected as "monitor", and the
clients' logins from `client_login()` / `client()`. `log_dir/credentials.env` (mode 0600) holds
every password, `log_dir/client.env` the server's URL (SPECBUS_NATS_URL, every node's) and the
first client user's login as `specbus generate` and Client.from_env read them (with several
client users, also `client-<user>.env` for each). Each client user may read and
cancel only its own requests (services/runtime/auth.py).

Gateways (StackConfig.gateways, the OpenAI-compatible API of services/gateway/gateway.py) are clients,
not roles with a NATS user: each gets every client user's password and API key and the monitor's
password; `openai_base_url` and `api_key(user)` say how to reach them, and client.env gets
OPENAI_BASE_URL and OPENAI_API_KEY.

A Stack starts and stops processes when asked; `services.launch.supervisor.supervise` restarts those
that exit by themselves (what `specbus up` runs).

Start-up waits until every instance has published a heartbeat on `<prefix>.heartbeat` (a gateway:
until it accepts HTTP connections); a process that exits first, or an instance still silent after
ready_timeout_s, fails the start with the tail of that process's log. Stopping goes upstream to
downstream, one role group at a time (processes.STOP_ORDER): gateways first (no new requests
come in), then schedulers, so each finishes its step in flight against live drafters and
verifiers and sends every request's final commit to a live postprocessor; then drafters and
verifiers; postprocessors last, after they have forwarded those final commits. Each process gets
SIGTERM, stop_timeout_s to exit by itself, then SIGKILL; the server stops last.

The Stack is the core; its collaborators each do one job: services/launch/processes.py starts
and stops the processes, services/launch/credentials.py makes the credentials and writes the env
files, services/launch/health.py watches heartbeats and waits for readiness.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import sys
import tempfile
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from nats.aio.client import Client

from schemas.config import CLIENT_ENV_FILE, load_config
from schemas.config import ROLES as CONFIGS
from schemas.bus.control import Heartbeat
from schemas.bus.subjects import DEFAULT_PREFIX, Subjects
from schemas.draft_kinds import DRAFT_KINDS
from services.client import Client as SpecbusClient
from services.launch.credentials import CREDENTIALS_FILE, StackCredentials
from services.launch.health import HeartbeatWatch, accepts_http, wait_ready
from services.launch.natsserver import NatsCluster, NatsServer, NatsServerConfig
from services.launch.processes import (HostPlacement, ServiceProcess, StackError, build_linear_kernel, free_port,
                                       start_service_process, stop_in_order)
from services.runtime.auth import CLIENT, MONITOR, check_user_names
from services.runtime.bus import connect

log = structlog.get_logger(__name__)

# Every role the stack runs, in start order (docker-compose.yml runs the same set).
ROLES = tuple(CONFIGS)  # scheduler, verifier, drafter, postprocessor


@dataclass(frozen=True)
class StackConfig:
    """What to run. counts: instances per role. target_model/draft_model/eagle_head None: the
    services' defaults (the shipped pair and head, or SPECBUS_TARGET_MODEL / SPECBUS_DRAFT_MODEL /
    SPECBUS_EAGLE_HEAD).
    role_args: extra `serve <role>` flags, e.g. {"scheduler": ["--max-queue", "4"]}.
    role_env: extra environment per role (it wins over the stack's own).
    auth: generate users and passwords for every role and for client_users (module docstring).
    auth=False: no users but those in nats.users, with nats_user/nats_password for the stack's
    own connection (it watches heartbeats) and the services' logins in role_env.
    nats_cluster: nats-server processes; above 1, a NatsCluster of that many nodes joined by
    routes, every service and client given every node's URL (a node's death moves its
    connections to the others)."""

    schedulers: int = 1
    verifiers: int = 1
    drafters: int = 1
    postprocessors: int = 1
    # OpenAI-compatible HTTP gateways (services/gateway/gateway.py), none unless asked for: each is one more
    # process. Gateway i listens on 127.0.0.1:http_port + i (http_port 0: free ports), in gateway_ports.
    gateways: int = 0
    http_port: int = 0
    target_model: str | None = None
    draft_model: str | None = None
    # the drafters' --draft-method: "model" (draft_model), "ngram" (prompt lookup, no model) or
    # "eagle" (eagle_head over target_model's features); None: theirs (SPECBUS_DRAFT_METHOD, model)
    draft_method: str | None = None
    eagle_head: str | None = None
    dtype: str | None = None  # the verifiers' and drafters' --dtype; None: theirs (SPECBUS_DTYPE, auto)
    weights: str | None = None  # the verifiers' --weights; None: theirs (SPECBUS_WEIGHTS, auto)
    # Each verifier's and drafter's KV cache budget ("2GiB"); None: theirs (SPECBUS_KV_CACHE_MEMORY, 2GiB).
    kv_cache_memory: str | None = None
    # The verifiers' and drafters' prefix caching (gpu_worker/batching/prefix_cache.py); None: theirs
    # (SPECBUS_PREFIX_CACHING, on).
    prefix_caching: bool | None = None
    # torch threads per verifier / drafter process; 0: `role_threads` picks from the machine.
    verifier_threads: int = 0
    drafter_threads: int = 0
    prefix: str = DEFAULT_PREFIX
    nats: NatsServerConfig = field(default_factory=NatsServerConfig)
    nats_cluster: int = 1
    role_args: dict[str, list[str]] = field(default_factory=dict)
    role_env: dict[str, dict[str, str]] = field(default_factory=dict)
    auth: bool = True
    client_users: tuple[str, ...] = (CLIENT,)
    nats_user: str | None = None
    nats_password: str | None = None
    log_dir: str | Path | None = None  # None: a temporary dir, removed on stop
    log_level: str = "info"
    ready_timeout_s: float = 120.0
    # Prometheus endpoints: 0 = none; else each new instance id gets the next port from here
    # (a restarted id keeps its own), listed in Stack.metrics_ports.
    metrics_port_base: int = 0
    stop_timeout_s: float = 10.0
    # where the NATS nodes and the services run (ops/faults/netns.py: a network namespace each); None: here
    placement: HostPlacement | None = None

    def __post_init__(self) -> None:
        for role in ROLES:
            if self.count(role) < 0:
                raise ValueError(f"{role}s: must be >= 0, got {self.count(role)}")
        unknown = (set(self.role_args) | set(self.role_env)) - set(ROLES)
        if unknown:
            raise ValueError(f"role_args/role_env: unknown role {sorted(unknown)[0]!r}, expected one of {ROLES}")
        if self.auth and (self.nats.users or self.nats_user is not None):
            raise ValueError("nats.users/nats_user: auth=True makes its own users; set auth=False to bring yours")
        if self.auth and not self.client_users:
            raise ValueError("client_users: auth=True needs at least one client user")
        if self.auth:
            check_user_names(self.client_users)
        if self.nats_cluster < 1:
            raise ValueError(f"nats_cluster: must be >= 1 (nats-server processes), got {self.nats_cluster}")
        for role in ("verifier", "drafter"):
            if getattr(self, f"{role}_threads") < 0:
                raise ValueError(f"{role}_threads: must be >= 0 (0: from the machine), got "
                                 f"{getattr(self, f'{role}_threads')}")
        if not 0 <= self.metrics_port_base < 65536:
            raise ValueError(f"metrics_port_base: must be a port or 0 (off), got {self.metrics_port_base}")

    def count(self, role: str) -> int:
        return getattr(self, f"{role}s")


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


MAX_DRAFTER_THREADS = 4  # a small draft's forward is mostly per-call overhead past a few threads
# A model with fewer bytes of weights on disk than this runs on one thread: its forward is mostly
# per-op overhead, and a second thread only spins at every op's barrier, on the cores the other
# processes of the stack need (ops/bench/RESULTS.md "Fewer ops a layer, our own block attention,
# threads by model size").
SMALL_MODEL_BYTES = 16 << 20


# the settings that say which model a verifier or drafter loads: the drafter kinds' model settings among them
MODEL_SETTINGS = ("target_model", "draft_method",
                  *(kind.model_setting for kind in DRAFT_KINDS.values() if kind.model_setting is not None))


def role_model(role: str, config: StackConfig) -> Path | None:
    """The model directory a verifier or drafter of this stack loads, resolved as the service
    resolves it (`load_config`: the stack's setting, else its SPECBUS_ one, else the default);
    None for a drafter of a kind that loads no model (ngram)."""
    fields = {f.name for f in dataclasses.fields(CONFIGS[role])}
    service = load_config(CONFIGS[role], **{name: getattr(config, name) for name in MODEL_SETTINGS if name in fields})
    if role == "verifier":
        return Path(service.target_model)
    setting = DRAFT_KINDS[service.draft_method].model_setting  # the field naming what the drafter loads
    return None if setting is None else Path(getattr(service, setting))


def is_small_model(path: Path | None) -> bool:
    """True for no model (prompt lookup) or a directory whose *.safetensors hold < SMALL_MODEL_BYTES."""
    if path is None:
        return True
    files = list(path.glob("*.safetensors")) if path.is_dir() else []
    return bool(files) and sum(f.stat().st_size for f in files) < SMALL_MODEL_BYTES


def role_threads(role: str, config: StackConfig, cores: int) -> int | None:
    """torch threads for one process of role; None for roles without torch.

    Given (config.verifier_threads / drafter_threads) wins. A small model (`is_small_model`: the
    tiny pair, the shipped EAGLE head, prompt lookup) gets 1. Else, from the machine's
    cores: the verifiers share every core (cores // verifiers), the drafters too, each at most
    MAX_DRAFTER_THREADS, each at least 1: 2 cores -> verifier 2, drafter 2; 4 -> 4, 4; 16 -> 16, 4.
    A request's draft and verify run one after the other, so each has the cores while it runs,
    and the torch-free processes' work between steps is a small part of a step. The measurements
    behind the rule: ops/bench/RESULTS.md "Threads per role" and "Fewer ops a layer, our own block
    attention, threads by model size".
    """
    if role not in ("verifier", "drafter"):
        return None
    given = getattr(config, f"{role}_threads")
    if given:
        return given
    if is_small_model(role_model(role, config)):
        return 1
    if role == "drafter":
        return max(1, min(cores // max(1, config.drafters), MAX_DRAFTER_THREADS))
    return max(1, cores // max(1, config.verifiers))


def serve_command(role: str, instance_id: str, nats_url: str, config: StackConfig) -> list[str]:
    """The argv that runs one service instance (as a container would, plus the stack's flags)."""
    argv = [sys.executable, "-m", "services.cli", "--log-level", config.log_level, "serve", role,
            "--nats-url", nats_url, "--prefix", config.prefix, "--instance-id", instance_id]
    # The target dir also holds the tokenizer that prompts are encoded and outputs decoded with.
    settings = {"target_model": config.target_model, "tokenizer": config.target_model,
                "draft_model": config.draft_model, "draft_method": config.draft_method,
                "eagle_head": config.eagle_head, "dtype": config.dtype,
                # --weights is how the verifier holds the target; a draft model has no GGUF blocks,
                # so a drafter takes only int8 (Q8_0 blocks quantized at load, from any model)
                "weights": config.weights if role == "verifier" or config.weights == "int8" else None,
                "kv_cache_memory": config.kv_cache_memory, "prefix_caching": config.prefix_caching,
                "torch_threads": role_threads(role, config, usable_cores())}
    for config_field in dataclasses.fields(CONFIGS[role]):
        if settings.get(config_field.name) is not None:
            argv += ["--" + config_field.name.replace("_", "-"), str(settings[config_field.name])]
    return argv + list(config.role_args.get(role, []))  # role_args come last: they win


def port_args(role: str, instance_id: str, config: StackConfig, metrics_ports: dict[str, int],
              gateway_ports: dict[str, int]) -> list[str]:
    """The --metrics-port / --http-port flags of one instance. Assigns instance_id its ports in
    metrics_ports (each new id the next port from metrics_port_base) and, for a gateway, in
    gateway_ports (the next from http_port, or a free one); an id that has one keeps it."""
    argv = []
    if config.metrics_port_base:
        port = metrics_ports.setdefault(instance_id, config.metrics_port_base + len(metrics_ports))
        argv += ["--metrics-port", str(port)]
    if role == "gateway":
        port = gateway_ports.get(instance_id) or (
            config.http_port + len(gateway_ports) if config.http_port else free_port(set(gateway_ports.values())))
        gateway_ports[instance_id] = port
        argv += ["--http-port", str(port)]
    return argv


def make_log_dir(log_dir: str | Path | None) -> tuple[Path, bool]:
    """(the directory, whether the stack owns it): the one given, created if needed, or a fresh
    temporary one the stack removes on stop."""
    if log_dir is None:
        return Path(tempfile.mkdtemp(prefix="specbus-stack-")), True
    path = Path(log_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path, False


@dataclass
class Stack:
    """A running stack: its server, its processes by instance id, the heartbeats it has seen
    (`heartbeats`, `heartbeat_seen_at`) and its credentials (module docstring)."""

    config: StackConfig = field(default_factory=StackConfig)
    server: NatsServer | NatsCluster | None = field(default=None, init=False)
    processes: dict[str, ServiceProcess] = field(default_factory=dict, init=False)  # instance id -> process
    watch: HeartbeatWatch = field(default_factory=HeartbeatWatch, init=False)
    credentials: StackCredentials = field(init=False, repr=False)
    nc: Client | None = field(default=None, init=False, repr=False)
    log_dir: Path | None = field(default=None, init=False)
    next_index: Counter = field(default_factory=Counter, init=False)  # role -> the n of its next id
    exit_stack: AsyncExitStack = field(default_factory=AsyncExitStack, init=False, repr=False)
    owns_log_dir: bool = field(default=False, init=False)
    metrics_ports: dict[str, int] = field(default_factory=dict, init=False)  # instance id -> /metrics port
    gateway_ports: dict[str, int] = field(default_factory=dict, init=False)  # instance id -> HTTP port

    def __post_init__(self) -> None:
        self.credentials = StackCredentials(self.config.client_users)

    @property
    def heartbeats(self) -> dict[str, Heartbeat]:
        """The last heartbeat of each instance id."""
        return self.watch.heartbeats

    @property
    def heartbeat_seen_at(self) -> dict[str, float]:
        """When each instance id last heartbeated (time.monotonic())."""
        return self.watch.seen_at

    @property
    def credentials_path(self) -> Path | None:
        """Every user's password as KEY=value lines (None without auth)."""
        return self.log_dir / CREDENTIALS_FILE if self.credentials.values and self.log_dir else None

    @property
    def client_env_path(self) -> Path | None:
        """SPECBUS_NATS_URL, the first client user's SPECBUS_NATS_USER/_PASSWORD (with auth) and,
        with gateways, OPENAI_BASE_URL and OPENAI_API_KEY (None before the server started)."""
        return self.log_dir / CLIENT_ENV_FILE if self.log_dir and self.server is not None else None

    @property
    def openai_base_url(self) -> str:
        """The first gateway's API root, http://127.0.0.1:<port>/v1."""
        if not self.gateway_ports:
            raise StackError("no gateway in this stack: StackConfig(gateways=1)")
        return f"http://127.0.0.1:{next(iter(self.gateway_ports.values()))}/v1"

    def api_key(self, user: str | None = None) -> str:
        """A client user's API key for the gateways (StackCredentials.api_key)."""
        return self.credentials.api_key(user)

    def login(self, user: str) -> dict[str, str]:
        """{"user", "password"} of a user of this stack (a role or a client user); {} without auth."""
        return self.credentials.login(user)

    def client_login(self, user: str | None = None) -> dict[str, str]:
        """A client user's login (default: the first client user) as Client(...) keywords."""
        return self.login(user or self.config.client_users[0])

    def client(self, user: str | None = None, **options) -> SpecbusClient:
        """A Client for this stack (url, prefix, a client user's login); `async with` it."""
        return SpecbusClient(self.url, prefix=self.config.prefix, **self.client_login(user), **options)

    @property
    def url(self) -> str:
        if self.server is None:
            raise StackError("stack not started: no url yet")
        return self.server.url

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.config.prefix)

    def by_role(self, role: str) -> list[ServiceProcess]:
        return [p for p in self.processes.values() if p.role == role]

    async def start(self) -> Stack:
        """Server, then every instance; returns once all have heartbeated (StackError if not)."""
        await self.start_server()
        await self.start_services()
        return self

    async def start_server(self) -> str:
        """The nats-server and the stack's heartbeat watcher; returns the url. With auth, fresh
        credentials for every user first (credentials.env and client.env in the log dir); client.env
        then gets the server's URL."""
        try:
            self.log_dir, self.owns_log_dir = make_log_dir(self.config.log_dir)
            nats = self.config.nats
            if nats.jetstream_store_dir is None and self.config.nats_cluster == 1:
                # JetStream for the gateway's stored Responses (services/gateway/response_store.py)
                nats = dataclasses.replace(nats, jetstream_store_dir=self.log_dir / "jetstream")
            if self.config.auth:
                nats = dataclasses.replace(nats, users=self.credentials.generate(self.log_dir, self.config.prefix))
            size, placement = self.config.nats_cluster, self.config.placement
            places = placement.nats_nodes(size) if placement is not None else ()
            if size == 1 and places:
                nats = dataclasses.replace(nats, host=places[0][0], exec_prefix=places[0][1])
            server = NatsServer(nats) if size == 1 else NatsCluster(nats, size=size, places=places)
            self.server = await self.exit_stack.enter_async_context(server)
            self.credentials.add_nats_env(self.log_dir, self.server.url, self.config.prefix)
            own = self.login(MONITOR) or {"user": self.config.nats_user, "password": self.config.nats_password}
            self.nc = await connect(self.server.url, "specbus-stack", initial_connect_timeout_s=10.0, **own)
            self.exit_stack.push_async_callback(self.nc.close)
            await self.nc.subscribe(self.subjects.heartbeat, cb=self.watch.on_heartbeat)
        except BaseException:
            await self.stop()
            raise
        return self.server.url

    async def start_services(self) -> None:
        """Every configured instance, at once; returns when all have heartbeated."""
        try:
            await build_linear_kernel()
            started = [await self.spawn(role) for role in ROLES for _ in range(self.config.count(role))]
            await wait_ready(started, self.is_ready, self.config.ready_timeout_s)
            if self.gateway_ports:
                self.credentials.add_openai_env(self.log_dir, self.openai_base_url)
        except BaseException:
            await self.stop()
            raise

    async def spawn(self, role: str, instance_id: str | None = None, *,
                    http_port: int | None = None) -> ServiceProcess:
        """Start one instance of role (id `<role>-<n>` unless given; a gateway on http_port when
        given); does not wait for it."""
        if role not in ROLES:
            raise ValueError(f"role: unknown role {role!r}, expected one of {ROLES}")
        if instance_id is None:
            instance_id = f"{role}-{self.next_index[role]}"
            self.next_index[role] += 1
        known = self.processes.get(instance_id)
        if known is not None and known.running:
            raise StackError(f"{instance_id} is already running (pid {known.process.pid})")
        assert self.log_dir is not None
        if http_port is not None:
            self.gateway_ports[instance_id] = http_port
        argv = serve_command(role, instance_id, self.url, self.config) + \
            port_args(role, instance_id, self.config, self.metrics_ports, self.gateway_ports)
        if self.config.placement is not None:
            argv = [*self.config.placement.exec_prefix(role, instance_id), *argv]
        env = {**self.credentials.role_env(role), **self.config.role_env.get(role, {})}
        self.watch.forget(instance_id)
        started = await start_service_process(role, instance_id, argv, env, self.log_dir / f"{instance_id}.log")
        self.processes[instance_id] = started
        log.info("stack_process_started", role=role, instance_id=instance_id, pid=started.process.pid,
                 metrics_port=self.metrics_ports.get(instance_id))
        return started

    async def spawn_replacement(self, dead: ServiceProcess) -> ServiceProcess:
        """A fresh instance (a new id) of a dead one's role in its place; does not wait for it. A
        gateway listens on the dead one's HTTP port, so its clients' base URL stays valid."""
        return await self.spawn(dead.role, http_port=self.gateway_ports.get(dead.instance_id))

    async def start_instance(self, role: str, instance_id: str | None = None,
                             timeout_s: float | None = None) -> ServiceProcess:
        """Start one more instance of role (or restart a dead one by id) and wait for its heartbeat."""
        started = await self.spawn(role, instance_id)
        await wait_ready([started], self.is_ready, self.config.ready_timeout_s if timeout_s is None else timeout_s)
        return started

    async def is_ready(self, proc: ServiceProcess) -> bool:
        """A service has heartbeated since it started; a gateway (no heartbeat: it is a client)
        accepts HTTP connections, which it does once its NATS connections are up."""
        if proc.role != "gateway":
            return self.watch.beat_since(proc.instance_id, proc.started_at)
        return await accepts_http(self.gateway_ports[proc.instance_id])

    def kill(self, instance_id: str, sig: int = signal.SIGKILL) -> None:
        """Send sig to one instance (SIGKILL: a crash; SIGTERM: a polite stop)."""
        proc = self.processes.get(instance_id)
        if proc is None:
            raise KeyError(f"instance_id: no process {instance_id!r}; known: {sorted(self.processes)}")
        if proc.running:
            proc.process.send_signal(sig)
            log.info("stack_process_signalled", instance_id=instance_id, signal=signal.Signals(sig).name)

    async def wait_exit(self, instance_id: str, timeout_s: float = 10.0) -> int:
        """The exit code of an instance, waiting up to timeout_s (asyncio.TimeoutError after)."""
        return await asyncio.wait_for(self.processes[instance_id].process.wait(), timeout=timeout_s)

    async def stop(self) -> None:
        """SIGTERM the processes role group by role group (STOP_ORDER; then SIGKILL), then close
        the connection and stop the server. Idempotent; keeps the log dir when it was given,
        removes a temporary one."""
        await stop_in_order(self.processes.values(), self.config.stop_timeout_s)
        await self.exit_stack.aclose()
        if self.owns_log_dir and self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self.owns_log_dir = False

    async def __aenter__(self) -> Stack:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
