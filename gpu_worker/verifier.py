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
import time
from contextlib import AsyncExitStack

import structlog

from gpu_worker.slots import evict_idle_loop, instance_heartbeat
from gpu_worker.verify_step import Verifier, load_verifier, verify_batch
from schemas.codec import decode, encode, error_reply
from schemas.config import VerifierConfig
from schemas.errors import ErrorCode, SpecbusError
from schemas.messages import Heartbeat, VerifyRequest
from schemas.subjects import Subjects
from services.bus import (BoundedHandler, BusError, Endpoint, add_micro_service, connect_service, heartbeat_loop,
                          publish, respond)
from services.logs import log_context

log = structlog.get_logger(__name__)

SERVICE_VERSION = "0.1.0"
MAX_CONCURRENT_MESSAGES = 4  # decoding, refusals and error replies overlap; batches take the lock
MAX_PENDING_MESSAGES = 64


def heartbeat(verifier: Verifier, interval_s: float) -> Heartbeat:
    return instance_heartbeat(verifier, "verifier", interval_s)


async def refuse(verifier: Verifier, nc, msg, counter: str, exc: SpecbusError) -> None:
    verifier.counters[counter] += 1
    log.warning(f"verify_request_{counter}", code=exc.code.value, field=exc.field, error=exc.message)
    await respond(nc, msg, error_reply(exc), verifier.counters)


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
                await respond(nc, msg, error_reply(exc), verifier.counters)
                return
        if time.time() > request.deadline:
            verifier.counters["late_replies"] += 1  # sent anyway: the scheduler may still use it
        await respond(nc, msg, encode(response), verifier.counters)
        for postprocessor_id, record in records:
            try:
                await publish(nc, subjects.post_side(postprocessor_id), encode(record))
            except BusError as exc:
                verifier.counters["side_records_dropped"] += 1
                log.warning("side_record_dropped", request_id=record.request_id, error=str(exc))
            else:
                verifier.counters["side_records_published"] += 1


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
        nc = await connect_service(config, f"verifier-{config.instance_id}")
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
