"""Tool calling in text, NATS-free: tools and past calls rendered into a chat, the grammar that
makes the output a valid call, and the calls parsed back out of the output (whole or streamed).

A tool is OpenAI's function definition as a dict: {"name", "description", "parameters" (a JSON
schema of the arguments object)}. A call is (name, arguments as a JSON text).

Two ways into the prompt:
- the model's own: a chat template that reads `tools` (the variable transformers passes) gets
  the tools and the messages as they are, assistant `tool_calls` and `tool` turns included;
- the generic one, for templates without a tools section (SmolLM2's renders role and content
  only): the Hermes format, which Qwen2.5, Hermes and SmolLM3 were trained on and vLLM's
  `hermes` parser reads. The tools go into the system turn as JSON inside <tools></tools>;
  each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; a tool's result
  goes back as a user turn of `<tool_response>...</tool_response>` (a user turn, as Qwen2.5's
  template writes it, because many templates refuse roles they do not know). Chosen over a bare
  JSON object (llama-server's generic format) because the tags let a model mix text and calls
  under tool_choice "auto" and let a parser find calls in a stream without guessing where a
  JSON answer ends.

The grammar (`call_grammar`, llguidance's Lark dialect with embedded JSON schemas) is what
tool_choice "required" and a named function send as structured outputs: one call (or several,
one per line, with parallel calls) of a declared tool whose arguments follow its schema, in
the JSON layout of text/grammar.py, so every separator and the call's frame are forced tokens.

A grammar makes a call valid, not finished: a model may keep writing digits of a number the
schema leaves unbounded (JSON numbers have no length) until max_tokens cuts the call. So the call
grammar bounds the numbers a schema leaves open (`bounded_numbers`), by what JSON can carry
between programs anyway (RFC 8259 section 6: integers within +-(2**53 - 1) are the interoperable
ones, IEEE doubles the usual precision): a number or integer without a maximum (minimum) gets
MAX_SAFE_INTEGER (its negative), a number without multipleOf at most MAX_FRACTION_DIGITS digits
after the point and no exponent (multipleOf 10**-MAX_FRACTION_DIGITS). Every call it allows is
still valid for the declared schema. Strings are left as declared: an argument's text may be
long on purpose (code, a document), and max_tokens is its bound (close a schema with maxLength
to bound it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

import llguidance

OPEN, CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
# the JSON layout of text/grammar.py, for %json blocks
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
MAX_CACHED_SCHEMAS = 1024  # checked tool schemas remembered per process
MAX_SAFE_INTEGER = 2**53 - 1  # RFC 8259 section 6: the integers every JSON parser holds exactly
# digits after a number's point that the call grammar allows where a schema sets no multipleOf;
# llguidance's multipleOf takes a decimal step of at most 10 digits
MAX_FRACTION_DIGITS = 9
NUMBER_TYPES = ("number", "integer")
# the keywords whose values are subschemas (a dict of them, a list of them, or one)
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
SCHEMA_ONES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "unevaluatedProperties",
               "unevaluatedItems", "propertyNames")
SYSTEM_PREAMBLE = ("You are a function calling AI model. You are provided with function signatures within "
                   "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
                   "Don't make assumptions about what values to plug into functions. Here are the available tools: "
                   "<tools>\n{tools}\n</tools>\nFor each function call, return a json object with function name "
                   "and arguments within <tool_call></tool_call> XML tags, one call a line:\n"
                   '<tool_call>{{"name": <function-name>, "arguments": <args-json-object>}}</tool_call>')


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text


def template_reads_tools(template: str | None) -> bool:
    """Whether a chat template has a tools section (it reads the `tools` variable)."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def tool_json(tool: dict) -> dict:
    """OpenAI's function definition as the prompt shows it: {"type": "function", "function": ...}."""
    return {"type": "function", "function": {"name": tool["name"], "description": tool.get("description") or "",
                                             "parameters": tool.get("parameters") or EMPTY_PARAMETERS}}


def call_text(call: ToolCall) -> str:
    """One call as the generic format writes it (and the grammar forces it)."""
    return f'{OPEN}{{"name": {json.dumps(call.name)}, "arguments": {call.arguments}}}{CLOSE}'


def generic_messages(messages: Sequence[dict], tools: Sequence[dict]) -> list[dict]:
    """messages ({"role", "content", "tool_calls": [ToolCall]} ) in the generic format (module
    docstring), as plain role/content turns any template renders: the tools in the system turn
    (merged into the first one when there is one), calls and results as tagged text."""
    out: list[dict] = []
    if tools:
        listing = "\n".join(json.dumps(tool_json(t), ensure_ascii=False) for t in tools)
        preamble = SYSTEM_PREAMBLE.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            preamble = messages[0]["content"] + "\n\n" + preamble
            messages = messages[1:]
        out.append({"role": "system", "content": preamble})
    for message in messages:
        if message["role"] == "tool":
            text = f"{RESPONSE_OPEN}\n{message['content']}\n{RESPONSE_CLOSE}"
            if out and out[-1].get("tool_results"):  # one user turn for consecutive results
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "tool_results": True})
            continue
        calls = message.get("tool_calls") or []
        content = "\n".join([message["content"]] * bool(message["content"]) + [call_text(c) for c in calls])
        out.append({"role": message["role"], "content": content})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """messages for a template with a tools section, in transformers' shape: a call's arguments
    as a dict, under {"type": "function", "function": {...}}."""
    out = []
    for message in messages:
        turn = {k: v for k, v in message.items() if k != "tool_calls"}
        if message.get("tool_calls"):
            turn["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                                  for c in message["tool_calls"]]
        out.append(turn)
    return out


def call_grammar(tools: Sequence[dict], parallel: bool) -> str:
    """The Lark grammar of a valid answer under tool_choice required (or one named tool: give
    only it): one call of a declared tool (with parallel, one or more, one per line), arguments
    valid for its parameters schema."""
    names = []
    rules = []
    for i, tool in enumerate(tools):
        arguments = tool.get("parameters") or EMPTY_PARAMETERS
        bounded = bounded_numbers(arguments)
        arguments = arguments if schema_error(bounded) else bounded  # a bound the schema cannot take: as declared
        schema = {"type": "object", "properties": {"name": {"const": tool["name"]}, "arguments": arguments},
                  "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": JSON_LAYOUT}
        names.append(f"call_{i}")
        rules.append(f"call_{i}: %json {json.dumps(schema)}")
    start = "start: call (\"\\n\" call)*" if parallel else "start: call"
    return "\n".join([start, f'call: "{OPEN}" body "{CLOSE}"', "body: " + " | ".join(names), *rules])


def bounded_numbers(schema: dict) -> dict:
    """schema with the bounds of the module docstring on each number and integer it leaves open
    (a copy; values under enum, const, default and examples are data, left alone)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded_numbers(sub) for name, sub in out[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded_numbers(sub) for sub in out[key]]
    for key in SCHEMA_ONES:
        if isinstance(out.get(key), dict):
            out[key] = bounded_numbers(out[key])
    types = out.get("type")
    types = types if isinstance(types, list) else [types]
    if not any(t in NUMBER_TYPES for t in types) or "enum" in out or "const" in out:
        return out
    low = max((out[k] for k in ("minimum", "exclusiveMinimum") if isinstance(out.get(k), (int, float))), default=None)
    high = min((out[k] for k in ("maximum", "exclusiveMaximum") if isinstance(out.get(k), (int, float))), default=None)
    if high is None and (low is None or low < MAX_SAFE_INTEGER):
        out["maximum"] = MAX_SAFE_INTEGER
    if low is None and (high is None or high > -MAX_SAFE_INTEGER):
        out["minimum"] = -MAX_SAFE_INTEGER
    if "number" in types and "multipleOf" not in out:
        out["multipleOf"] = float(f"1e-{MAX_FRACTION_DIGITS}")
    return out


def schema_error(parameters: dict) -> str:
    """Why a tool's parameters are not a JSON schema the grammar can follow ("" when they are).
    Cached by the schema's text: an agent sends the same tools with every request."""
    return _schema_error(json.dumps({**parameters, "x-guidance": JSON_LAYOUT}, sort_keys=True))


@lru_cache(maxsize=MAX_CACHED_SCHEMAS)
def _schema_error(schema: str) -> str:
    return llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(
        f"start: args\nargs: %json {schema}")).strip()


def parse_call(text: str, names: Sequence[str]) -> ToolCall | None:
    """The call in the text between the tags, None when it is not one of a declared tool."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def parse_output(text: str, names: Sequence[str]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output: the text outside the calls, and the calls in order;
    a tagged block that is not a call of a declared tool stays in the content."""
    stream = CallStream(names)
    pieces = list(stream.feed(text)) + list(stream.finish())
    content = "".join(p for p in pieces if isinstance(p, str))
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    return (content.strip() if calls else content), calls


@dataclass
class CallStream:
    """Calls parsed from an output as it streams: `feed` each text delta, then `finish`; each
    yields text (content, held back while it may be the start of a call's tag) and ToolCalls."""

    names: Sequence[str]
    buffer: str = ""
    inside: bool = False  # after an opening tag
    calls: int = 0

    def feed(self, text: str) -> Iterator[str | ToolCall]:
        self.buffer += text
        while True:
            if self.inside:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    return
                call = parse_call(self.buffer[:end], self.names)
                yield call if call is not None else OPEN + self.buffer[:end + len(CLOSE)]
                self.calls += call is not None
                self.buffer, self.inside = self.buffer[end + len(CLOSE):], False
                continue
            start = self.buffer.find(OPEN)
            if start >= 0:
                yield from self.text(self.buffer[:start])
                self.buffer, self.inside = self.buffer[start + len(OPEN):], True
                continue
            keep = next((n for n in range(min(len(OPEN) - 1, len(self.buffer)), 0, -1)
                         if OPEN.startswith(self.buffer[-n:])), 0)
            yield from self.text(self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return

    def text(self, text: str) -> Iterator[str]:
        # between and after calls, whitespace is layout, not content
        if text and not (self.calls and not text.strip()):
            yield text

    def finish(self) -> Iterator[str | ToolCall]:
        """The rest at the end of the output: an unclosed call (cut by max_tokens, or ended at
        EOS without its closing tag) is a call if its JSON is whole, else text."""
        rest, inside = self.buffer, self.inside
        self.buffer, self.inside = "", False
        if inside:
            call = parse_call(rest, self.names)
            if call is not None:
                self.calls += 1
                yield call
                return
            rest = OPEN + rest
        yield from self.text(rest)
