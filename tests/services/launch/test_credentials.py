"""A stack's credentials alone (services/launch/credentials.py): the env files it writes, owner-only,
and the logins each process gets."""

import stat

import pytest

from schemas.config import CLIENT_ENV_FILE
from services.launch.credentials import CREDENTIALS_FILE, NO_AUTH_API_KEY, StackCredentials
from services.runtime.auth import API_KEY_PREFIX, CLIENT_USERS_ENV, api_key_env, password_env


def env_lines(path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def test_generate_writes_every_secret_owner_only_and_the_first_users_login(tmp_path):
    credentials = StackCredentials(("alice", "bob"))
    users = credentials.generate(tmp_path, "specbus")
    assert {user.user for user in users} >= {"scheduler", "verifier", "drafter", "postprocessor", "alice", "bob"}
    for name in (CREDENTIALS_FILE, CLIENT_ENV_FILE, "client-alice.env", "client-bob.env"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
    assert env_lines(tmp_path / CREDENTIALS_FILE) == credentials.values
    alice = credentials.login("alice")
    assert env_lines(tmp_path / CLIENT_ENV_FILE) == {"SPECBUS_NATS_USER": "alice",
                                                     "SPECBUS_NATS_PASSWORD": alice["password"]}
    assert env_lines(tmp_path / "client-bob.env")["SPECBUS_NATS_USER"] == "bob"


def test_one_client_user_gets_client_env_only(tmp_path):
    StackCredentials(("client",)).generate(tmp_path, "specbus")
    assert sorted(path.name for path in tmp_path.iterdir()) == [CLIENT_ENV_FILE, CREDENTIALS_FILE]


def test_logins_and_keys_by_user_and_by_role(tmp_path):
    credentials = StackCredentials(("alice", "bob"))
    credentials.generate(tmp_path, "specbus")
    assert credentials.api_key() == credentials.values[api_key_env("alice")] and credentials.api_key().startswith(
        API_KEY_PREFIX)
    with pytest.raises(KeyError, match="no user 'carol'"):
        credentials.login("carol")
    password = credentials.login("drafter")["password"]
    assert credentials.role_env("drafter") == {"SPECBUS_NATS_USER": "drafter", "SPECBUS_NATS_PASSWORD": password}
    gateway = credentials.role_env("gateway")
    assert gateway[CLIENT_USERS_ENV] == "alice,bob" and password_env("monitor") in gateway
    assert {api_key_env("alice"), api_key_env("bob"), password_env("bob")} <= set(gateway)
    assert password_env("scheduler") not in gateway


def test_without_auth_nothing_is_secret(tmp_path):
    credentials = StackCredentials(("client",))
    assert credentials.login("client") == {} and credentials.api_key() == NO_AUTH_API_KEY
    assert credentials.role_env("scheduler") == {} and credentials.role_env("gateway") == {"SPECBUS_NO_AUTH": "1"}
    credentials.add_openai_env(tmp_path, "http://127.0.0.1:9/v1")
    assert env_lines(tmp_path / CLIENT_ENV_FILE) == {"OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
                                                     "OPENAI_API_KEY": NO_AUTH_API_KEY}


def test_a_stack_started_again_in_the_same_log_dir_replaces_the_client_settings(tmp_path):
    credentials = StackCredentials(("client",))
    for port in (9, 10):
        credentials.add_nats_env(tmp_path, f"nats://127.0.0.1:{port}", "specbus")
        credentials.add_openai_env(tmp_path, f"http://127.0.0.1:{port}/v1")
    lines = (tmp_path / CLIENT_ENV_FILE).read_text().splitlines()
    assert lines == ["SPECBUS_NATS_URL=nats://127.0.0.1:10", "SPECBUS_PREFIX=specbus",
                     "OPENAI_BASE_URL=http://127.0.0.1:10/v1", f"OPENAI_API_KEY={NO_AUTH_API_KEY}"]


def test_openai_settings_go_to_every_client_file_with_that_users_key(tmp_path):
    credentials = StackCredentials(("alice", "bob"))
    credentials.generate(tmp_path, "specbus")
    credentials.add_openai_env(tmp_path, "http://127.0.0.1:9/v1")
    assert env_lines(tmp_path / CLIENT_ENV_FILE)["OPENAI_API_KEY"] == credentials.api_key("alice")
    bob = env_lines(tmp_path / "client-bob.env")
    assert bob["SPECBUS_NATS_USER"] == "bob" and bob["OPENAI_API_KEY"] == credentials.api_key("bob")


@pytest.mark.parametrize("auth", [True, False])
def test_every_client_file_names_every_nats_node(tmp_path, auth):
    """`. client.env` is all a client needs: the URL of every node too, comma separated, as
    SPECBUS_NATS_URL (what the CLI and Client.from_env read)."""
    credentials = StackCredentials(("alice", "bob"))
    if auth:
        credentials.generate(tmp_path, "specbus")
    urls = "nats://127.0.0.1:14222,nats://127.0.0.1:14223"
    credentials.add_nats_env(tmp_path, urls, "tenant-a")
    files = [CLIENT_ENV_FILE, "client-alice.env", "client-bob.env"] if auth else [CLIENT_ENV_FILE]
    for name in files:
        assert env_lines(tmp_path / name)["SPECBUS_NATS_URL"] == urls
        assert env_lines(tmp_path / name)["SPECBUS_PREFIX"] == "tenant-a"
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
    if auth:  # the login is still there
        assert env_lines(tmp_path / "client-bob.env")["SPECBUS_NATS_USER"] == "bob"
