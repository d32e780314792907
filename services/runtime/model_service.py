"""The NATS service the verifier and the drafter both run around their batch function.

`run_slot_service(owner, config, service, stop)` is the NATS service both run around their
batch function (`SlotService`): connect, one bounded handler on their subject, nats.micro
registration, heartbeats, idle eviction, Prometheus metrics on config.metrics_port, drain on stop.
Per message: decode (a bad message gets an Error reply naming the field), refuse an expired
deadline (Error `timeout`, field "deadline"), run one batch at a time (the model is one
resource) on the model thread (`on_model_thread`) so heartbeats and NATS pings keep flowing, reply, then
`after_reply`. Counters: bad_messages, expired, overloaded, failed_batches, late_replies.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import structlog
from nats.aio.client import Client

from gpu_worker.batching.slots import SlotOwner, evict_idle, instance_heartbeat
from schemas.bus.clock import MAX_CLOCK_SKEW_S
from schemas.bus.codec import decode, encode, encode_beats, error_reply, reply_version
from schemas.config import ModelServiceConfig, service_version
from schemas.errors import ErrorCode, SpecbusError
from schemas.bus.subjects import Subjects
from services.runtime.bus import (
    BoundedHandler,
    Endpoint,
    add_micro_service,
    cancel_tasks,
    connect_service,
    expired,
    heartbeat_loop,
    respond,
)
from services.runtime.logs import log_context
from services.runtime.metrics import MODEL_SERVICE_GAUGES, ModelServiceMetrics, serve_metrics
from services.runtime.tasks import Serving, serve_until_stopped

log = structlog.get_logger(__name__)

# Every torch call of a model service (loading, batches, eviction) runs on this one thread, never
# on whichever thread of asyncio's pool is free. Each OS thread that enters a parallel torch op
# becomes the master of an OpenMP team of its own; once a process holds more OpenMP threads than
# it has cores, libgomp stops spinning at its barriers and sleeps in the kernel instead, and a
# forward has a few hundred barriers (ops/bench/RESULTS.md, "The step around the forward").
MODEL_THREAD = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")


async def on_model_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) on MODEL_THREAD."""
    return await asyncio.get_running_loop().run_in_executor(MODEL_THREAD, fn, *args)


MAX_CONCURRENT_MESSAGES = 4  # decoding, refusals and error replies overlap; batches take the lock
MAX_PENDING_MESSAGES = 64

@dataclass(frozen=True)
class SlotService:
    """What differs between the verifier and the drafter service. run_batch(request) ->
    (response, extra) runs on the model thread; after_reply(nc, extra, v) runs once the reply is out
    (the verifier publishes its side records there, in the request's version v). Replies go in the
    request's version."""

    role: str  # nats.micro service name, heartbeat role, metric prefix
    endpoint: str  # the nats.micro endpoint's name
    description: str
    subject: str
    request_type: type
    run_batch: Callable[[Any], tuple[Any, Any]]
    after_reply: Callable[[Client, Any, int], Awaitable[None]] | None = None


async def evict_idle_loop(owner: SlotOwner, lock: asyncio.Lock) -> None:
    """Free idle slots while no batches arrive, so heartbeats show the capacity back. lock:
    the one the service holds while a batch runs."""
    interval_s = min(max(owner.slot_idle_ttl_s / 4, 0.05), 10.0)
    while True:
        await asyncio.sleep(interval_s)
        async with lock:
            await on_model_thread(evict_idle, owner)


async def refuse(owner: SlotOwner, service: SlotService, nc: Client, msg, counter: str, exc: SpecbusError) -> None:
    owner.counters[counter] += 1
    log.warning(f"{service.role}_request_{counter}", code=exc.code.value, field=exc.field, error=exc.message)
    await respond(nc, msg, error_reply(exc, v=reply_version(msg.data)), owner.counters)


async def handle_batch(owner: SlotOwner, service: SlotService, metrics: ModelServiceMetrics, nc: Client,
                       lock: asyncio.Lock, msg) -> None:
    """One message (module docstring): decode, refuse expired work, run, reply, after_reply."""
    try:
        request = decode(msg.data, service.request_type)
    except SpecbusError as exc:
        await refuse(owner, service, nc, msg, "bad_messages", exc)
        return
    with log_context(batch_id=request.batch_id, scheduler_id=request.scheduler_id):
        async with lock:
            # checked once the model is free (waiting for it takes time), on this machine's clock
            late = expired(request.deadline, skew_s=MAX_CLOCK_SKEW_S)
            if late is not None:
                await refuse(owner, service, nc, msg, "expired", late)
                return
            started = time.monotonic()
            try:
                response, extra = await on_model_thread(service.run_batch, request)
            except SpecbusError as exc:
                await refuse(owner, service, nc, msg, "bad_messages", exc)
                return
            except Exception as exc:
                owner.counters["failed_batches"] += 1
                log.exception(f"{service.role}_batch_failed")
                await respond(nc, msg, error_reply(exc, v=request.v), owner.counters)
                return
            metrics.batch_seconds.observe(time.monotonic() - started)
        if expired(request.deadline, skew_s=MAX_CLOCK_SKEW_S) is not None:
            owner.counters["late_replies"] += 1  # sent anyway: the scheduler may still use it
        await respond(nc, msg, encode(response, request.v), owner.counters)
        if service.after_reply is not None:
            await service.after_reply(nc, extra, request.v)


def slot_counts(owner: SlotOwner, handler: BoundedHandler) -> dict[str, int]:
    """$SRV.STATS data and the counts behind the Prometheus metrics."""
    free = owner.cache.num_free
    return {**owner.counters, **handler.stats(), "free_slots": free, "used_slots": owner.cache.max_slots - free}


async def run_slot_service(owner: SlotOwner, config: ModelServiceConfig, service: SlotService,
                           stop: asyncio.Event) -> None:
    """Serve service.subject for a loaded owner until `stop` is set, then drain."""
    await serve_until_stopped(slot_service(owner, config, service), stop)


@asynccontextmanager
async def slot_service(owner: SlotOwner, config: ModelServiceConfig, service: SlotService) -> AsyncIterator[Serving]:
    """The service of a loaded owner (services/runtime/tasks.py's lifecycle): connected, its
    endpoint, metrics, heartbeats and idle eviction running; on exit stopped in reverse order."""
    subjects = Subjects(config.prefix)
    lock = asyncio.Lock()
    metrics = ModelServiceMetrics(service.role)
    async with AsyncExitStack() as stack:
        nc = await connect_service(config, f"{service.role}-{config.instance_id}")
        stack.push_async_callback(nc.drain)

        async def handle(msg) -> None:
            await handle_batch(owner, service, metrics, nc, lock, msg)

        async def overloaded(msg) -> None:
            await refuse(owner, service, nc, msg, "overloaded",
                         SpecbusError(ErrorCode.overloaded, f"{service.role} has too many batches queued"))

        handler = BoundedHandler(handle, name=service.endpoint, max_concurrency=MAX_CONCURRENT_MESSAGES,
                                 max_pending=MAX_PENDING_MESSAGES, on_overload=overloaded)
        stack.push_async_callback(handler.stop)
        metrics.watch_counts(lambda: slot_counts(owner, handler), MODEL_SERVICE_GAUGES)
        stack.enter_context(serve_metrics(metrics.registry, config.metrics_port))
        micro = await add_micro_service(
            nc, service.role, service_version(), service.description,
            endpoints={service.endpoint: Endpoint(subject=service.subject, handler=handler.dispatch)},
            metadata={"instance_id": config.instance_id, **owner.model_ids}, stats_data=lambda _: metrics.stats())
        stack.push_async_callback(micro.stop)
        tasks = [
            asyncio.create_task(heartbeat_loop(nc, subjects.heartbeat, lambda: encode_beats(
                instance_heartbeat(owner, service.role, config.heartbeat_interval_s)), config.heartbeat_interval_s),
                name=f"{service.role}-heartbeat"),
            asyncio.create_task(evict_idle_loop(owner, lock), name=f"{service.role}-evict-idle"),
        ]
        stack.push_async_callback(cancel_tasks, tasks)
        log.info(f"{service.role}_serving", subject=service.subject, metrics_port=config.metrics_port)
        yield Serving(tasks)  # a crashed heartbeat or eviction loop: exit non-zero
        log.info(f"{service.role}_stopping", **owner.counters)
