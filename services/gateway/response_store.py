"""Stored Responses (POST /v1/responses with store: true) in NATS JetStream key-value: the bus the
stack already runs, so a stored response outlives the gateway that made it and every gateway
behind one NATS reads the same ones.

One bucket per client user, `responses_<user>` (services/runtime/auth.py `responses_bucket`), written through that user's own
connection: NATS permissions (services/runtime/auth.py `kv_subjects`) let a user touch only its
own bucket, so another API key's response is not found (a 404), by the server's rules and not
only the gateway's. Keys are response ids; a value is the record's JSON: the response as
GET returns it and the conversation so far as chat turns (what previous_response_id continues).
Entries expire after RESPONSES_TTL_S (the bucket's max_age), as OpenAI keeps responses 30 days;
the bucket keeps one revision per key on file storage.

A store that cannot be reached (JetStream off, the bucket refused) is a 503 naming `store`:
the response is never silently left unstored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType

from services.gateway.api_errors import ApiError
from services.runtime.auth import responses_bucket

RESPONSES_TTL_S = 30 * 24 * 3600.0  # OpenAI keeps a stored response 30 days
KV_TIMEOUT_S = 10.0


def unavailable(exc: BaseException) -> ApiError:
    return ApiError(503, f"store: the response store (NATS JetStream key-value) is unavailable: "
                         f"{type(exc).__name__} {str(exc)[:200]}".strip(), type="service_unavailable", param="store",
                    code="store_unavailable")


@dataclass
class ResponseStore:
    """The per-user buckets, opened (created when missing) on first use through each user's connection."""

    connections: dict[str, Any]  # client user -> its NATS connection
    buckets: dict[str, Any] = field(default_factory=dict)

    async def bucket(self, user: str) -> Any:
        if user not in self.buckets:
            js = self.connections[user].jetstream(timeout=KV_TIMEOUT_S)
            try:
                self.buckets[user] = await js.create_key_value(KeyValueConfig(
                    bucket=responses_bucket(user), history=1, ttl=RESPONSES_TTL_S, storage=StorageType.FILE))
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                raise unavailable(exc) from None
        return self.buckets[user]

    async def put(self, user: str, response_id: str, record: dict) -> None:
        kv = await self.bucket(user)
        try:
            await kv.put(response_id, json.dumps(record, separators=(",", ":")).encode())
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            raise unavailable(exc) from None

    async def get(self, user: str, response_id: str, param: str = "response_id") -> dict:
        """The record; a 404 naming param when the user has none of that id."""
        kv = await self.bucket(user)
        try:
            entry = await kv.get(response_id)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.InvalidKeyError):
            raise not_found(response_id, param) from None
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            raise unavailable(exc) from None
        if not entry.value:
            raise not_found(response_id, param)
        return json.loads(entry.value)

    async def delete(self, user: str, response_id: str) -> None:
        await self.get(user, response_id)  # a 404 for one that is not there
        kv = await self.bucket(user)
        try:
            await kv.purge(response_id)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            raise unavailable(exc) from None


def not_found(response_id: str, param: str) -> ApiError:
    return ApiError(404, f"{param}: no response {response_id[:80]!r} (not stored, expired, or another key's)",
                    type="invalid_request_error", param=param, code="not_found")
