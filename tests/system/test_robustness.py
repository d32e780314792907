"""Requests that could take a lane, a batch or the whole stack down, or hang, through a real stack
(services.launch.stack.Stack: every service its own process, a real nats-server, the tiny model
pair shipped in models/tiny): each ends alone with a typed error, and the stack serves on. Each
test ends by checking that every service process is still running.

The verifier and the drafter hold MAX_SEQ_LEN positions, so reaching that limit is quick.
"""

import asyncio
import time

import msgpack
import pytest
import pytest_asyncio

from schemas.bus.codec import decode, encode
from schemas.errors import ErrorCode
from schemas.streams import StreamChunk
from services.client import RequestError, make_request

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_SEQ_LEN = 64
MAX_STEP_TOKENS = 16  # prefill in chunks, as a long prompt is on a real deployment
PROMPT = list(range(100, 140))  # 40 tokens of the tiny model's vocabulary
TIMEOUT_S = 60.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(start_stack, tiny_pair):
    limit = ["--max-seq-len", str(MAX_SEQ_LEN)]
    role_args = {"verifier": limit, "drafter": limit, "scheduler": ["--max-step-tokens", str(MAX_STEP_TOKENS)]}
    async with start_stack(*tiny_pair, role_args=role_args) as running:
        yield running


def greedy(request_id=None, prompt=PROMPT, **options):
    options = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "num_speculative_tokens": 4,
               "timeout_s": TIMEOUT_S, **options}
    return make_request(prompt, **({"request_id": request_id} if request_id else {}), **options)


async def raw_generate(client, payload: bytes, reply: str | None = None) -> StreamChunk:
    """Publish bytes as a GenerateRequest from `client`, with reply (default: a fresh inbox of
    its own); the first chunk that comes back."""
    reply = reply or client.nc.new_inbox()
    inbox = await client.nc.subscribe(reply)
    try:
        await client.nc.publish(client.generate_subject, payload, reply=reply)
        return decode((await inbox.next_msg(timeout=TIMEOUT_S)).data, StreamChunk)
    finally:
        await inbox.unsubscribe()


async def still_serving(stack, client) -> None:
    """Every service process runs, and a request is served end to end."""
    assert all(process.running for process in stack.processes.values()), \
        {instance_id: process.log_tail() for instance_id, process in stack.processes.items() if not process.running}
    result = await client.generate(greedy())
    assert result.finish_reason == "length" and len(result.token_ids) == 8


async def test_a_reply_subject_too_long_is_refused_and_the_stack_lives_on(stack, client):
    """Item 1: the first Commit refused the inbox, ending the request raised again, lane 0's
    task died, the scheduler exited 0 and `specbus up` stopped every service."""
    reply = client.nc.new_inbox() + "." + "x" * 300
    chunk = await raw_generate(client, encode(greedy("long-reply")), reply=reply)
    assert chunk.finish_reason == "error" and chunk.request_id == "long-reply"
    assert (chunk.error.code, chunk.error.field) == (ErrorCode.invalid_field, "reply_subject")
    await asyncio.sleep(1.0)  # the crash was immediate; give a dying process time to show it
    await still_serving(stack, client)


async def test_float32_unrepresentable_sampling_values_are_refused_naming_the_field(stack, client):
    """Item 2: temperature 1e308 (inf in float32) failed the whole verifier batch, innocent
    requests with it, and got the verifier marked dead."""
    innocent = asyncio.create_task(client.generate(greedy(max_tokens=20)))
    for index, (field, value) in enumerate((("temperature", 1e308), ("temperature", 1e-300), ("top_p", 1e-300))):
        raw = greedy(f"bad-sampling-{index}", max_tokens=32, temperature=1.0).model_dump()
        raw["sampling"][field] = value
        chunk = await raw_generate(client, msgpack.packb(raw, use_bin_type=True))
        assert chunk.finish_reason == "error" and chunk.error.code == ErrorCode.invalid_field
        assert chunk.error.field == f"sampling.{field}", chunk.error
    result = await innocent
    assert result.finish_reason == "length" and len(result.token_ids) == 20
    await still_serving(stack, client)


async def test_a_prompt_over_max_seq_len_is_refused_at_once(stack, client):
    """Item 3: a prompt longer than max_seq_len was refused only after it had been prefilled
    (chunk by chunk, MAX_STEP_TOKENS at a time, until the verifier had no room left)."""
    chunk = await raw_generate(client, encode(greedy(prompt=list(range(100, 100 + MAX_SEQ_LEN + 1)))))
    assert chunk.finish_reason == "error" and chunk.seq == 0
    assert (chunk.error.code, chunk.error.field) == (ErrorCode.invalid_field, "prompt_token_ids")
    assert f"max_seq_len {MAX_SEQ_LEN}" in chunk.error.message
    assert chunk.usage is None or chunk.usage.steps == 0  # refused at admission: no verify step ran
    await still_serving(stack, client)


async def test_generation_stops_at_max_seq_len_with_length(stack, client):
    """Item 4: reaching max_seq_len ended in an "error" without a reason. max_tokens up to the cap
    (the least of max_tokens_cap and max_seq_len) runs into max_seq_len and ends with "length";
    above the cap it is refused at once, stating the cap."""
    for k in (0, 4):
        result = await client.generate(greedy(max_tokens=MAX_SEQ_LEN, num_speculative_tokens=k))
        assert result.finish_reason == "length"
        assert len(result.token_ids) == MAX_SEQ_LEN - len(PROMPT)
    with pytest.raises(RequestError, match=f"above the cap {MAX_SEQ_LEN} \\(max_model_len {MAX_SEQ_LEN}") as refused:
        await client.generate(greedy(max_tokens=1000))
    assert refused.value.field == "sampling.max_tokens"
    await still_serving(stack, client)


async def test_a_reused_request_id_is_refused_as_duplicate(stack, client):
    """Item 7: a reused id was admitted, its commits silently dropped by the postprocessor, and
    the client waited out its timeout."""
    first = await client.generate(greedy("reused-id"))
    assert first.finish_reason == "length"
    started = time.monotonic()
    with pytest.raises(RequestError) as info:
        await client.generate(greedy("reused-id", timeout_s=20.0))
    assert (info.value.code, info.value.field) == (ErrorCode.duplicate_request_id, "request_id")
    assert time.monotonic() - started < 20.0  # answered, not timed out
    await still_serving(stack, client)


async def test_malformed_requests_get_an_error_that_says_what_is_wrong(stack, client):
    """Item 9: deep nesting or invalid UTF-8 came back `malformed` with an empty message."""
    for payload in (b"\x91" * 5000 + b"\x00", b"\x81\xa2\xc3\x28\x01"):
        chunk = await raw_generate(client, payload)
        assert chunk.finish_reason == "error" and chunk.error.code == ErrorCode.malformed
        assert not chunk.error.message.rstrip().endswith(":"), chunk.error.message
    await still_serving(stack, client)
