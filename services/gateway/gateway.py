"""The OpenAI-compatible HTTP gateway: `specbus serve gateway` (docs/HTTP_API.md#openai-compatible-api).

    GET  /v1/models             the target (with the draft as an extra field)
    GET  /v1/models/{id}        that entry (the SDK's models.retrieve)
    POST /v1/completions        text or token-id prompts; stream, logprobs, echo, n
    POST /v1/chat/completions   messages (the scheduler renders the target's chat template), tools
    POST /v1/responses          OpenAI's Responses API, stored in NATS key-value (responses_api.py)
    POST /v1/messages           Anthropic's Messages API (messages_api.py)
    GET  /health                200 once a scheduler answers $SRV.PING, else 503
    GET  /metrics               Prometheus

It is just another NATS client (services/client.py's Client): each API key maps to a client
user, and the gateway holds one NATS connection per user, so the isolation NATS gives client
users (own subjects, own inbox) holds through HTTP too; a "monitor" connection pings the
schedulers for /health. Any number of gateways can run behind a load balancer: they share no
state. What is not I/O has its own modules: request_bodies.py (bodies and their mapping to
GenerateRequests), responses.py (the OpenAI shapes), api_errors.py, api_keys.py, token_texts.py;
front_door.py holds the limits checked before any work.

FastAPI on uvicorn, as vLLM and SGLang serve their OpenAI APIs: request bodies are typed models
(validated before a handler runs, and published as the OpenAPI schema at /docs), Starlette's
StreamingResponse does SSE and tells a handler when its client went away, and uvicorn's server
runs inside our own asyncio loop next to the NATS connections (its signal handling is left to the
CLI, like every other service's).

Limits come before work (`front_door`, plain ASGI around the app): the API key is checked before
a byte of the body is read, a body over max_body_bytes is refused by its Content-Length (or once
that much came), and the whole body must arrive within body_timeout_s; only then does FastAPI see
the request, with the body already in memory. uvicorn's h11 protocol gets a deadline for each
request's headers (`HeaderDeadlineH11`: uvicorn has none, so a client that sends half a request
line would hold its connection forever) and answers malformed HTTP with an OpenAI error too.
Every error, the framework's own included (unknown route, method, unparsable body), is an OpenAI
error object.

A request is sent and its first chunk awaited before any HTTP status goes out, so what the
scheduler refuses (a bad field, overloaded, no scheduler) is an HTTP error, not a broken stream;
an error after the first chunk ends the SSE stream with an error event and `data: [DONE]`. A
client that disconnects, mid-stream or while it waits for a non-streamed answer, cancels its
requests (Stream.close sends the CancelRequest).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio
import nats.errors
import structlog
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from text.tokenizer import Tokenizer, load_tokenizer
from schemas.bus.codec import CodecError, decode_heartbeat
from schemas.config import GatewayConfig
from schemas.errors import ErrorCode, SpecbusError
from schemas.bus.subjects import DEFAULT_CLIENT_USER, Subjects
from services.client import Client, Stream
from services.gateway.api_errors import ApiError, clip, content_type_error, framework_error, validation_error
from services.gateway.api_keys import Login, gateway_logins, user_for_key
from services.gateway.front_door import check_gateway_limits, front_door, protocol_class
from services.gateway.request_bodies import ChatBody, ChoicePlan, CompletionBody, chat_plans, completion_plans
from services.gateway.responses import Choice, Envelope, VerifierLimits, merge_pieces, model_card, speculation_json, sse, usage_json
from services.gateway.messages_api import add_routes as add_messages_routes
from services.gateway.responses_api import add_routes as add_responses_routes
from services.gateway.token_texts import TokenTexts
from services.gateway.tools import shape_choices, stream_shapers
from services.runtime.auth import MONITOR, check_user_names, env_file_text, generate_api_keys, inbox_prefix, password_env
from services.runtime.bus import connect_service
from services.runtime.metrics import LATENCY_BUCKETS, Metrics, serve_metrics
from services.runtime.tasks import Serving, serve_until_stopped

log = structlog.get_logger(__name__)

# On stop, how long responses in flight may go on before they are cut (their requests then cancelled);
# under the stack's SIGKILL stop_timeout_s.
STOP_GRACE_S = 5.0
RETRY_AFTER_S = 1
CLIENT_GONE_STATUS = 499  # nginx's "client closed request": logged and counted, read by nobody
T = TypeVar("T")


class GatewayMetrics(Metrics):
    def __init__(self) -> None:
        super().__init__("gateway")
        self.requests = self.counter("http_requests", "HTTP requests answered", ("endpoint", "status"))
        self.cancelled = self.counter("disconnect_cancels", "requests cancelled because their client went away")
        self.generated_tokens = self.counter("generated_tokens", "completion tokens sent to HTTP clients")
        self.time_to_first_chunk = self.histogram("time_to_first_chunk_seconds",
                                                  "request received to its first chunk", LATENCY_BUCKETS)
        self.open_streams = Gauge(self.prefix + "open_streams", "SSE responses in progress", registry=self.registry)


@dataclass
class Gateway:
    """What the HTTP handlers share: the config, one Client per client user, the tokenizer."""

    config: GatewayConfig
    clients: dict[str, Client]  # client user -> its connection
    logins: list[Login] | None  # None: no_auth (every key goes to the one client)
    health_nc: Any  # a connection allowed to publish $SRV.PING
    tokenizer: Tokenizer
    texts: TokenTexts
    model: str
    card: dict
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    limits: VerifierLimits = field(default_factory=VerifierLimits)

    def client_for(self, request: Request) -> Client:
        return self.clients[self.user_for(request.headers.get("authorization"))]

    def user_for(self, authorization: str | None) -> str:
        """The client user of an Authorization header (ApiError 401); without auth, the one login."""
        if self.logins is None:
            return next(iter(self.clients))
        return user_for_key(self.logins, authorization)

    def check_model(self, model: str | None) -> None:
        """None or "" (no model named) is the one model served, as vLLM takes it."""
        if model and model != self.model:
            raise ApiError(404, f"model {clip(model)!r} does not exist; this server serves {self.model!r}",
                           type="invalid_request_error", param="model", code="model_not_found")

    def model_entry(self) -> dict:
        now = time.monotonic()
        return self.card | {"max_model_len": self.limits.max_model_len(now), "weights": self.limits.served_weights(now)}

    async def on_heartbeat(self, msg: Any) -> None:
        try:
            beat = decode_heartbeat(msg.data)
        except CodecError:
            return  # the services count bad heartbeats; the gateway only needs the good ones
        if beat is not None:  # None: the beat's copy for other versions
            self.limits.observe(beat, time.monotonic())


# ---------------------------------------------------------------------------------------------
# running a request's choices


@dataclass
class Running:
    """The open streams of one HTTP request, each with its Choice and its first chunk."""

    streams: list[Stream | None]  # None: not opened (yet)
    choices: list[Choice]
    firsts: list[Any]

    async def close(self) -> None:
        """Close every stream (cancelling the unfinished), even inside a cancelled scope."""
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*(s.close() for s in self.streams if s is not None), return_exceptions=True)

    async def chunks(self) -> AsyncIterator[tuple[int, Any]]:
        """(position, chunk) of every stream as they come, first chunks first."""
        for position, first in enumerate(self.firsts):
            yield position, first
        queue: asyncio.Queue = asyncio.Queue()
        pending = [position for position, first in enumerate(self.firsts) if not first.final]

        async def pump(position: int) -> None:
            try:
                async for chunk in self.streams[position]:
                    await queue.put((position, chunk, None))
                await queue.put((position, None, None))
            except Exception as exc:  # the reader raises it
                await queue.put((position, None, exc))

        tasks = [asyncio.create_task(pump(position)) for position in pending]
        try:
            remaining = len(tasks)
            while remaining:
                position, chunk, error = await queue.get()
                if error is not None:
                    raise error
                if chunk is None:
                    remaining -= 1
                    continue
                yield position, chunk
        finally:
            for task in tasks:
                task.cancel()


async def open_choices(gateway: Gateway, client: Client, plans: list[ChoicePlan], top_n: int | None,
                       param_names: dict[str, str], prompt_top_n: int | None = None) -> Running:
    """Send every choice's request and wait for each first chunk; an error closes them all."""
    running = Running([None] * len(plans), [], [])

    async def first(position: int, plan: ChoicePlan) -> Any:
        running.streams[position] = await client.open_stream(plan.request)
        return await anext(running.streams[position])

    started = time.monotonic()
    tasks = [asyncio.create_task(first(position, plan)) for position, plan in enumerate(plans)]
    try:
        running.firsts = list(await asyncio.gather(*tasks))
    except BaseException as exc:
        for task in tasks:  # the other choices stop too; close() then cancels their requests
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await running.close()
        if isinstance(exc, SpecbusError):
            raise ApiError.from_specbus(exc, param_names) from None
        raise
    running.choices = [Choice(plan.index, gateway.texts, top_n, plan.echo_text, prompt_top_n) for plan in plans]
    gateway.metrics.time_to_first_chunk.observe(time.monotonic() - started)
    return running


def piece_of(kind: str, choice: Choice, chunk: Any, *, delta: bool) -> dict:
    return choice.completion_piece(chunk) if kind == "completion" else choice.chat_piece(chunk, delta=delta)


async def respond(gateway: Gateway, request: Request, client: Client, body: CompletionBody | ChatBody,
                  kind: Literal["completion", "chat"], plans: list[ChoicePlan], top_n: int | None) -> Response:
    """The response: a stream once every choice's first chunk came, or the whole thing. A client
    that goes away before (a non-streamed request: before the end) cancels the requests."""
    envelope = Envelope(kind, gateway.model)

    def opening() -> Awaitable[Running]:
        return open_choices(gateway, client, plans, top_n, body.param_names(), body.prompt_logprobs)

    if body.stream:
        running = await unless_gone(gateway, request, opening())
        if running is None:
            return Response(status_code=CLIENT_GONE_STATUS)
        return StreamingResponse(stream_events(gateway, running, envelope, body, kind), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    answer = await unless_gone(gateway, request, collect(gateway, opening, envelope, body))
    return Response(status_code=CLIENT_GONE_STATUS) if answer is None else JSONResponse(answer)


async def collect(gateway: Gateway, opening: Callable[[], Awaitable[Running]], envelope: Envelope,
                  body: CompletionBody | ChatBody) -> dict:
    """A non-streamed response: every choice's chunks gathered."""
    running = await opening()
    pieces: dict[int, list[dict]] = {position: [] for position in range(len(running.choices))}
    try:
        async for position, chunk in running.chunks():
            pieces[position].append(piece_of(envelope.kind, running.choices[position], chunk, delta=False))
    except SpecbusError as exc:
        raise ApiError.from_specbus(exc, body.param_names()) from None
    finally:
        await running.close()
    choices = shape_choices(body, [merge_pieces(envelope.kind, pieces[position])
                                   for position in range(len(running.choices))])
    usage = usage_json(running.choices, body.n)
    gateway.metrics.generated_tokens.inc(usage["completion_tokens"])
    answer = envelope.wrap(choices, chunk=False, usage=usage, speculation=speculation_json(running.choices))
    if envelope.kind == "chat" and body.prompt_logprobs is not None:  # vLLM: next to the choices (one prompt)
        answer["prompt_logprobs"] = running.choices[0].prompt_logprobs
    return answer


async def unless_gone(gateway: Gateway, request: Request, work: Awaitable[T]) -> T | None:
    """work's result, or None when the HTTP client disconnects first: work is then cancelled,
    which closes its streams and so cancels their requests."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if not task.cancelled() and task.done() and not gone.done():
        return task.result()
    await asyncio.gather(task, return_exceptions=True)
    gateway.metrics.cancelled.inc()
    log.info("gateway_client_gone", path=request.url.path)
    return None


async def disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is read: what comes next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def stream_events(gateway: Gateway, running: Running, envelope: Envelope, body: CompletionBody | ChatBody,
                        kind: str) -> AsyncIterator[str]:
    """The SSE events of a streamed response; closing early (a client gone) cancels the requests."""
    include_usage = body.include_usage
    shapers = stream_shapers(body, len(running.choices))  # a chat with tools: its calls parsed out
    finished = False
    gateway.metrics.open_streams.inc()
    try:
        if kind == "chat":  # one choice per chunk, as OpenAI streams n > 1
            for c in running.choices:
                role = {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}
                yield sse(envelope.wrap([role], chunk=True) | ({"usage": None} if include_usage else {}))
        async for position, chunk in running.chunks():
            piece = piece_of(kind, running.choices[position], chunk, delta=True)
            piece = piece if shapers is None else shapers[position].piece(piece)
            gateway.metrics.generated_tokens.inc(len(chunk.token_ids))
            event = envelope.wrap([piece], chunk=True)
            yield sse(event | ({"usage": None} if include_usage else {}))
        if include_usage:
            yield sse(envelope.wrap([], chunk=True, usage=usage_json(running.choices, body.n),
                                    speculation=speculation_json(running.choices)))
        finished = True
    except (SpecbusError, ApiError) as exc:
        error = exc if isinstance(exc, ApiError) else ApiError.from_specbus(exc)
        log.warning("gateway_stream_error", status=error.status, message=error.message)
        yield sse(error.to_json())
        finished = True
    finally:
        gateway.metrics.open_streams.dec()
        if not finished:
            gateway.metrics.cancelled.inc()
            log.info("gateway_client_gone", request_ids=[s.request.request_id for s in running.streams])
        await running.close()
    yield sse("[DONE]")


# ---------------------------------------------------------------------------------------------
# the app


def build_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(title="specbus", description="OpenAI-compatible API of a specbus deployment")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        # 429 and 503 pass: say when to retry (the openai SDK waits that long before its retries)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status in (429, 503) else None
        return JSONResponse(exc.to_json(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        # a body of another content type is never read as JSON: that, not its fields, is the error
        error = content_type_error(request.headers.get("content-type")) or validation_error(exc.errors())
        return JSONResponse(error.to_json(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def framework(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own refusals (unknown route, method, a body it cannot parse), which it would
        # answer as {"detail": ...}
        error = framework_error(exc.status_code, request.method, request.url.path, (exc.headers or {}).get("Allow"),
                                exc.__cause__)
        return JSONResponse(error.to_json(), status_code=error.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        # our bug: logged with its traceback by Starlette after this answer; the client gets no details
        error = ApiError(500, "internal error", type="server_error", code="internal")
        return JSONResponse(error.to_json(), status_code=500)

    def authorized(request: Request) -> Client:
        """The API key's client (the front door checked the key before the body was read)."""
        return gateway.client_for(request)

    @app.get("/v1/models")
    async def models(client: Client = Depends(authorized)) -> dict:
        return {"object": "list", "data": [gateway.model_entry()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, client: Client = Depends(authorized)) -> dict:
        gateway.check_model(model_id)
        return gateway.model_entry()

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request, client: Client = Depends(authorized)) -> Response:
        gateway.check_model(body.model)
        plans = completion_plans(body, gateway.texts, gateway.config.timeout_s)
        return await respond(gateway, request, client, body, "completion", plans, body.logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request, client: Client = Depends(authorized)) -> Response:
        gateway.check_model(body.model)
        plans = chat_plans(body, gateway.config.default_max_tokens, gateway.config.timeout_s, gateway.tokenizer)
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        return await respond(gateway, request, client, body, "chat", plans, top_n)

    async def open_chat(client: Client, body: ChatBody) -> Running:
        plans = chat_plans(body, gateway.config.default_max_tokens, gateway.config.timeout_s, gateway.tokenizer)
        return await open_choices(gateway, client, plans, None, body.param_names())

    add_responses_routes(app, gateway, authorized, open_chat, unless_gone)
    add_messages_routes(app, gateway, authorized, open_chat, unless_gone)

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            await gateway.health_nc.request("$SRV.PING.scheduler", b"", timeout=gateway.config.health_timeout_s)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, nats.errors.ConnectionClosedError):
            error = ApiError(503, "no scheduler answers", type="service_unavailable", code="unavailable")
            return JSONResponse(error.to_json(), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def counted(app: Any, metrics: GatewayMetrics, routes: set[str]) -> Any:
    """app, counting each HTTP response by route (one of routes, else "other") and status as it
    starts (plain ASGI: Starlette's BaseHTTPMiddleware would pass every SSE chunk through one more task)."""

    async def asgi(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def send_counted(message):
            if message["type"] == "http.response.start":
                path = scope["path"] if scope["path"] in routes else "other"
                metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        await app(scope, receive, send_counted)

    return asgi


class GatewayServer(uvicorn.Server):
    """uvicorn without its own signal handlers: the CLI's stop event ends it (module docstring)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def connect_clients(config: GatewayConfig, exit_stack: AsyncExitStack) -> tuple[dict[str, Client], Any,
                                                                                       list[Login] | None]:
    """One Client per client user (or the config's one login with no_auth) and the /health connection."""
    if config.no_auth:
        client = await exit_stack.enter_async_context(Client.from_config(config, name=f"{config.instance_id}"))
        return {config.nats_user or DEFAULT_CLIENT_USER: client}, client.nc, None
    logins = gateway_logins(os.environ)
    clients = {}
    for login in logins:
        bus = dataclasses.replace(config, nats_user=login.user, nats_password=login.password)
        clients[login.user] = await exit_stack.enter_async_context(
            Client.from_config(bus, name=f"{config.instance_id}-{login.user}"))
    monitor_password = os.environ.get(password_env(MONITOR), "")
    if not monitor_password:
        raise SpecbusError(ErrorCode.invalid_field, "the gateway pings schedulers for /health as the monitor user",
                           password_env(MONITOR))
    health_nc = await connect_service(config, f"{config.instance_id}-health", user=MONITOR, password=monitor_password,
                                      inbox_prefix=inbox_prefix(MONITOR))
    exit_stack.push_async_callback(health_nc.close)
    return clients, health_nc, logins


async def run_gateway(config: GatewayConfig, stop: asyncio.Event) -> None:
    """Serve the API on http_host:http_port until stop is set (services/runtime/tasks.py's
    lifecycle; an HTTP server that ends by itself exits non-zero)."""
    await serve_until_stopped(gateway_service(config), stop)


@asynccontextmanager
async def gateway_service(config: GatewayConfig) -> AsyncIterator[Serving]:
    """The HTTP server serving, its NATS clients connected; on exit it finishes its responses
    (within STOP_GRACE_S), then the clients close."""
    check_gateway_limits(config)
    tokenizer = load_tokenizer(config.target_model)
    model = config.served_model_name or Path(config.target_model).name
    created = int((Path(config.target_model) / "config.json").stat().st_mtime)
    async with AsyncExitStack() as exit_stack:
        clients, health_nc, logins = await connect_clients(config, exit_stack)
        gateway = Gateway(config, clients, logins, health_nc, tokenizer, TokenTexts(tokenizer), model,
                          model_card(model, config.target_model, config.draft_model, created))
        # the verifiers' max_seq_len, for /v1/models' max_model_len
        await health_nc.subscribe(Subjects(config.prefix).heartbeat, cb=gateway.on_heartbeat)
        listener = exit_stack.enter_context(http_socket(config.http_host, config.http_port))
        api = build_app(gateway)
        app = counted(front_door(api, config, gateway.user_for), gateway.metrics, {route.path for route in api.routes})
        server = GatewayServer(uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=STOP_GRACE_S,
            http=protocol_class(config.header_timeout_s), timeout_keep_alive=config.keep_alive_timeout_s,
            h11_max_incomplete_event_size=config.max_header_bytes))
        with serve_metrics(gateway.metrics.registry, config.metrics_port):
            serving = asyncio.create_task(server.serve(sockets=[listener]), name="gateway-http")
            log.info("gateway_listening", url=f"http://{config.http_host}:{listener.getsockname()[1]}/v1",
                     model=model, users=sorted(clients), auth=logins is not None)
            try:
                yield Serving([serving])
            finally:
                server.should_exit = True
                await asyncio.wait({serving})
            serving.result()  # an error of its shutdown


def http_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so a taken port is an error naming http_port (uvicorn
    would exit the process)."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise SpecbusError(ErrorCode.invalid_field, f"cannot serve HTTP on {host}:{port}: {exc.strerror or exc}",
                           "http_port") from None
    return listener


def main(argv: list[str] | None = None) -> int:
    """`python -m services.gateway.gateway api-keys --client-users a,b`: fresh API keys as KEY=value lines
    (append them to docker compose's .env; `specbus up` makes its own)."""
    parser = argparse.ArgumentParser(prog="python -m services.gateway.gateway")
    commands = parser.add_subparsers(dest="command", required=True)
    keys = commands.add_parser("api-keys", help="random API keys as SPECBUS_<USER>_API_KEY=value lines")
    keys.add_argument("--client-users", default=DEFAULT_CLIENT_USER, help="comma-separated client user names")
    args = parser.parse_args(argv)
    try:
        users = check_user_names([u for u in args.client_users.split(",") if u])
    except SpecbusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(env_file_text(generate_api_keys(users)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
