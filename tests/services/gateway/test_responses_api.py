"""services/gateway/responses_api.py, NATS-free: Responses input items as chat turns, the chat
body a request becomes, and the SDK's event order for text and calls."""

import pytest

from services.gateway.api_errors import ApiError
from services.gateway.responses_api import ResponseBuilder, ResponsesBody, chat_body, input_turns


def test_input_items_become_chat_turns():
    turns = input_turns([
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "tool"]
    assert [c["id"] for c in turns[2]["tool_calls"]] == ["c1", "c2"]
    assert input_turns("Hi") == [{"role": "user", "content": "Hi"}]
    with pytest.raises(ApiError, match=r"input\[0\].type"):
        input_turns([{"type": "image", "url": "x"}])


def test_the_chat_body_has_instructions_history_and_chat_shaped_tools():
    body = ResponsesBody(input="More", instructions="Be brief.", max_output_tokens=5,
                         tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                         tool_choice={"type": "function", "name": "f"})
    chat, turns = chat_body(body, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "user"]
    assert turns[0]["content"] == "Hi" and len(turns) == 3  # the instructions are not part of the conversation
    assert chat.max_tokens == 5 and chat.tool_mode() == "named" and chat.tools[0].function.name == "f"


def test_events_come_in_the_sdks_order():
    builder = ResponseBuilder(ResponsesBody(input="x"), "m")
    events = builder.opening()
    events += builder.piece({"delta": {"content": "Let me check."}, "finish_reason": None})
    events += builder.piece({"delta": {"content": "", "tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        "finish_reason": "tool_calls"})
    events += builder.closing()
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert builder.turn() == {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
