"""Anthropic's Messages API on the gateway, `POST /v1/messages` (docs/TOOLS.md), over the chat
machinery as responses_api.py does for OpenAI's Responses: `system` the system turn, `messages`
with text, `tool_use` and `tool_result` blocks as chat turns (a tool_result is a tool turn),
`tools` ({name, description, input_schema}) and `tool_choice` (auto, any = required, tool =
named, none) as services/gateway/tools.py's, `stop_sequences` as stop. The answer's content is
text and tool_use blocks, `stop_reason` end_turn, max_tokens, stop_sequence or tool_use.

Streaming sends Anthropic's events: message_start, then per block content_block_start,
content_block_delta (text_delta, or input_json_delta with the whole input of a complete call),
content_block_stop, then message_delta (stop_reason, output usage) and message_stop; each
written `event: <type>` + `data:`. The Anthropic SDK authenticates with `x-api-key`; the gateway
takes keys as `Authorization: Bearer` (the SDK's `auth_token`).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from pydantic import Field, ValidationError

from services.gateway.api_errors import ApiError, validation_error
from services.gateway.request_bodies import ChatBody, SpecbusFields
from services.gateway.responses_api import OpenChat, answer, chat_pieces, parts_text
from services.gateway.tools import field_error

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class MessagesBody(SpecbusFields):
    """Anthropic's fields taken (others are refused, naming them; top_k is Anthropic's too), and
    specbus's (SpecbusFields, as on the chat route)."""

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    stop_sequences: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


def is_text_block(block: dict) -> bool:
    return block.get("type") == "text"


def block_text(content: Any, param: str) -> str:
    """A system prompt's or a tool_result's content: a text, or text blocks."""
    return parts_text(content, param, is_text_block, "a text, or a list of text blocks")


def message_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic messages as chat turns: tool_use blocks become the assistant turn's tool_calls,
    tool_result blocks tool turns (before the user's text of the same message)."""
    turns = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise field_error(f"messages[{i}].role", "user or assistant")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise field_error(f"messages[{i}].content", "a text or a list of blocks")
        texts, calls, results = [], [], []
        for j, block in enumerate(blocks):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": str(block.get("id")), "type": "function", "function": {
                    "name": str(block.get("name")), "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and role == "user":
                results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id")),
                                "content": block_text(block.get("content", ""), f"messages[{i}].content[{j}].content")})
            else:
                raise field_error(f"messages[{i}].content[{j}].type", f"{str(kind)[:40]!r} is not served in a "
                                                                      f"{role} message")
        turns += results
        if texts or calls:
            turns.append({"role": role, "content": "".join(texts) or None} | ({"tool_calls": calls} if calls else {}))
    return turns


def chat_tools(body: MessagesBody) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if body.tools is not None:
        out["tools"] = [{"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description"), "parameters": t.get("input_schema")}}
            for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        kind = choice.get("type")
        if kind not in ("auto", "any", "tool", "none"):
            raise field_error("tool_choice.type", "auto, any, tool or none")
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or \
            {"type": "function", "function": {"name": str(choice.get("name"))}}
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    return out


def chat_body(body: MessagesBody) -> ChatBody:
    system = block_text(body.system, "system") if body.system is not None else None
    messages = ([{"role": "system", "content": system}] if system else []) + message_turns(body.messages)
    raw = {"model": body.model, "messages": messages, "max_tokens": body.max_tokens, "temperature": body.temperature,
           "top_p": body.top_p, "stop": body.stop_sequences, "stream": body.stream,
           **body.specbus_fields(), **chat_tools(body)}
    try:
        return ChatBody.model_validate({k: v for k, v in raw.items() if v is not None})
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


@dataclass
class MessageBuilder:
    """An Anthropic message's content blocks as its chat pieces come, and their stream events."""

    model: str
    id: str = field(default_factory=lambda: "msg_" + secrets.token_hex(12))
    content: list[dict] = field(default_factory=list)
    text_open: bool = False
    finish_reason: str | None = None
    usage: Any = None

    def message(self, final: bool) -> dict:
        u = self.usage
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.content if final else [],
                "stop_reason": STOP_REASONS.get(self.finish_reason or "") if final else None, "stop_sequence": None,
                "usage": {"input_tokens": u.prompt_tokens if u else 0, "output_tokens": u.completion_tokens if u else 0}}

    def opening(self) -> list[dict]:
        return [{"type": "message_start", "message": self.message(final=False)}]

    def piece(self, piece: dict) -> list[dict]:
        events = []
        text = piece["delta"].get("content") or ""
        if text:
            if not self.text_open:
                self.content.append({"type": "text", "text": ""})
                self.text_open = True
                events.append({"type": "content_block_start", "index": len(self.content) - 1,
                               "content_block": {"type": "text", "text": ""}})
            self.content[-1]["text"] += text
            events.append({"type": "content_block_delta", "index": len(self.content) - 1,
                           "delta": {"type": "text_delta", "text": text}})
        for call in piece["delta"].get("tool_calls", []):
            events += self.close_text()
            block = {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                     "name": call["function"]["name"], "input": json.loads(call["function"]["arguments"])}
            self.content.append(block)
            index = len(self.content) - 1
            events += [{"type": "content_block_start", "index": index, "content_block": dict(block, input={})},
                       {"type": "content_block_delta", "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}},
                       {"type": "content_block_stop", "index": index}]
        if piece["finish_reason"] is not None:
            self.finish_reason = piece["finish_reason"]
        return events

    def close_text(self) -> list[dict]:
        if not self.text_open:
            return []
        self.text_open = False
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def closing(self) -> list[dict]:
        final = self.message(final=True)
        return self.close_text() + [
            {"type": "message_delta", "delta": {"stop_reason": final["stop_reason"], "stop_sequence": None},
             "usage": {"output_tokens": final["usage"]["output_tokens"]}},
            {"type": "message_stop"}]


def add_routes(app: FastAPI, gateway: Any, authorized: Callable, open_chat: OpenChat,
               unless_gone: Callable[[Any, Request, Awaitable], Awaitable]) -> None:
    """POST /v1/messages on app; the chat machinery (open_chat, unless_gone) is the gateway's."""

    async def pieces(client: Any, chat: ChatBody, builder: MessageBuilder) -> AsyncIterator[list[dict]]:
        async for piece in chat_pieces(open_chat, client, chat, builder):
            yield builder.piece(piece)

    @app.post("/v1/messages")
    async def create(body: MessagesBody, request: Request, client: Any = Depends(authorized)) -> Response:
        gateway.check_model(body.model)
        chat = chat_body(body)
        builder = MessageBuilder(gateway.model)
        events = pieces(client, chat, builder)

        async def closing() -> list[dict]:
            return builder.closing()

        async def whole() -> dict:
            async for _ in events:
                pass
            builder.close_text()
            return builder.message(final=True)

        def error_event(exc: ApiError) -> dict:
            return {"type": "error", "error": {"type": exc.type, "message": exc.message}}

        return await answer(gateway, request, unless_gone, body.stream, events, whole, builder.opening, closing,
                            error_event)
