"""The OpenAI-compatible gateway through the official `openai` package, against a real
stack: nats-server, scheduler, verifier, drafter, postprocessor and gateway, each a process, on a
tiny random model pair whose target tokenizer got a ChatML chat template.

Expected values come from the NATS client (services/client.py) for the same request: greedy
text, logprobs, prompt scores. The OpenAI and vLLM behaviours a peer's test suite checks (usage,
models.retrieve, prompt_logprobs, stream rules, echo offsets) are here too, and one client's
flood on the bus; the limits checked before work are in tests/system/api/test_gateway_hardening.py.
The scheduler admits 2 running + 2 queued requests, so a request
with n=8 long choices meets `overloaded`. The test that stops the scheduler runs after the others
on that stack; the last test starts a second, bare stack without auth (a gateway and no scheduler).
"""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest
import pytest_asyncio
from openai.types import CompletionUsage
from openai.types.completion_usage import CompletionTokensDetails, PromptTokensDetails

from text.token_bytes import TokenBytes
from text.tokenizer import load_tokenizer
from schemas.bus.codec import decode, encode
from schemas.bus.control import Heartbeat
from schemas.bus.protocol import MAX_PROMPT_CHARS
from services.client import Client, make_request, score_request
from services.launch.natsserver import NatsServerConfig
from services.runtime.auth import CLIENT_MAX_PAYLOAD
from services.runtime.bus import connect

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "def read_lines(path):\n    with open(path) as f:\n"
MAX_TOKENS = 12
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(start_stack, chatml_pair):
    # adaptive k off: every step drafts the k it names, so the tests that count predicted tokens
    # do not depend on the timings adaptive k decides from (with this random pair's low acceptance
    # it may choose k=0 for a whole request; its own tests: tests/system/pipeline/test_adaptive_k_stack.py)
    scheduler = ["--max-running", "2", "--max-queue", "2", "--draft-timeout-s", "5", "--adaptive-k", "false"]
    async with start_stack(*chatml_pair, gateways=1, client_users=("alice", "bob"),
                           nats=NatsServerConfig(http_port=0),  # /connz: who published what
                           role_args={"scheduler": scheduler}) as running:
        yield running


@pytest.fixture(scope="module")
def api(stack):
    """The openai SDK as alice, without retries (the SDK retries 429 and 5xx by default)."""
    return openai.AsyncOpenAI(base_url=stack.openai_base_url, api_key=stack.api_key("alice"), max_retries=0,
                              timeout=120)


@pytest.fixture(scope="module")
def model(chatml_pair):
    return chatml_pair[0].name


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def scheduler_stats(stack) -> dict:
    reply = await stack.nc.request("$SRV.STATS.scheduler", b"", timeout=5)
    return json.loads(reply.data)["endpoints"][0]["data"]


async def test_client_env_is_all_the_cli_and_the_client_need(stack):
    """The stack's NATS port is not the default one: `. client.env` must say where it is."""
    env = dict(line.split("=", 1) for line in stack.client_env_path.read_text().splitlines())
    assert env["SPECBUS_NATS_URL"] == stack.url and not stack.url.endswith(":4222")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SPECBUS_NATS", "OPENAI_"))}
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "services.cli", "generate", "--prompt", "hi", "--max-tokens", "2"],
        capture_output=True, text=True, timeout=120, env=clean | env)
    assert done.returncode == 0, done.stderr
    async with Client.from_env(env) as client:
        result = await client.generate(make_request("hi", max_tokens=2, temperature=0.0))
    assert result.usage.completion_tokens == 2


async def test_client_env_sets_up_the_sdk_and_models_lists_the_target(stack, chatml_pair, model):
    env = dict(line.split("=", 1) for line in stack.client_env_path.read_text().splitlines())
    assert env["OPENAI_BASE_URL"] == stack.openai_base_url and env["OPENAI_API_KEY"] == stack.api_key("alice")
    listed = await openai.AsyncOpenAI(base_url=env["OPENAI_BASE_URL"], api_key=env["OPENAI_API_KEY"]).models.list()
    assert [m.id for m in listed.data] == [model]
    assert listed.data[0].model_extra["draft_model"] == chatml_pair[1].name
    bob = openai.AsyncOpenAI(base_url=stack.openai_base_url, api_key=stack.api_key("bob"), max_retries=0)
    assert [m.id for m in (await bob.models.list()).data] == [model]


async def gateway_connections(stack) -> dict[str, dict]:
    """The gateway's NATS connections by user, from the server's /connz."""
    url = f"http://127.0.0.1:{stack.server.monitoring_port}/connz?auth=1"
    connections = json.loads((await asyncio.to_thread(http_get, url))[1])["connections"]
    return {c["authorized_user"]: c for c in connections if c.get("name", "").startswith("gateway-0-")}


async def test_each_key_sends_on_its_own_users_connection(stack, model):
    before = await gateway_connections(stack)
    assert set(before) == {"alice", "bob", "monitor"}  # monitor: /health
    bob = openai.AsyncOpenAI(base_url=stack.openai_base_url, api_key=stack.api_key("bob"), max_retries=0)
    await bob.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    after = await gateway_connections(stack)
    assert after["bob"]["in_msgs"] > before["bob"]["in_msgs"]  # bob's request went out as bob
    assert after["alice"]["in_msgs"] == before["alice"]["in_msgs"]


async def test_greedy_completion_equals_the_nats_clients_streamed_or_not(stack, api, client, model):
    expected = await client.generate(make_request(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    completion = await api.completions.create(model=model, prompt=PROMPT, **GREEDY)
    choice = completion.choices[0]
    assert choice.text == expected.text and choice.finish_reason == "length"
    assert completion.usage.completion_tokens == MAX_TOKENS == expected.usage.completion_tokens
    assert completion.usage.prompt_tokens == expected.usage.prompt_tokens
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + MAX_TOKENS
    assert completion.model_extra["speculation"]["draft_tokens_proposed"] > 0

    stream = await api.completions.create(model=model, prompt=PROMPT, stream=True,
                                          stream_options={"include_usage": True}, **GREEDY)
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert all(c.usage is None for c in chunks[:-1])

    by_ids = await api.completions.create(model=model, prompt=expected.prompt_token_ids, **GREEDY)
    assert by_ids.choices[0].text == expected.text


async def test_completion_logprobs_have_the_openai_shape_and_the_cli_json_values(stack, api, client, model):
    tokenizer = load_tokenizer(stack.config.target_model)
    ids = tokenizer.encode(PROMPT)
    login = stack.client_login("alice")
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "services.cli", "generate", "--url", stack.url, "--json",
                         "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", str(MAX_TOKENS), "--temperature",
                         "0", "--ignore-eos", "--logprobs", "3"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "SPECBUS_NATS_USER": login["user"], "SPECBUS_NATS_PASSWORD": login["password"]})
    assert done.returncode == 0, done.stderr
    expected = json.loads(done.stdout)

    completion = await api.completions.create(model=model, prompt=ids, logprobs=3, **GREEDY)
    logprobs = completion.choices[0].logprobs
    def text(token_id):
        return tokenizer.hf.decode([token_id], skip_special_tokens=False)

    assert logprobs.tokens == [text(i) for i in expected["token_ids"]]
    assert logprobs.token_logprobs == [entry["logprob"] for entry in expected["logprobs"]]
    for top, entry in zip(logprobs.top_logprobs, expected["logprobs"]):
        assert top == {text(t["token_id"]): t["logprob"] for t in entry["top"]} | \
            {text(entry["token_id"]): entry["logprob"]}
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(MAX_TOKENS)]

    stream = await api.completions.create(model=model, prompt=ids, logprobs=3, stream=True, **GREEDY)
    streamed = [chunk.choices[0].logprobs async for chunk in stream]
    assert [v for lp in streamed for v in lp.token_logprobs] == logprobs.token_logprobs
    assert [v for lp in streamed for v in lp.text_offset] == logprobs.text_offset


async def test_echo_with_logprobs_and_no_tokens_scores_the_prompt(api, client, model):
    expected = await client.generate(score_request(PROMPT, prompt_logprobs=2))
    scored = await api.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    choice = scored.choices[0]
    assert choice.text == PROMPT
    assert len(choice.logprobs.tokens) == len(expected.prompt_token_ids)
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == [entry.logprob for entry in expected.prompt_logprobs[1:]]
    assert "".join(choice.logprobs.tokens) == PROMPT


async def test_chat_streamed_and_not_equals_the_nats_clients_chat(api, client, model):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Read a file."}]
    expected = await client.generate(make_request(messages=messages, max_tokens=MAX_TOKENS, temperature=0.0,
                                                  ignore_eos=True, logprobs=2))
    chat = await api.chat.completions.create(model=model, messages=messages, logprobs=True, top_logprobs=2, **GREEDY)
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == "length"
    content = choice.logprobs.content
    assert [entry.logprob for entry in content] == [entry.logprob for entry in expected.logprobs]
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    assert [[t.logprob for t in entry.top_logprobs] for entry in content] == \
        [[v for _, v in entry.top] for entry in expected.logprobs]
    assert b"".join(bytes(entry.bytes) for entry in content).decode() == expected.text

    stream = await api.chat.completions.create(model=model, messages=messages, stream=True,
                                               max_completion_tokens=MAX_TOKENS, temperature=0.0,
                                               extra_body={"ignore_eos": True})
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_n_choices_are_the_nats_clients_with_seed_plus_index(api, client, model):
    sampled = dict(temperature=1.0, top_p=0.9, max_tokens=8, seed=11)
    expected = [await client.generate(make_request(PROMPT, ignore_eos=True, **(sampled | {"seed": 11 + i})))
                for i in range(2)]
    completion = await api.completions.create(model=model, prompt=PROMPT, n=2, extra_body={"ignore_eos": True},
                                              **sampled)
    assert [c.index for c in completion.choices] == [0, 1]
    assert [c.text for c in completion.choices] == [e.text for e in expected]
    assert completion.usage.completion_tokens == 16


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("top_p", 2.0), ("top_k", -3),
                                          ("num_speculative_tokens", 99), ("presence_penalty", 2.5),
                                          ("logprobs", 99), ("frequency", 1)])
async def test_a_bad_field_is_a_400_naming_it(api, model, field, value):
    with pytest.raises(openai.BadRequestError) as caught:
        await api.completions.create(model=model, prompt=PROMPT, max_tokens=4, extra_body={field: value})
    assert caught.value.status_code == 400 and caught.value.body["param"] == field


async def test_bad_key_unknown_model_and_no_chat_template_errors(stack, api, model):
    stranger = openai.AsyncOpenAI(base_url=stack.openai_base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        await stranger.models.list()
    assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):  # the key is checked before the body
        await stranger.completions.create(model=model, prompt=PROMPT, max_tokens=4, extra_body={"top_k": "x"})
    with pytest.raises(openai.NotFoundError) as caught:
        await api.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as caught:
        await api.chat.completions.create(model=model, messages=[{"role": "r" * 65, "content": "hi"}], max_tokens=4)
    assert caught.value.body["param"] == "messages[0].role"


async def wait_idle(stack) -> dict:
    """The scheduler's stats once nothing runs or waits (60 s at most)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stats = await scheduler_stats(stack)
        if not stats["running"] and not stats["queued"]:
            break
        await asyncio.sleep(0.1)
    return stats


async def test_a_full_scheduler_is_a_429_and_a_deadline_a_504(stack, api, model):
    with pytest.raises(openai.RateLimitError) as caught:
        await api.completions.create(model=model, prompt=PROMPT, n=8, max_tokens=1500, extra_body={"ignore_eos": True})
    assert caught.value.status_code == 429 and caught.value.body["code"] == "overloaded"
    assert caught.value.response.headers["retry-after"] == "1"
    stats = await wait_idle(stack)  # the choices that were admitted are cancelled with the refused ones
    assert stats["running"] == stats["queued"] == 0
    status, metrics = await asyncio.to_thread(http_get, stack.openai_base_url.removesuffix("/v1") + "/metrics")
    assert status == 200 and 'specbus_gateway_http_requests_total{endpoint="/v1/completions",status="429"} 1.0' \
        in metrics
    with pytest.raises(openai.APIStatusError) as caught:
        await api.completions.create(model=model, prompt=PROMPT, max_tokens=2000,
                                     extra_body={"ignore_eos": True, "timeout_s": 0.05})
    assert caught.value.status_code == 504


def ended_by_the_client(stats: dict) -> int:
    """Requests the client's going away ended: its CancelRequest, or the postprocessor's stop
    notice when a chunk bounced off the closed inbox first (whichever reaches the scheduler first)."""
    return stats.get("finished_cancelled", 0) + stats.get("finished_stop_notice", 0)


async def test_a_client_that_disconnects_mid_stream_cancels_its_request(stack, api, model):
    cancelled_before = ended_by_the_client(await scheduler_stats(stack))
    stream = await api.completions.create(model=model, prompt=PROMPT, max_tokens=1500, stream=True,
                                          extra_body={"ignore_eos": True})
    received = 0
    async for _ in stream:
        received += 1
        if received == 2:
            assert (await scheduler_stats(stack))["running"] >= 1
            break
    await stream.close()
    stats = await wait_idle(stack)
    assert stats["running"] == 0 and ended_by_the_client(stats) == cancelled_before + 1, stats

    # not streamed: the client gives up (its HTTP request cancelled) once the request runs
    waiting = asyncio.create_task(api.completions.create(model=model, prompt=PROMPT, max_tokens=2000,
                                                         extra_body={"ignore_eos": True}))
    deadline = time.monotonic() + 60
    while not (await scheduler_stats(stack))["running"] and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    stats = await wait_idle(stack)
    assert stats["running"] == 0 and ended_by_the_client(stats) == cancelled_before + 2, stats
    status, metrics = await asyncio.to_thread(http_get, stack.openai_base_url.removesuffix("/v1") + "/metrics")
    assert status == 200 and "specbus_gateway_disconnect_cancels_total 2.0" in metrics


async def test_a_user_under_its_share_is_served_while_another_fills_the_scheduler(stack, api, model):
    """alice fills all 2 running + 2 queued places; bob, with none, is admitted and alice's newest
    queued request is refused in his place (fair share: services/scheduler/budget/fair_share.py)."""
    long = {"model": model, "prompt": PROMPT, "max_tokens": 1500, "extra_body": {"ignore_eos": True}}
    alice = [asyncio.create_task(api.completions.create(**long)) for _ in range(4)]
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            stats = await scheduler_stats(stack)
            if stats["running"] + stats["queued"] == 4:
                break
            await asyncio.sleep(0.05)
        assert stats["running"] + stats["queued"] == 4, stats
        bob = openai.AsyncOpenAI(base_url=stack.openai_base_url, api_key=stack.api_key("bob"), max_retries=0)
        answer = await bob.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
        assert answer.usage.completion_tokens == 4
        done, _ = await asyncio.wait(alice, timeout=120, return_when=asyncio.FIRST_EXCEPTION)
        refused = [task.exception() for task in done if task.exception() is not None]
        assert refused and all(isinstance(exc, openai.RateLimitError) for exc in refused), refused
        assert any("refused for fair share" in exc.body["message"] for exc in refused), refused
    finally:
        for task in alice:
            task.cancel()
        await asyncio.gather(*alice, return_exceptions=True)
        await wait_idle(stack)


async def test_logit_bias_and_penalties_are_applied_as_the_nats_clients(api, client, model):
    greedy = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    plain = await client.generate(make_request(PROMPT, **greedy))
    top = plain.token_ids[0]  # the greedy top token after the prompt
    banned = await api.completions.create(model=model, prompt=PROMPT, logit_bias={str(top): -100}, **GREEDY)
    expected = await client.generate(make_request(PROMPT, logit_bias={top: -100}, **greedy))
    assert banned.choices[0].text == expected.text != plain.text and expected.token_ids[0] != top
    assert top not in expected.token_ids

    penalties = dict(presence_penalty=1.5, frequency_penalty=1.0, logit_bias={"17": 3.0})
    extra = {"ignore_eos": True, "repetition_penalty": 1.3}
    completion = await api.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                              extra_body=extra, **penalties)
    expected = await client.generate(make_request(PROMPT, **greedy, **(penalties | {"repetition_penalty": 1.3})))
    assert completion.choices[0].text == expected.text != plain.text
    chat = await api.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=4, extra_body=extra, **penalties)
    assert chat.choices[0].finish_reason == "length"

    for bad, param in ((dict(frequency_penalty=-3.0), "frequency_penalty"), (dict(logit_bias={"x": 1}), "logit_bias"),
                       (dict(logit_bias={"5": 250}), "logit_bias"),
                       (dict(logit_bias={"100000": 1}), "logit_bias"),  # outside the vocabulary: the verifier's check
                       (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty")):
        with pytest.raises(openai.BadRequestError) as caught:
            await api.completions.create(model=model, prompt=PROMPT, max_tokens=2, **bad)
        assert caught.value.status_code == 400 and caught.value.body["param"] == param, caught.value.body


# ---------------------------------------------------------------------------------------------
# what a peer's OpenAI-server test suite (vLLM's, SGLang's) checks


async def verifier_max_seq_len(stack) -> int:
    """max_seq_len as a verifier's heartbeat advertises it."""
    subscription = await stack.nc.subscribe(stack.subjects.heartbeat)
    try:
        while True:
            beat = decode((await subscription.next_msg(timeout=30)).data, Heartbeat)
            if beat.role == "verifier":
                return int(beat.model_ids["max_seq_len"])
    finally:
        await subscription.unsubscribe()


async def test_models_retrieve_gives_the_entry_with_max_model_len(stack, api, model):
    expected = await verifier_max_seq_len(stack)
    retrieved = await api.models.retrieve(model)
    assert (retrieved.id, retrieved.object, retrieved.model_extra["max_model_len"]) == (model, "model", expected)
    assert retrieved.model_extra["weights"] == "dense"  # which model of the target: the tiny one has no GGUF blocks
    listed = await api.models.list()
    assert listed.data == [retrieved]
    with pytest.raises(openai.NotFoundError) as caught:
        await api.models.retrieve("gpt-4")
    assert caught.value.body["code"] == "model_not_found"


async def test_usage_holds_only_openai_fields_with_drafts_as_predicted_tokens(api, model):
    await api.completions.create(model=model, prompt=PROMPT, max_tokens=1)  # puts the prompt in the prefix cache
    completion = await api.completions.create(model=model, prompt=PROMPT, **GREEDY)
    speculation = completion.model_extra["speculation"]
    proposed, accepted = speculation["draft_tokens_proposed"], speculation["draft_tokens_accepted"]
    assert proposed > 0 and speculation["acceptance_rate"] == accepted / proposed and speculation["steps"] > 0
    prompt_tokens = completion.usage.prompt_tokens
    # the prefix cache served part of the prompt, never all of it: the last token is computed
    cached = completion.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < prompt_tokens
    assert completion.usage == CompletionUsage(  # the SDK's equality, as a peer's suite checks it
        prompt_tokens=prompt_tokens, completion_tokens=MAX_TOKENS, total_tokens=prompt_tokens + MAX_TOKENS,
        completion_tokens_details=CompletionTokensDetails(accepted_prediction_tokens=accepted, audio_tokens=0,
                                                          reasoning_tokens=0,
                                                          rejected_prediction_tokens=proposed - accepted),
        prompt_tokens_details=PromptTokensDetails(audio_tokens=0, cached_tokens=cached))
    stream = await api.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                               stream=True, stream_options={"include_usage": True}, **GREEDY)
    last = [chunk async for chunk in stream][-1]
    assert last.choices == [] and last.usage.model_extra == {} and last.usage.completion_tokens == MAX_TOKENS
    assert last.model_extra["speculation"]["draft_tokens_proposed"] == \
        sum(last.usage.completion_tokens_details.model_dump(include={"accepted_prediction_tokens",
                                                                     "rejected_prediction_tokens"}).values())


@pytest.mark.parametrize("extra, param", [
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"logit_bias": {str(10**6): 1.0}}, "logit_bias"),
], ids=["stop_token_ids", "logit_bias"])
async def test_token_ids_outside_the_vocabulary_are_refused_at_admission_naming_the_field(stack, api, model, extra,
                                                                                          param):
    """As a prompt id is: refused by the scheduler before the request is queued (counted as a
    refusal), not first by a verifier."""
    refused_before = (await scheduler_stats(stack)).get("refused_invalid_field", 0)
    with pytest.raises(openai.BadRequestError) as caught:
        await api.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body=extra)
    assert caught.value.body["param"] == param and "outside the vocabulary" in caught.value.body["message"]
    assert (await scheduler_stats(stack)).get("refused_invalid_field", 0) == refused_before + 1


async def test_max_tokens_over_max_model_len_is_refused_stating_the_effective_cap(api, model):
    max_model_len = (await api.models.retrieve(model)).model_extra["max_model_len"]
    assert max_model_len < 4096  # the scheduler's default max_tokens_cap: max_model_len is the cap
    with pytest.raises(openai.BadRequestError) as caught:
        await api.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=max_model_len + 1)
    assert caught.value.body["param"] == "max_completion_tokens"
    assert f"above the cap {max_model_len} (max_model_len {max_model_len}" in caught.value.body["message"]


async def test_a_completion_that_ends_inside_a_character_has_whole_text_and_exact_logprob_bytes(stack, api, model):
    """The issue's case made certain: logit_bias forces a token that begins a 3-byte character,
    and max_tokens 1 ends the request there. The text, whole or streamed, leaves the unfinished
    bytes out (no U+FFFD); the logprobs still list the token with its exact bytes."""
    vocabulary = TokenBytes(load_tokenizer(stack.config.target_model))
    start = next(i for i in range(vocabulary.tokenizer.vocab_size) if vocabulary.get(i) == "\u20ac".encode()[:1])
    asked = {"model": model, "messages": [{"role": "tool", "content": "x"}], "max_tokens": 1, "temperature": 0.0,
             "logprobs": True, "logit_bias": {str(start): 100.0}, "extra_body": {"ignore_eos": True}}
    whole = await api.chat.completions.create(**asked)
    assert whole.choices[0].message.content == "" and whole.choices[0].finish_reason == "length"
    assert [entry.bytes for entry in whole.choices[0].logprobs.content] == [list(vocabulary.get(start))]
    chunks = [chunk async for chunk in await api.chat.completions.create(**asked, stream=True)]
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(choice.delta.content or "" for choice in streamed) == ""
    assert [e.bytes for choice in streamed if choice.logprobs for e in choice.logprobs.content] == [[0xE2]]


def vllm_scores(result) -> list:
    """A NATS client's prompt logprobs (top 2) as vLLM's prompt_logprobs."""
    return [None if entry is None else {str(i): v for i, v in entry.top[:2]} | {str(entry.token_id): entry.logprob}
            for entry in result.prompt_logprobs]


async def test_prompt_logprobs_is_vllms_extra_field(stack, api, client, model):
    expected = await client.generate(score_request(PROMPT, prompt_logprobs=2))
    completion = await api.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0,
                                              extra_body={"prompt_logprobs": 2})
    scored = completion.choices[0].model_extra["prompt_logprobs"]
    assert [None if e is None else {i: v["logprob"] for i, v in e.items()} for e in scored] == vllm_scores(expected)
    tokenizer = load_tokenizer(stack.config.target_model)
    assert scored[1][str(expected.prompt_token_ids[1])]["decoded_token"] == \
        tokenizer.hf.decode([expected.prompt_token_ids[1]])
    assert all(e is None or all(v["rank"] >= 1 for v in e.values()) for e in scored)

    messages = [{"role": "user", "content": "Read a file."}]
    chat = await api.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0,
                                             extra_body={"prompt_logprobs": 2})
    expected = await client.generate(make_request(messages=messages, max_tokens=0, prompt_logprobs=2))
    assert [None if e is None else {i: v["logprob"] for i, v in e.items()} for e in chat.model_extra["prompt_logprobs"]] \
        == vllm_scores(expected)
    with pytest.raises(openai.BadRequestError) as caught:  # vLLM's rule: not in a stream
        await api.completions.create(model=model, prompt=PROMPT, stream=True, extra_body={"prompt_logprobs": 1})
    assert caught.value.body["param"] == "prompt_logprobs"


async def test_stream_options_without_stream_is_a_400(api, model):
    for create in (lambda: api.completions.create(model=model, prompt=PROMPT, max_tokens=2,
                                                  stream_options={"include_usage": True}),
                   lambda: api.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=2, stream_options={"include_usage": True})):
        with pytest.raises(openai.BadRequestError) as caught:
            await create()
        assert caught.value.body["param"] == "stream_options"


async def test_n_choices_stream_one_choice_per_chunk(api, model):
    sampled = {"n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 3, "extra_body": {"ignore_eos": True}}
    for stream in (await api.completions.create(model=model, prompt=PROMPT, stream=True, **sampled),
                   await api.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                     stream=True, **sampled)):
        chunks = [chunk async for chunk in stream]
        assert all(len(chunk.choices) == 1 for chunk in chunks)
        assert sorted({chunk.choices[0].index for chunk in chunks}) == [0, 1]
        for index in (0, 1):
            assert [c.choices[0].finish_reason for c in chunks if c.choices[0].index == index][-1] == "length"


async def test_an_omitted_model_is_the_one_served(api, model):
    completion = await api.completions.create(model=openai.omit, prompt=PROMPT, **GREEDY)
    named = await api.completions.create(model=model, prompt=PROMPT, **GREEDY)
    assert completion.model == model and completion.choices[0].text == named.choices[0].text
    chat = await api.chat.completions.create(model=openai.omit, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=2)
    assert chat.model == model


async def test_custom_roles_and_extra_message_fields_reach_the_template_as_role_and_content(api, client, model):
    """As vLLM: any role the template renders, extra fields accepted; the template gets role and content."""
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "Read a file.", "name": "ann"},
                {"role": "assistant", "content": None, "tool_calls": []},
                {"role": "tool", "content": "ok", "tool_call_id": "call-1"}]
    plain = [{"role": m["role"], "content": m["content"] or ""} for m in messages]
    expected = await client.generate(make_request(messages=plain, max_tokens=MAX_TOKENS, temperature=0.0,
                                                  ignore_eos=True))
    chat = await api.chat.completions.create(model=model, messages=messages, **GREEDY)
    assert chat.choices[0].message.content == expected.text


async def test_echo_text_agrees_with_its_offsets_for_every_token_special_ones_included(stack, model):
    """The request from the field: five <|endoftext|> as token ids, echoed with logprobs."""
    body = {"model": model, "prompt": [0, 0, 0, 0, 0], "max_tokens": 3, "temperature": 0, "echo": True,
            "logprobs": 0}
    status, answer = await asyncio.to_thread(http_post, stack, "/v1/completions", json.dumps(body).encode())
    assert status == 200, answer
    choice = json.loads(answer)["choices"][0]
    text, tokens, offsets = choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    assert tokens[:5] == ["<|endoftext|>"] * 5 and text.startswith("<|endoftext|>" * 5)
    assert len(tokens) == len(offsets) == 8
    for token, start in zip(tokens, offsets):
        assert text[start:start + len(token)] == token or token == "<|endoftext|>" and start >= 65


def http_post(stack, path: str, body: bytes, user: str = "alice") -> tuple[int, str]:
    request = urllib.request.Request(stack.openai_base_url.removesuffix("/v1") + path, data=body, method="POST",
                                     headers={"Authorization": f"Bearer {stack.api_key(user)}",
                                              "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


# ---------------------------------------------------------------------------------------------
# one client's flood on the bus


async def scheduler_connection(stack) -> dict:
    url = f"http://127.0.0.1:{stack.server.monitoring_port}/connz?auth=1"
    connections = json.loads((await asyncio.to_thread(http_get, url))[1])["connections"]
    [scheduler] = [c for c in connections if c.get("name") == "scheduler-0"]
    return scheduler


FLOOD_MESSAGES = 40


async def test_a_clients_flood_of_its_largest_messages_leaves_the_scheduler_on_the_bus(stack, api, client, model):
    """alice publishes FLOOD_MESSAGES of the largest requests her account lets her send (valid,
    each refused: a prompt of MAX_PROMPT_CHARS four-byte characters) while bob streams through the
    gateway. The scheduler cannot read them as fast as she sends: nats-server cuts its
    subscription's own connection as a slow consumer, never the connection the step loop uses,
    so bob's stream completes as it would alone and unflagged. One byte over her limit closes
    alice's own connection, nobody else's."""
    expected = await client.generate(make_request(PROMPT, max_tokens=48, temperature=0.0, ignore_eos=True))
    before, stats_before = await scheduler_connection(stack), await scheduler_stats(stack)
    bob = openai.AsyncOpenAI(base_url=stack.openai_base_url, api_key=stack.api_key("bob"), max_retries=0, timeout=300)
    stream = await bob.completions.create(model=model, prompt=PROMPT, max_tokens=48, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
    flood = encode(make_request("\U0001F600" * MAX_PROMPT_CHARS, max_tokens=1))
    assert 4 * MAX_PROMPT_CHARS < len(flood) < CLIENT_MAX_PAYLOAD - 256  # room for the subject and inbox
    alice = await connect(stack.url, "alice-flood", **stack.client_login("alice"))
    try:
        text, flags = "", []
        async for chunk in stream:
            if not text and chunk.choices[0].text:  # bob's stream runs: now the flood
                for _ in range(FLOOD_MESSAGES):
                    await alice.publish(stack.subjects.generate_for("alice"), flood, reply=alice.new_inbox())
            text += chunk.choices[0].text
            flags += chunk.choices[0].model_extra.get("degraded", [])
        await alice.flush(timeout=120)
        assert alice.stats["reconnects"] == 0 and alice.stats["out_msgs"] >= FLOOD_MESSAGES
        # one byte over her limit: the server closes her connection (nats-py only knows the server-wide limit)
        await alice.publish(stack.subjects.generate_for("alice"), b"\xc1" * (CLIENT_MAX_PAYLOAD + 1))
        deadline = time.monotonic() + 60
        while "maximum payload exceeded" not in stack.server.log_tail(1_000_000):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
    finally:
        await alice.close()
    assert text == expected.text and "verifier_retry" not in flags, flags
    refused = "refused_invalid_field"  # at least the first reached the scheduler and was refused
    await poll_scheduler(stack, lambda s: s.get(refused, 0) > stats_before.get(refused, 0))
    after = await scheduler_connection(stack)
    assert after["cid"] == before["cid"]  # the step loop's connection: the same, never cut
    log = stack.processes["scheduler-0"].log_tail(2_000_000)
    assert not re.search(r"nats_(dis|re)connected\s+connection=scheduler-0(\s|$)", log, re.MULTILINE)
    server_log = stack.server.log_tail(1_000_000)
    cut = [line for line in server_log.splitlines() if "Slow Consumer" in line]  # "v2.16.0:python3:<name>"
    assert not [line for line in cut if ':scheduler-0"' in line], cut
    assert "user:alice" in next(line for line in server_log.splitlines() if "maximum payload exceeded" in line)


async def poll_scheduler(stack, done, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not done(stats := await scheduler_stats(stack)):
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.1)
    return stats


async def test_health_is_ready_with_a_scheduler_and_503_without(stack, api, model):
    root = stack.openai_base_url.removesuffix("/v1")
    assert (await asyncio.to_thread(http_get, root + "/health"))[0] == 200
    stack.kill("scheduler-0", signal.SIGTERM)
    await stack.wait_exit("scheduler-0", timeout_s=30)
    status, body = await asyncio.to_thread(http_get, root + "/health")
    assert status == 503 and json.loads(body)["error"]["code"] == "unavailable"
    with pytest.raises(openai.InternalServerError) as caught:
        await api.completions.create(model=model, prompt=PROMPT, max_tokens=4)
    assert caught.value.status_code == 503


async def test_without_auth_any_key_is_accepted_and_no_scheduler_is_a_503(start_stack, chatml_pair):
    async with start_stack(*chatml_pair, schedulers=0, verifiers=0, drafters=0, postprocessors=0, gateways=1,
                           auth=False) as bare:
        env = dict(line.split("=", 1) for line in bare.client_env_path.read_text().splitlines())
        assert env == {"SPECBUS_NATS_URL": bare.url, "SPECBUS_PREFIX": bare.config.prefix,
                       "OPENAI_BASE_URL": bare.openai_base_url, "OPENAI_API_KEY": bare.api_key()}
        anyone = openai.AsyncOpenAI(base_url=bare.openai_base_url, api_key="anything", max_retries=0)
        assert [m.id for m in (await anyone.models.list()).data] == [chatml_pair[0].name]
        with pytest.raises(openai.InternalServerError) as caught:
            await anyone.completions.create(model=chatml_pair[0].name, prompt=PROMPT, max_tokens=4)
        assert caught.value.status_code == 503 and caught.value.body["code"] == "unavailable"
