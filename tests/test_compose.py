"""docker-compose.yml without a Docker engine: it parses, each service runs a command the real
CLI parser accepts, its settings are real config fields, and it runs the roles the embedded
stack runs."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from schemas.config import ENV_PREFIX, ROLES as CONFIGS
from services.auth import password_env
from services.cli import build_parser
from services.natsserver import DEFAULT_MAX_PAYLOAD
from services.stack import ROLES, StackConfig, serve_command

REPO = Path(__file__).resolve().parent.parent
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
    return {name: svc for name, svc in services.items() if name != "nats" and "profiles" not in svc}


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
    for name, svc in role_services(services).items():
        assert svc["depends_on"]["nats"]["condition"] == "service_healthy", name
        env = svc["environment"]
        assert env["SPECBUS_NATS_URL"] == "nats://nats:4222", name
        fields = {f.name for f in dataclasses.fields(CONFIGS[name])}
        for key in set(env) - NOT_CONFIG_ENV:
            assert key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX):].lower() in fields, f"{name}: {key}"
        # Each role logs in as its own user, with a password only from the host's environment
        # or .env: `:?` stops compose when it is unset or empty, so none is ever blank.
        assert env["SPECBUS_NATS_USER"] == name
        assert env["SPECBUS_NATS_PASSWORD"].startswith(f"${{{password_env(name)}:?"), name


def test_nats_is_the_official_image_with_a_healthz_healthcheck(services):
    nats = services["nats"]
    assert nats["image"].split(":")[0] == "nats"
    assert any("/healthz" in part and ":8222" in part for part in nats["healthcheck"]["test"])
    conf_host_path, conf_container_path, _ = nats["volumes"][0].split(":")
    assert conf_host_path == "./ops/nats/nats-server.conf"  # the config services/auth.py renders
    conf = (REPO / conf_host_path).read_text()
    assert "http_port: 8222" in conf and f"max_payload: {DEFAULT_MAX_PAYLOAD}" in conf
    assert nats["command"][-1] == conf_container_path


def test_nats_gets_every_password_its_config_refers_to_and_no_default(services):
    conf = (REPO / "ops/nats/nats-server.conf").read_text()
    referenced = set(re.findall(r"password: \$(SPECBUS_\w+_NATS_PASSWORD)", conf))
    assert referenced == {password_env(user) for user in (*ROLES, "monitor", "client")}
    env = services["nats"]["environment"]
    assert set(env) == referenced
    for variable, value in env.items():
        assert value.startswith(f"${{{variable}:?"), variable


def test_the_password_file_stays_out_of_git_and_of_the_image():
    for ignore in (".gitignore", ".dockerignore"):
        assert ".env" in (REPO / ignore).read_text().split("\n"), ignore


def test_verifier_reserves_a_gpu_that_the_cpu_override_switches_off(services):
    devices = services["verifier"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    cpu = load("docker-compose.cpu.yml")["services"]["verifier"]
    assert cpu["deploy"] == ("reset", None)
    assert cpu["environment"]["SPECBUS_DEVICE"] == "cpu"


def test_dockerfile_ships_the_models_the_services_default_to():
    dockerfile = (REPO / "ops/Dockerfile").read_text()
    assert "COPY models models" in dockerfile
    for setting in ("SPECBUS_TARGET_MODEL=/app/models/target", "SPECBUS_DRAFT_MODEL=/app/models/draft"):
        assert setting in dockerfile
    build = load("docker-compose.yml")["x-specbus"]["build"]
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
