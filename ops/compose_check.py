"""`make compose-check`: the docker-compose stack run for real, as root on a Debian bookworm host
with no image registry (docs/OPERATIONS.md#one-service-per-process-or-container). Steps, in order:

1. apt-get installs what is missing (docker.io, docker-compose, debootstrap); dockerd is started
   when none answers.
2. The base image: `debootstrap --variant=minbase bookworm` from the host's own Debian mirror
   (python3, venv, headers, g++), imported as BASE_IMAGE; kept for later runs. `--base IMAGE`
   (e.g. python:3.11-slim where a registry is at hand) skips it.
3. A wheelhouse on the host: the host venv's versions of every dependency (pip freeze as
   constraints), the local CPU torch wheel and the default model's package, served on loopback
   while `docker build --network host -f ops/Dockerfile` installs from it and nothing else.
4. The reference: `specbus up` on the host, greedy generations of PROMPTS and one chat, stopped.
5. `docker-compose up -d` (the CPU stack), waited for until every container is healthy; from the
   host: `specbus generate` against each node's URL, a chat and a stream with the openai SDK,
   streaming load with a SIGKILL of the scheduler's NATS node and then of the scheduler
   (every stream must finish with the reference's tokens), `--scale drafter=2`, `specbus
   selfcheck --quick`, a client without credentials refused, no password in the image.
6. `down -v`, checked to leave no container, network or volume of the project.

Prints one summary line on stdout (each step's progress on stderr), writes the figures to
build/compose-check/results.json and exits 1 on any failure. Containers reach only loopback (the
build) or their compose network."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file: the checkout's packages, not an installed copy

from services.client import Client, make_request  # noqa: E402
from services.commands.models import PACKAGE, PACKAGE_VERSION  # noqa: E402
from services.runtime.auth import password_env, read_env_file  # noqa: E402
from services.runtime.bus import BusUnavailable, connect  # noqa: E402
from services.runtime.logs import configure_logging  # noqa: E402
from schemas.bus.codec import decode  # noqa: E402
from schemas.bus.control import Heartbeat  # noqa: E402

WORK = REPO / "build" / "compose-check"  # wheelhouse, logs, results (build/ is ignored by git and docker)
ENV_FILE = REPO / ".env"
PROJECT = "specbus-check"  # the compose project: its label finds every container, network and volume
IMAGE = "specbus:latest"  # docker-compose.yml's image
BASE_IMAGE = "specbus-base:bookworm"
SUITE = "bookworm"  # Debian's python3 is 3.11 there, as the cp311 torch wheel wants
BASE_PACKAGES = "python3,python3-venv,python3-dev,g++"
TORCH_SPEC = "torch==2.13.0"  # the Makefile's pin: a local CPU wheel on the project's machines
WHEEL_PORT = 8731  # fixed, so that the build args (hence docker's layer cache) are the same every run
NODE_URLS = ["nats://127.0.0.1:4222", "nats://127.0.0.1:4223", "nats://127.0.0.1:4224"]
GATEWAY = "http://127.0.0.1:8000"
HOST_PORTS = (4222, 4223, 4224, 8000)
NODES = ("nats-1", "nats-2", "nats-3")
PROMPTS = ["def fibonacci(n):", "The capital of France is", "Once upon a time", "import numpy as np\n",
           "SELECT name FROM", "The three primary colors are", "class Stack:\n", "In 1969, the first"]
MAX_TOKENS = 48
CHAT = [{"role": "user", "content": "Name three fruits."}]
CHAT_MAX_TOKENS = 24
FAULT_AFTER_CHUNKS = 2  # every stream has this many chunks when the kill comes: mid-stream, not by wall time
HEALTHY_TIMEOUT_S = 600.0
SELFCHECK_TIMEOUT_S = 900.0


class Failed(Exception):
    pass


def log(message: str) -> None:
    print(f"[compose-check] {message}", file=sys.stderr, flush=True)


def run(command: list[str], *, timeout: float = 600.0, check: bool = True, quiet: bool = False,
        **options) -> subprocess.CompletedProcess:
    """Run command, output captured; a failure raises Failed with the output's tail."""
    if not quiet:
        log("$ " + " ".join(command))
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **options)
    if check and result.returncode != 0:
        tail = (result.stdout + result.stderr).strip().splitlines()[-20:]
        raise Failed(f"`{' '.join(command[:4])} ...` exited {result.returncode}:\n" + "\n".join(tail))
    return result


@contextlib.contextmanager
def step(name: str, figures: dict):
    started = time.monotonic()
    log(f"{name} ...")
    yield
    figures.setdefault("steps_s", {})[name] = round(time.monotonic() - started, 1)
    log(f"{name}: {time.monotonic() - started:.1f} s")


# ---------------------------------------------------------------------------------------------
# the host: packages, dockerd, compose


def install_missing() -> None:
    """apt-get what the check needs and the host lacks (a docker client alone is not a daemon)."""
    wanted = {"dockerd": "docker.io", "debootstrap": "debootstrap"}
    missing = [package for binary, package in wanted.items() if shutil.which(binary) is None]
    if compose_command() is None:
        missing.append("docker-compose")
    if not missing:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], env=env)
    run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], env=env)


def compose_command() -> list[str] | None:
    """`docker compose` where the plugin exists, else docker-compose v1 (Debian's), else None."""
    if shutil.which(docker_cli()) and run([docker_cli(), "compose", "version"], check=False, quiet=True).returncode == 0:
        return [docker_cli(), "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def docker_cli() -> str:
    """The docker client installed beside the dockerd on PATH (Debian's docker.io: /usr/sbin/dockerd,
    /usr/bin/docker; Docker's own packages: both in /usr/bin), else the first on PATH. A client found
    first on PATH may belong to no daemon here (e.g. a newer static binary in /usr/local/bin); the
    daemon's own client speaks its API version and builds with its classic builder."""
    if dockerd := shutil.which("dockerd"):
        for directory in (Path(dockerd).parent, Path(dockerd).parent.parent / "bin"):
            if (directory / "docker").is_file():
                return str(directory / "docker")
    return shutil.which("docker") or "docker"


def docker_answers() -> bool:
    return run([docker_cli(), "info"], check=False, quiet=True, timeout=30).returncode == 0


def host_figures(compose: list[str]) -> dict:
    """What ran the check: the docker client and daemon, compose, the CPU's bf16 flag, the load."""
    version = run([docker_cli(), "version", "-f", "{{.Client.Version}} {{.Server.Version}}"], quiet=True).stdout.split()
    cpuinfo = Path("/proc/cpuinfo").read_text()
    return {"docker_client": f"{docker_cli()} {version[0]}", "dockerd": version[1],
            "compose": run([*compose, "version", "--short"], quiet=True).stdout.strip(),
            "bf16": [flag for flag in ("avx512_bf16", "amx_bf16") if f" {flag}" in cpuinfo],
            "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}


def ensure_dockerd() -> None:
    if docker_answers():
        return
    WORK.mkdir(parents=True, exist_ok=True)
    with open(WORK / "dockerd.log", "ab") as out:  # it outlives the check: later runs find it
        subprocess.Popen(["dockerd"], stdout=out, stderr=out, start_new_session=True)
    deadline = time.monotonic() + 60
    while not docker_answers():
        if time.monotonic() > deadline:
            raise Failed(f"dockerd did not answer within 60 s; see {WORK / 'dockerd.log'}")
        time.sleep(1)


def debian_mirror(apt: Path = Path("/etc/apt")) -> str:
    """The host's Debian mirror of SUITE (a deb822 .sources stanza or a sources.list line), for debootstrap."""
    for path in sorted((apt / "sources.list.d").glob("*.sources")):
        for stanza in path.read_text().split("\n\n"):
            fields = dict(line.split(":", 1) for line in stanza.splitlines() if ":" in line and not line.startswith("#"))
            if SUITE in fields.get("Suites", "").split():
                return fields["URIs"].split()[0]
    for path in [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*.list"))]:
        for line in path.read_text().splitlines() if path.exists() else []:
            words = [w for w in line.split() if not w.startswith("[")]
            if len(words) >= 3 and words[0] == "deb" and words[2] == SUITE:
                return words[1]
    raise Failed(f"no Debian {SUITE} mirror in {apt}/sources.list*; pass --base IMAGE")


def image_exists(name: str) -> bool:
    return run([docker_cli(), "image", "inspect", name], check=False, quiet=True).returncode == 0


def ensure_base_image() -> None:
    """BASE_IMAGE from debootstrap, once: later runs reuse it (`docker rmi` it to rebuild)."""
    if image_exists(BASE_IMAGE):
        log(f"{BASE_IMAGE} exists")
        return
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="specbus-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        run(["nice", "-n", "10", "debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", SUITE,
             str(rootfs), debian_mirror()], timeout=1800)
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/locale"):
            shutil.rmtree(rootfs / cache, ignore_errors=True)  # the .debs, indexes and docs: no image needs them
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        run([docker_cli(), "import", "-", BASE_IMAGE], stdin=tar.stdout)
        if tar.wait() != 0:
            raise Failed("tar of the debootstrap root failed")


# ---------------------------------------------------------------------------------------------
# the image


def build_wheelhouse(wheels: Path) -> None:
    """Every wheel the image installs, at the versions of the venv running this check."""
    wheels.mkdir(parents=True, exist_ok=True)
    frozen = run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], quiet=True).stdout
    constraints = WORK / "constraints.txt"
    constraints.write_text("".join(line + "\n" for line in frozen.splitlines() if " @ " not in line))
    pip = [sys.executable, "-m", "pip"]
    run([*pip, "wheel", "-q", "-w", str(wheels), "-c", str(constraints), TORCH_SPEC, "setuptools>=68",
         "-r", str(WORK / "requirements.txt")], timeout=1800)
    run([*pip, "download", "-q", "--no-deps", "--only-binary", ":all:", f"{PACKAGE}=={PACKAGE_VERSION}",
         "-d", str(wheels)], timeout=600)


def write_requirements() -> None:
    import tomllib
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (WORK / "requirements.txt").write_text("".join(d + "\n" for d in dependencies))


@contextlib.contextmanager
def serve_directory(directory: Path):
    """An HTTP server of directory's listing on loopback (pip's --find-links reads it); its URL."""
    handler = functools.partial(QuietHandler, directory=str(directory))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEEL_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)  # taken: a cache miss, not a failure
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def build_image(base: str, wheels_url: str | None, figures: dict) -> None:
    args = ["--build-arg", f"BASE={base}", "--build-arg", f"TORCH_SPEC={TORCH_SPEC}"]
    if wheels_url:
        args += ["--build-arg", "PIP_NO_INDEX=1", "--build-arg", f"PIP_FIND_LINKS={wheels_url}"]
    started = time.monotonic()
    result = run(["nice", "-n", "10", docker_cli(), "build", "--network", "host", "-f", "ops/Dockerfile", "-t", IMAGE,
                  *args, "."], cwd=REPO, timeout=3600, env={**os.environ, "DOCKER_BUILDKIT": "0"})
    (WORK / "build.log").write_text(result.stdout + result.stderr)
    figures["build_s"] = round(time.monotonic() - started, 1)
    figures["image_bytes"] = int(run([docker_cli(), "image", "inspect", "-f", "{{.Size}}", IMAGE], quiet=True).stdout)
    figures["base_image_bytes"] = int(run([docker_cli(), "image", "inspect", "-f", "{{.Size}}", base], quiet=True).stdout)


def ensure_env_file() -> dict[str, str]:
    """.env as docs/OPERATIONS.md#one-service-per-process-or-container says to make it (kept when it exists and is complete)."""
    env = read_env_file(ENV_FILE) if ENV_FILE.exists() else {}
    python = [sys.executable, "-m"]
    if password_env("client") not in env:
        run([*python, "services.runtime.auth", "credentials", "--client-users", "client", "--out", str(ENV_FILE)],
            cwd=REPO, env=repo_env())
    if "SPECBUS_CLIENT_API_KEY" not in read_env_file(ENV_FILE):
        keys = run([*python, "services.gateway.gateway", "api-keys", "--client-users", "client"], cwd=REPO,
                   env=repo_env()).stdout
        with open(ENV_FILE, "a") as out:
            out.write(keys)
    return read_env_file(ENV_FILE)


def repo_env(**extra: str) -> dict[str, str]:
    """The environment of a host command: this checkout's packages first."""
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


def no_secret_in_image(env: dict[str, str]) -> None:
    seen = run([docker_cli(), "image", "inspect", IMAGE], quiet=True).stdout + \
        run([docker_cli(), "history", "--no-trunc", IMAGE], quiet=True).stdout
    leaked = [key for key, value in env.items() if key.endswith(("_PASSWORD", "_API_KEY")) and value in seen]
    if leaked:
        raise Failed(f"the image's config or history holds {leaked}")


# ---------------------------------------------------------------------------------------------
# generations


async def greedy_tokens(client: Client, tag: str) -> list[list[int]]:
    requests = [make_request(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, request_id=f"{tag}-{i}")
                for i, p in enumerate(PROMPTS)]
    results = await asyncio.gather(*(client.generate(r) for r in requests))
    return [list(r.token_ids) for r in results]


def openai_chat(base_url: str, api_key: str) -> tuple[str, str]:
    """The same greedy chat, whole and streamed, through the openai SDK."""
    import openai
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    options = dict(model=model, messages=CHAT, temperature=0, max_tokens=CHAT_MAX_TOKENS)
    whole = client.chat.completions.create(**options).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(**options, stream=True) if c.choices]
    return whole, "".join(parts)


def read_lines(stream, lines: list[str], ready: threading.Event) -> None:
    for line in stream:
        lines.append(line)
        if line.startswith("ready:"):
            ready.set()
    ready.set()  # it exited


def reference_run(figures: dict) -> tuple[list[list[int]], str]:
    """Greedy tokens of PROMPTS and the chat's text from `specbus up` on the host."""
    log_dir = WORK / "up"
    shutil.rmtree(log_dir, ignore_errors=True)
    specbus = str(Path(sys.executable).with_name("specbus"))
    up = subprocess.Popen([specbus, "up", "--port", "0", "--http-port", "0", "--log-dir", str(log_dir)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=repo_env())
    lines, ready = [], threading.Event()
    threading.Thread(target=read_lines, args=(up.stdout, lines, ready), daemon=True).start()
    try:
        if not ready.wait(HEALTHY_TIMEOUT_S) or up.poll() is not None:
            raise Failed("specbus up did not get ready:\n" + "".join(lines[-20:]))
        env = read_env_file(log_dir / "client.env")
        tokens = asyncio.run(client_run(Client.from_env(env), greedy_tokens, "up"))
        whole, _ = openai_chat(env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"])
        return tokens, whole
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


async def client_run(client: Client, function, *args):
    async with client:
        return await function(client, *args)


def specbus_generate(url: str, login: dict[str, str]) -> list[int]:
    result = run([str(Path(sys.executable).with_name("specbus")), "generate", "--url", url, "--prompt", PROMPTS[0],
                  "--temperature", "0", "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json"],
                 env=repo_env(SPECBUS_NATS_USER=login["user"], SPECBUS_NATS_PASSWORD=login["password"]), quiet=True)
    return list(json.loads(result.stdout)["token_ids"])


async def streams_under_fault(client: Client, tag: str, fault) -> list[tuple[list[int], str]]:
    """The greedy PROMPTS streamed at once; fault() runs once every stream has FAULT_AFTER_CHUNKS
    chunks. Each stream's (tokens, outcome): "finished", "finished, failover" or the error."""
    counts = [0] * len(PROMPTS)
    all_started = asyncio.Event()

    async def one(i: int, prompt: str) -> tuple[list[int], str]:
        tokens, failover = [], False
        request = make_request(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, request_id=f"{tag}-{i}")
        try:
            async for chunk in client.stream(request):
                tokens += list(chunk.token_ids)
                failover = failover or "failover" in chunk.degraded
                counts[i] += 1
                if min(counts) >= FAULT_AFTER_CHUNKS:
                    all_started.set()
        except Exception as exc:  # the outcome says which
            return tokens, f"{type(exc).__name__}: {exc}"
        finally:
            counts[i] = max(counts[i], FAULT_AFTER_CHUNKS)  # a finished stream waits for no one
            if min(counts) >= FAULT_AFTER_CHUNKS:
                all_started.set()
        return tokens, "finished, failover" if failover else "finished"

    tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(PROMPTS)]
    await all_started.wait()
    await asyncio.to_thread(fault)
    return await asyncio.wait_for(asyncio.gather(*tasks), 300)


def outcomes(streamed: list[tuple[list[int], str]], reference: list[list[int]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for (tokens, outcome), expected in zip(streamed, reference):
        key = ("identical" + outcome[len("finished"):]) if outcome.startswith("finished") and tokens == expected \
            else (outcome if not outcome.startswith("finished") else f"different output ({len(tokens)} tokens)")
        counts[key] = counts.get(key, 0) + 1
    return counts


async def live_instances(client: Client, role: str, seconds: float = 3.0) -> set[str]:
    """Instance ids of role (every role: "role/id") heard heartbeating within seconds."""
    seen: set[str] = set()

    async def on_beat(msg) -> None:
        with contextlib.suppress(Exception):
            beat = decode(msg.data, Heartbeat)
            if role == "*":
                seen.add(f"{beat.role}/{beat.instance_id}")
            elif beat.role == role:
                seen.add(beat.instance_id)

    subscription = await client.nc.subscribe(client.subjects.heartbeat, cb=on_beat)
    await asyncio.sleep(seconds)
    await subscription.unsubscribe()
    return seen


async def refused_without_credentials() -> None:
    for url in NODE_URLS:
        for login in ({}, {"user": "client", "password": "Wrong-password-123"}):
            try:
                nc = await connect(url, "intruder", initial_connect_timeout_s=2.0, max_reconnect_attempts=0, **login)
            except BusUnavailable:
                continue
            await nc.close()
            raise Failed(f"{url} let in a client with {login or 'no credentials'}")
    request = urllib.request.Request(f"{GATEWAY}/v1/models")  # no API key
    try:
        urllib.request.urlopen(request, timeout=10)
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            return
        raise Failed(f"the gateway answered {exc.code} to a request without an API key") from None
    raise Failed("the gateway served a request without an API key")


# ---------------------------------------------------------------------------------------------
# the compose stack


class ComposeStack:
    def __init__(self, compose: list[str]):
        self.compose = [*compose, "-p", PROJECT]

    def __call__(self, *args: str, timeout: float = 600.0) -> str:
        return run([*self.compose, *args], cwd=REPO, timeout=timeout).stdout

    def containers(self, service: str | None = None) -> list[str]:
        filters = ["--filter", f"label=com.docker.compose.project={PROJECT}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        return run([docker_cli(), "ps", "-aq", *filters], quiet=True).stdout.split()

    def state(self, container: str) -> dict:
        return json.loads(run([docker_cli(), "inspect", "-f", "{{json .State}}", container], quiet=True).stdout)

    def wait_healthy(self, timeout: float = HEALTHY_TIMEOUT_S) -> None:
        """Until every container of the project runs and each with a healthcheck is healthy."""
        deadline = time.monotonic() + timeout
        while True:
            states = {c: self.state(c) for c in self.containers()}
            waiting = [c for c, s in states.items()
                       if not s["Running"] or s.get("Health", {}).get("Status", "healthy") != "healthy"]
            if states and not waiting:
                return
            if time.monotonic() > deadline:
                raise Failed(f"containers not healthy within {timeout:.0f} s: {waiting}\n" + self.logs())
            time.sleep(1)

    def sigkill(self, service: str) -> str:
        """SIGKILL the main process of service's one container from the host, as a crash would
        (`docker kill` would count as a stop, and the restart policy would not apply)."""
        [container] = self.containers(service)
        os.kill(self.state(container)["Pid"], signal.SIGKILL)
        return container

    def node_of(self, prefix: str) -> str:
        """The NATS node holding the connection whose name starts with prefix (each node's /connz)."""
        script = ("import json, urllib.request; print(json.dumps([c.get('name', '') for c in json.load("
                  "urllib.request.urlopen('http://127.0.0.1:8222/connz?limit=1024', timeout=5))['connections'] or []]))")
        for node in NODES:
            [container] = self.containers(node)
            names = json.loads(run([docker_cli(), "exec", container, "python", "-c", script], quiet=True).stdout)
            if any(name.startswith(prefix) for name in names):
                return node
        raise Failed(f"no node holds a connection named {prefix}*")

    def logs(self) -> str:
        result = run([*self.compose, "logs", "--no-color", "--tail", "20"], cwd=REPO, check=False, quiet=True)
        return result.stdout[-4000:]

    def down(self) -> None:
        run([*self.compose, "down", "-v", "--remove-orphans", "-t", "10"], cwd=REPO, check=False, timeout=300)

    def leftovers(self) -> list[str]:
        """Containers, networks and volumes of the project, found by compose's label or by the
        name compose gives them (PROJECT_...), so that an unlabelled one is found too."""
        found = set(self.containers())
        for kind in ("container", "network", "volume"):
            for selector in (f"label=com.docker.compose.project={PROJECT}", f"name={PROJECT}_"):
                listing = run([docker_cli(), kind, "ls", "-aq" if kind == "container" else "-q", "--filter", selector],
                              quiet=True).stdout.split()
                found |= {name if kind == "container" else f"{kind} {name}" for name in listing}
        return sorted(found)


async def every_role_beats(env: dict[str, str]) -> None:
    """Until each role's instance heartbeats (the gateway's healthcheck needs only a scheduler)."""
    roles = {"scheduler", "verifier", "drafter", "postprocessor"}
    async with Client(NODE_URLS, user="client", password=env[password_env("client")]) as client:
        deadline = time.monotonic() + HEALTHY_TIMEOUT_S
        while roles - {beat.split("/")[0] for beat in await live_instances(client, "*", 1.0)}:
            if time.monotonic() > deadline:
                raise Failed(f"not every role heartbeats within {HEALTHY_TIMEOUT_S:.0f} s")


def wait_for_port_free() -> None:
    import socket
    taken = []
    for port in HOST_PORTS:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                taken.append(port)
    if taken:
        raise Failed(f"127.0.0.1 ports {taken} are in use; the compose stack publishes {list(HOST_PORTS)}")


def check_stack(stack: ComposeStack, env: dict[str, str], reference: list[list[int]], reference_chat: str,
                figures: dict) -> None:
    login = {"user": "client", "password": env[password_env("client")]}

    with step("specbus generate against each node", figures):
        for url in NODE_URLS:
            if specbus_generate(url, login) != reference[0]:
                raise Failed(f"`specbus generate --url {url}` differs from specbus up's")

    with step("openai chat and stream", figures):
        whole, streamed = openai_chat(f"{GATEWAY}/v1", env["SPECBUS_CLIENT_API_KEY"])
        if whole != reference_chat or streamed != whole:
            raise Failed(f"chat {whole!r} / stream {streamed!r} differ from specbus up's {reference_chat!r}")

    async def over_nats() -> None:
        async with Client(NODE_URLS, **login) as client:
            with step("greedy through compose", figures):
                if await greedy_tokens(client, "compose") != reference:
                    raise Failed("greedy outputs through compose differ from specbus up's")

            with step("SIGKILL of the scheduler's NATS node under load", figures):
                node = await asyncio.to_thread(stack.node_of, "scheduler-")
                streamed = await streams_under_fault(client, "kill-node", lambda: stack.sigkill(node))
                figures["node_kill"] = {"node": node, "outcomes": outcomes(streamed, reference)}
                log(f"killed {node}: {figures['node_kill']['outcomes']}")
                if set(figures["node_kill"]["outcomes"]) - {"identical", "identical, failover"}:
                    raise Failed(f"streams across the loss of {node}: {figures['node_kill']['outcomes']}")
                await asyncio.to_thread(stack.wait_healthy)  # the restart policy brings it back

            with step("SIGKILL of the scheduler under load", figures):
                killed_at = time.monotonic()
                streamed = await streams_under_fault(client, "kill-scheduler", lambda: stack.sigkill("scheduler"))
                figures["scheduler_kill"] = {"outcomes": outcomes(streamed, reference),
                                             "streams_done_s": round(time.monotonic() - killed_at, 1)}
                log(f"killed the scheduler: {figures['scheduler_kill']}")
                if set(figures["scheduler_kill"]["outcomes"]) - {"identical", "identical, failover"}:
                    raise Failed(f"streams across the scheduler's death: {figures['scheduler_kill']['outcomes']}")
                await asyncio.to_thread(stack.wait_healthy)
                if await greedy_tokens(client, "after-faults") != reference:
                    raise Failed("greedy outputs after the faults differ")

            with step("--scale drafter=2", figures):
                await asyncio.to_thread(stack, "up", "-d", "--no-recreate", "--scale", "drafter=2")
                await asyncio.to_thread(stack.wait_healthy)
                deadline = time.monotonic() + 300
                while len(drafters := await live_instances(client, "drafter")) < 2:
                    if time.monotonic() > deadline:
                        raise Failed(f"two drafters never heartbeat: {drafters}")
                figures["drafters"] = len(drafters)
                if await greedy_tokens(client, "two-drafters") != reference:
                    raise Failed("greedy outputs with two drafters differ")

    asyncio.run(over_nats())

    with step("specbus selfcheck --quick", figures):
        result = run([str(Path(sys.executable).with_name("specbus")), "selfcheck", "--url", ",".join(NODE_URLS),
                      "--quick"], env=repo_env(SPECBUS_NATS_USER=login["user"], SPECBUS_NATS_PASSWORD=login["password"]),
                     timeout=SELFCHECK_TIMEOUT_S, check=False)
        (WORK / "selfcheck.txt").write_text(result.stdout + result.stderr)
        if result.returncode != 0:
            raise Failed(f"specbus selfcheck --quick failed:\n{result.stdout[-3000:]}")

    with step("clients without credentials refused", figures):
        asyncio.run(refused_without_credentials())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", help="the image's base (e.g. python:3.11-slim); default: a debootstrap "
                                       f"{SUITE} base ({BASE_IMAGE}), built once")
    args = parser.parse_args(argv)
    configure_logging(level="warning")  # the client's, on stderr: stdout holds the summary line only
    if os.geteuid() != 0:
        print("compose-check: FAILED: run as root (apt-get, dockerd, debootstrap)")
        return 1
    WORK.mkdir(parents=True, exist_ok=True)
    figures: dict = {}
    started = time.monotonic()
    stack = None
    try:
        with step("apt packages", figures):
            install_missing()
        with step("dockerd", figures):
            ensure_dockerd()
        figures["host"] = host_figures(compose_command())
        stack = ComposeStack(compose_command())
        stack.down()  # what a failed earlier run left
        wait_for_port_free()
        with step("base image", figures):
            if not args.base:
                ensure_base_image()
        with step("image", figures):
            write_requirements()
            if args.base:
                build_image(args.base, None, figures)
            else:
                build_wheelhouse(WORK / "wheels")
                with serve_directory(WORK / "wheels") as url:
                    build_image(BASE_IMAGE, url, figures)
        env = ensure_env_file()
        no_secret_in_image(env)
        with step("reference: specbus up", figures):
            reference, reference_chat = reference_run(figures)
        with step("compose up until healthy", figures):
            up_at = time.monotonic()
            stack("up", "-d", "--no-build")
            stack.wait_healthy()
            asyncio.run(every_role_beats(env))
            figures["healthy_s"] = round(time.monotonic() - up_at, 1)
        check_stack(stack, env, reference, reference_chat, figures)
        with step("down", figures):
            stack.down()
            if leftovers := stack.leftovers():
                raise Failed(f"down left {leftovers}")
            stack = None
    except Exception as exc:  # any failure, expected or not, ends in the summary line
        figures["error"] = str(exc) if isinstance(exc, Failed) else f"{type(exc).__name__}: {exc}"
        print(f"[compose-check] FAILED: {exc}", file=sys.stderr)
        if stack is not None:
            print(stack.logs(), file=sys.stderr)
    finally:
        if stack is not None:
            stack.down()
    figures["total_s"] = round(time.monotonic() - started, 1)
    figures["loadavg_end"] = os.getloadavg()
    (WORK / "results.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(summary(figures))
    return 1 if "error" in figures else 0


def summary(figures: dict) -> str:
    total = f"{figures['total_s'] // 60:.0f}m{figures['total_s'] % 60:02.0f}s"
    if "error" in figures:
        return f"compose-check: FAILED after {total}: {figures['error'].splitlines()[0]}"
    node, scheduler = figures["node_kill"], figures["scheduler_kill"]
    return (f"compose-check: ok in {total}: image {figures['image_bytes'] / 1e9:.2f} GB built in {figures['build_s']:.0f} s, "
            f"healthy in {figures['healthy_s']:.0f} s; 3 nodes generate = specbus up; openai chat+stream = specbus up; "
            f"{node['node']} killed: {fmt(node['outcomes'])}; scheduler killed: {fmt(scheduler['outcomes'])}; "
            f"{figures['drafters']} drafters; selfcheck --quick ok; no-credential clients refused; down left nothing")


def fmt(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {what}" for what, n in counts.items())


if __name__ == "__main__":
    sys.exit(main())
