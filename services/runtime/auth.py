"""NATS users and subject permissions, one user per role.

The permission model is data, here and nowhere else: `role_permissions(prefix)` says what each
role may publish and subscribe to, built from the subject names of schemas/bus/subjects.py
(`Subjects`); the routes themselves (who publishes what to whom) are documented in
schemas/doc_tables.py SUBJECT_ROUTES, and tests/services/runtime/test_auth.py checks each
role's permissions against real subscriptions and publishes:

    role           publishes                                   subscribes
    client <u>     <p>.generate.<u>, <p>.cancel.<u>,           <p>.heartbeat (failover), its own inbox
                   its key-value bucket's JetStream API (kv_subjects)
    scheduler      <p>.draft.*, <p>.verify.*, <p>.post.*.commit, <p>.generate.* (queue "schedulers"),
                   <p>.heartbeat, _INBOX.> (error chunks,      <p>.cancel.*, <p>.heartbeat, <p>.stop.<id>
                   $SRV replies)
    drafter        <p>.heartbeat; replies                      <p>.draft.<id>
    verifier       <p>.post.*.side, <p>.heartbeat; replies     <p>.verify.<id>
    postprocessor  _INBOX.> (client chunks, $SRV replies),     <p>.post.<id>.commit, <p>.post.<id>.side
                   <p>.stop.*, <p>.heartbeat
    monitor        $SRV.> (ping/info/stats)                    <p>.heartbeat

Every service also subscribes to its nats.micro control subjects (`$SRV.<VERB>`,
`$SRV.<VERB>.<role>`, `$SRV.<VERB>.<role>.<service id>`), and every user to its own inbox
`_INBOX.<user>.>` (its request replies, the postprocessor's bounce inbox): each user connects with
`inbox_prefix=inbox_prefix(user)`, and no user can subscribe to another user's inbox, so a client
never sees another client's stream. A client user publishes only to the generate and cancel
subjects that end with its own name, so the scheduler knows who sent each request from the
subject: it refuses a reply subject outside that user's inbox (no client can aim a stream at
another's inbox) and a cancel of another user's request. "replies" is nats-server's `allow_responses`: one publish to
the reply subject of each message received, and nothing else; the drafter and verifier need no
more. The scheduler and postprocessor publish to `_INBOX.>` instead (no allow_responses): the
scheduler receives reply subjects from clients, and allow_responses would let a client aim the
scheduler's answer at any subject (e.g. `<p>.verify.x`); `_INBOX.>` confines it to inboxes.

`<id>` is `*` by default: one user per role, shared by its instances (scale out without touching
the server). The trade-off: any drafter may then subscribe to another drafter's subject and
take a share of its work. Binding a user to one instance (`instance_id=...`) closes that, at the
price of one user per instance and a server config reload for each new instance.

Two accounts keep one client from knocking a service off the bus. nats-server's `users` entries take
no limits, its accounts do (`limits { max_payload }`): the role users are in SERVICES_ACCOUNT,
the client users in CLIENTS_ACCOUNT, whose `max_payload` is CLIENT_MAX_PAYLOAD (a message over it
closes that client's connection, never a service's; the server-wide max_payload stays what the
services need). Accounts see nothing of each other but what they export and import, so
`render_auth` joins them with exactly the client users' permissions: their generate and cancel
subjects are streamed from CLIENTS to SERVICES, heartbeats and each client's inbox from SERVICES
to CLIENTS (a stream keeps the reply subject, so the scheduler still sees the sender's inbox). The
server announces the server-wide max_payload to every connection, so a client is told its own
limit by the client library (`services/client.py` connects with `max_payload=CLIENT_MAX_PAYLOAD`).

Credentials come from the environment (`users_from_env`), never from a default:
    SPECBUS_CLIENT_USERS            client user names, "alice,bob" (at least one; not role names)
    SPECBUS_<USER>_NATS_PASSWORD    one per user: the role users (named scheduler, verifier,
                                    drafter, postprocessor, monitor) and each client user
`generate_credentials()` makes random ones (the embedded stack; `python -m services.runtime.auth
credentials --out .env` for docker compose).

`render_server_config(users)` is the nats-server config file; `env_password_users()` gives users
whose passwords are `$SPECBUS_<USER>_NATS_PASSWORD` references that nats-server resolves from its
own environment at start (a missing variable stops it with "variable reference ... can not be
found"): that is how ops/nats/nats-server.conf is made (`python -m services.runtime.auth config`).

The server reports a refused publish or subscription asynchronously (to error_cb), so a
request to a forbidden subject would just time out. `PermissionWatch` turns that report into a
`PermissionDenied` at the call waiting on that subject.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import string
import sys
from collections import Counter
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from schemas.config import MAX_MESSAGE_BYTES, NATS_PORT
from schemas.errors import ErrorCode, SpecbusError
from schemas.bus.protocol import MAX_PROMPT_CHARS
from schemas.bus.subjects import DEFAULT_PREFIX, INSTANCE_ID_PATTERN, SCHEDULER_QUEUE_GROUP, Subjects, check_instance_id

# nats-server limits, shared by the server config rendered here and services/launch/natsserver.py
# (the server-wide max_payload is schemas.config MAX_MESSAGE_BYTES).
MAX_MAX_PAYLOAD = 64 * 1024 * 1024  # nats-server's own hard limit
# What a client user may publish at most (its account's limit, module docstring): the largest
# valid GenerateRequest, a prompt of MAX_PROMPT_CHARS characters at 4 UTF-8 bytes each (or as many
# int32 token ids), plus room for the options. The services keep MAX_MESSAGE_BYTES: their
# batches, commits and prompt logprobs are larger.
CLIENT_MAX_PAYLOAD = 4 * MAX_PROMPT_CHARS + 64 * 1024
# The two accounts of an authenticated deployment (module docstring).
SERVICES_ACCOUNT = "SERVICES"
CLIENTS_ACCOUNT = "CLIENTS"


@dataclass(frozen=True)
class NatsUser:
    """One user of the server. publish/subscribe: allowed subjects (wildcards fine); None allows
    everything. allow_responses lets a responder publish its reply to the requester's inbox
    without listing `_INBOX.>` in publish. account: SERVICES_ACCOUNT or CLIENTS_ACCOUNT (rendered
    under `accounts`, see `render_auth`); None: the server's global account (`authorization`)."""

    user: str
    password: str
    publish: tuple[str, ...] | None = None
    subscribe: tuple[str, ...] | None = None
    allow_responses: bool = False
    account: str | None = None


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


def render_auth(users: Iterable[NatsUser], client_max_payload: int = CLIENT_MAX_PAYLOAD) -> dict:
    """The server config's user blocks: `authorization` for users without an account, `accounts`
    for the others (module docstring). The subjects that cross between the two accounts are the
    client users' own permissions: what a client may publish is exported to the services, what it
    may subscribe to is imported from them; nothing else crosses."""
    users = list(users)
    out: dict = {}
    plain = [render_user(u) for u in users if u.account is None]
    if plain:
        out["authorization"] = {"users": plain}
    in_accounts = [u for u in users if u.account is not None]
    if not in_accounts:
        return out
    unknown = {u.account for u in in_accounts} - {SERVICES_ACCOUNT, CLIENTS_ACCOUNT}
    if unknown:
        raise ValueError(f"account: {min(unknown)!r} is not {SERVICES_ACCOUNT} or {CLIENTS_ACCOUNT}")
    clients = [u for u in in_accounts if u.account == CLIENTS_ACCOUNT]
    sent = list(dict.fromkeys(s for u in clients for s in (u.publish or ()) if not s.startswith(("$JS.", "$KV."))))
    heard = list(dict.fromkeys(s for u in clients for s in (u.subscribe or ())))
    accounts = {
        SERVICES_ACCOUNT: {
            "users": [render_user(u) for u in in_accounts if u.account == SERVICES_ACCOUNT],
            "exports": [{"stream": s, "accounts": [CLIENTS_ACCOUNT]} for s in heard],
            "imports": [{"stream": {"account": CLIENTS_ACCOUNT, "subject": s}} for s in sent],
        },
        CLIENTS_ACCOUNT: {
            "users": [render_user(u) for u in clients],
            "exports": [{"stream": s, "accounts": [SERVICES_ACCOUNT]} for s in sent],
            "imports": [{"stream": {"account": SERVICES_ACCOUNT, "subject": s}} for s in heard],
            "limits": {"max_payload": client_max_payload},
        },
    }
    out["accounts"] = accounts
    return out


CLIENT = "client"
MONITOR = "monitor"
# Not a client-side user: the user nats-servers of a cluster log in to each other's route port
# as (ops/nats/cluster.conf); its password is generated with the others.
ROUTE = "route"
SERVICE_ROLES = ("scheduler", "verifier", "drafter", "postprocessor")
ROLES = (*SERVICE_ROLES, MONITOR)  # users named after their role; client users are named in CLIENT_USERS_ENV
INBOX_ROOT = "_INBOX"
CLIENT_USERS_ENV = "SPECBUS_CLIENT_USERS"
_USER_NAME = re.compile(INSTANCE_ID_PATTERN)  # a user name is an inbox subject token
PASSWORD_LENGTH = 32  # generated: a letter, then letters and digits (~190 bits)
# nats-server parses a `$VAR` value as a config token, not as a string: "yes" becomes a bool,
# "12-ab" a broken date, "a b" or "a,b" a parse error and "a#b" may end at a comment. Passwords
# that start with a letter and hold only these characters stay strings, byte for byte.
_PASSWORD = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{15,127}$")
MONITORING_PORT = 8222  # /healthz for the compose healthcheck


class AuthConfigError(SpecbusError):
    """Credentials missing or malformed; `field` names the environment variable."""

    def __init__(self, message: str, variable: str):
        super().__init__(ErrorCode.invalid_field, message, variable)


class PermissionDenied(SpecbusError):
    """The server refused a publish or a subscription of this connection."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.forbidden, message)


@dataclass(frozen=True)
class Permissions:
    """Subjects a role may publish/subscribe to (wildcards as NATS has them). allow_responses:
    may publish once to the reply subject of each message it receives."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False


def password_env(user: str) -> str:
    """The variable holding a user's password: SPECBUS_<USER>_NATS_PASSWORD (- becomes _)."""
    return f"SPECBUS_{user.upper().replace('-', '_')}_NATS_PASSWORD"


def inbox_prefix(user: str) -> str:
    """The inbox prefix a user must connect with (nats-py `connect(inbox_prefix=...)`)."""
    return f"{INBOX_ROOT}.{user}"


def micro_subjects(role: str) -> tuple[str, ...]:
    """What nats.micro subscribes to for a service named `role` (PING, INFO and STATS, each
    for all services, for the name, and for the name and service id)."""
    return ("$SRV.*", f"$SRV.*.{role}", f"$SRV.*.{role}.*")


def kv_subjects(client_user: str) -> tuple[str, ...]:
    """The JetStream API subjects of the user's own key-value bucket, `responses_<user>`, where the
    gateway keeps its stored Responses (services/gateway/response_store.py): create and inspect
    it, get a key (direct or through the stream), put, delete and purge keys. No other bucket."""
    bucket = responses_bucket(client_user)
    stream = f"KV_{bucket}"
    return (f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.MSG.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}.>", f"$KV.{bucket}.>")


def responses_bucket(client_user: str) -> str:
    """The key-value bucket of a client user's stored Responses (user names are subject tokens)."""
    return f"responses_{client_user}"


def role_permissions(prefix: str = DEFAULT_PREFIX, instance_id: str = "*",
                     client_user: str = CLIENT) -> dict[str, Permissions]:
    """Least privilege per role (module docstring); instance_id `*` lets one user serve every
    instance of its role, a real id binds it to one. CLIENT is the client user `client_user`.
    The user's own inbox is added by `nats_user`."""
    subjects = Subjects(prefix)
    p, own = subjects.prefix, instance_id if instance_id == "*" else check_instance_id(instance_id)
    inboxes = f"{INBOX_ROOT}.>"
    return {
        # heartbeats: a client fails its request over when the scheduler running it falls silent
        CLIENT: Permissions(publish=(subjects.generate_for(client_user), subjects.cancel_for(client_user),
                                     *kv_subjects(client_user)),
                            subscribe=(subjects.heartbeat,)),
        "scheduler": Permissions(
            publish=(f"{p}.draft.*", f"{p}.verify.*", f"{p}.post.*.commit", subjects.heartbeat, inboxes),
            subscribe=(f"{subjects.generate}.* {SCHEDULER_QUEUE_GROUP}", f"{subjects.cancel}.*", subjects.heartbeat,
                       f"{p}.stop.{own}", *micro_subjects("scheduler")),
        ),
        "drafter": Permissions(publish=(subjects.heartbeat,),
                               subscribe=(f"{p}.draft.{own}", *micro_subjects("drafter")), allow_responses=True),
        "verifier": Permissions(publish=(f"{p}.post.*.side", subjects.heartbeat),
                                subscribe=(f"{p}.verify.{own}", *micro_subjects("verifier")), allow_responses=True),
        "postprocessor": Permissions(
            publish=(inboxes, f"{p}.stop.*", subjects.heartbeat),
            subscribe=(f"{p}.post.{own}.commit", f"{p}.post.{own}.side", *micro_subjects("postprocessor")),
        ),
        MONITOR: Permissions(publish=("$SRV.>",), subscribe=(subjects.heartbeat,)),
    }


def check_user_name(user: str, variable: str) -> str:
    if not isinstance(user, str) or not _USER_NAME.match(user):
        raise AuthConfigError(f"user name {user!r} is not valid: 1-64 characters from A-Z a-z 0-9 _ -", variable)
    return user


def nats_user(role: str, user: str, password: str, prefix: str = DEFAULT_PREFIX, instance_id: str = "*") -> NatsUser:
    """The server-side user for `role`: its permissions plus its own inbox."""
    all_permissions = role_permissions(prefix, instance_id, client_user=user if role == CLIENT else CLIENT)
    if role not in all_permissions:
        raise ValueError(f"role: unknown role {role!r}, expected one of {sorted(all_permissions)}")
    permissions = all_permissions[role]
    return NatsUser(user=user, password=password, publish=permissions.publish,
                    subscribe=(*permissions.subscribe, inbox_prefix(user) + ".>"),
                    allow_responses=permissions.allow_responses,
                    account=CLIENTS_ACCOUNT if role == CLIENT else SERVICES_ACCOUNT)


def client_user_names(env: Mapping[str, str]) -> list[str]:
    """The names in SPECBUS_CLIENT_USERS ("alice,bob"): valid, distinct, not a role's name."""
    names = [name.strip() for name in env.get(CLIENT_USERS_ENV, "").split(",") if name.strip()]
    if not names:
        raise AuthConfigError("NATS auth needs at least one client user: set it to 'name[,name...]'",
                              CLIENT_USERS_ENV)
    return check_user_names(names)


def user_roles(client_users: Iterable[str]) -> list[tuple[str, str]]:
    """(role, user name) of every user: each role's user, named after it, then the clients."""
    return [*((role, role) for role in ROLES), *((CLIENT, user) for user in check_user_names(client_users))]


def check_user_names(client_users: Iterable[str]) -> list[str]:
    names = [check_user_name(user, CLIENT_USERS_ENV) for user in client_users]
    for user in names:
        if user in (*ROLES, ROUTE):
            raise AuthConfigError(f"client user {user!r} clashes with the {user} role's user", CLIENT_USERS_ENV)
    variables = [password_env(user) for user in (*ROLES, *names)]
    if len(set(variables)) != len(variables):
        raise AuthConfigError(f"client users {names} repeat a name (or differ only in case or - and _)",
                              CLIENT_USERS_ENV)
    return names


def users_from_env(env: Mapping[str, str] | None = None, prefix: str = DEFAULT_PREFIX) -> list[NatsUser]:
    """Every role user (named after its role) and every client user in SPECBUS_CLIENT_USERS,
    each with the password in SPECBUS_<USER>_NATS_PASSWORD.

    Call it only when auth is wanted: a missing or empty password is an AuthConfigError naming
    the variable (no default is ever filled in)."""
    env = os.environ if env is None else env
    users = []
    for role, user in user_roles(client_user_names(env)):
        password = env.get(password_env(user), "")
        if not password:
            raise AuthConfigError(f"NATS auth needs a password for the user {user!r}: set it "
                                  "(python -m services.runtime.auth credentials makes random ones)", password_env(user))
        if not _PASSWORD.match(password):
            raise AuthConfigError("must be 16-128 characters from A-Z a-z 0-9 _ -, starting with a letter "
                                  "(nats-server reads other values as numbers, dates or syntax)", password_env(user))
        users.append(nats_user(role, user, password, prefix))
    return users


def generate_credentials(client_users: Iterable[str] = (CLIENT,)) -> dict[str, str]:
    """Fresh random passwords for every role and the client users, as `users_from_env` reads them,
    and for the cluster's route user."""
    users = user_roles(client_users)
    env = {CLIENT_USERS_ENV: ",".join(user for role, user in users if role == CLIENT)}
    return env | {password_env(user): random_password() for user in (*(user for _, user in users), ROUTE)}


def random_password() -> str:
    letters_digits = string.ascii_letters + string.digits
    return secrets.choice(string.ascii_letters) + "".join(
        secrets.choice(letters_digits) for _ in range(PASSWORD_LENGTH - 1))


def write_secret(path: str | Path, text: str) -> Path:
    """Write text to a file only its owner may read (0600 from creation, never wider)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its old mode through O_CREAT
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return path


def env_file_text(env: Mapping[str, str]) -> str:
    """KEY=value lines (docker compose reads them from `.env`; a shell can `set -a; . file`)."""
    return "".join(f"{key}={value}\n" for key, value in env.items())


def read_env_file(path: Path) -> dict[str, str]:
    """The KEY=value lines of a file as a dict (env_file_text's, and those a person writes: blank
    lines and # comments skipped, `export ` and one level of surrounding quotes removed)."""
    values = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.removeprefix("export ").partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key.strip()] = value
    return values


API_KEY_PREFIX = "sk-specbus-"


def api_key_env(user: str) -> str:
    """The variable holding a client user's API key: SPECBUS_<USER>_API_KEY (- becomes _)."""
    return password_env(user).removesuffix("_NATS_PASSWORD") + "_API_KEY"


def generate_api_keys(users: Sequence[str]) -> dict[str, str]:
    """A fresh random key per client user, as `gateway_logins` reads them."""
    return {api_key_env(user): API_KEY_PREFIX + secrets.token_urlsafe(24) for user in users}


# ---------------------------------------------------------------------------------------------
# nats-server config file


class EnvRef(str):
    """A config value nats-server reads from its environment: rendered as `$NAME`, unquoted."""


def env_password_users(client_users: Iterable[str] = (CLIENT,), prefix: str = DEFAULT_PREFIX) -> list[NatsUser]:
    """The users `users_from_env` would give, each password a `$SPECBUS_<USER>_NATS_PASSWORD`
    reference that nats-server resolves from its own environment."""
    return [nats_user(role, user, EnvRef(password_env(user)), prefix) for role, user in user_roles(client_users)]


def render_server_config(
    users: Iterable[NatsUser],
    *,
    host: str = "0.0.0.0",
    port: int = NATS_PORT,
    http_port: int | None = MONITORING_PORT,
    max_payload: int = MAX_MESSAGE_BYTES,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_ca: str | None = None,
) -> str:
    """The nats-server config file (NATS config syntax): listener, limits, users with their
    permissions in their accounts (render_auth, as the embedded server writes them) and optional TLS."""
    config: dict[str, Any] = {"host": host, "port": port}
    if http_port is not None:
        config["http_port"] = http_port
    config["max_payload"] = max_payload
    config |= render_auth(users)
    if tls_cert is not None:
        config["tls"] = render_tls(tls_cert, tls_key, tls_ca)
    header = "# Rendered by services/runtime/auth.py (python -m services.runtime.auth config); do not edit by hand.\n"
    return header + "".join(f"{key}: {conf_value(value, 0)}\n" for key, value in config.items())


def conf_value(value: Any, depth: int) -> str:
    """One value in NATS config syntax: strings JSON-quoted, EnvRef as `$NAME`."""
    pad, inner = "  " * depth, "  " * (depth + 1)
    if isinstance(value, EnvRef):
        return f"${value}"
    if isinstance(value, dict):
        lines = "".join(f"{inner}{key}: {conf_value(item, depth + 1)}\n" for key, item in value.items())
        return "{\n" + lines + pad + "}"
    if isinstance(value, list) and any(isinstance(item, dict) for item in value):
        return "[\n" + "".join(f"{inner}{conf_value(item, depth + 1)}\n" for item in value) + pad + "]"
    if isinstance(value, list):
        return "[" + ", ".join(conf_value(item, depth) for item in value) + "]"
    return json.dumps(value)


# ---------------------------------------------------------------------------------------------
# permission errors at the call that caused them

_VIOLATION = re.compile(r'Permissions Violation for (Publish|Subscription) to "([^"]*)"', re.IGNORECASE)
T = TypeVar("T")


@dataclass
class PermissionWatch:
    """Fails the calls waiting on a subject the server refused.

    nats-server answers a forbidden PUB/SUB with `-ERR 'Permissions Violation for Publish to
    "<subject>"'` (or `Subscription to`); nats-py hands that to error_cb and nothing else, so a
    request simply times out, and a stream read from a refused inbox waits for nothing. Feed
    error_cb's exceptions to `on_error`, and await each call through `guard(call, publish=...,
    subscribe=...)`, naming the subjects the call publishes or subscribes to: a refusal of one of
    them while the call runs cancels it and raises PermissionDenied. The guarded call must wait
    for something the server sends (a reply, a message): `flush()` is no barrier, since nats-py
    writes its PING straight to the socket, ahead of SUB/PUB still queued, so its PONG can come
    before the refusal. The error names only the subject, so every call waiting on it fails (they
    are all refused); nats-py lowercases the message, so subjects are compared lowercased (two
    subjects differing only in case would share a refusal).
    """

    waiters: dict[tuple[str, str], set[asyncio.Future]] = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)  # (kind, subject) -> violations seen

    def on_error(self, exc: BaseException) -> bool:
        """True when exc was a permissions violation (then counted, its waiters failed)."""
        match = _VIOLATION.search(str(exc))
        if match is None:
            return False
        key = ("publish" if match.group(1).lower() == "publish" else "subscribe", match.group(2).lower())
        self.counts[key] += 1
        for waiter in self.waiters.get(key, ()):
            if not waiter.done():
                waiter.set_result(key)
        return True

    async def guard(self, call: Awaitable[T], *, publish: Iterable[str] = (), subscribe: Iterable[str] = ()) -> T:
        """Await call; PermissionDenied as soon as the server refuses a publish to one of
        `publish` or a subscription to one of `subscribe`. Call it before the call sends
        anything (pass the coroutine unstarted): the refusal comes back after one round trip."""
        keys = [("publish", s.lower()) for s in publish] + [("subscribe", s.lower()) for s in subscribe]
        if not keys:
            if asyncio.iscoroutine(call):
                call.close()
            raise ValueError("guard: name at least one subject in publish or subscribe")
        refused = asyncio.get_running_loop().create_future()
        for key in keys:
            self.waiters.setdefault(key, set()).add(refused)
        task = asyncio.ensure_future(call)
        try:
            await asyncio.wait({task, refused}, return_when=asyncio.FIRST_COMPLETED)
            if refused.done():
                kind, subject = refused.result()
                raise PermissionDenied(f"the server refused to let this connection {kind} to {subject!r}")
            return task.result()
        finally:
            if not task.done():
                task.cancel()
            for key in keys:
                waiters = self.waiters[key]
                waiters.discard(refused)
                if not waiters:
                    del self.waiters[key]


# ---------------------------------------------------------------------------------------------
# python -m services.runtime.auth config|credentials


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.runtime.auth", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    config = commands.add_parser("config", help="the nats-server config; passwords as $VAR references, "
                                 "or from the environment with --from-env")
    config.add_argument("--prefix", default=DEFAULT_PREFIX)
    config.add_argument("--client-users", default=CLIENT, help="comma-separated client user names")
    config.add_argument("--from-env", action="store_true",
                        help="users from SPECBUS_CLIENT_USERS, real passwords from SPECBUS_<USER>_NATS_PASSWORD")
    config.add_argument("--tls-cert")
    config.add_argument("--tls-key")
    config.add_argument("--tls-ca")
    config.add_argument("--out", help="write here (mode 0600) instead of stdout")
    credentials = commands.add_parser("credentials", help="random passwords as KEY=value lines")
    credentials.add_argument("--client-users", default=CLIENT, help="comma-separated client user names")
    credentials.add_argument("--out", help="write here (mode 0600) instead of stdout")
    args = parser.parse_args(argv)
    client_users = [u for u in args.client_users.split(",") if u]
    try:
        if args.command == "credentials":
            text = env_file_text(generate_credentials(client_users))
        else:
            users = users_from_env(prefix=args.prefix) if args.from_env else env_password_users(client_users, args.prefix)
            text = render_server_config(users, tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca)
    except SpecbusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        write_secret(args.out, text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

