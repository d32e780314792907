"""The scheduler over a real nats-server, with the real verifier and drafter services (tiny random
checkpoints in tmp_path) as asyncio tasks. The test itself is the postprocessor: it heartbeats as
one and subscribes to its commit subject, and it is the client: it publishes GenerateRequests
with a reply inbox."""

import asyncio
import json
import time

import msgpack
import pytest

from schemas.bus.codec import decode, encode
from schemas.commits import Commit
from schemas.config import DrafterConfig, SchedulerConfig, VerifierConfig, load_config
from schemas.bus.control import Heartbeat
from schemas.errors import ErrorCode
from schemas.generation import CancelRequest, GenerateRequest
from schemas.steps import VerifyRequest, VerifyResponse, VerifyResult
from schemas.streams import Admitted, StreamChunk
from schemas.bus.subjects import DEFAULT_CLIENT_USER, Subjects
from services.drafter.drafter import run_drafter
from services.scheduler.scheduler import run_scheduler
from services.verifier.verifier import run_verifier
from services.runtime.bus import heartbeat_loop, request
from tests.conftest import wait_for_heartbeats
from text.tokenizer import tokenizer_id

POSTPROCESSOR = "pp-test"
PROMPTS = [[3, 14, 15, 9, 26], [5, 35, 8], [9, 7, 9, 3, 2, 38, 4, 6, 26, 4, 33, 8, 3, 27]]
SUBJECTS = Subjects()
GENERATE = SUBJECTS.generate_for(DEFAULT_CLIENT_USER)  # the conftest nc's inbox is that user's


class InProcessStack:
    """Services as tasks, each with its own stop event; the test plays postprocessor and client."""

    def __init__(self, nats_url, nc, tokenizer_dir):
        self.nats_url, self.nc, self.tokenizer_dir = nats_url, nc, tokenizer_dir
        self.services: dict[str, tuple[asyncio.Event, asyncio.Task]] = {}
        self.commits: dict[str, list[Commit]] = {}
        self.finished: dict[str, asyncio.Event] = {}
        self.tasks: list[asyncio.Task] = []

    def start(self, name, run, config):
        stop = asyncio.Event()
        self.services[name] = (stop, asyncio.create_task(run(config, stop), name=name))

    async def stop(self, name):
        stop, task = self.services.pop(name)
        stop.set()
        await asyncio.wait_for(task, timeout=30)

    async def be_postprocessor(self):
        async def on_commit(msg):
            commit = decode(msg.data, Commit)
            self.commits.setdefault(commit.request_id, []).append(commit)
            if commit.finish_reason is not None:
                self.finished.setdefault(commit.request_id, asyncio.Event()).set()

        await self.nc.subscribe(SUBJECTS.post_commit(POSTPROCESSOR), cb=on_commit)
        model_ids = {"tokenizer": tokenizer_id(self.tokenizer_dir)}
        self.tasks.append(asyncio.create_task(heartbeat_loop(self.nc, SUBJECTS.heartbeat, lambda: encode(Heartbeat(
            instance_id=POSTPROCESSOR, role="postprocessor", capacity=64, load=0, model_ids=model_ids,
            sent_at=time.time(), interval_s=0.1)), 0.1)))

    async def wait_for_instances(self, *instance_ids, timeout_s=60.0):
        await wait_for_heartbeats(self.nc, instance_ids, timeout_s=timeout_s)

    async def generate(self, request: GenerateRequest, timeout_s=60.0) -> list[Commit]:
        """Commits of one request, in seq order, once its final commit arrived."""
        self.finished.setdefault(request.request_id, asyncio.Event())
        await self.nc.publish(GENERATE, encode(request), reply=self.nc.new_inbox())
        await asyncio.wait_for(self.finished[request.request_id].wait(), timeout=timeout_s)
        commits = sorted(self.commits[request.request_id], key=lambda c: c.seq)
        assert [c.seq for c in commits] == list(range(len(commits)))
        return commits

    async def close(self):
        for name in list(self.services):
            await self.stop(name)
        for task in self.tasks:
            task.cancel()


@pytest.fixture
async def stack(nats_server, nc, model_dirs):
    stack = InProcessStack(nats_server.url, nc, model_dirs["target"])
    yield stack
    await stack.close()


def scheduler_config(stack, **overrides):
    settings = dict(nats_url=stack.nats_url, instance_id="sched-test", tokenizer=str(stack.tokenizer_dir),
                    heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0)
    return load_config(SchedulerConfig, env={}, **{**settings, **overrides})


def start_pipeline(stack, model_dirs, draft="draft", **scheduler_overrides):
    target, draft = model_dirs["target"], model_dirs[draft]
    common = dict(env={}, nats_url=stack.nats_url, heartbeat_interval_s=0.1, max_slots=16, max_seq_len=128)
    stack.start("verifier", run_verifier, load_config(VerifierConfig, target_model=str(target),
                                                      instance_id="verifier-a", **common))
    stack.start("drafter", run_drafter, load_config(DrafterConfig, draft_model=str(draft),
                                                    instance_id="drafter-a", **common))
    stack.start("scheduler", run_scheduler, scheduler_config(stack, **scheduler_overrides))


def greedy(request_id, prompt, k, max_tokens=12):
    return GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                           sampling={"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True},
                           speculative={"num_speculative_tokens": k})


def completion(commits):
    return [t for c in commits for t in c.token_ids.tolist()]


async def first_chunk(nc, payload: bytes) -> StreamChunk:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(GENERATE, payload, reply=inbox)
    chunk = decode((await sub.next_msg(timeout=10)).data, StreamChunk)
    await sub.unsubscribe()
    return chunk


@pytest.mark.parametrize("draft", ["draft", "twin"])
async def test_greedy_speculative_output_equals_plain_decoding(stack, model_dirs, draft):
    await stack.be_postprocessor()
    start_pipeline(stack, model_dirs, draft, draft_timeout_s=2.0)
    await stack.wait_for_instances("verifier-a", "drafter-a", "sched-test")
    plain = await asyncio.gather(*(stack.generate(greedy(f"plain-{i}", p, k=0)) for i, p in enumerate(PROMPTS)))
    spec = await asyncio.gather(*(stack.generate(greedy(f"spec-{i}", p, k=4)) for i, p in enumerate(PROMPTS)))
    for i, (plain_commits, spec_commits) in enumerate(zip(plain, spec)):
        assert completion(spec_commits) == completion(plain_commits), f"prompt {i}"
        assert len(completion(spec_commits)) == 12
        assert spec_commits[0].prompt_token_ids.tolist() == PROMPTS[i]
        final = spec_commits[-1]
        assert final.finish_reason == "length" and final.usage.completion_tokens == 12
        assert final.usage.draft_tokens_proposed > 0 and final.usage.prompt_tokens == len(PROMPTS[i])
        assert not any(c.degraded for c in spec_commits)
    spec_steps, plain_steps = sum(c[-1].usage.steps for c in spec), sum(c[-1].usage.steps for c in plain)
    assert spec_steps <= plain_steps
    if draft == "twin":  # the target drafting for itself: all accepted, 5 tokens a step
        assert all(c[-1].usage.acceptance_rate > 0.9 for c in spec) and spec_steps < plain_steps / 2

    ping = json.loads((await request(stack.nc, "$SRV.PING.scheduler", b"", timeout_s=5)).data)
    assert ping["name"] == "scheduler"
    stats = json.loads((await request(stack.nc, "$SRV.STATS.scheduler", b"", timeout_s=5)).data)
    assert stats["endpoints"][0]["data"]["finished_length"] == 2 * len(PROMPTS)


async def test_drafter_stopped_mid_stream_requests_finish_flagged_with_unchanged_output(stack, model_dirs):
    await stack.be_postprocessor()
    # adaptive k off: every step asks the drafter, so its loss always shows (adaptive k may stop
    # asking this random draft before the kill, and the requests end before it is missed); no
    # suffix index: its drafts would stand in for the lost drafter's in some steps
    start_pipeline(stack, model_dirs, draft_timeout_s=2.0, adaptive_k=False, suffix_max_tokens=0)
    await stack.wait_for_instances("verifier-a", "drafter-a", "sched-test")
    reference = await asyncio.gather(*(stack.generate(greedy(f"ref-{i}", p, k=0, max_tokens=40))
                                       for i, p in enumerate(PROMPTS)))
    running = [asyncio.create_task(stack.generate(greedy(f"run-{i}", p, k=4, max_tokens=40)))
               for i, p in enumerate(PROMPTS)]
    while not all(stack.commits.get(f"run-{i}") for i in range(len(PROMPTS))):
        await asyncio.sleep(0.01)
    _, drafter = stack.services.pop("drafter")
    drafter.cancel()  # gone without a goodbye: no more answers, no more heartbeats
    outputs = await asyncio.gather(*running)
    for ref, out in zip(reference, outputs):
        assert completion(out) == completion(ref)
        assert out[-1].finish_reason == "length"
    assert any("draft_timeout" in c.degraded for out in outputs for c in out)
    assert any(out[-1].usage.degraded_steps.get("draft_timeout") for out in outputs)


async def test_cancel_ends_the_request_with_a_final_commit(stack, model_dirs):
    await stack.be_postprocessor()
    start_pipeline(stack, model_dirs)
    await stack.wait_for_instances("verifier-a", "drafter-a", "sched-test")
    long = greedy("to-cancel", PROMPTS[0], k=2, max_tokens=100)
    running = asyncio.create_task(stack.generate(long))
    while not stack.commits.get("to-cancel"):
        await asyncio.sleep(0.01)
    await stack.nc.publish(SUBJECTS.cancel_for(DEFAULT_CLIENT_USER), encode(CancelRequest(request_id="to-cancel")))
    commits = await running
    assert commits[-1].finish_reason == "cancelled" and len(completion(commits)) < 100


async def test_the_client_hears_when_its_request_arrives_and_when_it_starts(stack, model_dirs):
    """Admitted (started False) on arrival, Admitted (started True) when it leaves the queue: a
    client that hears neither sends the request again (services/client.py)."""
    await stack.be_postprocessor()
    stack.start("scheduler", run_scheduler, scheduler_config(stack))  # no verifier yet: it stays queued
    await stack.wait_for_instances("sched-test")
    inbox = await stack.nc.subscribe(stack.nc.new_inbox())
    await stack.nc.publish(GENERATE, encode(greedy("acked", PROMPTS[0], k=0, max_tokens=4)), reply=inbox.subject)
    queued = decode((await inbox.next_msg(timeout=10)).data, Admitted)
    assert (queued.request_id, queued.scheduler_id, queued.started) == ("acked", "sched-test", False)
    stack.start("verifier", run_verifier, load_config(  # with a verifier it starts
        VerifierConfig, env={}, nats_url=stack.nats_url, heartbeat_interval_s=0.1, max_slots=16, max_seq_len=128,
        target_model=str(model_dirs["target"]), instance_id="verifier-a"))
    started = decode((await inbox.next_msg(timeout=60)).data, Admitted)
    assert (started.request_id, started.scheduler_id, started.started) == ("acked", "sched-test", True)


async def test_queue_full_is_refused_with_overloaded(stack):
    await stack.be_postprocessor()  # no verifier: admitted requests wait in the queue
    stack.start("scheduler", run_scheduler, scheduler_config(stack, max_running=1, max_queue=1))
    await stack.wait_for_instances("sched-test")
    for name in ("queued-1", "queued-2"):
        await stack.nc.publish(GENERATE, encode(greedy(name, [1, 2], k=0)), reply=stack.nc.new_inbox())
    chunk = await first_chunk(stack.nc, encode(greedy("one-too-many", [1, 2], k=0)))
    assert chunk.final and chunk.finish_reason == "error" and chunk.error.code == ErrorCode.overloaded
    assert chunk.request_id == "one-too-many"


async def test_bad_requests_get_an_error_naming_the_field(stack):
    stack.start("scheduler", run_scheduler, scheduler_config(stack, max_tokens_cap=64))
    await stack.wait_for_instances("sched-test")
    raw = greedy("bad", [1, 2], k=0).model_dump()
    raw["sampling"]["top_p"] = 5.0
    chunk = await first_chunk(stack.nc, msgpack.packb(raw))
    assert chunk.error.code == ErrorCode.invalid_field and chunk.error.field == "sampling.top_p"
    chunk = await first_chunk(stack.nc, encode(greedy("too-long", [1, 2], k=0, max_tokens=65)))
    assert chunk.error.field == "sampling.max_tokens" and chunk.request_id == "too-long"
    chunk = await first_chunk(stack.nc, encode(GenerateRequest(request_id="oov", prompt_token_ids=[1, 10_000])))
    assert chunk.error.field == "prompt_token_ids"
    chunk = await first_chunk(stack.nc, b"\x93 not a map")
    assert chunk.error.code == ErrorCode.malformed and chunk.finish_reason == "error"
    chunk = await first_chunk(stack.nc, encode(greedy("after", [1, 2], k=0, max_tokens=65)))
    assert chunk.request_id == "after" and chunk.error.field == "sampling.max_tokens"  # still serving


async def test_stop_with_a_hung_verify_in_flight_ends_the_request_within_the_grace(stack):
    """A verifier that takes the batch and never answers: stopping the scheduler does not wait
    out verify_timeout_s, it cancels the step after stop_grace_s and fails the request."""
    await stack.be_postprocessor()
    received = asyncio.Event()

    async def hang(msg):
        received.set()  # and never reply

    await stack.nc.subscribe(SUBJECTS.verify("verifier-hung"), cb=hang)
    model_ids = {"tokenizer": tokenizer_id(stack.tokenizer_dir)}
    stack.tasks.append(asyncio.create_task(heartbeat_loop(stack.nc, SUBJECTS.heartbeat, lambda: encode(Heartbeat(
        instance_id="verifier-hung", role="verifier", capacity=8, load=0, free_slots=8, model_ids=model_ids,
        sent_at=time.time(), interval_s=0.1)), 0.1)))
    stack.start("scheduler", run_scheduler, scheduler_config(stack, verify_timeout_s=60.0, stop_grace_s=0.5))
    await stack.wait_for_instances("verifier-hung", "sched-test")
    stack.finished["hung"] = asyncio.Event()
    await stack.nc.publish(GENERATE, encode(greedy("hung", PROMPTS[0], k=0)), reply=stack.nc.new_inbox())
    await asyncio.wait_for(received.wait(), timeout=10)
    started = time.monotonic()
    await stack.stop("scheduler")
    assert time.monotonic() - started < 10  # the grace, not the 60 s verify timeout
    await asyncio.wait_for(stack.finished["hung"].wait(), timeout=5)
    assert stack.commits["hung"][-1].finish_reason == "error"


async def test_a_slow_verifier_that_heartbeats_is_waited_for_and_its_clients_are_kept_alive(stack):
    """A verify that outlasts verify_timeout_s at a verifier that heartbeats all along: the
    scheduler waits for that answer (the batch is sent once: no re-send, no `verifier_retry`),
    and meanwhile the client hears Admitted `started` again (keepalives), so it never takes the
    silence for lost output. The batch is held until both showed, so nothing here depends on
    the machine's speed."""
    await stack.be_postprocessor()
    batches, answer = [], asyncio.Event()

    async def slow(msg):  # one batch at a time, as a verifier runs them
        message = decode(msg.data, VerifyRequest)
        batches.append(message)
        if message.rows and not answer.is_set():
            await answer.wait()
        rows = [VerifyResult(request_id=r.request_id, step=r.step, token_ids=[9] if r.emit else [])
                for r in message.rows]
        await stack.nc.publish(msg.reply, encode(VerifyResponse(batch_id=message.batch_id,
                                                                verifier_id="verifier-slow", rows=rows)))

    await stack.nc.subscribe(SUBJECTS.verify("verifier-slow"), cb=slow)
    model_ids = {"tokenizer": tokenizer_id(stack.tokenizer_dir)}
    stack.tasks.append(asyncio.create_task(heartbeat_loop(stack.nc, SUBJECTS.heartbeat, lambda: encode(Heartbeat(
        instance_id="verifier-slow", role="verifier", capacity=8, load=0, free_slots=8, model_ids=model_ids,
        sent_at=time.time(), interval_s=0.1)), 0.1)))
    # A try of 0.2 s, and tries enough that the batch's deadline is far off: the held batch is
    # never refused as late. heartbeat_timeout_s 50 times the beats' interval: a loaded machine
    # does not make the verifier look dead.
    stack.start("scheduler", run_scheduler, scheduler_config(stack, verify_timeout_s=0.2, verify_retries=1000,
                                                             heartbeat_timeout_s=5.0))
    await stack.wait_for_instances("verifier-slow", "sched-test")
    inbox = await stack.nc.subscribe(stack.nc.new_inbox())
    stack.finished["slow"] = asyncio.Event()
    await stack.nc.publish(GENERATE, encode(greedy("slow", PROMPTS[0], k=0, max_tokens=2)), reply=inbox.subject)
    started = 0
    while started < 2:  # the start, then a keepalive while the verify is held
        started += decode((await inbox.next_msg(timeout=60)).data, Admitted).started
    while not (await scheduler_stats(stack)).get("verify_waits_past_timeout"):  # its first try ran out
        await asyncio.sleep(0.05)
    answer.set()
    await asyncio.wait_for(stack.finished["slow"].wait(), timeout=60)
    commits = sorted(stack.commits["slow"], key=lambda c: c.seq)
    assert commits[-1].finish_reason == "length" and not any(c.degraded for c in commits)
    assert not any(row.is_retry for batch in batches for row in batch.rows)  # waited for, never sent again
    assert (await scheduler_stats(stack)).get("verify_failures", 0) == 0


async def scheduler_stats(stack) -> dict:
    reply = await request(stack.nc, "$SRV.STATS.scheduler", b"", timeout_s=5)
    return json.loads(reply.data)["endpoints"][0]["data"]
