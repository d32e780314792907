"""OpenAI's Responses API on the gateway (docs/TOOLS.md):

    POST   /v1/responses          text or items in, a Response out (or its SSE events)
    GET    /v1/responses/{id}     a stored response, its owner only
    DELETE /v1/responses/{id}     forget it, its owner only

A Responses request becomes one chat completion: `instructions` the system turn, `input` (a
text, or message / function_call / function_call_output items) the turns after the stored
conversation of `previous_response_id`, `tools` and `tool_choice` services/gateway/tools.py's
(the Responses shape of a function tool, flat, turned into the chat shape), so speculation,
grammars and tool-call parsing are the chat route's. As OpenAI does, a previous response's
instructions are not carried over. `store` (default true) keeps the response and its
conversation in NATS key-value (services/gateway/response_store.py); `store: false` keeps
nothing, and such a response cannot be continued or fetched.

Streaming sends the SDK's event types in its order: response.created, response.in_progress,
then per output item output_item.added, (a message) content_part.added, output_text.delta...,
output_text.done, content_part.done, (a function call) function_call_arguments.delta / .done,
output_item.done, and last response.completed (response.incomplete when cut by
max_output_tokens); each event has a sequence_number and is written `event: <type>` + `data:`.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas.errors import SpecbusError
from services.gateway.api_errors import ApiError, validation_error
from services.gateway.request_bodies import ChatBody, SpecbusFields
from services.gateway.response_store import ResponseStore
from services.gateway.tools import StreamShaper, field_error, tool_names

CLIENT_GONE_STATUS = 499


class ResponsesBody(SpecbusFields):
    """The fields of POST /v1/responses taken (others are refused, naming them), and specbus's
    (SpecbusFields, as on the chat route)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None


def parts_text(content: Any, param: str, is_part: Callable[[dict], bool], expected: str) -> str:
    """A content given as a text, or as a list of parts that each pass is_part (a dict with a
    `text`), joined; else a 400 naming param that says what was expected. The Responses API's
    and the Messages API's contents (`is_text_part`, messages_api's `is_text_block`)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and is_part(p) for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise field_error(param, expected)


def is_text_part(part: dict) -> bool:
    """A message item's part: input_text, output_text or text, each a dict with a text."""
    return isinstance(part.get("text"), str)


def input_turns(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat turns of `input`: messages (developer is system), function calls folded into
    one assistant turn's tool_calls, function_call_output items as tool turns."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    turns: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise field_error(f"input[{i}].role", f"{str(role)[:40]!r} is not user, assistant, system or developer")
            turns.append({"role": "system" if role == "developer" else role,
                          "content": parts_text(item.get("content"), f"input[{i}].content", is_text_part,
                                                "a message's content is a text or a list of text parts")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise field_error(f"input[{i}]", "a function_call item needs call_id, name and arguments")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if turns and turns[-1]["role"] == "assistant" and turns[-1].get("tool_calls") is not None:
                turns[-1]["tool_calls"].append(call)
            else:
                turns.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
                raise field_error(f"input[{i}]", "a function_call_output item needs call_id and output")
            turns.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            raise field_error(f"input[{i}].type", f"{str(kind)[:40]!r} is not message, function_call or "
                                                  f"function_call_output")
    return turns


def chat_tools(body: ResponsesBody) -> dict[str, Any]:
    """tools / tool_choice in the chat shape (a Responses function tool is flat)."""
    out: dict[str, Any] = {}
    if body.tools is not None:
        tools = []
        for i, tool in enumerate(body.tools):
            if tool.get("type") != "function":
                raise field_error(f"tools[{i}].type", "only function tools are served")
            tools.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
        out["tools"] = tools
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise field_error("tool_choice", "a named tool_choice is {\"type\": \"function\", \"name\": ...}")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    if body.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = body.parallel_tool_calls
    return out


def text_format(body: ResponsesBody) -> dict[str, Any]:
    """`text.format` as the chat route's response_format."""
    fmt = (body.text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return {}
    if fmt.get("type") == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "schema"), "schema": fmt.get("schema", {}), "strict": fmt.get("strict")}}}
    return {"response_format": {"type": fmt.get("type")}}


def chat_body(body: ResponsesBody, history: list[dict[str, Any]]) -> tuple[ChatBody, list[dict[str, Any]]]:
    """The chat body of a Responses request, and its conversation (without instructions)."""
    turns = history + input_turns(body.input)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + turns
    raw = {"model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
           "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream,
           **body.specbus_fields(), **chat_tools(body), **text_format(body)}
    try:
        return ChatBody.model_validate({k: v for k, v in raw.items() if v is not None}), turns
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass
class ResponseBuilder:
    """A Response's output items as its chat pieces come, and the stream events that tell them."""

    body: ResponsesBody
    model: str
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[dict] = field(default_factory=list)
    message: dict | None = None  # the open message item
    sequence: int = 0
    finish_reason: str | None = None
    usage: Any = None

    def event(self, kind: str, **fields: Any) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def response(self, status: str) -> dict:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": incomplete, "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens, "model": self.model, "output": self.output,
                "parallel_tool_calls": body.parallel_tool_calls is not False,
                "previous_response_id": body.previous_response_id, "store": body.store,
                "temperature": body.temperature, "top_p": body.top_p, "tool_choice": body.tool_choice or "auto",
                "tools": body.tools or [], "text": body.text or {"format": {"type": "text"}}, "truncation": "disabled",
                "metadata": body.metadata or {}, "user": body.user, "usage": self.usage_json()}

    def usage_json(self) -> dict | None:
        if self.usage is None:
            return None
        u = self.usage
        return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.prompt_tokens + u.completion_tokens}

    def opening(self) -> list[dict]:
        snapshot = self.response("in_progress")
        return [self.event("response.created", response=snapshot), self.event("response.in_progress", response=snapshot)]

    def piece(self, piece: dict) -> list[dict]:
        """The events of one chat piece (its text and calls)."""
        events = []
        text = piece["delta"].get("content") or ""
        if text:
            if self.message is None:
                self.message = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                                "content": []}
                self.output.append(self.message)
                events.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                         item=dict(self.message, content=[])))
                self.message["content"].append({"type": "output_text", "text": "", "annotations": []})
                events.append(self.event("response.content_part.added", item_id=self.message["id"],
                                         output_index=len(self.output) - 1, content_index=0,
                                         part={"type": "output_text", "text": "", "annotations": []}))
            self.message["content"][0]["text"] += text
            events.append(self.event("response.output_text.delta", item_id=self.message["id"],
                                     output_index=self.output.index(self.message), content_index=0, delta=text))
        for call in piece["delta"].get("tool_calls", []):
            events += self.close_message()
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call["id"],
                    "name": call["function"]["name"], "arguments": ""}
            self.output.append(item)
            index = len(self.output) - 1
            events.append(self.event("response.output_item.added", output_index=index, item=dict(item)))
            item["arguments"] = call["function"]["arguments"]
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                     delta=item["arguments"]))
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     arguments=item["arguments"]))
            item["status"] = "completed"
            events.append(self.event("response.output_item.done", output_index=index, item=dict(item)))
        if piece["finish_reason"] is not None:
            self.finish_reason = piece["finish_reason"]
        return events

    def close_message(self) -> list[dict]:
        if self.message is None:
            return []
        message, self.message = self.message, None
        index, part = self.output.index(message), message["content"][0]
        message["status"] = "completed"
        return [self.event("response.output_text.done", item_id=message["id"], output_index=index, content_index=0,
                           text=part["text"]),
                self.event("response.content_part.done", item_id=message["id"], output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=message)]

    def closing(self) -> list[dict]:
        events = self.close_message()
        status = "incomplete" if self.finish_reason == "length" else "completed"
        return events + [self.event(f"response.{status}", response=self.response(status))]

    def turn(self) -> dict:
        """The response as an assistant chat turn, for the stored conversation."""
        text = "".join(i["content"][0]["text"] for i in self.output if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.output if i["type"] == "function_call"]
        return {"role": "assistant", "content": text or None} | ({"tool_calls": calls} if calls else {})


def sse_event(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


OpenChat = Callable[[Any, ChatBody], Awaitable[Any]]  # (client, chat body) -> the gateway's Running


async def chat_pieces(open_chat: OpenChat, client: Any, chat: ChatBody, builder: Any) -> AsyncIterator[dict]:
    """The one choice's streamed chat pieces, calls parsed out; the Running is closed at the end,
    and builder.usage set once it finished."""
    running = await open_chat(client, chat)
    names = tool_names(chat)
    shaper = StreamShaper(names) if names is not None else None
    try:
        async for _, chunk in running.chunks():
            piece = running.choices[0].chat_piece(chunk, delta=True)
            yield piece if shaper is None else shaper.piece(piece)
    except SpecbusError as exc:
        raise ApiError.from_specbus(exc, chat.param_names()) from None
    finally:
        await running.close()
    builder.usage = running.choices[0].usage


async def answer(gateway: Any, request: Request, unless_gone: Callable, stream: bool, events: AsyncIterator[list[dict]],
                 whole: Callable[[], Awaitable[dict]], opening: Callable[[], list[dict]],
                 closing: Callable[[], Awaitable[list[dict]]], error_event: Callable[[ApiError], dict]) -> Response:
    """A route's answer from its event batches: whole() as JSON, or the SSE events (opening, the
    batches, closing), once the first batch came, so an error before it is an HTTP error; a client
    gone first is cancelled (unless_gone, the gateway's)."""
    if not stream:
        whole_answer = await unless_gone(gateway, request, whole())
        return Response(status_code=CLIENT_GONE_STATUS) if whole_answer is None else JSONResponse(whole_answer)
    first = await unless_gone(gateway, request, anext(events, []))
    if first is None:
        return Response(status_code=CLIENT_GONE_STATUS)

    async def sse() -> AsyncIterator[str]:
        try:
            for event in opening() + first:
                yield sse_event(event)
            async for batch in events:
                for event in batch:
                    yield sse_event(event)
            for event in await closing():
                yield sse_event(event)
        except ApiError as exc:
            yield sse_event(error_event(exc))
        finally:
            await events.aclose()

    return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def add_routes(app: FastAPI, gateway: Any, authorized: Callable, open_chat: OpenChat,
               unless_gone: Callable[[Any, Request, Awaitable], Awaitable]) -> None:
    """The /v1/responses routes on app; the chat machinery (open_chat, unless_gone) is the gateway's."""
    store = ResponseStore({user: client.nc for user, client in gateway.clients.items()})

    async def pieces(client: Any, chat: ChatBody, builder: ResponseBuilder) -> AsyncIterator[list[dict]]:
        async for piece in chat_pieces(open_chat, client, chat, builder):
            yield builder.piece(piece)

    async def keep(user: str, builder: ResponseBuilder, turns: list[dict], answer: dict) -> None:
        if builder.body.store:
            await store.put(user, builder.id, {"response": answer, "messages": turns + [builder.turn()]})

    @app.post("/v1/responses")
    async def create(body: ResponsesBody, request: Request, client: Any = Depends(authorized)) -> Response:
        gateway.check_model(body.model)
        user = gateway.user_for(request.headers.get("authorization"))
        history = [] if body.previous_response_id is None else \
            (await store.get(user, body.previous_response_id, "previous_response_id"))["messages"]
        chat, turns = chat_body(body, history)
        builder = ResponseBuilder(body, gateway.model)
        events = pieces(client, chat, builder)

        async def closing() -> list[dict]:
            events_left = builder.closing()
            await keep(user, builder, turns, events_left[-1]["response"])
            return events_left

        async def whole() -> dict:
            async for _ in events:
                pass
            return (await closing())[-1]["response"]

        def error_event(exc: ApiError) -> dict:
            return builder.event("error", code=exc.code, message=exc.message, param=exc.param)

        return await answer(gateway, request, unless_gone, body.stream, events, whole, builder.opening, closing,
                            error_event)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request, client: Any = Depends(authorized)) -> dict:
        user = gateway.user_for(request.headers.get("authorization"))
        return (await store.get(user, response_id))["response"]

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request, client: Any = Depends(authorized)) -> dict:
        user = gateway.user_for(request.headers.get("authorization"))
        await store.delete(user, response_id)
        return {"id": response_id, "object": "response", "deleted": True}
