"""The gateway's front door: the limits checked before any work, as plain ASGI around the app,
and uvicorn's h11 protocol with a deadline on request headers.

In order: the headers' size (a 431 over max_header_bytes), the API key (under /v1, before a byte
of the body is read), the body's declared size (a 413 by its Content-Length), then the body itself,
read whole within body_timeout_s and max_body_bytes and handed to the app as one message. A
refusal closes the connection. `HeaderDeadlineH11` gives each request's head header_timeout_s to
arrive (uvicorn has no such deadline: a client that sends half a request line would hold its
connection forever) and answers malformed or oversized heads with an OpenAI error too.
"""

from __future__ import annotations

import asyncio
import http
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import h11
import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

from schemas.config import GatewayConfig
from schemas.errors import ErrorCode, SpecbusError
from services.gateway.api_errors import ApiError

log = structlog.get_logger(__name__)

DRAIN_FACTOR = 2  # a body up to this many times max_body_bytes is read out before its 413 (front_door)


def needs_api_key(path: str) -> bool:
    """Everything under /v1 needs a key (even a route that does not exist: the key is checked
    before anything else); /health, /metrics and the OpenAPI docs do not, by design: they show
    no tenant's data (docs/PROTOCOL.md#tenant-isolation says why)."""
    return path == "/v1" or path.startswith("/v1/")


def check_header_size(headers: Sequence[tuple[bytes, bytes]], max_header_bytes: int) -> None:
    """A 431 for headers over max_header_bytes (h11 bounds only a head that arrives in pieces)."""
    size = sum(len(name) + len(value) + 4 for name, value in headers)
    if size > max_header_bytes:
        raise headers_too_large(max_header_bytes)


def headers_too_large(max_header_bytes: int) -> ApiError:
    return ApiError(431, f"the request headers are over {max_header_bytes} bytes (max_header_bytes)",
                    code="headers_too_large")


def declared_length(headers: Sequence[tuple[bytes, bytes]], max_body_bytes: int) -> int | None:
    """The body's Content-Length (None: not given, e.g. chunked); a 413 over max_body_bytes, a
    400 for a value that is not a number."""
    values = [value for name, value in headers if name.lower() == b"content-length"]
    if not values:
        return None
    try:
        length = int(values[0])
    except ValueError:
        raise ApiError(400, "Content-Length is not a number", code="bad_request") from None
    if length > max_body_bytes:
        raise body_too_large(max_body_bytes)
    return length


def body_too_large(max_body_bytes: int) -> ApiError:
    return ApiError(413, f"the request body is over {max_body_bytes} bytes (max_body_bytes)",
                    code="request_too_large")


def body_too_slow(body_timeout_s: float) -> ApiError:
    return ApiError(408, f"the request body did not arrive within {body_timeout_s:g} s (body_timeout_s)",
                    type="timeout", code="request_timeout")


def check_gateway_limits(config: GatewayConfig) -> None:
    """SpecbusError naming the first GatewayConfig limit that is not positive."""
    for name in ("max_body_bytes", "body_timeout_s", "header_timeout_s", "keep_alive_timeout_s", "max_header_bytes"):
        if not getattr(config, name) > 0:
            raise SpecbusError(ErrorCode.invalid_field, f"must be > 0, got {getattr(config, name)!r}", name)


def front_door(app: Any, config: GatewayConfig, user_for: Callable[[str | None], str]) -> Any:
    """app behind the limits checked before any work (module docstring): the key (under /v1),
    then the body's declared size, then the body itself, read whole within body_timeout_s and
    max_body_bytes and handed to app as one message. A refusal closes the connection, and what is
    left of the body is not read, with one exception: a body over the cap by at most as much again
    (DRAIN_FACTOR) is read out and dropped before its 413, so that a client which writes its whole
    body before it reads (the SDKs do) gets the answer, not a reset connection. user_for: the
    client user of an Authorization header (ApiError 401 for a bad key)."""

    async def asgi(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        headers = scope["headers"]
        drain = False  # a 413 reads the rest first: the key is good and the body not far over
        try:
            check_header_size(headers, config.max_header_bytes)
            if needs_api_key(scope["path"]):
                authorization = next((v.decode("latin-1") for k, v in headers if k == b"authorization"), None)
                user_for(authorization)
            declared_length(headers, DRAIN_FACTOR * config.max_body_bytes)
            drain = True
            body = await read_body(receive, config.max_body_bytes, config.body_timeout_s)
        except ApiError as error:
            if error.status == 413 and drain:
                await read_body(receive, DRAIN_FACTOR * config.max_body_bytes, config.body_timeout_s, keep=False)
            return await send_error(send, error, close=True)
        if body is None:  # the client went away while sending it
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # next: the disconnect, which handlers watch for
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await app(scope, replay, send)

    return asgi


async def read_body(receive: Callable[[], Awaitable[dict]], max_body_bytes: int, timeout_s: float, *,
                    keep: bool = True) -> bytes | None:
    """The whole request body (None: the client disconnected first); ApiError 413 past
    max_body_bytes, 408 past timeout_s. keep=False: read what is left of a body and drop it
    (errors swallowed: the caller is refusing it anyway)."""
    parts, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                part = message.get("body", b"")
                size += len(part)
                if size > max_body_bytes:
                    raise body_too_large(max_body_bytes)
                if keep:
                    parts.append(part)
                if not message.get("more_body", False):
                    return b"".join(parts)
    except TimeoutError:
        if keep:
            raise body_too_slow(timeout_s) from None
    except ApiError:
        if keep:
            raise
    return None


async def send_error(send: Callable[[dict], Awaitable[None]], error: ApiError, *, close: bool = False) -> None:
    """An OpenAI error as a whole ASGI response; close: with `Connection: close`."""
    payload = json.dumps(error.to_json()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class HeaderDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on request headers: from a connection's start, and
    from the first byte of each later request, its request line and headers must be complete
    within header_timeout_s, or the connection is closed (uvicorn only times out idle keep-alive
    connections). Malformed or oversized headers get an OpenAI error instead of uvicorn's text."""

    header_timeout_s: float = 10.0  # set per server by `protocol_class`
    header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # (part of) the next request's head, or nothing yet
            if self.header_timer is None and not self.transport.is_closing():
                self.arm_header_timer()
        else:
            self.cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_header_timer()
        super().connection_lost(exc)

    def arm_header_timer(self) -> None:
        self.header_timer = self.loop.call_later(self.header_timeout_s, self.headers_too_slow)

    def cancel_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def headers_too_slow(self) -> None:
        self.header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.info("gateway_header_timeout", client=self.client)
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to what h11 refuses: a head that grew past h11's bound (the server's
        h11_max_incomplete_event_size: max_header_bytes) before it was complete is the front
        door's 431 (however TCP split it), anything else a 400."""
        max_header_bytes = self.config.h11_max_incomplete_event_size
        if len(self.conn.trailing_data[0]) > max_header_bytes:
            error = headers_too_large(max_header_bytes)
        else:
            error = ApiError(400, f"not a valid HTTP request: {msg}", code="bad_request")
        payload = json.dumps(error.to_json()).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        response = h11.Response(status_code=error.status, headers=headers,
                                reason=http.HTTPStatus(error.status).phrase.encode())
        for event in (response, h11.Data(data=payload), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def protocol_class(header_timeout_s: float) -> type[H11Protocol]:
    return type("GatewayH11Protocol", (HeaderDeadlineH11,), {"header_timeout_s": header_timeout_s})
