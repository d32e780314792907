"""Tool calling and the Responses API through the gateway with the real clients (the openai SDK,
LangChain, litellm), against a real stack on the tiny random pair with a ChatML template (no
tools section: the generic format of text/tool_calls.py).

A random model writes nonsense, so what is checked is what the grammar guarantees: under
tool_choice required or a named function every answer is a call of a declared tool whose
arguments validate against its schema, greedy k=4 equals k=0 token for token under every
tool_choice, the SDK assembles streamed calls into the same calls, and the Responses API stores,
continues (across a gateway restart, and from another gateway on the same NATS), hides from
another key and deletes. The schemas close
their objects (additionalProperties false) and bound their values, so a random model still
finishes a call within max_tokens.

litellm's import is the slowest single thing here: it runs in a thread while the stack starts
(`litellm_import`), so the file pays it once and mostly while it waits anyway.
"""

import importlib
import json
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
import pytest_asyncio

pytestmark = pytest.mark.asyncio(loop_scope="module")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "boolean"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add numbers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CHOICES = ["required", {"type": "function", "function": {"name": "add"}}]


@pytest.fixture(scope="module")
def litellm_import():
    """litellm being imported in a worker thread (module docstring); .result() is the module."""
    with pytest.MonkeyPatch.context() as env, ThreadPoolExecutor(1) as pool:
        env.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its bundled price list: no download
        yield pool.submit(importlib.import_module, "litellm")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(litellm_import, start_stack, chatml_pair):
    async with start_stack(*chatml_pair, gateways=2, client_users=("alice", "bob")) as running:
        yield running


@pytest.fixture(scope="module")
def api(stack):
    return openai.AsyncOpenAI(base_url=stack.openai_base_url, api_key=stack.api_key("alice"), max_retries=0, timeout=120)


def check_calls(calls, named: str | None = None) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        assert named in (None, call.function.name)
        out.append((call.function.name, arguments))
    assert out
    return out


@pytest.mark.parametrize("choice", CHOICES, ids=["required", "named"])
async def test_required_and_named_calls_validate_and_are_exact_under_speculation(api, choice):
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    answers = {}
    for k in (0, 4):
        reply = await api.chat.completions.create(
            model="", messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, temperature=0,
            max_tokens=80, logprobs=True, extra_body={"num_speculative_tokens": k})
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
        assert len(message.tool_calls) == 1 and message.tool_calls[0].id.startswith("call_")
        answers[k] = (check_calls(message.tool_calls, named), [t.token for t in reply.choices[0].logprobs.content])
    assert answers[4] == answers[0]
    # sampled, seeded: still a valid call every time
    for seed in range(3):
        reply = await api.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice=choice,
                                                  parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=80)
        check_calls(reply.choices[0].message.tool_calls, named)


@pytest.mark.parametrize("choice", ["auto", "none"])
async def test_auto_and_none_are_exact_under_speculation(api, choice):
    texts = []
    for k in (0, 4):
        reply = await api.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice=choice,
                                                  temperature=0, max_tokens=16, logprobs=True,
                                                  extra_body={"num_speculative_tokens": k})
        texts.append([t.token for t in reply.choices[0].logprobs.content])
    assert texts[0] == texts[1]


async def test_streamed_calls_assemble_into_the_whole_answers_calls(api):
    whole = await api.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="required",
                                              temperature=0, max_tokens=120)
    calls: dict[int, dict] = {}
    finish = None
    async with await api.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="required",
                                                 temperature=0, max_tokens=120, stream=True) as stream:
        async for chunk in stream:
            for delta in chunk.choices:
                finish = delta.finish_reason or finish
                for call in delta.delta.tool_calls or []:
                    entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
    expected = [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.choices[0].message.tool_calls]
    assert [calls[i] for i in sorted(calls)] == expected
    assert finish == whole.choices[0].finish_reason


async def test_history_with_calls_and_results_renders_and_answers(api):
    first = await api.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, temperature=0, max_tokens=80)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    reply = await api.chat.completions.create(model="", messages=history, tools=TOOLS, tool_choice="none",
                                              temperature=0, max_tokens=8)
    assert reply.choices[0].message.tool_calls is None
    plain = await api.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + 10  # the call and its result are in the prompt


@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "nonsense"}}}}}], "required", "tools[0].function.parameters"),
    (TOOLS + [TOOLS[0]], "auto", "tools[2].function.name"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "tools[0].function.name"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice.function.name"),
    (None, "required", "tool_choice"),
])
async def test_bad_tool_definitions_are_400s_naming_the_field(api, tools, choice, param):
    with pytest.raises(openai.BadRequestError) as caught:
        await api.chat.completions.create(model="", messages=ASK, max_tokens=4, tool_choice=choice,
                                          **({"tools": tools} if tools is not None else {}))
    assert caught.value.body["param"] == param, caught.value.body


async def test_langchain_bind_tools_gets_a_valid_call(stack):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """Weather of a city."""
        return "sunny"

    chat = ChatOpenAI(model="", base_url=stack.openai_base_url, api_key=stack.api_key("alice"), temperature=0,
                      max_tokens=120, max_retries=0)
    message = await chat.bind_tools([get_weather], tool_choice="get_weather", strict=True).ainvoke("Weather in Oslo?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert message.tool_calls[0]["args"]["city"] in ("Paris", "Oslo")


async def test_litellm_completion_with_tools(stack, api, litellm_import: Future):
    litellm = litellm_import.result(timeout=600)
    model = (await api.models.list()).data[0].id
    reply = await litellm.acompletion(model=f"openai/{model}", api_base=stack.openai_base_url,
                                      api_key=stack.api_key("alice"), messages=ASK, tools=TOOLS,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                      temperature=0, max_tokens=80)
    calls = reply.choices[0].message.tool_calls
    assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)


RESPONSE_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER}]


async def test_responses_create_stream_and_tools(api):
    text = await api.responses.create(model="", input="Hello", instructions="Be brief.", max_output_tokens=8,
                                      temperature=0)
    assert text.status == "incomplete" and text.usage.output_tokens == 8 and text.output_text
    called = await api.responses.create(model="", input="Weather?", tools=RESPONSE_TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    [call] = [item for item in called.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    async with api.responses.stream(model="", input="Weather?", tools=RESPONSE_TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=80, temperature=0) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    [streamed] = [item for item in final.output if item.type == "function_call"]
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)


async def test_responses_are_stored_per_key_and_survive_a_gateway_restart(stack, api):
    first = await api.responses.create(model="", input="Hello", max_output_tokens=4, temperature=0)
    second = await api.responses.create(model="", input="More", previous_response_id=first.id, max_output_tokens=4,
                                        temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens  # the history came back
    bob = openai.AsyncOpenAI(base_url=stack.openai_base_url, api_key=stack.api_key("bob"), max_retries=0, timeout=120)
    with pytest.raises(openai.NotFoundError):
        await bob.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        await bob.responses.create(model="", input="x", previous_response_id=first.id, max_output_tokens=2)
    other_port = list(stack.gateway_ports.values())[1]  # another gateway on the same NATS sees it
    other = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{other_port}/v1", api_key=stack.api_key("alice"),
                               max_retries=0, timeout=120)
    assert (await other.responses.retrieve(second.id)).previous_response_id == first.id
    unstored = await api.responses.create(model="", input="Hello", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(unstored.id)

    gateway = "gateway-0"  # the one `api` talks to (the stack's first)
    stack.kill(gateway)
    await stack.wait_exit(gateway)
    await stack.start_instance("gateway", gateway)
    third = await api.responses.create(model="", input="Again", previous_response_id=second.id, max_output_tokens=4,
                                       temperature=0)
    assert third.usage.input_tokens > second.usage.input_tokens
    assert (await api.responses.retrieve(first.id)).id == first.id
    await api.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(first.id)


async def test_anthropic_sdk_messages_text_tools_and_stream(stack):
    import anthropic

    greedy = {"temperature": 0}  # the SDK no longer takes temperature as an argument
    claude = anthropic.AsyncAnthropic(base_url=stack.openai_base_url.removesuffix("/v1"),
                                      auth_token=stack.api_key("alice"), max_retries=0, timeout=120)
    text = await claude.messages.create(model="", max_tokens=6, system="Be brief.", extra_body=greedy,
                                        messages=[{"role": "user", "content": "Hello"}])
    assert text.stop_reason == "max_tokens" and text.usage.output_tokens == 6 and text.content[0].type == "text"
    tools = [{"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER}]
    called = await claude.messages.create(model="", max_tokens=80, tools=tools, extra_body=greedy,
                                          tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                          messages=[{"role": "user", "content": "Weather in Oslo?"}])
    [use] = [block for block in called.content if block.type == "tool_use"]
    assert called.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER)
    async with claude.messages.stream(model="", max_tokens=80, tools=tools, extra_body=greedy,
                                      tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                      messages=[{"role": "user", "content": "Weather in Oslo?"}]) as stream:
        final = await stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(use.name, use.input)]
    answer = await claude.messages.create(model="", max_tokens=4, tools=tools, extra_body=greedy, messages=[
        {"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": called.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}])
    assert answer.usage.input_tokens > called.usage.input_tokens
