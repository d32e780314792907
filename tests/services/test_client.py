"""Client library against a real nats-server; the test plays the service side, publishing
StreamChunks to the inbox each GenerateRequest names as its reply subject."""

import asyncio
import contextlib
import json
import math
import time
from types import SimpleNamespace

import numpy as np
import pytest

from schemas.bus.codec import decode, encode, encode_beats
from schemas.config import BusConfig
from schemas.bus.control import Heartbeat
from schemas.bus.protocol import PROTOCOL_VERSION as N
from schemas.errors import CodecError, ErrorCode
from schemas.generation import CancelRequest, GenerateRequest, seed_from_request_id
from schemas.streams import Admitted, SamplingMask, StreamChunk, TokenLogprob, Usage
from schemas.bus.subjects import Subjects
from schemas.bus.versions import Window
from schemas.bus.wire import Error
from services.client import (
    Client,
    GenerationResult,
    Overloaded,
    RequestError,
    StreamBroken,
    StreamTimeout,
    make_request,
    score_request,
)
from services.launch.natsserver import NatsServer, NatsServerConfig
from services.runtime.auth import generate_credentials, password_env, users_from_env
from services.runtime.bus import connect


@pytest.fixture
async def service(nc):
    """(generate requests, cancel requests) queues: what the client sent."""
    generate, cancel = asyncio.Queue(), asyncio.Queue()
    await nc.subscribe("specbus.generate.client", cb=generate.put)  # no login: the default client user
    await nc.subscribe("specbus.cancel.client", cb=cancel.put)
    await nc.flush(timeout=2)
    return generate, cancel


@pytest.fixture
async def client(nats_server):
    async with Client(nats_server.url, timeout_margin_s=0.2, idle_timeout_s=5.0, gap_grace_s=0.2) as c:
        yield c


def chunk(seq, text="", request_id="req-1", **fields):
    return StreamChunk(request_id=request_id, seq=seq, text=text, **fields)


async def beat(nc, instance_id: str) -> None:
    """A scheduler's heartbeats every 0.05 s, until cancelled."""
    while True:
        heartbeat = Heartbeat(instance_id=instance_id, role="scheduler", capacity=8, load=0, sent_at=time.time(),
                              interval_s=0.05)
        await nc.publish(Subjects().heartbeat, encode(heartbeat))
        await asyncio.sleep(0.05)


async def answer(nc, generate, *chunks):
    """Receive the client's request, publish chunks to its inbox; returns the request."""
    msg = await asyncio.wait_for(generate.get(), timeout=5)
    for item in chunks:
        await nc.publish(msg.reply, encode(item))
    await nc.flush(timeout=2)
    return decode(msg.data, GenerateRequest)


async def test_stream_reorders_by_seq_and_drops_duplicates(nc, service, client):
    generate, _ = service
    request = make_request("hi", request_id="req-1")
    async with await client.open_stream(request) as stream:
        sent = await answer(nc, generate, chunk(1, "b"), chunk(0, "a"), chunk(0, "a"),
                            chunk(2, "c", finish_reason="length"))
        received = [item async for item in stream]
    assert sent == request
    assert [(item.seq, item.text) for item in received] == [(0, "a"), (1, "b"), (2, "c")]
    assert stream.num_duplicates == 1


async def test_generate_gathers_tokens_logprobs_masks_and_usage(nc, service, client):
    generate, _ = service
    request = make_request([3, 4], request_id="req-1", logprobs=1, logprob_token_ids=[7], sampling_mask=True)
    entry = TokenLogprob(token_id=5, logprob=-0.5, rank=1, token="x", top_ids=[5], top_logprobs=[-0.5],
                         requested_logprobs=[-math.inf])
    usage = Usage(prompt_tokens=2, completion_tokens=3, steps=2)
    generation = asyncio.create_task(client.generate(request))
    await answer(nc, generate,
                 chunk(0, "xy", token_ids=[5, 6], from_draft=[True, False], logprobs=[entry, entry],
                       sampling_masks=[SamplingMask(all_tokens=True, size=9), SamplingMask(token_ids=[6], size=1)],
                       prompt_token_ids=[3, 4], prompt_logprobs=[None, entry]),
                 chunk(1, "z", token_ids=[8], from_draft=[False], degraded=["logprobs_timeout"],
                       finish_reason="eos", usage=usage))
    result = await asyncio.wait_for(generation, timeout=5)
    assert (result.text, result.token_ids, result.prompt_token_ids) == ("xyz", [5, 6, 8], [3, 4])
    assert result.logprobs == [entry, entry, None] and result.sampling_masks[2] is None
    assert result.from_draft == [True, False, False] and result.degraded == ["logprobs_timeout"]
    assert result.finish_reason == "eos" and result.usage == usage
    out = json.loads(json.dumps(result.to_json(), allow_nan=False))  # plain JSON: no Infinity
    assert {"text", "token_ids", "prompt_token_ids", "logprobs", "prompt_logprobs", "sampling_masks",
            "finish_reason", "usage"} <= out.keys()
    assert out["logprobs"][0] == {"token_id": 5, "token": "x", "logprob": -0.5, "rank": 1,
                                  "top": [{"token_id": 5, "logprob": -0.5}],
                                  "requested": [{"token_id": 7, "logprob": None}]}
    assert out["logprobs"][2] is None and out["prompt_logprobs"][0] is None
    assert out["sampling_masks"][0] == {"all": True, "size": 9, "truncated": False, "token_ids": []}
    assert out["usage"]["completion_tokens"] == 3


async def test_gap_before_the_final_chunk_raises_stream_broken(nc, service, nats_server):
    generate, _ = service
    async with Client(nats_server.url, timeout_margin_s=0.2, gap_grace_s=0.2, failover=False) as client:
        generation = asyncio.create_task(client.generate(make_request("hi", request_id="req-1")))
        await answer(nc, generate, chunk(0, "a"), chunk(2, "c", finish_reason="length"))
        with pytest.raises(StreamBroken, match=r"seqs \[1\] never arrived"):
            await asyncio.wait_for(generation, timeout=5)


async def test_a_lost_chunk_is_sent_again_by_a_run_resumed_after_what_was_read(nc, service, client):
    """Failover (on by default): the stream lost seq 1 (say, in a dead NATS node), so the client
    sends the request again as a new run resuming after the tokens it read, with the seed its
    original id gives; the new run's chunks continue the stream's seqs."""
    generate, cancel = service
    request = make_request("hi", request_id="req-1", temperature=0.7)
    generation = asyncio.create_task(client.generate(request))
    await answer(nc, generate, chunk(0, "a", token_ids=[5], from_draft=[False]),
                 chunk(2, "c", token_ids=[7], from_draft=[False], finish_reason="length"))
    resumed = await answer(nc, generate, chunk(0, "b", request_id="req-1.failover1", token_ids=[6],
                                               from_draft=[False]),
                           chunk(1, "c", request_id="req-1.failover1", token_ids=[7], from_draft=[False],
                                 finish_reason="length"))
    assert resumed.request_id == "req-1.failover1" and resumed.resume_token_ids.tolist() == [5]
    assert resumed.sampling.seed == seed_from_request_id("req-1")  # the draws of the original id
    result = await asyncio.wait_for(generation, timeout=5)
    assert (result.text, result.token_ids, result.finish_reason) == ("abc", [5, 6, 7], "length")
    assert result.num_chunks == 3 and result.degraded == ["failover"]
    assert decode((await asyncio.wait_for(cancel.get(), timeout=2)).data, CancelRequest).request_id == "req-1"


async def test_a_lost_commit_fails_over_but_a_schedulers_verdict_does_not(nc, service, client):
    """The postprocessor's `unavailable` error for a commit that never came names no scheduler:
    the client runs the rest again. The same code in a chunk that names the scheduler (its final
    commit, e.g. no verifier left) is the request's end: RequestError, no new run."""
    generate, _ = service
    lost = Error(code=ErrorCode.unavailable, message="commit 1 of the stream never reached the postprocessor")
    generation = asyncio.create_task(client.generate(make_request("hi", request_id="req-1")))
    await answer(nc, generate, chunk(0, "a", token_ids=[5], from_draft=[False], scheduler_id="s1"),
                 chunk(1, finish_reason="error", error=lost))
    resumed = await answer(nc, generate, chunk(0, "b", request_id="req-1.failover1", token_ids=[6], from_draft=[False],
                                               scheduler_id="s2"),
                           chunk(1, request_id="req-1.failover1", finish_reason="error", scheduler_id="s2",
                                 error=Error(code=ErrorCode.unavailable, message="no verifier left")))
    assert resumed.resume_token_ids.tolist() == [5]
    with pytest.raises(RequestError, match="no verifier left") as ended:
        await asyncio.wait_for(generation, timeout=5)
    assert ended.value.partial.token_ids == [5, 6] and ended.value.partial.degraded == ["failover"]


async def test_a_lost_commit_after_a_lost_chunk_fails_over_too(nc, service, client):
    """A NATS node dies: seq 1 (a chunk) is lost on the way to the client and a commit on the way
    to the postprocessor, whose `unavailable` error (no scheduler named) becomes the stream's last
    seq 2. That gap is a loss too, not the request's verdict: the client runs the rest again."""
    generate, _ = service
    lost = Error(code=ErrorCode.unavailable, message="commit 2 of the stream never reached the postprocessor")
    generation = asyncio.create_task(client.generate(make_request("hi", request_id="req-1")))
    await answer(nc, generate, chunk(0, "a", token_ids=[5], from_draft=[False], scheduler_id="s1"),
                 chunk(2, finish_reason="error", error=lost))
    resumed = await answer(nc, generate, chunk(0, "b", request_id="req-1.failover1", token_ids=[6], from_draft=[False],
                                               scheduler_id="s1", finish_reason="length"))
    assert resumed.resume_token_ids.tolist() == [5]
    result = await asyncio.wait_for(generation, timeout=5)
    assert (result.token_ids, result.finish_reason, result.degraded) == ([5, 6], "length", ["failover"])


async def test_a_stopping_scheduler_hands_the_request_to_another_resuming_after_what_was_read(
        nc, service, nats_server):
    """`shutting_down` (the scheduler got SIGTERM) is a hand-over: the client waits until another
    scheduler heartbeats, then sends the rest as a new run, the seed and positions unchanged."""
    generate, _ = service

    stopping = Error(code=ErrorCode.shutting_down, message="scheduler s1 is stopping; send the request again")
    async with Client(nats_server.url, heartbeat_timeout_s=0.3) as client:
        beating = [asyncio.create_task(beat(nc, "s1"))]
        generation = asyncio.create_task(client.generate(make_request("hi", request_id="req-1", temperature=0.7)))
        await answer(nc, generate, chunk(0, "a", token_ids=[5], from_draft=[False], scheduler_id="s1"),
                     chunk(1, finish_reason="error", error=stopping, scheduler_id="s1"))
        await asyncio.sleep(0.5)  # s1 still beats while it drains: the client waits for another scheduler
        assert generate.empty() and not generation.done()
        beating.append(asyncio.create_task(beat(nc, "s2")))
        resumed = await answer(nc, generate, chunk(0, "b", request_id="req-1.failover1", token_ids=[6],
                                                   from_draft=[False], scheduler_id="s2", finish_reason="length"))
        result = await asyncio.wait_for(generation, timeout=5)
        for task in beating:
            task.cancel()
    assert resumed.resume_token_ids.tolist() == [5] and resumed.sampling.seed == seed_from_request_id("req-1")
    assert (result.text, result.token_ids, result.degraded) == ("ab", [5, 6], ["failover"])


async def test_request_timeout_raises_and_cancels(nc, service, client):
    generate, cancel = service
    started = time.monotonic()
    generation = asyncio.create_task(client.generate(make_request("hi", request_id="req-1", timeout_s=0.3)))
    await answer(nc, generate)  # the service stays silent
    with pytest.raises(StreamTimeout, match="timeout_s 0.3"):
        await asyncio.wait_for(generation, timeout=5)
    assert 0.5 <= time.monotonic() - started < 2.5  # timeout_s + margin
    assert decode((await asyncio.wait_for(cancel.get(), timeout=2)).data, CancelRequest).request_id == "req-1"


async def test_idle_timeout_between_chunks_raises_and_cancels(nc, service, nats_server):
    generate, cancel = service
    async with Client(nats_server.url, idle_timeout_s=0.3, failover=False) as client:
        generation = asyncio.create_task(client.generate(make_request("hi", request_id="req-1")))
        await answer(nc, generate, chunk(0, "a"))
        with pytest.raises(StreamTimeout, match="idle"):
            await asyncio.wait_for(generation, timeout=5)
    assert decode((await asyncio.wait_for(cancel.get(), timeout=2)).data, CancelRequest).request_id == "req-1"


async def test_a_request_no_scheduler_acknowledges_is_sent_again(nc, service, nats_server):
    """The GenerateRequest, or the scheduler's Admitted, lost on the way (in a dying NATS node,
    say): after admission_timeout_s without an answer the request goes again as a new run, and
    the first one is cancelled in case it lives after all."""
    generate, cancel = service
    async with Client(nats_server.url, admission_timeout_s=0.3) as client:
        generation = asyncio.create_task(client.generate(make_request("hi", request_id="req-1")))
        first = await answer(nc, generate)  # lost: neither an Admitted nor a chunk comes back
        resent = await answer(nc, generate, Admitted(request_id="req-1.failover1", scheduler_id="s1", started=True),
                              chunk(0, "a", request_id="req-1.failover1", finish_reason="length"))
        result = await asyncio.wait_for(generation, timeout=5)
    assert first.request_id == "req-1" and resent.resume_token_ids is None
    assert (result.text, result.finish_reason, result.degraded) == ("a", "length", ["failover"])
    assert decode((await asyncio.wait_for(cancel.get(), timeout=2)).data, CancelRequest).request_id == "req-1"


async def test_a_queued_request_is_not_sent_again_and_a_started_one_is_bounded_by_idle(nc, service, nats_server):
    """Admitted (queued) ends the admission wait: a request may sit in a scheduler's queue for
    long, bounded by its deadline and its scheduler's heartbeats only. Admitted (started) starts
    the idle bound, so a run whose every chunk was lost is run again."""
    generate, cancel = service
    async with Client(nats_server.url, admission_timeout_s=0.2, idle_timeout_s=0.4) as client:
        generation = asyncio.create_task(client.generate(make_request("hi", request_id="req-1")))
        msg = await asyncio.wait_for(generate.get(), timeout=5)
        await nc.publish(msg.reply, encode(Admitted(request_id="req-1", scheduler_id="s1")))
        await asyncio.sleep(1.0)  # five admission timeouts, two idle ones: a queued request waits them out
        assert generate.empty() and not generation.done()
        await nc.publish(msg.reply, encode(Admitted(request_id="req-1", scheduler_id="s1", started=True)))
        resent = await answer(nc, generate, chunk(0, "a", request_id="req-1.failover1", finish_reason="length"))
        result = await asyncio.wait_for(generation, timeout=5)
    assert resent.request_id == "req-1.failover1"
    assert (result.text, result.degraded) == ("a", ["failover"])
    assert decode((await asyncio.wait_for(cancel.get(), timeout=2)).data, CancelRequest).request_id == "req-1"


async def test_error_chunk_raises_request_error_naming_the_field(nc, service, client):
    generate, _ = service
    error = Error(code="invalid_field", message="top_p must be > 0", field="sampling.top_p")
    generation = asyncio.create_task(client.generate(make_request("hi", request_id="req-1")))
    await answer(nc, generate, chunk(0, "a"), chunk(1, finish_reason="error", error=error))
    with pytest.raises(RequestError, match="sampling.top_p") as caught:
        await asyncio.wait_for(generation, timeout=5)
    assert caught.value.code == "invalid_field" and caught.value.field == "sampling.top_p"
    assert caught.value.partial.text == "a"


async def test_overloaded_is_its_own_error_type(nc, service, client):
    generate, _ = service
    generation = asyncio.create_task(client.generate(make_request("hi", request_id="req-1")))
    await answer(nc, generate, chunk(0, finish_reason="error", error=Error(code="overloaded", message="queue full")))
    with pytest.raises(Overloaded, match="queue full"):
        await asyncio.wait_for(generation, timeout=5)


async def test_no_scheduler_fails_fast(client):
    started = time.monotonic()
    with pytest.raises(RequestError, match="no scheduler") as caught:
        await client.generate(make_request("hi", timeout_s=30))
    assert caught.value.code == "unavailable" and time.monotonic() - started < 2


async def test_leaving_a_stream_early_cancels_the_request(nc, service, client):
    generate, cancel = service
    stream = client.stream(make_request("hi", request_id="req-1"))
    async with contextlib.aclosing(stream):
        first = asyncio.create_task(anext(stream))
        await answer(nc, generate, chunk(0, "a"))
        assert (await asyncio.wait_for(first, timeout=5)).text == "a"
    assert decode((await asyncio.wait_for(cancel.get(), timeout=2)).data, CancelRequest).request_id == "req-1"


async def test_cancel_publishes_a_cancel_request(service, client):
    _, cancel = service
    await client.cancel("req-9")
    assert decode((await asyncio.wait_for(cancel.get(), timeout=2)).data, CancelRequest).request_id == "req-9"


def test_make_request_fills_the_nested_fields():
    request = make_request("hello", max_tokens=5, temperature=0, stop=["\n"], logprobs=3, logprobs_mode="processed",
                           num_speculative_tokens=2, draft_mode="sample", timeout_s=9, stream=False, seed=None)
    assert request.prompt == "hello" and request.prompt_token_ids is None
    assert (request.sampling.max_tokens, request.sampling.temperature, request.sampling.stop) == (5, 0, ["\n"])
    assert request.sampling.seed is None
    assert (request.logprobs.logprobs, request.logprobs.logprobs_mode) == (3, "processed")
    assert (request.speculative.num_speculative_tokens, request.speculative.draft_mode) == (2, "sample")
    assert (request.timeout_s, request.stream) == (9, False)
    ids = make_request(np.array([1, 2, 3]))
    assert ids.prompt is None and ids.prompt_token_ids.tolist() == [1, 2, 3]


def test_score_request_asks_for_prompt_logprobs_and_no_tokens():
    request = score_request([1, 2, 3], prompt_logprobs=2, logprobs_mode="processed", temperature=0.7)
    assert request.sampling.max_tokens == 0 and request.logprobs.prompt_logprobs == 2
    assert request.logprobs.logprobs_mode == "processed" and request.sampling.temperature == 0.7


def test_bad_request_options_name_the_field():
    with pytest.raises(CodecError, match="sampling.top_p") as caught:
        make_request("hi", top_p=0)
    assert caught.value.field == "sampling.top_p"
    with pytest.raises(CodecError, match="unknown request option 'topp'"):
        make_request("hi", topp=0.5)
    with pytest.raises(CodecError, match="prompt_token_ids"):
        make_request([])


def test_result_of_a_stream_without_logprobs_has_none():
    result = GenerationResult("r")
    result.add(chunk(0, "a", request_id="r", token_ids=[1], from_draft=[False], finish_reason="length"))
    out = result.to_json()
    assert out["logprobs"] is None and out["sampling_masks"] is None and out["token_ids"] == [1]


# ---------------------------------------------------------------------------------------------
# under NATS auth: what the server refuses is an error at once, not a timeout


@pytest.fixture
def secured():
    """A nats-server with the role users and client users alice and bob; yields (server, credentials)."""
    credentials = generate_credentials(["alice", "bob"])
    with NatsServer(NatsServerConfig(users=tuple(users_from_env(credentials)))) as server:
        yield server, credentials


def bus_config(server, credentials, user, **fields) -> BusConfig:
    return BusConfig(nats_url=server.url, nats_user=user, nats_password=credentials[password_env(user)], **fields)


async def test_a_client_logs_in_from_a_bus_config_and_streams_through_its_own_inbox(secured):
    server, credentials = secured
    scheduler = await connect(server.url, "scheduler", user="scheduler",
                              password=credentials[password_env("scheduler")])

    async def on_generate(msg):
        request = decode(msg.data, GenerateRequest)
        await scheduler.publish(msg.reply, encode(chunk(0, "ok", request_id=request.request_id, finish_reason="stop")))

    await scheduler.subscribe("specbus.generate.*", queue="schedulers", cb=on_generate)
    await scheduler.flush(timeout=2)
    async with Client.from_config(bus_config(server, credentials, "alice"), timeout_margin_s=0.2) as alice:
        result = await alice.generate(make_request("hi", timeout_s=5))
    assert (result.text, result.finish_reason) == ("ok", "stop")
    await scheduler.close()


@pytest.mark.parametrize("when", ["while reading", "before reading"])
async def test_a_refused_request_is_a_forbidden_error_at_once(secured, when):
    server, credentials = secured
    async with Client.from_config(bus_config(server, credentials, "alice", prefix="not-allowed")) as alice:
        started = time.monotonic()
        stream = await alice.open_stream(make_request("hi", timeout_s=30))
        if when == "before reading":
            await asyncio.sleep(0.3)  # the refusal arrives before anyone waits for a chunk
        with pytest.raises(RequestError, match="publish to 'not-allowed.generate.alice'") as refused:
            async with stream:
                await stream.__anext__()
    assert refused.value.code == ErrorCode.forbidden and refused.value.request_id == stream.request.request_id
    assert time.monotonic() - started < 2.0


async def test_a_scheduler_silent_before_the_first_chunk_gets_the_request_sent_again(nc, service, nats_server):
    """Before the first chunk the client does not know which scheduler has the request: one of
    those alive when it was sent falling silent for heartbeat_timeout_s is enough to send it
    again (the same seed, nothing to resume from); the new run's chunks are the stream."""
    generate, cancel = service

    async with Client(nats_server.url, heartbeat_timeout_s=0.3) as client:
        beating = asyncio.create_task(beat(nc, "s1"))
        async with asyncio.timeout(5):
            while client.live_schedulers() != ["s1"]:
                await asyncio.sleep(0.01)
        generation = asyncio.create_task(client.generate(make_request("hi", request_id="req-1")))
        first = await answer(nc, generate)
        beating.cancel()  # s1 took it, then died: no chunk, no more beats; s2 (its restart, say) lives
        beating = asyncio.create_task(beat(nc, "s2"))
        resumed = await answer(nc, generate, chunk(0, "a", request_id="req-1.failover1", finish_reason="length"))
        beating.cancel()
        result = await asyncio.wait_for(generation, timeout=5)
    assert first.request_id == "req-1" and resumed.resume_token_ids is None
    assert (result.text, result.finish_reason, result.degraded) == ("a", "length", ["failover"])
    assert decode((await asyncio.wait_for(cancel.get(), timeout=2)).data, CancelRequest).request_id == "req-1"


async def test_a_client_sends_in_the_highest_version_every_live_scheduler_speaks():
    """Client.version (docs/PROTOCOL.md#version-rule): its low end before a scheduler is heard,
    then the highest that it and every live scheduler speak, read from the heartbeat copy
    addressed to its window."""
    client = Client(window=Window(N, N + 1), heartbeat_timeout_s=60.0)
    assert client.version() == N

    async def beats_from(instance_id: str, window: Window) -> None:
        beat = Heartbeat(instance_id=instance_id, role="scheduler", capacity=4, load=0, protocol_min=window.low,
                         protocol_version=window.high, sent_at=time.time(), interval_s=1.0)
        for copy in encode_beats(beat, window):
            await client.on_heartbeat(SimpleNamespace(data=copy))

    await beats_from("new-0", Window(N, N + 1))
    assert client.version() == N + 1
    await beats_from("old-0", Window(N, N))
    assert client.version() == N  # either may take the request
    client.scheduler_beats["old-0"] = time.monotonic() - 120.0  # silent past heartbeat_timeout_s
    assert client.version() == N + 1
