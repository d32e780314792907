"""text/tool_calls.py: the generic rendering, the call grammar (with the real llguidance matcher
over the shipped tiny tokenizer), and parsing calls out of whole and streamed outputs."""

import json

import llguidance
import pytest

from schemas.config import TINY_TARGET
from text.grammar import limits, llg_tokenizer
from text.tokenizer import load_tokenizer
from text.tool_calls import CLOSE, MAX_SAFE_INTEGER, OPEN, CallStream, ToolCall, bounded_numbers, call_grammar, \
    call_text, generic_messages, parse_output, schema_error, template_reads_tools

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                 "required": ["city"]}}
ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}


def test_template_reads_tools():
    assert template_reads_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_reads_tools("{% for message in messages %}{{ message.content }}{% endfor %}")
    assert not template_reads_tools(None)


def test_generic_messages_put_tools_in_the_system_turn_and_calls_and_results_as_tags():
    call = ToolCall("get_weather", '{"city": "Paris"}')
    turns = generic_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                              {"role": "assistant", "content": "", "tool_calls": [call]},
                              {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "warm"}], [WEATHER])
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert turns[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in turns[0]["content"]
    assert turns[2]["content"] == call_text(call) == OPEN + '{"name": "get_weather", "arguments": {"city": "Paris"}}' + CLOSE
    assert turns[3]["content"].count("<tool_response>") == 2  # consecutive results in one turn


def call_acceptor(tools: list[dict], parallel: bool):
    """text -> whether the call grammar of tools takes it whole."""
    tokenizer = load_tokenizer(TINY_TARGET)
    grammar = llguidance.LLMatcher.grammar_from_lark(call_grammar(tools, parallel))

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(llg_tokenizer(tokenizer, tokenizer.vocab_size), grammar, log_level=0,
                                       limits=limits())
        assert not matcher.is_error(), matcher.get_error()
        ids = tokenizer.encode(text)
        return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()
    return accepts


@pytest.mark.parametrize("parallel", [False, True])
def test_the_call_grammar_takes_valid_calls_only(parallel):
    accepts = call_acceptor([WEATHER, ADD], parallel)
    one = call_text(ToolCall("add", '{"a": 3}'))

    assert accepts(one)
    assert not accepts(call_text(ToolCall("add", '{"a": "x"}')))
    assert not accepts(call_text(ToolCall("nope", '{"a": 3}')))
    assert not accepts('{"name": "add", "arguments": {"a": 3}}')
    assert accepts(one + "\n" + one) == parallel


def test_the_call_grammar_bounds_the_numbers_a_schema_leaves_open():
    money = {"name": "pay", "parameters": {"type": "object", "properties": {
        "amount": {"type": "number"}, "count": {"type": "integer", "minimum": 1},
        "big": {"type": "integer", "minimum": 0, "maximum": 10**17}, "cents": {"type": "number", "multipleOf": 0.01},
        "tags": {"type": "array", "items": {"anyOf": [{"type": "number"}, {"type": "string"}]}}}}}
    accepts = call_acceptor([money], parallel=False)

    def call(**arguments) -> str:
        return call_text(ToolCall("pay", json.dumps(arguments)))

    assert accepts(call(amount=12.5, count=3, cents=0.25, tags=[1.123456789, "x"]))
    assert accepts(call(amount=-MAX_SAFE_INTEGER, count=MAX_SAFE_INTEGER, big=10**17))  # declared bounds stay
    assert not accepts(call(amount=MAX_SAFE_INTEGER + 1))  # RFC 8259's interoperable range
    assert not accepts(call(amount=1.1234567891))  # ten digits after the point
    assert not accepts(call(tags=[0.1234567891]))  # nested in items and anyOf too
    assert not accepts(call(count=MAX_SAFE_INTEGER + 1))
    assert not accepts(call(cents=0.125))  # the schema's own multipleOf
    untouched = {"type": "object", "properties": {"n": {"enum": [1.5, 2]}, "s": {"type": "string"}},
                 "default": {"type": "number"}}
    assert bounded_numbers(untouched) == untouched


def test_schema_error_names_a_bad_schema():
    assert schema_error(WEATHER["parameters"]) == ""
    assert "nonsense" in schema_error({"type": "object", "properties": {"x": {"type": "nonsense"}}})


def test_parse_output_splits_content_and_calls():
    text = "Let me look.\n" + call_text(ToolCall("get_weather", '{"city": "Oslo"}')) + "\n" + \
        OPEN + '{"name": "unknown", "arguments": {}}' + CLOSE
    content, calls = parse_output(text, ["get_weather"])
    assert calls == [ToolCall("get_weather", '{"city": "Oslo"}')]
    assert content.startswith("Let me look.") and "unknown" in content  # not a declared tool: stays text
    assert parse_output("no calls here", ["get_weather"]) == ("no calls here", [])
    # cut at EOS before the closing tag, the JSON whole: still a call
    assert parse_output(OPEN + '{"name": "get_weather", "arguments": {"city": "Rome"}}', ["get_weather"])[1]


def test_a_streamed_output_gives_the_same_calls_however_it_is_split():
    text = "Hi " + call_text(ToolCall("get_weather", '{"city": "Oslo"}')) + "\n" + \
        call_text(ToolCall("add", '{"a": 1}'))
    for size in (1, 3, 7, len(text)):
        stream = CallStream(["get_weather", "add"])
        parts = [p for i in range(0, len(text), size) for p in stream.feed(text[i:i + size])] + list(stream.finish())
        assert "".join(p for p in parts if isinstance(p, str)) == "Hi "
        assert [p for p in parts if isinstance(p, ToolCall)] == [ToolCall("get_weather", '{"city": "Oslo"}'),
                                                                 ToolCall("add", '{"a": 1}')]
    assert json.loads(parse_output(call_text(ToolCall("add", '{"a": 1}')), ["add"])[1][0].arguments) == {"a": 1}
