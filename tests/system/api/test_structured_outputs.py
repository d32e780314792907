"""Structured outputs through the gateway on the default pair (SmolLM2-135M-Instruct and its
draft), with the real clients: the openai SDK's `parse` with a pydantic model, JSON mode,
vLLM's structured_outputs (choice, regex), the `llm` CLI's json_object option and LangChain's
with_structured_output; greedy k=4 equals k=0 bit for bit under a grammar; bad grammars are 400s
naming the field; a grammar that cannot finish in max_tokens ends with finish_reason "length"."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pydantic
import pytest
import pytest_asyncio

from schemas.generation import StructuredOutputs
from text.grammar import Grammars, llg_tokenizer
from text.tokenizer import load_tokenizer

pytestmark = [pytest.mark.real_model, pytest.mark.asyncio(loop_scope="module")]

TIMEOUT_S = 300


class Colour(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    hex: str = pydantic.Field(pattern="^#[0-9a-f]{6}$")
    warm: bool


class Colours(pydantic.BaseModel):
    colours: list[Colour] = pydantic.Field(min_length=1, max_length=3)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(start_stack, smollm2_target, smollm2_draft):
    async with start_stack(smollm2_target, smollm2_draft, gateways=1, client_users=("alice",)) as running:
        yield running


@pytest.fixture(scope="module")
def api(stack):
    return openai.AsyncOpenAI(base_url=stack.openai_base_url, api_key=stack.api_key("alice"), max_retries=0,
                              timeout=TIMEOUT_S)


async def served_model(api) -> str:
    return (await api.models.list()).data[0].id


ASK = [{"role": "user", "content": "Describe the colour of the sky at noon as JSON."}]


async def test_sdk_parse_with_a_pydantic_model_is_exact_under_speculation(api):
    model = await served_model(api)
    answers = {}
    for k in (0, 4):
        completion = await api.beta.chat.completions.parse(
            model=model, messages=ASK, response_format=Colour, temperature=0, max_tokens=60,
            extra_body={"num_speculative_tokens": k, "logprobs_mode": "processed"}, logprobs=True)
        choice = completion.choices[0]
        assert isinstance(choice.message.parsed, Colour), choice.message.content
        answers[k] = (choice.message.content, [t.token for t in choice.logprobs.content],
                      [t.logprob for t in choice.logprobs.content])
        if k:
            assert completion.model_extra["speculation"]["draft_tokens_accepted"] > 0  # forced tokens, at least
    assert answers[4] == answers[0]


async def test_json_object_and_nested_schemas_parse(api, smollm2_target):
    model = await served_model(api)
    reply = await api.chat.completions.create(model=model, messages=ASK, response_format={"type": "json_object"},
                                              temperature=0, max_tokens=80)
    assert_json_mode(reply.choices[0].message.content, reply.choices[0].finish_reason, smollm2_target)
    nested = await api.beta.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "List three colours."}], response_format=Colours,
        temperature=0.8, seed=-12345, max_tokens=160)  # a negative seed, as OpenAI takes it
    assert nested.choices[0].finish_reason == "stop"
    assert 1 <= len(nested.choices[0].message.parsed.colours) <= 3


async def test_vllm_structured_outputs_choice_and_regex_on_completions(api):
    reply = await api.completions.create(model="", prompt="The weather today is", max_tokens=8, temperature=0,
                                         extra_body={"structured_outputs": {"choice": ["sunny", "rainy", "cloudy"]}})
    assert reply.choices[0].text in ("sunny", "rainy", "cloudy")
    reply = await api.completions.create(model="", prompt="A date:", max_tokens=20, temperature=0,
                                         extra_body={"structured_outputs": {"regex": "20[0-9]{2}-[01][0-9]-[0-3][0-9]"}})
    text = reply.choices[0].text
    assert len(text) == 10 and text.startswith("20") and text[4] == text[7] == "-", text


async def test_a_grammar_cut_by_max_tokens_ends_with_length_and_partial_text(api):
    model = await served_model(api)
    reply = await api.chat.completions.create(model=model, messages=ASK, response_format={"type": "json_object"},
                                              temperature=0, max_tokens=5)
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "format": "no-such-format-keyword-here", "x-unknown": 1, "dependentSchemas": {}}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"enum": [f"value-{i}" * 40 for i in range(4000)]}}}, "structured_outputs"),
])
async def test_bad_grammars_are_400s_naming_the_field(api, body, param):
    model = await served_model(api)
    with pytest.raises(openai.BadRequestError) as caught:
        await api.chat.completions.create(model=model, messages=ASK, max_tokens=8, extra_body=body)
    assert caught.value.body["param"].startswith(param), caught.value.body
    # the service is fine: the next request is served
    reply = await api.chat.completions.create(model=model, messages=ASK, max_tokens=2)
    # two sampled tokens may decode to no text yet (a partial UTF-8 character): count tokens
    assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) in {("length", 2), ("stop", 1), ("stop", 2)}


async def test_llm_cli_json_object_and_langchain_structured_output(stack, api, smollm2_target, tmp_path):
    model = await served_model(api)
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: specbus\n  model_name: {model}\n  api_base: {stack.openai_base_url}\n  api_key_name: specbus\n")
    (tmp_path / "keys.json").write_text(json.dumps({"specbus": stack.api_key("alice")}))
    llm, env = Path(sys.executable).with_name("llm"), os.environ | {"LLM_USER_PATH": str(tmp_path)}
    done = await asyncio.to_thread(
        subprocess.run, [str(llm), "-m", "specbus", "-o", "json_object", "1", "-o", "temperature", "0",
                         "-o", "max_tokens", "200", "list three colours as JSON"],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stderr
    logged = await asyncio.to_thread(subprocess.run, [str(llm), "logs", "-n", "1", "--json"], capture_output=True,
                                     text=True, timeout=TIMEOUT_S, env=env)
    response = json.loads(logged.stdout)[0]["response_json"]
    assert_json_mode(response["content"], response["finish_reason"], smollm2_target)
    assert done.stdout.rstrip("\n") == response["content"]

    from langchain_openai import ChatOpenAI
    chat = ChatOpenAI(model=model, base_url=stack.openai_base_url, api_key=stack.api_key("alice"), temperature=0,
                      max_tokens=60, max_retries=0, timeout=TIMEOUT_S)
    answer = await chat.with_structured_output(Colour).ainvoke(ASK[0]["content"])
    assert isinstance(answer, Colour)


def assert_json_mode(text: str, finish_reason: str, target: Path) -> None:
    """JSON mode's contract, as OpenAI documents it: an answer that stops is a JSON object; one cut
    by max_tokens ("length", which this small model reaches when it loops inside a string) is a
    prefix of one, every byte of it allowed by the json_object grammar."""
    if finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text
        return
    assert finish_reason == "length", finish_reason
    tokenizer = load_tokenizer(target)
    vocab_size = json.loads((target / "config.json").read_text())["vocab_size"]
    matcher = Grammars(llg_tokenizer(tokenizer, vocab_size)).matcher(StructuredOutputs(json_object=True))
    ids = tokenizer.encode(text)
    assert text.startswith("{") and matcher.validate_tokens(ids) == len(ids), text
