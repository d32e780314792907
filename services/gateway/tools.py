"""Tool calling on /v1/chat/completions, NATS-free: OpenAI's `tools`, `tool_choice` and
`parallel_tool_calls`, checked (a bad definition is a 400 naming its field), rendered into the
prompt, constrained by a grammar where the answer must be a call, and parsed back out of the
output into `message.tool_calls` / streamed `delta.tool_calls` (docs/TOOLS.md).

- `none`: no tool is offered (the definitions are left out of the prompt, since a model shown
  tools tends to call them) and the output is plain text; past calls and results still render.
- `auto` (the default with tools): the tools are in the prompt; what the model writes is parsed,
  calls of declared tools become tool_calls, the rest is content.
- `required`, or a named function: the output follows text/tool_calls.py's call grammar (sent as
  the request's structured_outputs, so the scheduler drafts its forced tokens for free and the
  verifier masks the rest: exact under speculation), over all tools or the named one.

The prompt: a chat with tools, or with calls or tool results in its history, is rendered here
with the target's chat template (text/tool_calls.py: the template's tools section where it has
one, else the generic Hermes format) and sent as prompt text, which the scheduler encodes as it
encodes a rendered chat; a plain chat still goes as messages.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from services.gateway.api_errors import ApiError
from text.chat_template import ChatTemplateError, render_chat
from text.tokenizer import Tokenizer
from text.tool_calls import CallStream, ToolCall, call_grammar, generic_messages, parse_output, schema_error, \
    template_messages, template_reads_tools, tool_json

MAX_TOOLS = 128  # as OpenAI caps them
NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted: the grammar always follows the schema under required/named


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolFields(BaseModel):
    """The chat body's tool fields (mixed into ChatBody)."""

    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    _checked: list[dict] | None = PrivateAttr(None)  # checked_tools, once per body

    def tool_mode(self) -> str:
        """none, auto, required or named (tool_choice's default: auto with tools, else none)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    def checked_tools(self) -> list[dict]:
        """The tools as plain dicts, each checked: a name by OpenAI's rule and not twice,
        parameters a JSON schema the grammar can follow, a named tool_choice declared."""
        if self._checked is None:
            self._checked = self.check_tools()
        return self._checked

    def check_tools(self) -> list[dict]:
        tools, seen = [], set()
        for i, tool in enumerate(self.tools or []):
            name = tool.function.name
            if not NAME_PATTERN.fullmatch(name):
                raise field_error(f"tools[{i}].function.name", f"{name[:80]!r} is not a function name "
                                                               f"(a-z, A-Z, 0-9, _ and -, at most 64)")
            if name in seen:
                raise field_error(f"tools[{i}].function.name", f"{name!r} is declared twice")
            seen.add(name)
            parameters = tool.function.parameters
            if parameters is not None:
                if parameters.get("type", "object") != "object":
                    raise field_error(f"tools[{i}].function.parameters", "the arguments' schema must be of type object")
                problem = schema_error(parameters)
                if problem:
                    raise field_error(f"tools[{i}].function.parameters", f"not a usable JSON schema: "
                                                                         f"{problem.splitlines()[0]}")
            tools.append(tool.function.model_dump(exclude_none=True))
        mode = self.tool_mode()
        if mode in ("required", "named") and not tools:
            raise field_error("tool_choice", f"tool_choice {mode!r} needs tools")
        if mode == "named" and self.tool_choice.function.name not in seen:
            raise field_error("tool_choice.function.name", f"{self.tool_choice.function.name[:80]!r} is not in tools")
        return tools

    def tool_grammar(self) -> dict[str, Any] | None:
        """structured_outputs for required / named (module docstring), else None."""
        mode = self.tool_mode()
        if mode not in ("required", "named"):
            return None
        tools = self.checked_tools()
        if mode == "named":
            tools = [t for t in tools if t["name"] == self.tool_choice.function.name]
        return {"grammar": call_grammar(tools, parallel=mode == "required" and self.parallel_tool_calls is not False)}


def field_error(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_field")


def history_calls(index: int, message: Any) -> list[ToolCall]:
    """An assistant turn's tool_calls (OpenAI's shape) as ToolCalls; a 400 naming the field."""
    given = (message.model_extra or {}).get("tool_calls") or []
    param = f"messages[{index}].tool_calls"
    if not isinstance(given, list):
        raise field_error(param, "must be a list")
    calls = []
    for j, call in enumerate(given):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise field_error(f"{param}[{j}].function", "each call needs function.name and function.arguments")
        arguments = function.get("arguments", "{}")
        try:
            value = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise field_error(f"{param}[{j}].function.arguments", "must be a JSON object's text")
        calls.append(ToolCall(function["name"], json.dumps(value, ensure_ascii=False)))
    return calls


def uses_tools(body: Any) -> bool:
    """Whether a chat body is rendered here (module docstring): tools, or calls or results in history."""
    return bool(body.tools) or any(m.role == "tool" or (m.model_extra or {}).get("tool_calls") for m in body.messages)


def chat_input(body: Any, tokenizer: Tokenizer | None) -> dict[str, Any]:
    """make_request's prompt input of a chat body: {"messages": ...}, or the rendered prompt text
    of a chat with tools (module docstring), which needs the target's tokenizer."""
    if not uses_tools(body):
        return {"messages": [{"role": m.role, "content": m.text()} for m in body.messages]}
    if tokenizer is None:
        raise ValueError("a chat with tools is rendered with the target's tokenizer: none was given")
    tools = body.checked_tools() if body.tool_mode() != "none" else []
    turns = [{"role": m.role, "content": m.text(), "tool_calls": history_calls(i, m)} for i, m in enumerate(body.messages)]
    for turn, message in zip(turns, body.messages):
        if message.role == "tool" and isinstance((message.model_extra or {}).get("tool_call_id"), str):
            turn["tool_call_id"] = message.model_extra["tool_call_id"]
    try:
        if template_reads_tools(tokenizer.chat_template):
            text = render_chat(tokenizer, template_messages(turns), tools=[tool_json(t) for t in tools] or None)
        else:
            text = render_chat(tokenizer, generic_messages(turns, tools))
    except ChatTemplateError as exc:
        raise field_error("messages", str(exc)) from None
    return {"prompt": text}


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def call_json(call: ToolCall, index: int | None = None) -> dict:
    """A call in OpenAI's shape (with its index in a streamed delta)."""
    entry = {"id": call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return entry if index is None else {"index": index} | entry


def tool_finish(finish_reason: str | None, calls: int) -> str | None:
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def shape_message(choice: dict, names: list[str]) -> dict:
    """A whole chat choice with its calls parsed out of the content (module docstring)."""
    content, calls = parse_output(choice["message"]["content"], names)
    if calls:
        choice["message"] = {"role": "assistant", "content": content or None,
                             "tool_calls": [call_json(c) for c in calls]}
        choice["finish_reason"] = tool_finish(choice["finish_reason"], len(calls))
    return choice


@dataclass
class StreamShaper:
    """One streamed choice's deltas with its calls parsed out as they complete."""

    names: list[str]
    stream: CallStream = field(init=False)

    def __post_init__(self) -> None:
        self.stream = CallStream(self.names)

    def piece(self, piece: dict) -> dict:
        parts = list(self.stream.feed(piece["delta"].get("content") or ""))
        if piece["finish_reason"] is not None:
            parts += list(self.stream.finish())
        before = self.stream.calls - sum(isinstance(p, ToolCall) for p in parts)
        delta: dict[str, Any] = {"content": "".join(p for p in parts if isinstance(p, str))}
        calls = [call_json(p, before + i) for i, p in enumerate(c for c in parts if isinstance(c, ToolCall))]
        if calls:
            delta["tool_calls"] = calls
        return piece | {"delta": delta, "finish_reason": tool_finish(piece["finish_reason"], self.stream.calls)}


def tool_names(body: Any) -> list[str] | None:
    """The names whose calls are parsed out of a chat body's output; None: no parsing."""
    if not getattr(body, "tools", None) or body.tool_mode() == "none":
        return None
    return [t.function.name for t in body.tools]


def shape_choices(body: Any, choices: list[dict]) -> list[dict]:
    names = tool_names(body)
    return choices if names is None else [shape_message(c, names) for c in choices]


def stream_shapers(body: Any, count: int) -> list[StreamShaper] | None:
    names = tool_names(body)
    return None if names is None else [StreamShaper(names) for _ in range(count)]
