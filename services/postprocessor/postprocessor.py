"""The postprocessor service: Commits and side-channel records in, StreamChunks out.

    python -m services.cli serve postprocessor      (or `run_postprocessor(config, stop)`)

Subscribes `<p>.post.<id>.commit` and `<p>.post.<id>.side` as nats.micro endpoints of the
service "postprocessor" ($SRV.STATS and the Prometheus metrics on metrics_port show the drop
counters), runs the logic of services/postprocessor/postprocessor_core.py (one message at a time per
subscription; the logic is synchronous, so every output is queued in order and one sender task
publishes them), ticks for timeouts, and heartbeats {"tokenizer": tokenizer_id} with its load.

Neither subscription has a reply subject: an undecodable message is logged and counted, never
answered. Chunks are published with a reply subject under this instance's own inbox: when the
client inbox has no subscriber (the client is gone), the server bounces a 503 status there, and
the request is dropped with a StopNotice(reason="error") to its scheduler.
"""

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import structlog

from text.tokenizer import load_tokenizer, tokenizer_id
from schemas.bus.codec import decode, encode, encode_beats
from schemas.bus.clock import wall as wall_clock
from schemas.commits import Commit, SideChannelRecord
from schemas.config import PostprocessorConfig, service_version
from schemas.bus.control import Heartbeat
from schemas.errors import CodecError, ErrorCode
from schemas.streams import StreamChunk
from schemas.bus.subjects import Subjects
from schemas.bus.wire import Error
from services.postprocessor.postprocessor_core import NoticeToScheduler, Outgoing, Postprocessor
from services.runtime.bus import (
    NO_RESPONDERS_STATUS,
    BusError,
    BusPayloadTooLarge,
    Endpoint,
    add_micro_service,
    connect_service,
    heartbeat_loop,
    publish,
)
from services.runtime.metrics import POSTPROCESSOR_GAUGES, Metrics, serve_metrics
from services.runtime.tasks import serve_until_stopped

log = structlog.get_logger(__name__)

DRAIN_TIMEOUT_S = 5.0


class PostprocessorService:
    """The NATS side of one Postprocessor; `async with` starts it, exit drains it."""

    def __init__(self, nc, post: Postprocessor, config: PostprocessorConfig, model_ids: dict[str, str]):
        self.nc = nc
        self.post = post
        self.config = config
        self.model_ids = model_ids
        self.subjects = Subjects(config.prefix)
        self.bounce_prefix = nc.new_inbox()
        self.outbox: asyncio.Queue[Outgoing] = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.micro = None
        self.bounce_sub = None
        self.num_send_failures = 0
        self.stopped = False
        self.metrics = Metrics("postprocessor")
        self.metrics.watch_counts(self.stats, POSTPROCESSOR_GAUGES)

    async def start(self) -> "PostprocessorService":
        instance_id = self.config.instance_id
        self.bounce_sub = await self.nc.subscribe(self.bounce_prefix + ".>", cb=self.on_bounce)
        self.micro = await add_micro_service(
            self.nc, "postprocessor", service_version(), "joins commits and logprobs, detokenizes, streams chunks",
            endpoints={"commit": Endpoint(self.subjects.post_commit(instance_id), self.on_commit),
                       "side": Endpoint(self.subjects.post_side(instance_id), self.on_side)},
            metadata={"instance_id": instance_id, **self.model_ids}, stats_data=lambda _: self.metrics.stats())
        tick_s = max(0.01, min(0.1, self.post.side_channel_timeout_s / 4))
        self.tasks = [
            asyncio.create_task(self.send_loop(), name="postprocessor-send"),
            asyncio.create_task(self.tick_loop(tick_s), name="postprocessor-tick"),
            asyncio.create_task(heartbeat_loop(self.nc, self.subjects.heartbeat, self.heartbeat,
                                               self.config.heartbeat_interval_s), name="postprocessor-heartbeat"),
        ]
        log.info("postprocessor_started", instance_id=instance_id, **self.model_ids)
        return self

    async def stop(self) -> None:
        """Stop taking messages, publish what is already queued (bounded), stop. Idempotent."""
        if self.stopped:
            return
        self.stopped = True
        if self.micro is not None:
            await self.micro.stop()
        try:
            await asyncio.wait_for(self.outbox.join(), timeout=DRAIN_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("outbox_not_drained", left=self.outbox.qsize())
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.bounce_sub is not None:
            await self.bounce_sub.unsubscribe()
        log.info("postprocessor_stopped", active_requests=self.post.load, **self.post.counters.as_dict())

    async def __aenter__(self) -> "PostprocessorService":
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def stats(self) -> dict:
        """The counters and the active_requests gauge of $SRV.STATS and of the metrics."""
        return {"active_requests": self.post.load, "send_failures": self.num_send_failures,
                **self.post.counters.as_dict()}

    def heartbeat(self) -> list[bytes]:
        load = self.post.load
        return encode_beats(Heartbeat(instance_id=self.config.instance_id, role="postprocessor",
                                capacity=self.post.max_requests, load=load,
                                free_slots=max(0, self.post.max_requests - load), model_ids=self.model_ids,
                                sent_at=wall_clock(), interval_s=self.config.heartbeat_interval_s))

    # ------------------------------------------------------------------ inbound

    async def on_commit(self, request) -> None:
        self.handle(request.data, Commit, self.post.on_commit)

    async def on_side(self, request) -> None:
        self.handle(request.data, SideChannelRecord, self.post.on_side)

    def handle(self, data: bytes, message_type: type, step) -> None:
        """Decode, run the (synchronous) logic, queue its outputs. Never raises: these
        subjects have no reply, so a failure is logged and counted."""
        try:
            message = decode(data, message_type)
        except CodecError as exc:
            self.post.counters.bad_messages += 1
            log.warning("bad_message", expected=message_type.__name__, code=exc.code.value, field=exc.field,
                        error=exc.message, bad_messages=self.post.counters.bad_messages)
            return
        try:
            self.queue(step(message, time.monotonic()))
        except Exception:
            log.exception("message_failed", type=message_type.__name__, request_id=message.request_id)
            try:
                self.queue(self.post.request_failed(message, time.monotonic()))
            except Exception:
                log.exception("request_fail_failed", request_id=message.request_id)

    async def on_bounce(self, msg) -> None:
        if not msg.headers or msg.headers.get("Status") != NO_RESPONDERS_STATUS:
            return
        request_id = msg.subject[len(self.bounce_prefix) + 1:]
        self.queue(self.post.client_gone(request_id, time.monotonic()))

    # ------------------------------------------------------------------ outbound

    def queue(self, outs: list[Outgoing]) -> None:
        for out in outs:
            self.outbox.put_nowait(out)

    async def tick_loop(self, tick_s: float) -> None:
        while True:
            await asyncio.sleep(tick_s)
            try:
                self.queue(self.post.on_tick(time.monotonic()))
            except Exception:
                log.exception("tick_failed")

    async def send_loop(self) -> None:
        while True:
            out = await self.outbox.get()
            try:
                await self.send(out)
            except BusError as exc:
                self.num_send_failures += 1
                log.warning("send_failed", error=str(exc), send_failures=self.num_send_failures)
            except Exception:  # one message's bug must not stop every stream behind it
                self.num_send_failures += 1
                log.exception("send_crashed", send_failures=self.num_send_failures)
            finally:
                self.outbox.task_done()

    async def send(self, out: Outgoing) -> None:
        if isinstance(out, NoticeToScheduler):
            await publish(self.nc, self.subjects.stop_notice(out.scheduler_id), encode(out.notice, out.v))
            return
        chunk = out.chunk
        reply = f"{self.bounce_prefix}.{chunk.request_id}"
        try:
            await publish(self.nc, out.inbox, encode(chunk, out.v), reply=reply)
        except BusPayloadTooLarge as exc:
            # The client must not wait for a chunk that cannot be sent: it gets a small final
            # error in its place and stops reading; the next chunk bounces and ends the request.
            self.num_send_failures += 1
            log.warning("chunk_too_large", request_id=chunk.request_id, seq=chunk.seq, error=str(exc))
            error = Error(code=ErrorCode.too_large, message=str(exc), request_id=chunk.request_id)
            replacement = StreamChunk(request_id=chunk.request_id, seq=chunk.seq, finish_reason="error", error=error)
            await publish(self.nc, out.inbox, encode(replacement, out.v), reply=reply)


async def run_postprocessor(config: PostprocessorConfig, stop: asyncio.Event) -> None:
    """Serve as one postprocessor until `stop` is set, then drain (services/runtime/tasks.py's
    lifecycle; a crashed send, tick or heartbeat loop exits non-zero)."""
    await serve_until_stopped(postprocessor_service(config), stop)


@asynccontextmanager
async def postprocessor_service(config: PostprocessorConfig) -> AsyncIterator[PostprocessorService]:
    """A started PostprocessorService, connected and its metrics served; on exit stopped, then drained."""
    tokenizer = load_tokenizer(config.tokenizer)
    model_ids = {"tokenizer": tokenizer_id(config.tokenizer)}
    post = Postprocessor(tokenizer, config.instance_id, side_channel_timeout_s=config.side_channel_timeout_s,
                         max_requests=config.max_requests)
    async with AsyncExitStack() as stack:
        nc = await connect_service(config, config.instance_id)
        stack.push_async_callback(nc.drain)
        service = await stack.enter_async_context(PostprocessorService(nc, post, config, model_ids))
        stack.enter_context(serve_metrics(service.metrics.registry, config.metrics_port))
        yield service
