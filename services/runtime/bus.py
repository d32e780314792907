"""NATS helpers every service uses: connect, request/publish with typed errors, bounded
handlers, micro-service registration and heartbeats.

Deadlines are absolute wall-clock seconds (`schemas.bus.clock.wall()`), the convention on the wire:
every message carries the absolute deadline of its request, so each hop computes its own
remaining time without adding up relative timeouts; a receiver allows for other machines'
clocks (`expired(..., skew_s=)`, schemas/bus/clock.py). Timeouts (`timeout_s`) are relative seconds.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import nats.micro
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.micro.service import EndpointConfig, EndpointStats, Service, ServiceConfig

from schemas.bus.clock import wall as wall_clock
from schemas.bus.codec import error_reply, reply_version
from schemas.config import BusConfig
from schemas.errors import ErrorCode, SpecbusError
from services.runtime.auth import PermissionWatch, inbox_prefix

log = structlog.get_logger(__name__)

# The Status header nats-server puts on a message it bounces back from a subject nobody
# subscribes to (a request with no responders, a chunk to a closed inbox).
NO_RESPONDERS_STATUS = "503"


class BusError(SpecbusError):
    """A bus operation failed. Each subclass is one failure; `code` is the wire ErrorCode a
    service answers with when it passes the failure on."""

    wire_code = ErrorCode.internal

    def __init__(self, message: str):
        super().__init__(self.wire_code, message)


class BusTimeout(BusError):
    wire_code = ErrorCode.timeout


class BusNoResponders(BusError):
    wire_code = ErrorCode.unavailable


class BusPayloadTooLarge(BusError):
    wire_code = ErrorCode.too_large


class BusDeadlineExpired(BusError):
    wire_code = ErrorCode.timeout


class BusUnavailable(BusError):
    """No usable connection: the first connect failed, or the client is closed or draining."""

    wire_code = ErrorCode.unavailable


# ---------------------------------------------------------------------------------------------
# connect


class BusClient(Client):
    """A nats-py Client as `connect` opens it, carrying what the helpers of this module need of a
    connection besides nats-py's own state: `permissions`, the PermissionWatch its error callback
    feeds; `payload_cap`, connect's max_payload (None: the server's); and `open_sibling(name)`,
    another connection with the same settings (`serve` gives a subscription one of its own).

    The connection owns them, rather than a module-level registry keyed by connection: they are
    born and die with it, nothing global can go stale or leak across tests, and a helper reads
    them without a lookup that can miss. A plain nats-py Client (not from `connect`) has none of
    them: the helpers then take the server's max_payload, a PermissionWatch nothing feeds, and no
    sibling.
    """

    def __init__(self, url: str | list[str], settings: dict[str, Any]):
        super().__init__()
        self.permissions = PermissionWatch()
        self.payload_cap: int | None = settings.get("max_payload")
        self.url_given = url
        self.settings = settings

    async def open_sibling(self, name: str) -> BusClient:
        """A new connection to the same servers with the same settings, named `name`."""
        return await connect(self.url_given, name, **self.settings)


# connect()'s settings under nats-py's own names; the others (opts) go to nats-py as they are
NATS_OPTION_NAMES = {"connect_timeout_s": "connect_timeout", "reconnect_time_wait_s": "reconnect_time_wait",
                     "ping_interval_s": "ping_interval"}
OWN_SETTINGS = ("initial_connect_timeout_s", "max_payload")  # enforced here, not by nats-py


async def connect(
    url: str | list[str],
    name: str,
    *,
    connect_timeout_s: float = 2.0,
    initial_connect_timeout_s: float = 30.0,
    reconnect_time_wait_s: float = 0.5,
    max_reconnect_attempts: int = -1,
    ping_interval_s: float = 10.0,
    max_outstanding_pings: int = 3,
    user: str | None = None,
    password: str | None = None,
    tls: ssl.SSLContext | None = None,
    tls_hostname: str | None = None,
    max_payload: int | None = None,
    **opts: Any,
) -> BusClient:
    """Connect with explicit settings; services reconnect forever (max_reconnect_attempts=-1).

    nats-py retries the first connection forever too when max_reconnect_attempts is -1, so
    the first connection gets its own bound: BusUnavailable after initial_connect_timeout_s.
    url: one URL, a list, or URLs separated by commas (a cluster's nodes, as NATS clients
    elsewhere take them); nats-py connects to one and, when it is lost, reconnects to another.
    max_payload: the most this connection sends, when it is below the server's max_payload (a
    client user's account limit, which the server enforces but does not announce: a message over
    it would close the connection); `publish` and `request` refuse more with BusPayloadTooLarge.
    Extra keyword arguments go to `nats.connect` unchanged.
    """
    if user is not None:
        opts.setdefault("inbox_prefix", inbox_prefix(user))  # the only inbox the server lets it read
    settings = dict(connect_timeout_s=connect_timeout_s, initial_connect_timeout_s=initial_connect_timeout_s,
                    reconnect_time_wait_s=reconnect_time_wait_s, max_reconnect_attempts=max_reconnect_attempts,
                    ping_interval_s=ping_interval_s, max_outstanding_pings=max_outstanding_pings, user=user,
                    password=password, tls=tls, tls_hostname=tls_hostname, max_payload=max_payload, **opts)
    nc = BusClient(url, settings)
    conn_log = log.bind(connection=name)
    nats_options = {NATS_OPTION_NAMES.get(key, key): value for key, value in settings.items()
                    if key not in OWN_SETTINGS}
    try:
        await asyncio.wait_for(nc.connect(servers=url.split(",") if isinstance(url, str) else url, name=name,
                                          **nats_options, **connection_callbacks(nc, conn_log)),
                               timeout=initial_connect_timeout_s)
    except (asyncio.TimeoutError, OSError, nats.errors.Error) as exc:
        reason = nc.last_error or exc  # after a timeout, the last attempt's error says why
        await nc.close()
        raise BusUnavailable(
            f"cannot connect to NATS at {url} as {name!r}: {str(reason) or type(reason).__name__}"
        ) from exc
    conn_log.info("nats_connected", server=server_address(nc), max_payload=nc.max_payload)
    return nc


def connection_callbacks(nc: BusClient, conn_log: Any) -> dict[str, Callable[..., Awaitable[None]]]:
    """nats-py's error, disconnected, reconnected and closed callbacks for nc: each logs, and the
    error callback feeds nc.permissions (permission violations arrive there, not at the call)."""
    dropped = Counter()

    async def on_error(exc: Exception) -> None:
        if nc.permissions.on_error(exc):
            conn_log.warning("nats_permission_denied", error=str(exc), count=sum(nc.permissions.counts.values()))
            return
        if isinstance(exc, nats.errors.SlowConsumerError):  # one per message dropped: logged sparingly
            dropped[exc.subject] += 1
            if dropped[exc.subject] % OVERLOAD_LOG_EVERY == 1:
                conn_log.warning("nats_subscription_dropped", subject=exc.subject, dropped=dropped[exc.subject])
            return
        conn_log.error("nats_error", error=str(exc) or type(exc).__name__, error_type=type(exc).__name__)

    async def on_disconnected() -> None:
        if not nc.is_closed:  # nats-py also calls this on a deliberate close()
            conn_log.warning("nats_disconnected")

    async def on_reconnected() -> None:
        conn_log.info("nats_reconnected", server=server_address(nc))

    async def on_closed() -> None:
        conn_log.info("nats_closed")

    return {"error_cb": on_error, "disconnected_cb": on_disconnected, "reconnected_cb": on_reconnected,
            "closed_cb": on_closed}


async def connect_service(config: BusConfig, name: str, **opts: Any) -> BusClient:
    """`connect` with the url, credentials and TLS files of a service's config (BusConfig or a
    subclass); opts go to `connect` and win over the config."""
    settings = {"connect_timeout_s": config.connect_timeout_s, "user": config.nats_user,
                "password": config.nats_password, "tls": tls_context(config.tls_ca, config.tls_cert, config.tls_key)}
    return await connect(config.nats_url, name, **(settings | opts))


def tls_context(ca: str | None = None, cert: str | None = None, key: str | None = None) -> ssl.SSLContext | None:
    """A client TLS context from file paths, or None when neither is given. ca: the CA that
    signed the server's certificate (default: the system's); cert + key: this client's own."""
    if not ca and not cert:
        return None
    context = ssl.create_default_context(cafile=ca or None)
    if cert:
        context.load_cert_chain(cert, key or None)
    return context


def payload_limit(nc: Client) -> int:
    """The most one message of nc may hold: the server's max_payload, or less (connect's max_payload)."""
    cap = nc.payload_cap if isinstance(nc, BusClient) else None
    return nc.max_payload if cap is None else min(cap, nc.max_payload)


def permission_watch(nc: Client) -> PermissionWatch:
    """The connection's PermissionWatch (a fresh one nothing feeds for a client not from `connect`)."""
    return nc.permissions if isinstance(nc, BusClient) else PermissionWatch()


def server_address(nc: Client) -> str | None:
    """host:port of the current server (never the URL: it may hold a password)."""
    url = nc.connected_url
    return f"{url.hostname}:{url.port}" if url else None


# ---------------------------------------------------------------------------------------------
# request / publish


def check_payload_size(nc: Client, subject: str, payload: bytes, headers: Mapping[str, str] | None) -> None:
    """Refuse before sending: the server counts headers too and drops the connection on a
    message over max_payload."""
    size, limit = len(payload) + header_block_size(headers), payload_limit(nc)
    if size > limit:
        raise BusPayloadTooLarge(f"message to {subject!r} is {size} bytes, over this connection's max_payload of {limit}")


def header_block_size(headers: Mapping[str, str] | None) -> int:
    """Bytes of the NATS/1.0 header block: status line, `key: value` lines, blank line."""
    if not headers:
        return 0
    return len("NATS/1.0\r\n") + sum(len(k) + len(v) + 4 for k, v in headers.items()) + 2


def expired(deadline: float, now: float | None = None, skew_s: float = 0.0) -> SpecbusError | None:
    """A `timeout` error naming "deadline" once the absolute deadline (wall_clock()) has passed
    by more than skew_s, else None: what a service answers work that came (or waited) too long.
    skew_s: for a deadline another process set, MAX_CLOCK_SKEW_S (schemas/bus/clock.py)."""
    late_s = (wall_clock() if now is None else now) - deadline
    if late_s < skew_s:
        return None
    return SpecbusError(ErrorCode.timeout, f"deadline passed {late_s:.3f} s ago", "deadline")


def effective_timeout(subject: str, timeout_s: float | None, deadline: float | None) -> float:
    """min(timeout_s, deadline - now); raises BusDeadlineExpired when no time is left."""
    if timeout_s is None and deadline is None:
        raise ValueError(f"request to {subject!r}: give timeout_s or deadline (no implicit default)")
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
    remaining = float("inf") if deadline is None else deadline - wall_clock()
    if remaining <= 0:
        raise BusDeadlineExpired(f"request to {subject!r}: deadline passed {-remaining:.3f} s ago, not sent")
    return min(timeout_s if timeout_s is not None else float("inf"), remaining)


async def request(
    nc: Client,
    subject: str,
    payload: bytes,
    *,
    timeout_s: float | None = None,
    deadline: float | None = None,
    headers: dict[str, str] | None = None,
) -> Msg:
    """Request/reply bounded by min(timeout_s, deadline - now); deadline is absolute wall_clock().

    Raises BusDeadlineExpired (not sent), BusPayloadTooLarge (not sent), BusNoResponders
    (nobody subscribes to the subject), BusTimeout (nobody answered in time).
    """
    wait_s = effective_timeout(subject, timeout_s, deadline)
    check_payload_size(nc, subject, payload, headers)
    with bus_errors(subject):
        try:
            return await permission_watch(nc).guard(nc.request(subject, payload, timeout=wait_s, headers=headers),
                                                    publish=[subject])
        except nats.errors.TimeoutError as exc:
            raise BusTimeout(f"no reply on {subject!r} within {wait_s:.3f} s") from exc


async def publish(
    nc: Client,
    subject: str,
    payload: bytes,
    *,
    reply: str = "",
    headers: dict[str, str] | None = None,
) -> None:
    """Publish with the same size check as `request` (BusPayloadTooLarge, nothing sent)."""
    check_payload_size(nc, subject, payload, headers)
    with bus_errors(subject):
        await nc.publish(subject, payload, reply=reply, headers=headers)


async def respond(nc: Client, msg: Any, payload: bytes, counters: Counter) -> None:
    """Answer msg (a nats Msg or micro Request) once. A payload over max_payload is replaced by
    a `too_large` Error reply; a reply that cannot go out (no reply subject, connection gone) is
    dropped; both are logged and counted in counters ("reply_too_large", "reply_failed")."""
    try:
        check_payload_size(nc, f"reply to {msg.subject}", payload, None)
    except BusError as exc:
        counters["reply_too_large"] += 1
        log.warning("reply_too_large", subject=msg.subject, error=str(exc))
        payload = error_reply(exc, v=reply_version(msg.data))  # in the version of what it answers
    try:
        await msg.respond(payload)
    except (ValueError, nats.errors.Error) as exc:  # ValueError: the message had no reply subject
        counters["reply_failed"] += 1
        log.warning("reply_failed", subject=msg.subject, error=str(exc) or type(exc).__name__)


@contextmanager
def bus_errors(subject: str) -> Iterator[None]:
    """nats-py's errors for a message to `subject`, as the BusError a caller handles."""
    try:
        yield
    except nats.errors.NoRespondersError as exc:
        raise BusNoResponders(f"no responders on {subject!r}") from exc
    except nats.errors.MaxPayloadError as exc:  # the server's max_payload shrank across a reconnect
        raise BusPayloadTooLarge(f"message to {subject!r} is over the server's max_payload") from exc
    except (
        nats.errors.ConnectionClosedError,
        nats.errors.ConnectionDrainingError,
        nats.errors.OutboundBufferLimitError,  # disconnected, and the reconnect buffer is full
    ) as exc:
        raise BusUnavailable(f"cannot send to {subject!r}: {type(exc).__name__}") from exc


# ---------------------------------------------------------------------------------------------
# bounded handlers

MsgHandler = Callable[[Any], Awaitable[None]]
OVERLOAD_LOG_EVERY = 100
# serve()'s bound on the payload its handlers hold: a few of the largest client messages
# (auth.CLIENT_MAX_PAYLOAD), far from what would make the process swap.
SERVE_PENDING_BYTES = 64 * 1024 * 1024
SERVE_PENDING_MSGS = 64 * 1024


@dataclass
class BoundedHandler:
    """Runs `handler` for each message in its own task, at most max_concurrency at a time.

    nats-py calls a subscription's callback one message at a time, so a slow handler would
    serialize the subscription. `dispatch` is that callback: it only schedules. A message that
    would make more than max_pending in flight (running + waiting for a slot), or more than
    max_pending_bytes of payload (None: no byte bound), is refused: `on_overload(msg)` lets the
    service answer `overloaded`; the refusal is counted and logged.
    A handler's exception is logged with its traceback and counted; the subscription lives on.
    Messages are nats `Msg` objects, or micro `Request` objects when used as a micro endpoint.
    """

    handler: MsgHandler
    name: str
    max_concurrency: int = 8
    max_pending: int = 64
    on_overload: MsgHandler | None = None
    max_pending_bytes: int | None = None
    num_received: int = field(default=0, init=False)
    num_completed: int = field(default=0, init=False)
    num_failed: int = field(default=0, init=False)
    num_refused: int = field(default=0, init=False)
    num_cancelled: int = field(default=0, init=False)
    subscription: Subscription | None = field(default=None, init=False)
    connection: Client | None = field(default=None, init=False)  # serve()'s own connection, closed by stop()
    tasks: set[asyncio.Task] = field(default_factory=set, init=False, repr=False)
    slots: asyncio.Semaphore = field(init=False, repr=False)
    pending_bytes: int = field(default=0, init=False)  # payload held by the tasks in flight

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1, got {self.max_concurrency}")
        if self.max_pending < self.max_concurrency:
            raise ValueError(
                f"max_pending: must be >= max_concurrency ({self.max_concurrency}), got {self.max_pending}"
            )
        self.slots = asyncio.Semaphore(self.max_concurrency)

    @property
    def in_flight(self) -> int:
        return len(self.tasks)

    async def dispatch(self, msg: Any) -> None:
        """The subscription callback: schedules the handler, or refuses; returns at once."""
        self.num_received += 1
        size = len(getattr(msg, "data", b"") or b"")
        # one message alone is always taken (it passed the server's max_payload)
        over_bytes = self.max_pending_bytes is not None and bool(self.tasks) and \
            self.pending_bytes + size > self.max_pending_bytes
        if self.in_flight >= self.max_pending or over_bytes:
            self.num_refused += 1
            log.warning("handler_overloaded", handler=self.name, in_flight=self.in_flight,
                        pending_bytes=self.pending_bytes, refused=self.num_refused)
            if self.on_overload is not None:
                try:
                    await self.on_overload(msg)
                except Exception:
                    log.exception("overload_reply_failed", handler=self.name)
            return
        task = asyncio.create_task(self.run_one(msg), name=f"{self.name}-handler")
        self.tasks.add(task)
        self.pending_bytes += size

        def done(task: asyncio.Task) -> None:
            self.tasks.discard(task)
            self.pending_bytes -= size

        task.add_done_callback(done)

    async def run_one(self, msg: Any) -> None:
        async with self.slots:
            try:
                await self.handler(msg)
            except asyncio.CancelledError:
                self.num_cancelled += 1
                raise
            except Exception:
                self.num_failed += 1
                log.exception("handler_failed", handler=self.name, subject=getattr(msg, "subject", None))
            else:
                self.num_completed += 1

    def stats(self) -> dict[str, int]:
        return {
            "received": self.num_received,
            "completed": self.num_completed,
            "failed": self.num_failed,
            "refused": self.num_refused,
            "cancelled": self.num_cancelled,
            "in_flight": self.in_flight,
        }

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Drain: stop taking messages (those already delivered are still scheduled), wait up
        to timeout_s for handlers to finish, then cancel the rest (counted). Idempotent."""
        subscription, self.subscription = self.subscription, None
        if subscription is not None:
            try:
                await asyncio.wait_for(subscription.drain(), timeout=timeout_s)
            except (asyncio.TimeoutError, nats.errors.Error) as exc:
                log.warning("subscription_drain_failed", handler=self.name, error=type(exc).__name__)
        if self.tasks:
            _, pending = await asyncio.wait(set(self.tasks), timeout=timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=timeout_s)
                log.warning("handlers_cancelled_on_stop", handler=self.name, count=len(pending))
        connection, self.connection = self.connection, None
        if connection is not None:
            await connection.close()


async def serve(
    nc: Client,
    subject: str,
    handler: MsgHandler,
    *,
    queue: str | None = None,
    max_concurrency: int = 8,
    max_pending: int = 64,
    on_overload: MsgHandler | None = None,
    max_pending_bytes: int = SERVE_PENDING_BYTES,
    own_connection: bool = True,
) -> BoundedHandler:
    """Subscribe `handler` to `subject` with bounded concurrency; `await bounded.stop()` drains.

    What may wait is bounded at both ends: the BoundedHandler refuses past max_pending messages
    or max_pending_bytes in flight, and nats-py's own queue for the subscription (what was read
    and not dispatched yet: a burst of small messages read at once lands there whole) drops past
    SERVE_PENDING_MSGS messages or max_pending_bytes instead of its defaults (512 Ki, 128 MiB).

    The subscription gets a connection of its own (same settings, named `<name>.<subject>`;
    on nc itself when nc did not come from `connect`): nats-server cuts a consumer that falls its
    max_pending (64 MiB) behind as a slow consumer, all of that connection's subscriptions with it.
    A flood of large messages on a subject anyone may publish to (a client's generate subject) can
    outrun a process whose CPU is busy, however fast its handlers refuse; on its own connection
    it costs at worst that connection (which reconnects; the senders' clients resend), never the
    one the service does its work on. Replies go out on whatever connection the handler uses."""
    bounded = BoundedHandler(handler, name=subject, max_concurrency=max_concurrency, max_pending=max_pending,
                             on_overload=on_overload, max_pending_bytes=max_pending_bytes)
    if own_connection and isinstance(nc, BusClient):
        bounded.connection = nc = await nc.open_sibling(f"{nc.options['name']}.{subject}")
    bounded.subscription = await nc.subscribe(subject, queue=queue or "", cb=bounded.dispatch,
                                              pending_msgs_limit=max(SERVE_PENDING_MSGS, max_pending),
                                              pending_bytes_limit=max_pending_bytes)
    if bounded.connection is not None:
        # the server has the subscription before the caller sends on its own connection; twice: nats-py
        # writes a flush's PING ahead of what its flusher task still holds (the SUB)
        await nc.flush()
        await nc.flush()
    return bounded


# ---------------------------------------------------------------------------------------------
# micro services ($SRV.PING / INFO / STATS)


@dataclass(frozen=True)
class Endpoint:
    """A micro endpoint: `handler` receives a `nats.micro.Request` (data, subject, respond)."""

    subject: str
    handler: MsgHandler
    queue_group: str | None = None
    metadata: dict[str, str] | None = None


async def add_micro_service(
    nc: Client,
    name: str,
    version: str,
    description: str = "",
    *,
    endpoints: Mapping[str, Endpoint] | None = None,
    metadata: Mapping[str, str] | None = None,
    stats_data: Callable[[EndpointStats], Any] | None = None,
) -> Service:
    """Register a NATS micro service so `$SRV.PING/INFO/STATS[.<name>[.<id>]]` answer.

    name: [A-Za-z0-9_-]+ and version: semver (nats.micro checks both, ValueError otherwise).
    endpoints: endpoint name -> Endpoint; give a BoundedHandler's `dispatch` as handler for concurrency
    (micro endpoints also run one request at a time). stats_data(endpoint_stats) returns the
    custom `data` of each endpoint in $SRV.STATS (queue depth, counters). Stop with
    `await service.stop()`.
    """
    config = ServiceConfig(
        name=name,
        version=version,
        description=description,
        metadata=dict(metadata or {}),
        stats_handler=stats_data,
    )
    service = await nats.micro.add_service(nc, config)
    for endpoint_name, endpoint in (endpoints or {}).items():
        await service.add_endpoint(
            EndpointConfig(
                name=endpoint_name,
                handler=endpoint.handler,
                subject=endpoint.subject,
                queue_group=endpoint.queue_group,
                metadata=endpoint.metadata,
            )
        )
    return service


# ---------------------------------------------------------------------------------------------
# heartbeats and liveness


async def cancel_tasks(tasks: list[asyncio.Task], timeout_s: float = 5.0) -> None:
    """Cancel a service's background tasks and wait up to timeout_s for them to end."""
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks, timeout=timeout_s)


async def heartbeat_loop(nc: Client, subject: str, make_payloads: Callable[[], bytes | list[bytes]],
                         interval_s: float) -> None:
    """Publish make_payloads() (one payload, or a beat's copy per version: codec.encode_beats)
    every interval_s until cancelled (run it as a task).

    A failing beat is logged and the loop goes on (a missed beat is what the registry is for);
    the loop ends when the connection is closed for good.
    """
    if interval_s <= 0:
        raise ValueError(f"interval_s: must be > 0, got {interval_s}")
    while True:
        try:
            payloads = make_payloads()
            for payload in [payloads] if isinstance(payloads, bytes) else payloads:
                await publish(nc, subject, payload)
        except BusUnavailable as exc:
            if nc.is_closed:
                log.warning("heartbeat_stopped_connection_closed", subject=subject)
                return
            log.warning("heartbeat_not_sent", subject=subject, error=str(exc))
        except Exception:
            log.exception("heartbeat_failed", subject=subject)
        await asyncio.sleep(interval_s)


