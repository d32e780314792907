"""services/gateway/messages_api.py, NATS-free: Anthropic blocks as chat turns, tool_choice as
the chat route's, and the event order of a streamed message."""

import pytest

from services.gateway.api_errors import ApiError
from services.gateway.messages_api import MessageBuilder, MessagesBody, chat_body, message_turns


def test_blocks_become_chat_turns_and_tool_choice_the_chat_routes():
    turns = message_turns([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                     {"type": "text", "text": "Thanks"}]}])
    assert [t["role"] for t in turns] == ["user", "assistant", "tool", "user"]
    assert turns[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    body = MessagesBody(max_tokens=8, system="Be brief.", messages=[{"role": "user", "content": "Hi"}],
                        tools=[{"name": "f", "input_schema": {"type": "object"}}],
                        tool_choice={"type": "tool", "name": "f", "disable_parallel_tool_use": True})
    chat = chat_body(body)
    assert [m.role for m in chat.messages] == ["system", "user"] and chat.tool_mode() == "named"
    with pytest.raises(ApiError, match=r"messages\[0\].content\[0\].type"):
        message_turns([{"role": "user", "content": [{"type": "image"}]}])


def test_events_come_in_anthropics_order():
    builder = MessageBuilder("m")
    events = builder.opening()
    events += builder.piece({"delta": {"content": "Checking."}, "finish_reason": None})
    events += builder.piece({"delta": {"content": "", "tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        "finish_reason": "tool_calls"})
    events += builder.closing()
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop", "content_block_start",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    assert builder.content[1] == {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}
