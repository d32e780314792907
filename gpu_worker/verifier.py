"""The verifier service: serves `<prefix>.verify.<instance_id>` with the step logic of
gpu_worker/verify_step.py, and publishes side-channel records to `<prefix>.post.<id>.side`.

`run_verifier(config, stop)` (started by `specbus serve verifier`): loads the target, connects,
registers nats.micro service "verifier" ($SRV.PING/INFO/STATS.verifier), heartbeats (role
verifier, capacity = max_slots, free_slots, load = slots in use, model_ids {"target",
"tokenizer"}), frees idle slots, and drains on stop. Per message: decode (a bad message gets an
Error reply naming the field), refuse an expired deadline (Error `timeout`, field "deadline"),
run one batch at a time (the model is one resource) in a worker thread so heartbeats and NATS
pings keep flowing, reply with the VerifyResponse, then publish the side records.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from contextlib import AsyncExitStack

import nats.errors
import structlog

from gpu_worker.verify_step import Verifier, evict_idle, load_verifier, verify_batch
from schemas.codec import decode, encode, error_reply
from schemas.config import VerifierConfig
from schemas.errors import ErrorCode, SpecbusError
from schemas.messages import Heartbeat, VerifyRequest
from schemas.subjects import Subjects
from services.bus import (BoundedHandler, BusError, Endpoint, add_micro_service, check_payload_size, connect,
                          heartbeat_loop, publish)
from services.logs import log_context

log = structlog.get_logger(__name__)

SERVICE_VERSION = "0.1.0"
MAX_CONCURRENT_MESSAGES = 4  # decoding, refusals and error replies overlap; batches take the lock
MAX_PENDING_MESSAGES = 64


def heartbeat(verifier: Verifier, interval_s: float) -> Heartbeat:
    return Heartbeat(instance_id=verifier.instance_id, role="verifier", capacity=verifier.cache.max_slots,
                     load=len(verifier.requests), free_slots=verifier.cache.num_free, model_ids=verifier.model_ids,
                     sent_at=time.time(), interval_s=interval_s)


def tls_context(config: VerifierConfig) -> ssl.SSLContext | None:
    if not (config.tls_ca or config.tls_cert):
        return None
    context = ssl.create_default_context(cafile=config.tls_ca)
    if config.tls_cert:
        context.load_cert_chain(config.tls_cert, config.tls_key)
    return context


async def respond(verifier: Verifier, nc, msg, payload: bytes) -> None:
    """Reply to msg (a micro Request); a reply that cannot go out is logged and counted."""
    try:
        check_payload_size(nc, "verify reply", payload, None)
    except BusError as exc:
        verifier.counters["reply_too_large"] += 1
        log.warning("verify_reply_too_large", error=str(exc))
        payload = error_reply(exc)
    try:
        await msg.respond(payload)
    except (ValueError, nats.errors.Error) as exc:  # ValueError: the message had no reply subject
        verifier.counters["reply_failed"] += 1
        log.warning("verify_reply_failed", error=str(exc) or type(exc).__name__)


async def refuse(verifier: Verifier, nc, msg, counter: str, exc: SpecbusError) -> None:
    verifier.counters[counter] += 1
    log.warning(f"verify_request_{counter}", code=exc.code.value, field=exc.field, error=exc.message)
    await respond(verifier, nc, msg, error_reply(exc))


def expired(request: VerifyRequest) -> SpecbusError | None:
    late_s = time.time() - request.deadline
    if late_s < 0:
        return None
    return SpecbusError(ErrorCode.timeout, f"deadline passed {late_s:.3f} s ago", "deadline")


async def handle_verify(verifier: Verifier, nc, subjects: Subjects, lock: asyncio.Lock, msg) -> None:
    """Decode, refuse expired work, verify (one batch at a time, in a thread), reply, publish
    the side records."""
    try:
        request = decode(msg.data, VerifyRequest)
    except SpecbusError as exc:
        await refuse(verifier, nc, msg, "bad_messages", exc)
        return
    with log_context(batch_id=request.batch_id, scheduler_id=request.scheduler_id):
        async with lock:
            late = expired(request)  # checked once the model is free: waiting for it takes time
            if late is not None:
                await refuse(verifier, nc, msg, "expired", late)
                return
            try:
                response, records = await asyncio.to_thread(verify_batch, verifier, request)
            except Exception as exc:
                verifier.counters["failed_batches"] += 1
                log.exception("verify_batch_failed")
                await respond(verifier, nc, msg, error_reply(exc))
                return
        if time.time() > request.deadline:
            verifier.counters["late_replies"] += 1  # sent anyway: the scheduler may still use it
        await respond(verifier, nc, msg, encode(response))
        for postprocessor_id, record in records:
            try:
                await publish(nc, subjects.post_side(postprocessor_id), encode(record))
            except BusError as exc:
                verifier.counters["side_records_dropped"] += 1
                log.warning("side_record_dropped", request_id=record.request_id, error=str(exc))
            else:
                verifier.counters["side_records_published"] += 1


async def evict_idle_loop(verifier: Verifier, lock: asyncio.Lock) -> None:
    """Free idle slots while no batches arrive, so heartbeats show the capacity back."""
    interval_s = min(max(verifier.slot_idle_ttl_s / 4, 0.05), 10.0)
    while True:
        await asyncio.sleep(interval_s)
        async with lock:
            evict_idle(verifier)


async def cancel_tasks(tasks: list[asyncio.Task], timeout_s: float = 5.0) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks, timeout=timeout_s)


async def run_verifier(config: VerifierConfig, stop: asyncio.Event) -> None:
    """Serve `<prefix>.verify.<instance_id>` until `stop` is set, then drain."""
    verifier = await asyncio.to_thread(load_verifier, config)
    subjects = Subjects(config.prefix)
    lock = asyncio.Lock()
    log.info("verifier_loaded", instance_id=config.instance_id, model=config.target_model, device=config.device,
             dtype=config.dtype, max_slots=config.max_slots, **verifier.model_ids)
    async with AsyncExitStack() as stack:
        nc = await connect(config.nats_url, f"verifier-{config.instance_id}",
                           connect_timeout_s=config.connect_timeout_s, user=config.nats_user,
                           password=config.nats_password, tls=tls_context(config))
        stack.push_async_callback(nc.drain)

        async def handle(msg) -> None:
            await handle_verify(verifier, nc, subjects, lock, msg)

        async def overloaded(msg) -> None:
            await refuse(verifier, nc, msg, "overloaded",
                         SpecbusError(ErrorCode.overloaded, "verifier has too many batches queued"))

        handler = BoundedHandler(handle, name="verify", max_concurrency=MAX_CONCURRENT_MESSAGES,
                                 max_pending=MAX_PENDING_MESSAGES, on_overload=overloaded)
        stack.push_async_callback(handler.stop)
        service = await add_micro_service(
            nc, "verifier", SERVICE_VERSION, "verifies draft tokens with the target model",
            endpoints={"verify": Endpoint(subject=subjects.verify(config.instance_id), handler=handler.dispatch)},
            metadata={"instance_id": config.instance_id, **verifier.model_ids},
            stats_data=lambda _: {**verifier.counters, **handler.stats(), "free_slots": verifier.cache.num_free})
        stack.push_async_callback(service.stop)
        tasks = [
            asyncio.create_task(heartbeat_loop(nc, subjects.heartbeat,
                                               lambda: encode(heartbeat(verifier, config.heartbeat_interval_s)),
                                               config.heartbeat_interval_s), name="verifier-heartbeat"),
            asyncio.create_task(evict_idle_loop(verifier, lock), name="verifier-evict-idle"),
        ]
        stack.push_async_callback(cancel_tasks, tasks)
        log.info("verifier_serving", subject=subjects.verify(config.instance_id))
        await stop.wait()
        log.info("verifier_stopping", **verifier.counters)
