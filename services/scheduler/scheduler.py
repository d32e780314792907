"""The scheduler service (docs/ARCHITECTURE.md#the-step-loop): admission on `<p>.generate`, the step
loop (draft -> verify -> commit), cancel and stop notices, heartbeats in and out.

The decisions live in services/scheduler/scheduler_core.py (`SchedulerState`); this module moves messages.

    await run_scheduler(load_config(SchedulerConfig), stop)

Subjects: `<p>.generate.<user>` (queue group "schedulers"; the reply subject must be that client
user's own inbox `_INBOX.<user>.`), `<p>.cancel.<user>` (every scheduler; the one that owns the
request acts, and only when the user is the request's own), `<p>.heartbeat` (in and out),
`stop_notice(instance_id)` (a nats.micro endpoint, so $SRV.STATS.scheduler shows the counters).
Beside the heartbeats, every heartbeat_interval_s, the keepalives of running requests whose
clients heard nothing since (SchedulerState.keepalives).

On stop: admission closes, the step in flight finishes (within stop_grace_s, else it is cancelled
and its requests fail), then every running or queued request
ends with finish_reason "error", code `shutting_down` (a final commit, or a final error chunk when
it has no live postprocessor), so no client waits for a scheduler that is gone: the client
library hands the request over to another scheduler (docs/PROTOCOL.md#scheduler-failover).
"""

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import msgpack
import structlog
from nats.aio.client import Client
from pydantic import TypeAdapter, ValidationError

from text.tokenizer import load_tokenizer, tokenizer_id
from schemas.bus.codec import (MAX_ARRAY_LEN, MAX_MAP_LEN, decode, decode_any, decode_heartbeat, encode, encode_beats,
                           reply_version)
from schemas.bus.clock import wall as wall_clock
from schemas.commits import StopNotice
from schemas.config import SchedulerConfig, service_version
from schemas.bus.control import Heartbeat
from schemas.errors import ErrorCode, SpecbusError
from schemas.generation import CancelRequest, GenerateRequest
from schemas.steps import DraftRequest, DraftResponse, VerifyRequest, VerifyResponse
from schemas.streams import StreamChunk
from schemas.bus.subjects import SCHEDULER_QUEUE_GROUP, Subjects
from schemas.bus.wire import Error, RequestId
from services.scheduler.admission import prompt_token_ids
from services.scheduler.scheduler_core import STEP_GAUGES, SchedulerState
from services.scheduler.scheduler_types import Outbox, StepPlan, internal_error
from services.runtime.auth import inbox_prefix
from services.runtime.bus import (
    BoundedHandler,
    BusDeadlineExpired,
    BusError,
    BusPayloadTooLarge,
    BusTimeout,
    Endpoint,
    add_micro_service,
    connect_service,
    heartbeat_loop,
    publish,
    request,
    serve,
)
from services.runtime.logs import log_context
from services.runtime.metrics import SCHEDULER_GAUGES, serve_metrics
from services.runtime.tasks import serve_until_stopped

log = structlog.get_logger(__name__)

IDLE_WAIT_S = 0.05  # how often an idle loop re-checks deadlines, queued requests and dead instances
# Error replies a retry or another verifier may cure; any other code means the message itself
# was refused, and its requests end with "error".
RETRYABLE_CODES = {ErrorCode.timeout, ErrorCode.unavailable, ErrorCode.no_capacity, ErrorCode.internal}


async def timed(awaitable):
    """(its result, the seconds it took, time.monotonic() when it was done)."""
    start = time.monotonic()
    result = await awaitable
    done = time.monotonic()
    return result, done - start, done


def request_id_of(data: bytes) -> str | None:
    """The request_id of a GenerateRequest that failed validation elsewhere, when that field
    itself is valid, so the error chunk names the request."""
    try:
        raw = msgpack.unpackb(data, raw=False, max_array_len=MAX_ARRAY_LEN, max_map_len=MAX_MAP_LEN, max_ext_len=0)
        return TypeAdapter(RequestId).validate_python(raw.get("request_id"))
    except (ValueError, AttributeError, ValidationError):
        return None


class Scheduler:
    """Subscriptions, the step loop task and the heartbeat task around one SchedulerState."""

    def __init__(self, config: SchedulerConfig, nc: Client, state: SchedulerState):
        self.config = config
        self.nc = nc
        self.state = state
        self.subjects = Subjects(config.prefix)
        self.wakeups = [asyncio.Event() for _ in range(config.lanes)]  # one per lane's step loop
        self.closing = False
        self.stopping = False
        self.handlers: list[BoundedHandler] = []
        self.subscriptions = []
        self.step_loops: list[asyncio.Task] = []
        self.tasks: list[asyncio.Task] = []  # the step loops and the heartbeat
        self.service = None
        # what the shell counts (messages dropped or refused, failed round trips); the core's
        # decisions are counted by SchedulerState (docs/ARCHITECTURE.md#one-owner-per-table)
        self.counters: Counter = Counter()

    async def start(self) -> None:
        subjects = self.subjects
        self.state.max_payload = self.nc.max_payload
        self.subscriptions.append(await self.nc.subscribe(subjects.heartbeat, cb=self.on_heartbeat))
        self.subscriptions.append(await self.nc.subscribe(f"{subjects.cancel}.*", cb=self.on_cancel))
        self.state.metrics.watch_counts(self.stats, (*SCHEDULER_GAUGES, *STEP_GAUGES))
        self.service = await add_micro_service(
            self.nc, "scheduler", service_version(), "admission and the speculative decoding step loop",
            endpoints={"stop": Endpoint(subjects.stop_notice(self.config.instance_id), self.on_stop_notice)},
            metadata={"instance_id": self.config.instance_id}, stats_data=lambda _: self.state.metrics.stats())
        # Listen before admitting: after heartbeat_timeout_s every live instance has been heard, so
        # the first requests get a drafter too (one started without would run k=0 steps: the same
        # greedy output, but another seeded sample, which a failover to this scheduler must not change).
        await asyncio.gather(asyncio.sleep(self.config.heartbeat_timeout_s),
                             asyncio.to_thread(self.state.admission.warm_grammars))  # none pays it at its first grammar
        self.step_loops = [asyncio.create_task(self.step_loop(lane), name=f"scheduler-lane-{lane}")
                           for lane in range(self.config.lanes)]
        self.handlers.append(await serve(self.nc, f"{subjects.generate}.*", self.on_generate,
                                         queue=SCHEDULER_QUEUE_GROUP, max_concurrency=4,
                                         max_pending=4 * self.config.max_queue + 64))
        # Heartbeats last: a client that hears this scheduler may send it requests (failover).
        self.tasks = [*self.step_loops, asyncio.create_task(heartbeat_loop(
            self.nc, subjects.heartbeat, self.heartbeat, self.config.heartbeat_interval_s), name="scheduler-heartbeat"),
            asyncio.create_task(self.keepalive_loop(), name="scheduler-keepalives")]
        log.info("scheduler_started", instance_id=self.config.instance_id, prefix=self.config.prefix)

    async def __aenter__(self) -> "Scheduler":
        try:
            await self.start()
        except BaseException:  # what started stops
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Close admission, let the step in flight finish, end every request, stop. Idempotent."""
        if self.stopping:
            return
        self.stopping = True
        for handler in self.handlers:
            await handler.stop(timeout_s=2.0)
        self.closing = True
        self.wake()
        if self.step_loops:
            _, pending = await asyncio.wait(self.step_loops, timeout=self.config.stop_grace_s)
            for step_loop in pending:
                step_loop.cancel()
                log.warning("step_loop_cancelled_on_stop", lane=step_loop.get_name(), after_s=self.config.stop_grace_s)
            await asyncio.gather(*pending, return_exceptions=True)  # drain() below ends their requests
        await self.send(self.state.drain(wall_clock()))
        for task in self.tasks:
            task.cancel()
        for subscription in self.subscriptions:
            await subscription.unsubscribe()
        if self.service is not None:
            await self.service.stop()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        log.info("scheduler_stopped", **self.state.stats(), **self.counters)

    def stats(self) -> dict:
        """The counters and gauges (running, queued) of $SRV.STATS, before the metrics' own."""
        return {**self.state.stats(), **self.counters,
                **{f"generate_{k}": v for h in self.handlers for k, v in h.stats().items()}}

    async def keepalive_loop(self) -> None:
        """Every heartbeat_interval_s, Admitted `started` to the clients of running requests that
        heard nothing since (SchedulerState.keepalives)."""
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            await self.send(self.state.keepalives())

    def heartbeat(self) -> list[bytes]:
        config = self.config
        return encode_beats(Heartbeat(instance_id=config.instance_id, role="scheduler",
                                capacity=config.max_running + config.max_queue, load=self.state.load,
                                model_ids={"tokenizer": self.state.tokenizer_hash}, sent_at=wall_clock(),
                                interval_s=config.heartbeat_interval_s))

    # ------------------------------------------------------------------ handlers

    async def on_generate(self, msg) -> None:
        if not msg.reply:
            self.counters["dropped_generate_no_reply"] += 1
            log.warning("generate_without_reply_subject", dropped=self.counters["dropped_generate_no_reply"])
            return
        user = self.subjects.user_of(msg.subject)
        if not msg.reply.startswith(inbox_prefix(user) + "."):
            # Only the sender's own inbox: `<p>.verify.x` would aim our answers at a service,
            # `_INBOX.<another user>.x` a stream at another client. Nothing is sent: an error
            # chunk to that subject would be the redirect itself.
            self.counters["refused_generate_reply_not_own_inbox"] += 1
            log.warning("generate_refused", code=ErrorCode.forbidden.value, field="reply_subject", user=user,
                        message=f"the reply subject is not in the inbox of {user!r}", reply=msg.reply[:200],
                        refused=self.counters["refused_generate_reply_not_own_inbox"])
            return
        request_id = None
        try:
            # the max_tokens cap depends on the verifiers' max_seq_len too: admission checks it
            generate = decode(msg.data, GenerateRequest, context={"max_tokens_cap": None})
            request_id = generate.request_id
            self.state.admission.check_request(generate)
            # in threads: a grammar's compile and probe, a long prompt's tokenizing take a while,
            # and the step loops must go on
            await asyncio.to_thread(self.state.admission.check_grammar, generate)
            prompt_ids = await asyncio.to_thread(prompt_token_ids, generate, self.state.tokenizer)
            self.state.admit(generate, msg.reply, prompt_ids, wall_clock())
        except Exception as exc:  # a SpecbusError names the field; anything else is our bug, answered `internal`
            if request_id is None and getattr(exc, "code", None) not in (ErrorCode.malformed, ErrorCode.too_large):
                request_id = request_id_of(msg.data)
            if isinstance(exc, SpecbusError):
                self.counters[f"refused_{exc.code.value}"] += 1
                log.warning("generate_refused", request_id=request_id, code=exc.code.value, field=exc.field,
                            message=exc.message)
            else:
                self.counters["refused_internal"] += 1
                log.exception("generate_failed", request_id=request_id)
            chunk = StreamChunk(request_id=request_id or "unknown", seq=0, finish_reason="error",
                                error=Error.from_exception(exc, request_id))
            await self.publish(msg.reply, encode(chunk, reply_version(msg.data)))
            return
        # The client resends a request it hears nothing about (schemas.streams.Admitted).
        await self.publish(msg.reply, encode(self.state.admitted(request_id, started=False, v=generate.v)))
        self.wake()

    async def on_cancel(self, msg) -> None:
        cancel = self.decode_or_drop(msg, CancelRequest)
        if cancel is None:
            return
        user = self.subjects.user_of(msg.subject)
        try:
            cancelled = self.state.cancel(cancel.request_id, owner_inbox=inbox_prefix(user) + ".")
        except SpecbusError as exc:  # another user's request: refused, counted, and answered if asked
            self.counters["refused_cancel_not_owner"] += 1
            log.warning("cancel_refused", request_id=cancel.request_id, user=user, code=exc.code.value,
                        field=exc.field, message=exc.message, refused=self.counters["refused_cancel_not_owner"])
            if msg.reply and msg.reply.startswith(inbox_prefix(user) + "."):
                await self.publish(msg.reply, encode(Error.from_exception(exc, cancel.request_id), cancel.v))
            return
        if cancelled:
            self.wake()

    async def on_stop_notice(self, msg) -> None:
        notice = self.decode_or_drop(msg, StopNotice)
        if notice is not None and self.state.stop_notice(notice.request_id):
            log.info("stop_notice", request_id=notice.request_id, reason=notice.reason,
                     postprocessor_id=notice.postprocessor_id)
            self.wake()

    async def on_heartbeat(self, msg) -> None:
        heartbeat = self.decode_or_drop(msg, Heartbeat, decode_heartbeat)
        if heartbeat is not None and heartbeat.instance_id != self.config.instance_id \
                and self.state.observe(heartbeat):
            self.wake()  # a new instance: queued requests may start now

    def decode_or_drop(self, msg, message_type, decoder=None):
        """The message, or None for a bad one (counted and logged; these subjects have no reply)
        or one the decoder (default `decode`) passes over (a heartbeat's copy for other versions)."""
        try:
            return decoder(msg.data) if decoder is not None else decode(msg.data, message_type)
        except SpecbusError as exc:
            kind = message_type.model_fields["type"].default
            self.counters[f"dropped_bad_{kind}"] += 1
            log.warning("bad_message_dropped", kind=kind, code=exc.code.value, field=exc.field, message=exc.message)
            return None

    # ------------------------------------------------------------------ the step loop

    def wake(self) -> None:
        """Every lane: something may be ready to run (a request, a cancel, an instance, a stop)."""
        for event in self.wakeups:
            event.set()

    async def step_loop(self, lane: int) -> None:
        wakeup = self.wakeups[lane]
        while not self.closing:
            wakeup.clear()  # before the boundary: a wake() from here on ends the idle wait below
            plan = None
            try:
                started = self.state.counters["started"]
                await self.send(self.state.boundary(wall_clock(), lane))
                if self.state.counters["started"] != started:
                    self.wake()  # a request started on another lane, whose loop may be idle
                plan = self.state.plan_step(wall_clock(), lane)
                busy = await self.step(plan)
            except Exception:
                log.exception("step_failed", lane=lane, batch_ids=plan and [m.batch_id for m in plan.verify_requests.values()])
                if plan is not None:
                    await self.fail_step(plan)
                busy = False
            finally:
                if plan is not None:
                    self.state.end_step(plan)
            if not busy:
                try:
                    await asyncio.wait_for(wakeup.wait(), timeout=IDLE_WAIT_S)
                except asyncio.TimeoutError:
                    pass

    async def fail_step(self, plan: StepPlan) -> None:
        """After an unexpected exception: the step's requests end with "error" (an `internal`
        error naming no detail; that is in the log); other requests and the lane go on."""
        outbox = Outbox()
        for rows in plan.rows.values():
            for planned in rows:
                request = planned.request
                if request.request_id not in self.state.running:
                    continue
                try:
                    outbox.extend(self.state.end(request, "error", wall_clock(), error=internal_error(
                        request.request_id, "the scheduler failed while running a step of this request (see its log)")))
                except Exception:
                    log.exception("fail_step_end_failed", request_id=request.request_id)
        try:
            await self.send(outbox)
        except Exception:
            log.exception("fail_step_send_failed")

    async def step(self, plan: StepPlan) -> bool:
        """One step of one lane; False when there was nothing to verify (the loop then idles briefly)."""
        state = self.state
        state.max_payload = self.nc.max_payload  # the server's; it may change across a reconnect
        started = time.monotonic()
        drafts = state.draft_batches(plan, wall_clock())
        replies = await asyncio.gather(*(timed(self.draft(d, m)) for d, m in drafts.items()))
        for (drafter_id, message), (reply, seconds, _) in zip(drafts.items(), replies):
            state.apply_draft(plan, drafter_id, message, reply)
            state.draft_timed(drafter_id, message, reply, seconds)
        drafted = time.monotonic()
        verifies = state.verify_batches(plan, wall_clock())
        await self.send(plan.outbox)  # requests whose row could not fit in a message
        replies = await asyncio.gather(*(timed(self.verify(v, m, plan)) for v, m in verifies.items()))
        verified = time.monotonic()
        for verifier_id, (reply, _, _) in zip(verifies, replies):
            await self.send(state.apply_verify(plan, verifier_id, reply, wall_clock()))
        committed = time.monotonic()
        for (verifier_id, message), (reply, seconds, answered_at) in zip(verifies.items(), replies):
            state.verify_timed(verifier_id, message, reply, seconds, committed - verified, verifier_id in plan.retried,
                               answered_at)
        if not plan.empty:  # release-only batches are not steps
            state.step_timed(plan, {v: reply for v, (reply, _, _) in zip(verifies, replies)}, committed - started)
            state.metrics.step_timed(drafted - started if drafts else None, verified - drafted, committed - verified)
        return not plan.empty

    async def draft(self, drafter_id: str, message: DraftRequest) -> DraftResponse | None:
        """The drafter's answer, or None when it was late, gone or answered with an error."""
        subject = self.subjects.draft(drafter_id)
        try:
            msg = await request(self.nc, subject, encode(message, self.state.placement.version_toward(drafter_id)),
                                timeout_s=self.config.draft_timeout_s)
            reply = decode_any(msg.data)
        except SpecbusError as exc:
            self.counters["draft_failures"] += 1
            log.warning("draft_failed", drafter_id=drafter_id, batch_id=message.batch_id, code=exc.code.value,
                        message=exc.message)
            return None
        if not isinstance(reply, DraftResponse) or reply.batch_id != message.batch_id:
            self.counters["draft_failures"] += 1
            log.warning("draft_unexpected_reply", drafter_id=drafter_id, batch_id=message.batch_id,
                        reply=getattr(reply, "code", reply.type))
            return None
        return reply

    async def verify(self, verifier_id: str, message: VerifyRequest, plan: StepPlan) -> VerifyResponse | Error | None:
        """The verifier's answer after at most verify_retries re-sends of the same message (rows
        flagged is_retry); None when it never answered usefully. A try waits the batch's own
        time (plan.attempt_s), and on while the verifier heartbeats (await_reply): a slow
        verifier is not sent the batch again, a silent one is."""
        subject = self.subjects.verify(verifier_id)
        attempt_s = plan.attempt_s.get(verifier_id, self.config.verify_timeout_s)
        # the verifier sends side records to the rows' postprocessors in the batch's version
        v = self.state.placement.version_toward(verifier_id, *{row.postprocessor_id for row in message.rows})
        for attempt in range(self.config.verify_retries + 1):
            if attempt:
                plan.retried.add(verifier_id)
                message = message.model_copy(update={"rows": [r.model_copy(update={"is_retry": True})
                                                              for r in message.rows]})
            with log_context(verifier_id=verifier_id, batch_id=message.batch_id, attempt=attempt):
                try:
                    msg = await self.await_reply(verifier_id, subject, encode(message, v), attempt_s, message.deadline)
                    reply = decode_any(msg.data)
                except BusDeadlineExpired:
                    break
                except BusPayloadTooLarge as exc:  # our message, not the verifier: no retry, nobody is dead
                    self.counters["verify_too_large"] += 1
                    log.warning("verify_too_large", message=exc.message)
                    return Error.from_exception(exc)
                except SpecbusError as exc:
                    self.counters["verify_failures"] += 1
                    log.warning("verify_failed", code=exc.code.value, message=exc.message)
                    continue
                if isinstance(reply, VerifyResponse) and reply.batch_id == message.batch_id:
                    return reply
                if isinstance(reply, Error) and reply.code not in RETRYABLE_CODES:
                    return reply
                self.counters["verify_failures"] += 1
                log.warning("verify_unexpected_reply", reply=getattr(reply, "code", reply.type))
        return None

    async def await_reply(self, instance_id: str, subject: str, payload: bytes, attempt_s: float,
                          deadline: float):
        """The reply to a request on subject, waited for attempt_s, then on, up to deadline, for as
        long as instance_id heartbeats (counted: `verify_waits_past_timeout`); BusTimeout once it
        is silent past attempt_s, and the bus's own errors."""
        reply = asyncio.ensure_future(request(self.nc, subject, payload, deadline=deadline))
        wait_s, extended = attempt_s, False
        try:
            while not (await asyncio.wait({reply}, timeout=wait_s))[0]:
                if not self.state.placement.alive(instance_id):
                    raise BusTimeout(f"no reply on {subject!r} within {attempt_s:.3f} s, and {instance_id} is silent")
                if not extended:
                    extended = True
                    self.counters["verify_waits_past_timeout"] += 1
                    log.info("verify_slow_verifier_alive", instance_id=instance_id, waited_s=round(attempt_s, 3))
                wait_s = self.config.heartbeat_interval_s
            return reply.result()
        finally:
            reply.cancel()  # no-op once done
            await asyncio.gather(reply, return_exceptions=True)

    # ------------------------------------------------------------------ output

    async def send(self, outbox: Outbox) -> None:
        for postprocessor_id, commit in outbox.commits:  # commit.v: its client's version
            v = self.state.placement.version_toward(postprocessor_id, cap=commit.v)
            await self.publish(self.subjects.post_commit(postprocessor_id), encode(commit, v))
        for inbox, message in [*outbox.acks, *outbox.chunks]:
            await self.publish(inbox, encode(message))

    async def publish(self, subject: str, payload: bytes) -> None:
        try:
            await publish(self.nc, subject, payload)
        except BusError as exc:
            self.counters["dropped_publish_failed"] += 1
            log.warning("publish_failed", subject=subject, code=exc.code.value, message=exc.message)


async def run_scheduler(config: SchedulerConfig, stop: asyncio.Event) -> None:
    """Serve until `stop` is set, then drain (module docstring): services/runtime/tasks.py's
    lifecycle; a crashed lane or heartbeat exits non-zero."""
    await serve_until_stopped(scheduler_service(config), stop)


@asynccontextmanager
async def scheduler_service(config: SchedulerConfig) -> AsyncIterator[Scheduler]:
    """A started Scheduler, connected and its metrics served; on exit stopped, then drained."""
    tokenizer = load_tokenizer(config.tokenizer)
    state = SchedulerState(config, tokenizer, tokenizer_id(config.tokenizer))
    async with AsyncExitStack() as stack:
        nc = await connect_service(config, config.instance_id)
        stack.push_async_callback(nc.drain)
        scheduler = await stack.enter_async_context(Scheduler(config, nc, state))
        stack.enter_context(serve_metrics(state.metrics.registry, config.metrics_port))
        yield scheduler
