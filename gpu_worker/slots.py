"""Request slots of a model's KV cache, kept the same way by the verifier
(gpu_worker/verify_step.py) and the drafter (services/drafter.py).

Both own a model, a KVCache and `requests: request_id -> state`, where each state holds its
cache `slot` and `last_used` (time.monotonic()). Slots are freed when the scheduler releases
them (PIPELINE.md, "Slot release"), when idle longer than slot_idle_ttl_s (their scheduler is
gone), and heartbeats report capacity = max_slots, load = slots in use, free_slots.
`load_model_and_cache` loads the model with its cache from the settings both configs share
(schemas/config.py ModelServiceConfig).
Counters: `slots_<reason>` per freed slot, `release_unknown` per released id without a slot.

`run_slot_service(owner, config, service, stop)` is the NATS service both run around their
batch function (`SlotService`): connect, one bounded handler on their subject, nats.micro
registration, heartbeats, idle eviction, Prometheus metrics on config.metrics_port, drain on stop.
Per message: decode (a bad message gets an Error reply naming the field), refuse an expired
deadline (Error `timeout`, field "deadline"), run one batch at a time (the model is one
resource) in a worker thread so heartbeats and NATS pings keep flowing, reply, then
`after_reply`. Counters: bad_messages, expired, overloaded, failed_batches, late_replies.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
import torch
from nats.aio.client import Client

from gpu_worker.checkpoint import load_model
from gpu_worker.kv_cache import KVCache
from gpu_worker.model import Model
from schemas.codec import decode, encode, error_reply
from schemas.config import ModelServiceConfig
from schemas.errors import ErrorCode, SpecbusError
from schemas.messages import Heartbeat
from schemas.subjects import Subjects
from services.bus import (BoundedHandler, Endpoint, add_micro_service, cancel_tasks, connect_service, expired,
                          heartbeat_loop, respond)
from services.logs import log_context
from services.metrics import MODEL_SERVICE_GAUGES, ModelServiceMetrics, serve_metrics

log = structlog.get_logger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SERVICE_VERSION = "0.1.0"
MAX_CONCURRENT_MESSAGES = 4  # decoding, refusals and error replies overlap; batches take the lock
MAX_PENDING_MESSAGES = 64


class SlotState(Protocol):
    slot: int
    last_used: float


class SlotOwner(Protocol):
    """What the functions below need of a Verifier or a Drafter."""

    instance_id: str
    cache: KVCache
    model_ids: dict[str, str]
    slot_idle_ttl_s: float
    requests: dict[str, SlotState]
    counters: Counter


def load_model_and_cache(model_dir: str, config: ModelServiceConfig) -> tuple[Model, KVCache]:
    """The model in model_dir and a KV cache of config.max_slots slots (device, dtype from
    config); applies config.torch_threads first. SpecbusError naming the field for a bad value."""
    if config.dtype not in DTYPES:
        raise SpecbusError(ErrorCode.invalid_field, f"dtype {config.dtype!r} is not one of {sorted(DTYPES)}", "dtype")
    if config.prefill_chunk < 1:
        raise SpecbusError(ErrorCode.invalid_field, f"prefill_chunk must be >= 1, got {config.prefill_chunk}",
                           "prefill_chunk")
    if config.torch_threads < 0:
        raise SpecbusError(ErrorCode.invalid_field, f"torch_threads must be >= 0, got {config.torch_threads}",
                           "torch_threads")
    if config.torch_threads:
        # process-wide; worker threads (asyncio.to_thread) pick it up on their first parallel op
        torch.set_num_threads(config.torch_threads)
    dtype = DTYPES[config.dtype]
    model, model_config = load_model(model_dir, config.device, dtype, config.max_seq_len)
    return model, KVCache(model_config, config.max_slots, config.max_seq_len, config.device, dtype)


def free_request(owner: SlotOwner, request_id: str, reason: str) -> bool:
    """Free request_id's slot if it has one, counted as `slots_<reason>`. True when freed."""
    state = owner.requests.pop(request_id, None)
    if state is None:
        return False
    owner.cache.free(state.slot)
    owner.counters[f"slots_{reason}"] += 1
    return True


def release(owner: SlotOwner, request_ids: list[str]) -> None:
    """Free the slots of finished / cancelled / migrated requests; ids without a slot (already
    evicted, or never seen) are counted."""
    for request_id in request_ids:
        if not free_request(owner, request_id, "released"):
            owner.counters["release_unknown"] += 1


def evict_idle(owner: SlotOwner, now: float | None = None) -> int:
    """Free slots untouched for slot_idle_ttl_s (their scheduler is gone); returns how many.
    now: time.monotonic() (tests pass a later one)."""
    now = time.monotonic() if now is None else now
    idle = [rid for rid, state in owner.requests.items() if now - state.last_used > owner.slot_idle_ttl_s]
    for request_id in idle:
        free_request(owner, request_id, "evicted")
    if idle:
        log.info("slots_evicted", count=len(idle), free_slots=owner.cache.num_free)
    return len(idle)


async def evict_idle_loop(owner: SlotOwner, lock: asyncio.Lock) -> None:
    """Free idle slots while no batches arrive, so heartbeats show the capacity back. lock:
    the one the service holds while a batch runs."""
    interval_s = min(max(owner.slot_idle_ttl_s / 4, 0.05), 10.0)
    while True:
        await asyncio.sleep(interval_s)
        async with lock:
            evict_idle(owner)


def instance_heartbeat(owner: SlotOwner, role: str, interval_s: float) -> Heartbeat:
    return Heartbeat(instance_id=owner.instance_id, role=role, capacity=owner.cache.max_slots,
                     load=len(owner.requests), free_slots=owner.cache.num_free, model_ids=owner.model_ids,
                     sent_at=time.time(), interval_s=interval_s)


# ---------------------------------------------------------------------------------------------
# the NATS service around a slot owner


@dataclass(frozen=True)
class SlotService:
    """What differs between the verifier and the drafter service. run_batch(request) ->
    (response, extra) runs in a worker thread; after_reply(nc, extra) runs once the reply is out
    (the verifier publishes its side records there)."""

    role: str  # nats.micro service name, heartbeat role, metric prefix
    endpoint: str  # the nats.micro endpoint's name
    description: str
    subject: str
    request_type: type
    run_batch: Callable[[Any], tuple[Any, Any]]
    after_reply: Callable[[Client, Any], Awaitable[None]] | None = None


async def refuse(owner: SlotOwner, service: SlotService, nc: Client, msg, counter: str, exc: SpecbusError) -> None:
    owner.counters[counter] += 1
    log.warning(f"{service.role}_request_{counter}", code=exc.code.value, field=exc.field, error=exc.message)
    await respond(nc, msg, error_reply(exc), owner.counters)


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
            late = expired(request.deadline)  # checked once the model is free: waiting for it takes time
            if late is not None:
                await refuse(owner, service, nc, msg, "expired", late)
                return
            started = time.monotonic()
            try:
                response, extra = await asyncio.to_thread(service.run_batch, request)
            except SpecbusError as exc:
                await refuse(owner, service, nc, msg, "bad_messages", exc)
                return
            except Exception as exc:
                owner.counters["failed_batches"] += 1
                log.exception(f"{service.role}_batch_failed")
                await respond(nc, msg, error_reply(exc), owner.counters)
                return
            metrics.batch_seconds.observe(time.monotonic() - started)
        if expired(request.deadline) is not None:
            owner.counters["late_replies"] += 1  # sent anyway: the scheduler may still use it
        await respond(nc, msg, encode(response), owner.counters)
        if service.after_reply is not None:
            await service.after_reply(nc, extra)


def slot_counts(owner: SlotOwner, handler: BoundedHandler) -> dict[str, int]:
    """$SRV.STATS data and the counts behind the Prometheus metrics."""
    free = owner.cache.num_free
    return {**owner.counters, **handler.stats(), "free_slots": free, "used_slots": owner.cache.max_slots - free}


async def run_slot_service(owner: SlotOwner, config: ModelServiceConfig, service: SlotService,
                           stop: asyncio.Event) -> None:
    """Serve service.subject for a loaded owner until `stop` is set, then drain."""
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
            nc, service.role, SERVICE_VERSION, service.description,
            endpoints={service.endpoint: Endpoint(subject=service.subject, handler=handler.dispatch)},
            metadata={"instance_id": config.instance_id, **owner.model_ids}, stats_data=lambda _: metrics.stats())
        stack.push_async_callback(micro.stop)
        tasks = [
            asyncio.create_task(heartbeat_loop(nc, subjects.heartbeat, lambda: encode(
                instance_heartbeat(owner, service.role, config.heartbeat_interval_s)), config.heartbeat_interval_s),
                name=f"{service.role}-heartbeat"),
            asyncio.create_task(evict_idle_loop(owner, lock), name=f"{service.role}-evict-idle"),
        ]
        stack.push_async_callback(cancel_tasks, tasks)
        log.info(f"{service.role}_serving", subject=service.subject, metrics_port=config.metrics_port)
        await stop.wait()
        log.info(f"{service.role}_stopping", **owner.counters)
