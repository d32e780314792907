"""services/gateway/api_keys.py: keys from the environment, each mapped to its client user."""

import pytest

from schemas.errors import SpecbusError
from services.gateway.api_errors import ApiError
from services.gateway.api_keys import Login, gateway_logins, user_for_key
from services.runtime.auth import api_key_env, generate_api_keys


def test_api_keys_come_from_the_environment_and_are_checked(monkeypatch):
    keys = generate_api_keys(["alice", "bob-2"])
    assert set(keys) == {"SPECBUS_ALICE_API_KEY", "SPECBUS_BOB_2_API_KEY"} and api_key_env("bob-2") in keys
    env = {"SPECBUS_CLIENT_USERS": "alice,bob-2", "SPECBUS_ALICE_NATS_PASSWORD": "p1",
           "SPECBUS_BOB_2_NATS_PASSWORD": "p2", **keys}
    logins = gateway_logins(env)
    assert [(login.user, login.password) for login in logins] == [("alice", "p1"), ("bob-2", "p2")]
    assert user_for_key(logins, f"Bearer {keys['SPECBUS_BOB_2_API_KEY']}") == "bob-2"
    for header in (None, "", "Bearer ", "Basic abc", f"Bearer {keys['SPECBUS_ALICE_API_KEY']}x"):
        with pytest.raises(ApiError) as caught:
            user_for_key(logins, header)
        assert (caught.value.status, caught.value.code) == (401, "invalid_api_key")
    with pytest.raises(SpecbusError) as caught:
        gateway_logins({k: v for k, v in env.items() if k != "SPECBUS_BOB_2_API_KEY"})
    assert caught.value.field == "SPECBUS_BOB_2_API_KEY"
    assert user_for_key([Login("a", "p", "k")], "bearer k") == "a"
