"""Structured outputs through the gateway on the default pair (SmolLM2-135M-Instruct and its
draft), with the real clients: the openai SDK's `parse` with a pydantic model, JSON mode,
vLLM's structured_outputs (choice, regex), the `llm` CLI's json_object option and LangChain's
with_structured_output; greedy k=4 equals k=0 bit for bit under a grammar; bad grammars are 400s
naming the field; a grammar that cannot finish in max_tokens ends with finish_reason "length"."""

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pydantic
import pytest
import pytest_asyncio

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


async def test_json_object_and_nested_schemas_parse(api):
    model = await served_model(api)
    reply = await api.chat.completions.create(model=model, messages=ASK, response_format={"type": "json_object"},
                                              temperature=0, max_tokens=80)
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
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
    assert reply.choices[0].message.content


def test_llm_cli_json_object_and_langchain_structured_output(stack, tmp_path):
    model = stack_model(stack)
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: specbus\n  model_name: {model}\n  api_base: {stack.openai_base_url}\n  api_key_name: specbus\n")
    (tmp_path / "keys.json").write_text(json.dumps({"specbus": stack.api_key("alice")}))
    llm = Path(sys.executable).with_name("llm")
    # sampled, seeded: greedy, this small model lists numbers until max_tokens in JSON mode
    done = subprocess.run([str(llm), "-m", "specbus", "-o", "json_object", "1", "-o", "temperature", "0.7",
                           "-o", "seed", "1", "-o", "max_tokens", "200", "list three colours as JSON"],
                          capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=os.environ | {"LLM_USER_PATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert isinstance(json.loads(done.stdout), dict), done.stdout

    from langchain_openai import ChatOpenAI
    chat = ChatOpenAI(model=model, base_url=stack.openai_base_url, api_key=stack.api_key("alice"), temperature=0,
                      max_tokens=60, max_retries=0, timeout=TIMEOUT_S)
    answer = chat.with_structured_output(Colour).invoke(ASK[0]["content"])
    assert isinstance(answer, Colour)


def stack_model(stack) -> str:
    return openai.OpenAI(base_url=stack.openai_base_url, api_key=stack.api_key("alice")).models.list().data[0].id
