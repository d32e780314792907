"""text/grammar.py: admission's compile-and-probe check refuses, naming the field, the grammars
that compile but break the matcher in its first tokens, and remembers what it refused; a
matcher that fails on an allowed token is a typed error, not a crash."""

import pytest

from schemas.config import TINY_TARGET
from schemas.errors import ErrorCode, SpecbusError
from schemas.generation import StructuredOutputs
from text.grammar import FIELD, Grammars, OutputMatcher, llg_tokenizer
from text.tokenizer import load_tokenizer

WIDE = "start: " + " | ".join('"w%dz"' % i for i in range(3000))
RECURSIVE = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
             "$ref": "#/$defs/n"}
SELF_ONLY = {"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"}


@pytest.fixture(scope="module")
def grammars():
    tokenizer = load_tokenizer(TINY_TARGET)
    return Grammars(llg_tokenizer(tokenizer, tokenizer.vocab_size)), tokenizer.vocab_size


@pytest.mark.parametrize("spec", [dict(grammar=WIDE), dict(json=RECURSIVE), dict(json=SELF_ONLY)],
                         ids=["wide", "recursive", "self_only"])
def test_a_grammar_that_breaks_the_matcher_is_refused_at_admission(grammars, spec):
    grammars, vocab_size = grammars
    with pytest.raises(SpecbusError, match="the grammar fails after") as raised:
        grammars.check(StructuredOutputs(**spec), vocab_size)
    assert raised.value.code == ErrorCode.invalid_field and raised.value.field == FIELD
    assert spec_refused_from_memory(grammars, StructuredOutputs(**spec), vocab_size) == raised.value.message


def spec_refused_from_memory(grammars: Grammars, spec: StructuredOutputs, vocab_size: int) -> str:
    """The message of the second refusal, with the template cache emptied: it comes from memory."""
    grammars.templates.clear()
    with pytest.raises(SpecbusError) as again:
        grammars.check(spec, vocab_size)
    assert not grammars.templates, "a refused spec is not compiled again"
    return again.value.message


@pytest.mark.parametrize("spec", [dict(json_object=True), dict(regex="[0-9]{2,4}"), dict(choice=["yes", "no"]),
                                  dict(grammar='start: "x" ("+" "x")* "."'), dict(json={"type": "object"})])
def test_ordinary_grammars_pass_the_probe(grammars, spec):
    grammars, vocab_size = grammars
    grammars.check(StructuredOutputs(**spec), vocab_size)


def test_a_matcher_that_fails_on_an_allowed_token_raises_a_typed_error(grammars):
    grammars, _ = grammars
    matcher = OutputMatcher(grammars.matcher(StructuredOutputs(grammar=WIDE)))
    first = matcher.forced()[0]  # the grammar allows (forces) it; consuming it overflows an Earley row
    with pytest.raises(SpecbusError, match="Current row has") as raised:
        matcher.advance([first])
    assert raised.value.code == ErrorCode.invalid_field and raised.value.field == FIELD
