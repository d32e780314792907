"""A stack's credentials and the env files it writes for its users (services/runtime/auth.py).

`StackCredentials.generate` makes fresh random passwords for every role and client user and an
API key per client user, and writes, owner-only, in the log dir: CREDENTIALS_FILE (every
password and key), CLIENT_ENV_FILE (the first client user's login as `specbus generate` reads
it) and, with several client users, `client-<user>.env` for each. `add_nats_env` adds the
server's SPECBUS_NATS_URL (every node's) and the subject prefix to those files, `add_openai_env` the gateways'
OPENAI_BASE_URL and OPENAI_API_KEY. Without auth, `values` stays empty:
`login` is {} and `api_key` the placeholder NO_AUTH_API_KEY.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from schemas.config import CLIENT_ENV_FILE, ENV_PREFIX
from services.runtime.auth import (CLIENT_USERS_ENV, MONITOR, NatsUser, api_key_env, env_file_text, generate_api_keys,
                                   generate_credentials, password_env, read_env_file, users_from_env, write_secret)

CREDENTIALS_FILE = "credentials.env"
NO_AUTH_API_KEY = "no-auth"  # the openai SDK insists on some key


@dataclass
class StackCredentials:
    """client_users: the client users, the first one the default. values: every password and API
    key, as users_from_env reads them ({} without auth)."""

    client_users: tuple[str, ...]
    values: dict[str, str] = field(default_factory=dict, repr=False)

    def generate(self, log_dir: Path, prefix: str) -> tuple[NatsUser, ...]:
        """Fresh credentials, written to the env files in log_dir; the server's users."""
        self.values = generate_credentials(self.client_users) | generate_api_keys(self.client_users)
        write_secret(log_dir / CREDENTIALS_FILE, env_file_text(self.values))
        for index, user in enumerate(self.client_users):  # client.env: the first one's login
            login = self.login(user)
            text = env_file_text({ENV_PREFIX + "NATS_USER": user, ENV_PREFIX + "NATS_PASSWORD": login["password"]})
            if index == 0:
                write_secret(log_dir / CLIENT_ENV_FILE, text)
            if len(self.client_users) > 1:
                write_secret(log_dir / f"client-{user}.env", text)
        return tuple(users_from_env(self.values, prefix))

    def login(self, user: str) -> dict[str, str]:
        """{"user", "password"} of a user (a role or a client user); {} without auth."""
        if not self.values:
            return {}
        variable = password_env(user)
        if variable not in self.values:
            raise KeyError(f"user: no user {user!r} in this stack; client users: {list(self.client_users)}")
        return {"user": user, "password": self.values[variable]}

    def api_key(self, user: str | None = None) -> str:
        """A client user's API key for the gateways (default: the first client user's); without
        auth any key is accepted, and this is a placeholder."""
        if not self.values:
            return NO_AUTH_API_KEY
        return self.values[api_key_env(user or self.client_users[0])]

    def role_env(self, role: str) -> dict[str, str]:
        """A role's NATS login as SPECBUS_NATS_USER/_PASSWORD; a gateway gets every client user's
        password and API key and the monitor's password instead (services/gateway/gateway.py)."""
        if role != "gateway":
            return {f"{ENV_PREFIX}NATS_{key.upper()}": value for key, value in self.login(role).items()}
        if not self.values:
            return {ENV_PREFIX + "NO_AUTH": "1"}
        users = (*self.client_users, MONITOR)
        return {CLIENT_USERS_ENV: ",".join(self.client_users),
                **{password_env(u): self.values[password_env(u)] for u in users},
                **{api_key_env(u): self.values[api_key_env(u)] for u in self.client_users}}

    def add_openai_env(self, log_dir: Path, base_url: str) -> None:
        """OPENAI_BASE_URL and OPENAI_API_KEY added to CLIENT_ENV_FILE (the first client user's
        key) and to each client-<user>.env (that user's), so `set -a; . file; set +a` sets up the
        openai SDK too."""
        self.add_client_env(log_dir, lambda user: {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": self.api_key(user)})

    def add_nats_env(self, log_dir: Path, nats_url: str, prefix: str) -> None:
        """SPECBUS_NATS_URL (nats_url: every node's URL, comma separated) and SPECBUS_PREFIX (the
        subject prefix) added to every client env file, so that `. file` is all `specbus
        generate` and Client.from_env need."""
        self.add_client_env(log_dir, lambda user: {ENV_PREFIX + "NATS_URL": nats_url, ENV_PREFIX + "PREFIX": prefix})

    def add_client_env(self, log_dir: Path, values: Callable[[str | None], dict[str, str]]) -> None:
        """values(user) added to CLIENT_ENV_FILE (user None: the first client user) and, with auth
        and several client users, to each client-<user>.env, a variable the file holds already
        taking the new value; without auth CLIENT_ENV_FILE is made if missing and holds only what
        is added."""
        files = {CLIENT_ENV_FILE: None}
        if self.values and len(self.client_users) > 1:
            files |= {f"client-{user}.env": user for user in self.client_users}
        for name, user in files.items():
            path = log_dir / name
            held = read_env_file(path) if path.exists() else {}
            write_secret(path, env_file_text(held | values(user)))
