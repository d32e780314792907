"""Bad input: hypothesis-generated garbage to every subject each service of a
real multi-process stack listens on (tiny random models, no NATS auth: what is tested is the
services' own defence, whoever got a message through).

Per subject, bounded examples of: random bytes, truncated msgpack of a valid message, one field
of a valid message replaced by a value of another type (NaN and inf among them), a wrong
protocol version, a list far over its limit, an unknown proposal kind / draft mode, and a valid
message of another type. A request with a reply subject (generate, draft.<id>, verify.<id>) gets
the typed error the codec gives for those bytes (an error StreamChunk for generate); every bad
message is counted by the service that dropped it and logged in at most one line at WARNING;
afterwards every process is alive and a greedy generation gives what it gave before.

Then extreme but valid requests: hypothesis-generated GenerateRequests with every field
at or between its schema limits (prompts over max_seq_len or of MAX_PROMPT_CHARS, token ids
outside the vocabulary, temperatures and top_p at their bounds, max_tokens up to the cap,
timeouts from 1 ns to an hour, ...) and CancelRequests racing them (right after the request, or
after a few chunks), 1-3 at once beside a greedy canary request: each ends with a typed outcome
(a final chunk, or a typed error) within its deadline, the canary's output is the undisturbed
one, and every service process is the one that started (same pids: no crash, no restart).
"""

import asyncio
import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

from schemas.bus.codec import MAX_ARRAY_LEN, decode
from schemas.commits import Commit, LogprobArrays, SideChannelRecord, StopNotice
from schemas.bus.control import Heartbeat
from schemas.errors import CodecError, ErrorCode
from schemas.generation import CancelRequest, GenerateRequest, LogprobOptions, RowSampling, SamplingParams
from schemas.bus.protocol import (MAX_BATCH_ROWS, MAX_LOGPROB_TOKEN_IDS, MAX_MASK_SIZE, MAX_PROMPT_CHARS,
                              MAX_SPECULATIVE_TOKENS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE,
                              MAX_TIMEOUT_S, MAX_TOKENS_CAP, MAX_TOP_K, MAX_TOP_LOGPROBS, MIN_TEMPERATURE, MIN_TOP_P,
                              PROTOCOL_VERSION)
from schemas.steps import DraftRequest, DraftRow, Proposal, VerifyRequest, VerifyResponse, VerifyRow
from schemas.streams import SamplingMask, StreamChunk
from schemas.bus.subjects import Subjects
from schemas.bus.wire import Error, Message
from services.client import RequestError, make_request
from services.runtime.auth import inbox_prefix
from services.runtime.bus import connect
from tests.tiny_checkpoints import VT

pytestmark = pytest.mark.asyncio(loop_scope="module")

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
MAX_SEQ_LEN = 256  # of the verifier's and drafter's caches: a longer prompt is over a limit
REPLY_TIMEOUT_S = 10.0
# Codes whose error must say which field is to blame.
FIELD_CODES = {ErrorCode.invalid_field, ErrorCode.unsupported_version, ErrorCode.wrong_message_type}
PROMPT = [17, 4, 99, 310, 8, 52, 1024, 77]


def deadline() -> float:
    return time.time() + 3600


@dataclass(frozen=True)
class Target:
    """One subject a service listens on. reply: "error" (an Error reply), "chunk" (an error
    StreamChunk to the reply inbox), or None (no reply: the bad message is dropped). counter:
    the service's $SRV.STATS counter that counts what it refused on this subject."""

    name: str
    role: str
    subject: Callable[[Subjects], str]
    message_type: type[Message]
    valid: Callable[[], Message]
    reply: str | None
    counter: str

    def __repr__(self) -> str:
        return self.name


TARGETS = [
    Target("generate", "scheduler", lambda s: s.generate_for("client"), GenerateRequest, lambda: GenerateRequest(
        request_id="fuzz-generate", prompt_token_ids=PROMPT, timeout_s=10.0,
        sampling=SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, stop=["x"], stop_token_ids=[1]),
        logprobs=LogprobOptions(logprobs=2, logprob_token_ids=[3])), "chunk", "refused_"),
    Target("cancel", "scheduler", lambda s: s.cancel_for("client"), CancelRequest,
           lambda: CancelRequest(request_id="fuzz-cancel"), None, "dropped_bad_cancel"),
    Target("stop", "scheduler", lambda s: s.stop_notice("scheduler-0"), StopNotice, lambda: StopNotice(
        request_id="fuzz-stop", batch_id=1, step=0, postprocessor_id="fuzz", stop="x", text_offset=1, num_tokens=1),
           None, "dropped_bad_stop_notice"),
    Target("heartbeat", "scheduler", lambda s: s.heartbeat, Heartbeat, lambda: Heartbeat(
        instance_id="fuzz-beat", role="verifier", capacity=4, load=0, free_slots=4, model_ids={"target": "x"},
        sent_at=time.time(), interval_s=0.5), None, "dropped_bad_heartbeat"),
    Target("draft", "drafter", lambda s: s.draft("drafter-0"), DraftRequest, lambda: DraftRequest(
        batch_id=1, scheduler_id="fuzz", deadline=deadline(), release=["fuzz-gone"], rows=[DraftRow(
            request_id="fuzz-draft", row=0, step=0, cached_len=0, new_token_ids=PROMPT, num_draft=2,
            draft_mode="sample", sampling=RowSampling(temperature=0.8, seed=1))]), "error", "bad_messages"),
    Target("verify", "verifier", lambda s: s.verify("verifier-0"), VerifyRequest, lambda: VerifyRequest(
        batch_id=1, scheduler_id="fuzz", deadline=deadline(), release=["fuzz-gone"], rows=[VerifyRow(
            request_id="fuzz-verify", row=0, step=0, cached_len=0, new_token_ids=PROMPT, draft_token_ids=[7, 8],
            proposal=Proposal(kind="sparse", ids=[[7, 9], [8, -1]], probs=[[0.6, 0.4], [1.0, 0.0]]),
            sampling=RowSampling(temperature=0.8, seed=1), logprobs=LogprobOptions(logprobs=1),
            postprocessor_id="postprocessor-0", prompt_len=len(PROMPT))]), "error", "bad_messages"),
    Target("commit", "postprocessor", lambda s: s.post_commit("postprocessor-0"), Commit, lambda: Commit(
        request_id="fuzz-commit", batch_id=1, step=0, seq=0, scheduler_id="fuzz", client_inbox="_INBOX.fuzz",
        token_ids=[5], num_draft=1, prompt_token_ids=PROMPT, logprobs=LogprobOptions(logprobs=1), stop=["x"]),
           None, "bad_messages"),
    Target("side", "postprocessor", lambda s: s.post_side("postprocessor-0"), SideChannelRecord,
           lambda: SideChannelRecord(
               request_id="fuzz-side", batch_id=1, step=0, verifier_id="fuzz", token_ids=[5],
               logprobs=LogprobArrays(token_logprobs=[-0.5], top_ids=[[5]], top_logprobs=[[-0.5]],
                                      requested_logprobs=np.zeros((1, 0), np.float32)),
               masks=[SamplingMask(token_ids=[5], size=1)]), None, "bad_messages"),
]
ROLES = ("scheduler", "verifier", "drafter", "postprocessor")


# ---------------------------------------------------------------------------------------------
# bad payloads


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every position in a msgpack-level message (map keys and list indices), outermost first."""
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += paths(item, (*prefix, index))
    return found


def replaced(raw: dict, path: tuple, new: Any) -> bytes:
    """raw with the value at path replaced by new, packed (raw itself is left alone)."""
    copy = msgpack.unpackb(msgpack.packb(raw, use_bin_type=True), raw=False)
    parent = copy
    for part in path[:-1]:
        parent = parent[part]
    parent[path[-1]] = new
    return msgpack.packb(copy, use_bin_type=True)


def without(raw: dict, key: str) -> bytes:
    return msgpack.packb({k: v for k, v in raw.items() if k != key}, use_bin_type=True)


wrong_values = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf]), st.floats(), st.none(), st.booleans(),
    st.integers(-2**63, 2**64 - 1), st.text(max_size=8), st.binary(max_size=8),
    st.lists(st.integers(-5, 5), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(-5, 5), max_size=2))
bad_versions = st.sampled_from([0, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, -1, 2**40, str(PROTOCOL_VERSION),
                                float(PROTOCOL_VERSION), None, True, [PROTOCOL_VERSION]])
unknown_kinds = st.text(max_size=12).filter(lambda kind: kind not in ("point_mass", "sparse", "dense", "greedy",
                                                                        "sample"))


def bad_payloads(target: Target) -> st.SearchStrategy[bytes]:
    raw = target.valid().model_dump()
    valid = msgpack.packb(raw, use_bin_type=True)
    where = paths(raw)
    lists = [path for path in where if isinstance(path_value(raw, path), list)]
    others = [msgpack.packb(t.valid().model_dump(), use_bin_type=True) for t in TARGETS
              if t.message_type is not target.message_type]
    others.append(msgpack.packb(Error(code=ErrorCode.internal, message="x").model_dump(), use_bin_type=True))
    strategies = [
        st.binary(max_size=256),
        st.integers(0, len(valid) - 1).map(lambda n: valid[:n]),
        st.builds(replaced, st.just(raw), st.sampled_from(where), wrong_values),
        st.builds(replaced, st.just(raw), st.just(("v",)), bad_versions),
        st.just(without(raw, "v")),
        st.sampled_from(others),
    ]
    if lists:
        strategies.append(st.builds(over_limits, st.just(raw), st.sampled_from(lists), st.booleans()))
    kinds = [path for path in where if path[-1] in ("kind", "draft_mode")]
    if kinds:
        strategies.append(st.builds(replaced, st.just(raw), st.sampled_from(kinds), unknown_kinds))
    return st.one_of(strategies)


def path_value(raw: dict, path: tuple) -> Any:
    for part in path:
        raw = raw[part]
    return raw


def over_limits(raw: dict, path: tuple, codec_limit: bool) -> bytes:
    """raw with the list at path grown past its field's limit (MAX_BATCH_ROWS + 1 copies of its
    first item: no list field allows more) or past the codec's (MAX_ARRAY_LEN + 1 zeros)."""
    if codec_limit:
        return replaced(raw, path, [0] * (MAX_ARRAY_LEN + 1))
    items = path_value(raw, path)
    return replaced(raw, path, [items[0] if items else 0] * (MAX_BATCH_ROWS + 1))


def expected_error(target: Target, payload: bytes) -> CodecError | None:
    """What the codec says of these bytes (None: they are a valid message, not sent)."""
    try:
        decode(payload, target.message_type)
    except CodecError as exc:
        return exc
    return None


# ---------------------------------------------------------------------------------------------
# the stack


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(start_stack, tiny_random_pair):
    limits = ["--max-seq-len", str(MAX_SEQ_LEN)]
    role_args = {"verifier": limits, "drafter": limits, "scheduler": ["--draft-timeout-s", "5"]}
    async with start_stack(*tiny_random_pair, auth=False, role_args=role_args) as running:
        yield running


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def nc(stack):
    # Without auth too, the scheduler answers a generate only to the sending user's inbox.
    connection = await connect(stack.url, "pytest-fuzz", inbox_prefix=inbox_prefix("client"))
    yield connection
    await connection.close()


def greedy(prompt, **options):
    return make_request(prompt, max_tokens=16, temperature=0.0, ignore_eos=True, num_speculative_tokens=4,
                        timeout_s=60.0, **options)


async def stats(nc, role: str) -> dict:
    reply = await nc.request(f"$SRV.STATS.{role}", b"", timeout=5)
    return json.loads(reply.data)["endpoints"][0]["data"]


def count(counter: str, role_stats: dict) -> int:
    """A counter, or the sum of all counters named counter* when it ends with "_"."""
    if counter.endswith("_"):
        return sum(value for name, value in role_stats.items() if name.startswith(counter))
    return role_stats.get(counter, 0)


def log_lines(stack, instance_id: str) -> list[str]:
    return (Path(stack.log_dir) / f"{instance_id}.log").read_text(errors="replace").splitlines()


@dataclass
class Baseline:
    """Before the fuzz: the reference output, log lengths and counters; `sent` counts bad messages."""

    reference: list[int]
    num_log_lines: dict[str, int]
    counters: dict[tuple[str, str], int]  # (role, counter) -> value
    sent: Counter


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def baseline(stack, nc, client) -> Baseline:
    reference = await client.generate(greedy(PROMPT))
    assert reference.finish_reason == "length" and len(reference.token_ids) == 16
    role_stats = {role: await stats(nc, role) for role in ROLES}
    return Baseline(reference=reference.token_ids,
                    num_log_lines={role: len(log_lines(stack, f"{role}-0")) for role in ROLES},
                    counters={(t.role, t.counter): count(t.counter, role_stats[t.role]) for t in TARGETS},
                    sent=Counter())


# ---------------------------------------------------------------------------------------------
# the fuzz


@pytest.mark.parametrize("target", TARGETS, ids=repr)
@FUZZ
@given(data=st.data())
async def test_a_bad_message_gets_the_codecs_typed_error(stack, nc, baseline, target, data):
    payload = data.draw(bad_payloads(target))
    expected = expected_error(target, payload)
    assume(expected is not None)
    subject = target.subject(stack.subjects)
    baseline.sent[target.name] += 1
    if target.reply is None:
        await nc.publish(subject, payload)
        return
    reply = await nc.request(subject, payload, timeout=REPLY_TIMEOUT_S)
    if target.reply == "chunk":
        chunk = decode(reply.data, StreamChunk)
        assert chunk.finish_reason == "error" and chunk.seq == 0
        error = chunk.error
    else:
        error = decode(reply.data, Error)
    assert (error.code, error.field) == (expected.code, expected.field), (error.message, expected.message)
    assert error.code != ErrorCode.internal and (error.field or error.code not in FIELD_CODES)


@pytest.mark.parametrize("role", ROLES)
@settings(max_examples=10, deadline=None)
@given(payload=st.binary(max_size=64), verb=st.sampled_from(["PING", "INFO", "STATS"]))
async def test_micro_subjects_answer_whatever_the_payload(stack, nc, role, payload, verb):
    reply = json.loads((await nc.request(f"$SRV.{verb}.{role}", payload, timeout=5)).data)
    assert reply["name"] == role and reply["metadata"]["instance_id"] == f"{role}-0"


async def test_every_bad_message_was_counted_logged_once_and_changed_nothing(stack, nc, client, baseline):
    assert sum(baseline.sent.values()) >= len(TARGETS) * 20, baseline.sent
    for (role, counter), before in baseline.counters.items():  # no-reply subjects: counted asynchronously
        # the postprocessor counts bad commits and side records together
        expected = sum(baseline.sent[t.name] for t in TARGETS if (t.role, t.counter) == (role, counter))
        for _ in range(100):
            dropped = count(counter, await stats(nc, role)) - before
            if dropped >= expected:
                break
            await asyncio.sleep(0.05)
        assert dropped == expected, (role, counter)
    for role in ROLES:
        lines = log_lines(stack, f"{role}-0")[baseline.num_log_lines[role]:]
        sent = sum(baseline.sent[t.name] for t in TARGETS if t.role == role)
        print(f"{role}: {len(lines)} log lines for {sent} bad messages")
        loud = [line for line in lines if "[error" in line or "[critical" in line or "Traceback" in line]
        assert not loud, f"{role}: {loud[:3]}"
        # at most one line per bad message (and a few for liveness, e.g. a heartbeat late on a busy machine)
        assert len(lines) <= sent + 4, f"{role}: {len(lines)} lines for {sent} bad messages: {lines[:5]}"
    for process in stack.processes.values():
        assert process.running, process.instance_id
    result = await client.generate(greedy(PROMPT))
    assert result.finish_reason == "length" and result.token_ids == baseline.reference


async def test_values_out_of_range_are_refused_naming_the_field(stack, nc, client):
    """Messages the codec accepts, with token ids or lengths beyond what the service holds."""
    outside = [*PROMPT[:-1], VT]
    with pytest.raises(RequestError, match=f"token id {VT} is outside the vocabulary") as refused:
        await client.generate(greedy(outside))
    assert (refused.value.code, refused.value.field) == (ErrorCode.invalid_field, "prompt_token_ids")

    draft = TARGETS[4].valid()
    draft.rows[0].new_token_ids = np.array(outside, np.int32)
    error = decode((await nc.request(stack.subjects.draft("drafter-0"), msgpack.packb(
        draft.model_dump(), use_bin_type=True), timeout=REPLY_TIMEOUT_S)).data, Error)
    assert (error.code, error.field) == (ErrorCode.invalid_field, "rows[0].new_token_ids")

    verify = TARGETS[5].valid()
    verify.rows[0].new_token_ids = np.array(outside, np.int32)
    response = decode((await nc.request(stack.subjects.verify("verifier-0"), msgpack.packb(
        verify.model_dump(), use_bin_type=True), timeout=REPLY_TIMEOUT_S)).data, VerifyResponse)
    [row] = response.rows
    assert (row.error.code, row.error.field) == (ErrorCode.invalid_field, "rows[0].new_token_ids")
    assert not len(row.token_ids)

    too_long = (PROMPT * (MAX_SEQ_LEN // len(PROMPT) + 1))[:MAX_SEQ_LEN + 1]
    with pytest.raises(RequestError, match=f"max_seq_len {MAX_SEQ_LEN}") as refused:
        await client.generate(greedy(too_long))
    assert (refused.value.code, refused.value.field) == (ErrorCode.invalid_field, "prompt_token_ids")


# ---------------------------------------------------------------------------------------------
# extreme but valid requests through the real stack

CANARY_TOKENS = 32
OUTCOME_SLACK_S = 30.0  # past a request's deadline + the client's margin: a busy machine, not a hang
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Repeated:
    """A long text prompt, drawn (and reported by hypothesis) as its character and length."""

    char: str
    count: int

    @property
    def text(self) -> str:
        return self.char * self.count


@st.composite
def extreme_requests(draw) -> tuple[Any, dict, int | None]:
    """(a prompt, request options at and between the limits of every field, after how many
    chunks to cancel it: None = never, 0 = right after sending it); `extreme_request` makes the
    request (kept apart so that a failing example is reported short)."""
    ids = st.integers(0, INT32_MAX) if draw(st.booleans()) else st.integers(0, VT - 1)  # out of the vocabulary too
    prompt = draw(st.one_of(
        st.lists(ids, min_size=1, max_size=draw(st.sampled_from([8, MAX_SEQ_LEN + 8, 5000]))),
        st.text(min_size=1, max_size=300),
        st.builds(Repeated, st.sampled_from(["x", "é", " "]),  # over max_seq_len; up to MAX_PROMPT_CHARS
                  st.sampled_from([MAX_SEQ_LEN + 1, 1 << 16, MAX_PROMPT_CHARS])),
    ))
    temperature = draw(st.one_of(st.just(0.0), st.sampled_from([MIN_TEMPERATURE, MAX_TEMPERATURE]),
                                 st.floats(MIN_TEMPERATURE, MAX_TEMPERATURE)))
    options = dict(
        max_tokens=draw(st.one_of(st.sampled_from([0, 1, MAX_TOKENS_CAP]), st.integers(0, 2 * MAX_SEQ_LEN))),
        temperature=temperature,
        top_k=draw(st.one_of(st.sampled_from([0, 1, MAX_TOP_K]), st.integers(0, VT))),
        top_p=draw(st.one_of(st.sampled_from([MIN_TOP_P, 1.0]), st.floats(MIN_TOP_P, 1.0))),
        min_p=draw(st.one_of(st.sampled_from([0.0, 0.999999]), st.floats(0.0, 0.999999))),
        seed=draw(st.one_of(st.none(), st.sampled_from([0, 2**63 - 1]))),
        stop=draw(st.lists(st.text(min_size=1, max_size=256), max_size=MAX_STOP_STRINGS)),
        stop_token_ids=draw(st.lists(ids, max_size=MAX_STOP_TOKEN_IDS)),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.one_of(st.none(), st.sampled_from([0, MAX_TOP_LOGPROBS]))),
        prompt_logprobs=draw(st.one_of(st.none(), st.sampled_from([0, MAX_TOP_LOGPROBS]))),
        logprobs_mode=draw(st.sampled_from(["raw", "processed"])),
        logprob_token_ids=draw(st.lists(ids, max_size=MAX_LOGPROB_TOKEN_IDS)),
        sampling_mask=draw(st.booleans()),
        max_mask_size=draw(st.sampled_from([1, MAX_MASK_SIZE])),
        num_speculative_tokens=draw(st.sampled_from([0, 1, MAX_SPECULATIVE_TOKENS])),
        draft_mode=draw(st.sampled_from(["greedy", "sample"])),
        timeout_s=draw(st.sampled_from([1e-9, 0.05, 30.0, MAX_TIMEOUT_S])),
        stream=draw(st.booleans()),
    )
    return prompt, options, draw(st.one_of(st.none(), st.integers(0, 3)))


def extreme_request(prompt, options: dict) -> GenerateRequest:
    prompt = prompt.text if isinstance(prompt, Repeated) else prompt
    try:
        return make_request(prompt, **options)
    except CodecError:  # a combination the schema refuses is not what this fuzz is about
        assume(False)


def canary_request(request_id: str) -> GenerateRequest:
    return make_request(PROMPT, request_id=request_id, max_tokens=CANARY_TOKENS, temperature=0.0, ignore_eos=True,
                        num_speculative_tokens=4, timeout_s=60.0)


@dataclass
class Outcome:
    request: GenerateRequest
    finish_reason: str | None = None
    error: str | None = None  # the typed error's code, from a final chunk or a RequestError
    untyped: str | None = None  # anything else: a timeout of the client, a broken stream, an exception


async def run_request(client, request: GenerateRequest, cancel_after: int | None) -> Outcome:
    outcome = Outcome(request)
    try:
        async with await client.open_stream(request) as stream:
            if cancel_after == 0:
                await client.cancel(request.request_id)
            async for chunk in stream:
                if cancel_after is not None and chunk.seq + 1 == cancel_after:
                    await client.cancel(request.request_id)
                if chunk.final:
                    outcome.finish_reason = chunk.finish_reason
    except RequestError as exc:
        outcome.finish_reason, outcome.error = "error", ErrorCode(exc.code).value
    except Exception as exc:  # noqa: BLE001 (StreamTimeout, StreamBroken, ...: what must not happen)
        outcome.untyped = repr(exc)
    return outcome


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service_pids(stack) -> dict[str, int]:
    return {p.instance_id: p.process.pid for p in stack.processes.values()}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def canary_reference(client) -> list[int]:
    result = await client.generate(canary_request("canary-reference"))
    assert result.finish_reason == "length" and len(result.token_ids) == CANARY_TOKENS
    return result.token_ids


# No shrinking: each example is seconds of a real stack; the failing example is reported as drawn.
@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(drawn=st.lists(extreme_requests(), min_size=1, max_size=3))
async def test_extreme_requests_and_racing_cancels_end_typed_and_leave_the_canary_and_services_alone(
        stack, client, service_pids, canary_reference, drawn):
    batch = [(extreme_request(prompt, options), cancel_after) for prompt, options, cancel_after in drawn]
    canary = asyncio.create_task(client.generate(canary_request(f"canary-{time.monotonic_ns()}")))
    bound_s = max(request.timeout_s for request, _ in batch) + client.timeout_margin_s + OUTCOME_SLACK_S
    outcomes = await asyncio.wait_for(asyncio.gather(*(run_request(client, request, cancel_after)
                                                       for request, cancel_after in batch)), timeout=bound_s)
    canary_result = await asyncio.wait_for(canary, timeout=60.0)

    for outcome in outcomes:
        what = f"{outcome.request.request_id}: {outcome}"
        assert outcome.untyped is None, what
        assert outcome.finish_reason in ("length", "stop", "eos", "cancelled", "timeout", "error"), what
        if outcome.finish_reason == "error":
            assert outcome.error in {code.value for code in ErrorCode}, what
    assert canary_result.finish_reason == "length" and canary_result.token_ids == canary_reference
    assert {p.instance_id: p.process.pid for p in stack.processes.values() if p.running} == service_pids
