"""The gateway's front door against a client that misbehaves: limits checked before any work,
and every error an OpenAI error object, the web framework's own included.

A bare stack: nats-server and one gateway (auth on, client user alice), no scheduler, so
nothing here waits on a model; the gateway's header and body deadlines are shortened
(HEADER_TIMEOUT_S, BODY_TIMEOUT_S) so the tests can watch them fire. What the limits let through
is served as usual (tests/system/api/test_gateway.py); one client's flood on the bus is tested there too.
Waits are bounded generously (WAIT_S): nothing here depends on how fast the machine is.
"""

import asyncio
import json
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import pytest_asyncio


pytestmark = pytest.mark.asyncio(loop_scope="module")

HEADER_TIMEOUT_S = 3
BODY_TIMEOUT_S = 3
MAX_BODY_BYTES = 8 * 1024 * 1024  # GatewayConfig's default
WAIT_S = 60.0  # the most any wait here takes before it fails
HUGE = 300_000_000
RSS_GROWTH_LIMIT = 64 * 1024 * 1024  # the gateway holds no body it refused: far below HUGE


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(start_stack, tiny_pair):
    gateway = ["--header-timeout-s", str(HEADER_TIMEOUT_S), "--body-timeout-s", str(BODY_TIMEOUT_S)]
    async with start_stack(*tiny_pair, schedulers=0, verifiers=0, drafters=0, postprocessors=0, gateways=1,
                           client_users=("alice",), role_args={"gateway": gateway}) as running:
        yield running


@pytest.fixture(scope="module")
def port(stack) -> int:
    return next(iter(stack.gateway_ports.values()))


@pytest.fixture(scope="module")
def api(stack):
    return openai.AsyncOpenAI(base_url=stack.openai_base_url, api_key=stack.api_key("alice"), max_retries=0,
                              timeout=WAIT_S)


def rss_bytes(stack) -> int:
    status = Path(f"/proc/{stack.processes['gateway-0'].process.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024


def head(path: str, length: int | None, key: str | None = None, method: str = "POST", extra: str = "") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: gateway", "Content-Type: application/json"]
    lines += [f"Content-Length: {length}"] if length is not None else []
    lines += [f"Authorization: Bearer {key}"] if key else []
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one HTTP response (the body by Content-Length, else to the close)."""
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        if not part:
            raise ConnectionError(f"closed before a whole response head: {data!r}")
        data += part
    head_bytes, body = data.split(b"\r\n\r\n", 1)
    status_line, *header_lines = head_bytes.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in header_lines)}
    length = int(headers.get("content-length", -1))
    while length < 0 or len(body) < length:
        part = sock.recv(65536)
        if not part:
            break
        body += part
    return int(status_line.split()[1]), headers, body


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the server has closed (EOF or reset); waits up to WAIT_S."""
    sock.settimeout(WAIT_S)
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return False
    return True


def upload(port: int, request_head: bytes, total: int, outcome: dict) -> None:
    """Send request_head, read the response the server gives before the body, then keep sending
    the body until it is all sent or the server has closed; outcome gets the response and the bytes sent."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    try:
        sock.sendall(request_head + b"{")
        outcome["response"] = read_response(sock)
        outcome["sent"] = 1
        chunk = b" " * (1 << 20)
        while outcome["sent"] < total:
            sock.sendall(chunk)
            outcome["sent"] += len(chunk)
    except OSError as exc:  # reset or broken pipe: the server closed it
        outcome["closed"] = type(exc).__name__
    finally:
        sock.close()


def http_get(port: int, path: str, key: str | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=WAIT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def is_openai_error(body: dict) -> bool:
    return set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}


# ---------------------------------------------------------------------------------------------
# limits before work


@pytest.mark.parametrize("keyed", [False, True], ids=["no key: 401", "a key: 413"])
async def test_a_huge_body_is_refused_before_it_is_read_and_health_answers_meanwhile(stack, port, keyed):
    """300 MB announced: without a key a 401, with one a 413, both before the body is read (the
    response comes while the client still sends), then the connection closes; the gateway's memory
    does not grow by the body and /health answers while the upload is under way."""
    before = rss_bytes(stack)
    outcome: dict = {}
    key = stack.api_key("alice") if keyed else None
    thread = threading.Thread(target=upload, args=(port, head("/v1/completions", HUGE, key), HUGE, outcome))
    thread.start()
    health_status, health = await asyncio.to_thread(http_get, port, "/health")
    await asyncio.to_thread(thread.join, WAIT_S)
    assert not thread.is_alive()
    status, headers, body = outcome["response"]
    assert status == (413 if keyed else 401) and headers["connection"] == "close"
    error = json.loads(body)
    assert is_openai_error(error) and error["error"]["code"] == ("request_too_large" if keyed else "invalid_api_key")
    assert outcome.get("closed") and outcome["sent"] < HUGE // 4  # the server stopped taking it
    assert health_status in (200, 503) and (health == {"status": "ok"} or is_openai_error(health))
    assert rss_bytes(stack) - before < RSS_GROWTH_LIMIT


async def test_a_chunked_body_over_the_cap_is_a_413_once_the_cap_is_reached(stack, port):
    """No Content-Length to refuse by: the body is kept up to max_body_bytes, no further (the
    rest, up to as much again, is read and dropped so that the client gets its 413)."""
    before = rss_bytes(stack)

    def chunked() -> tuple[int, dict, bytes]:
        sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        try:
            sock.sendall(head("/v1/completions", None, stack.api_key("alice"), extra="Transfer-Encoding: chunked\r\n"))
            piece = b" " * (1 << 20)
            for _ in range(2 * MAX_BODY_BYTES // len(piece)):  # over the cap, not so far that it is cut
                sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
            return read_response(sock)
        finally:
            sock.close()

    status, _, body = await asyncio.to_thread(chunked)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert rss_bytes(stack) - before < RSS_GROWTH_LIMIT


async def test_connections_with_half_sent_headers_are_closed(stack, port):
    """50 connections, each with half a request (and one with nothing at all), are closed after
    header_timeout_s; /health answers meanwhile."""
    connections = []
    for i in range(50):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        if i:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Le")
            await writer.drain()
        connections.append((reader, writer))
    status, _ = await asyncio.to_thread(http_get, port, "/health")
    assert status in (200, 503)

    async def closed(reader) -> bool:
        return await asyncio.wait_for(reader.read(), timeout=WAIT_S) == b""

    assert all(await asyncio.gather(*(closed(reader) for reader, _ in connections)))
    for _, writer in connections:
        writer.close()


async def test_a_body_that_stops_coming_is_a_408_and_the_connection_closes(stack, port):
    def slow() -> tuple[tuple[int, dict, bytes], bool]:
        sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        try:
            sock.sendall(head("/v1/completions", 100, stack.api_key("alice")) + b'{"prompt": ')
            return read_response(sock), closed_by_peer(sock)
        finally:
            sock.close()

    (status, headers, body), closed = await asyncio.to_thread(slow)
    assert status == 408 and headers["connection"] == "close" and closed
    assert json.loads(body)["error"]["code"] == "request_timeout"


@pytest.mark.parametrize("pieces", [1, 2], ids=["at once", "in pieces"])
async def test_oversized_headers_get_an_openai_error(stack, port, pieces):
    """Over max_header_bytes (16 KiB): a 431 however they arrive: read at once (the front door
    measures them) or in pieces that h11 refuses once the part received is already too long (TCP
    may split even a head sent at once, so both paths must give the same answer)."""
    request_head = head("/v1/models", None, method="GET", extra=f"X-Big: {'a' * 40_000}\r\n")

    def big() -> tuple[int, dict, bytes]:
        sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        try:
            if pieces == 1:
                sock.sendall(request_head)
            else:
                sock.sendall(request_head[:30_000])
            return read_response(sock)
        finally:
            sock.close()

    status, _, body = await asyncio.to_thread(big)
    error = json.loads(body)
    assert status == 431 and is_openai_error(error) and error["error"]["code"] == "headers_too_large"


# ---------------------------------------------------------------------------------------------
# every error an OpenAI error object


def raw_request(port: int, method: str, path: str, body: bytes, key: str | None) -> tuple[int, dict, dict]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    try:
        sock.sendall(head(path, len(body), key, method=method) + body)
        status, headers, payload = read_response(sock)
        return status, headers, json.loads(payload)
    finally:
        sock.close()


@pytest.mark.parametrize("method, path, body, status, code", [
    ("POST", "/v1/completions", b'{"prompt": "\xff"}', 400, "invalid_json"),  # a raw byte that is not UTF-8
    ("POST", "/v1/completions", b'{"prompt": ', 400, "invalid_json"),
    ("POST", "/v1/completions", b'["a list"]', 400, "bad_request"),
    ("GET", "/v1/nothing", b"", 404, "not_found"),
    ("GET", "/nothing", b"", 404, "not_found"),
    ("DELETE", "/v1/models", b"", 405, "method_not_allowed"),
    ("POST", "/v1/models", b"{}", 405, "method_not_allowed"),
    ("GET", "/v1/models", b"", 401, "invalid_api_key"),  # no key
])
async def test_framework_errors_are_openai_error_objects(stack, port, method, path, body, status, code):
    key = None if code == "invalid_api_key" else stack.api_key("alice")
    got, headers, error = await asyncio.to_thread(raw_request, port, method, path, body, key)
    assert (got, error["error"]["code"]) == (status, code) and is_openai_error(error)
    assert headers["content-type"] == "application/json"
    if status == 405:
        assert "GET" in headers["allow"]


async def test_an_unknown_model_of_8_mb_is_a_404_that_does_not_echo_it(api):
    name = "m" * 8_000_000
    with pytest.raises(openai.NotFoundError) as caught:
        await api.completions.create(model=name, prompt="x", max_tokens=1)
    assert caught.value.body["code"] == "model_not_found" and len(caught.value.response.content) < 1000
    with pytest.raises(openai.NotFoundError) as caught:
        await api.models.retrieve(name[:2000])
    assert len(caught.value.response.content) < 1000
    with pytest.raises(openai.BadRequestError) as caught:  # an unknown field of 1 MB names itself, clipped
        await api.completions.create(model=openai.omit, prompt="x", extra_body={"k" * 1_000_000: 1})
    assert len(caught.value.response.content) < 1000


async def test_a_body_over_the_cap_through_the_sdk_is_a_413(api):
    with pytest.raises(openai.APIStatusError) as caught:
        await api.completions.create(model=openai.omit, prompt="x" * (MAX_BODY_BYTES + 1), max_tokens=1)
    assert caught.value.status_code == 413 and caught.value.body["code"] == "request_too_large"


@pytest.mark.parametrize("body, words", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),  # valid UTF-8, deeper than the parser goes
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "4300 digits"),  # a number too long to convert
    (b"", "the body is empty"),
], ids=["deep", "huge integer", "empty"])
async def test_a_body_json_cannot_read_is_invalid_json_saying_why(stack, port, body, words):
    status, _, error = await asyncio.to_thread(raw_request, port, "POST", "/v1/completions", body,
                                               stack.api_key("alice"))
    assert (status, error["error"]["code"]) == (400, "invalid_json") and is_openai_error(error)
    assert words in error["error"]["message"] and "UTF-8" not in error["error"]["message"]


async def test_a_body_sent_as_plain_text_is_a_415_naming_the_content_type(stack, port):
    body = b'{"prompt": "x"}'
    request = head("/v1/completions", len(body), stack.api_key("alice")).replace(b"application/json", b"text/plain")

    def send() -> tuple[int, dict, bytes]:
        sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        try:
            sock.sendall(request + body)
            return read_response(sock)
        finally:
            sock.close()

    status, _, payload = await asyncio.to_thread(send)
    error = json.loads(payload)
    assert (status, error["error"]["code"]) == (415, "unsupported_media_type") and is_openai_error(error)
    assert "application/json" in error["error"]["message"] and "text/plain" in error["error"]["message"]


async def test_values_of_the_wrong_json_type_are_refused_naming_the_field(api):
    """Strict types for the whole API, as OpenAI's server takes them: "8" is not a number."""
    with pytest.raises(openai.BadRequestError) as caught:
        await api.completions.create(model=openai.omit, prompt="x", max_tokens="8")
    assert caught.value.body["param"] == "max_tokens" and caught.value.body["code"] == "invalid_field"
    with pytest.raises(openai.BadRequestError) as caught:
        await api.completions.create(model=openai.omit, prompt="x", extra_body={"ignore_eos": 1})
    assert caught.value.body["param"] == "ignore_eos"


async def test_a_lone_surrogate_in_chat_content_names_the_messages_full_path(stack, port):
    body = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "a\\ud800"}]}'
    status, _, error = await asyncio.to_thread(raw_request, port, "POST", "/v1/chat/completions", body,
                                               stack.api_key("alice"))
    assert (status, error["error"]["param"]) == (400, "messages[1].content") and is_openai_error(error)
