"""services/gateway/tools.py, NATS-free: the tool fields' checks (a 400 naming the field), the
grammar each tool_choice sends, the prompt a chat with tools becomes, and the calls parsed out
of whole and streamed choices."""

import pytest

from schemas.config import TINY_TARGET
from services.gateway.api_errors import ApiError
from services.gateway.request_bodies import ChatBody, chat_plans
from services.gateway.tools import StreamShaper, shape_message
from tests.tiny_checkpoints import CHATML
from text.tokenizer import load_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def chatml():
    import dataclasses
    return dataclasses.replace(load_tokenizer(TINY_TARGET), chat_template=CHATML)


def body(**fields) -> ChatBody:
    return ChatBody.model_validate({"messages": ASK, **fields})


@pytest.mark.parametrize("fields,param", [
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_fields_are_400s_naming_the_field(chatml, fields, param):
    with pytest.raises(ApiError) as caught:
        chat_plans(body(**fields), 16, 60.0, chatml)
    assert (caught.value.status, caught.value.param) == (400, param)


def test_each_tool_choice_sends_its_grammar_and_prompt(chatml):
    plain = chat_plans(body(), 16, 60.0, chatml)[0].request
    assert plain.messages is not None and plain.sampling.structured_outputs is None  # no tools: as before
    auto = chat_plans(body(tools=[WEATHER]), 16, 60.0, chatml)[0].request
    assert "<tools>" in auto.prompt and auto.sampling.structured_outputs is None
    none = chat_plans(body(tools=[WEATHER], tool_choice="none"), 16, 60.0, chatml)[0].request
    assert "<tools>" not in none.prompt
    required = chat_plans(body(tools=[WEATHER], tool_choice="required"), 16, 60.0, chatml)[0].request
    assert '"const": "get_weather"' in required.sampling.structured_outputs.grammar
    single = chat_plans(body(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False), 16, 60.0, chatml)
    assert single[0].request.sampling.structured_outputs.grammar.startswith("start: call\n")


def test_calls_in_history_render_back(chatml):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    prompt = chat_plans(ChatBody.model_validate({"messages": history}), 16, 60.0, chatml)[0].request.prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    bad = history[:1] + [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]
    with pytest.raises(ApiError, match="messages\\[1\\].tool_calls\\[0\\].function.arguments"):
        chat_plans(ChatBody.model_validate({"messages": bad}), 16, 60.0, chatml)


def test_whole_and_streamed_choices_carry_the_same_calls():
    text = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    whole = shape_message({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"},
                          ["get_weather"])
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == "Sure."
    [call] = whole["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    shaper = StreamShaper(["get_weather"])
    pieces = [shaper.piece({"index": 0, "delta": {"content": text[i:i + 5]}, "logprobs": None,
                            "finish_reason": "stop" if i + 5 >= len(text) else None}) for i in range(0, len(text), 5)]
    assert "".join(p["delta"]["content"] for p in pieces) == "Sure."
    [streamed] = [c for p in pieces for c in p["delta"].get("tool_calls", [])]
    assert streamed["index"] == 0 and streamed["function"] == call["function"]
    assert pieces[-1]["finish_reason"] == "tool_calls"
    untouched = shape_message({"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"},
                              ["get_weather"])
    assert untouched["message"] == {"role": "assistant", "content": "hi"} and untouched["finish_reason"] == "stop"
