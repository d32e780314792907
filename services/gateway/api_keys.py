"""API keys: SPECBUS_<USER>_API_KEY per client user (services/runtime/auth.py names the
variables), each key mapped to the client user whose NATS connection its requests go out on."""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.gateway.api_errors import ApiError
from services.runtime.auth import AuthConfigError, api_key_env, client_user_names, password_env


@dataclass(frozen=True)
class Login:
    user: str
    password: str
    api_key: str


def gateway_logins(env: Mapping[str, str]) -> list[Login]:
    """Every client user in SPECBUS_CLIENT_USERS with its NATS password and API key;
    AuthConfigError naming the variable that is missing."""
    logins = []
    for user in client_user_names(env):
        password, api_key = env.get(password_env(user), ""), env.get(api_key_env(user), "")
        for variable, value in ((password_env(user), password), (api_key_env(user), api_key)):
            if not value:
                raise AuthConfigError(f"the gateway needs it for the client user {user!r}", variable)
        logins.append(Login(user, password, api_key))
    return logins


def user_for_key(logins: Sequence[Login], authorization: str | None) -> str:
    """The client user whose key is in `Authorization: Bearer <key>`; 401 otherwise. Every key is
    compared in constant time."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(401, "missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key")
    found = [login.user for login in logins if hmac.compare_digest(login.api_key.encode(), key.strip().encode())]
    if not found:
        raise ApiError(401, "incorrect API key", code="invalid_api_key")
    return found[0]
