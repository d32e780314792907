"""Structured outputs: a request's StructuredOutputs as a grammar, its compile check, and the
matchers that follow a row's output token by token. Torch-free (the scheduler checks grammars
at admission); the verifier turns the bitmasks into tensors (gpu_worker/verifier/verifier_grammar.py).

The grammar library is llguidance (Microsoft's, Rust with Python bindings, no dependencies):
its matcher rolls back any number of tokens, which is what speculation needs (advance through a
step's drafts, go back at the first rejection), it computes forced continuations
(`compute_ff_tokens`, the point-mass drafts of jump-forward), it bounds compile and mask work
by LLParserLimits instead of stalling, and it never raises on a bad grammar (an error state with
a message). Measured against xgrammar in ops/bench/RESULTS.md (Structured outputs).

JSON has one fixed layout, Python's json.dumps default: ", " between items, ": " after keys, no
other whitespace. Fixed, the separators are forced (free) tokens and the model spends nothing on
layout; spaced, the model writes JSON as it saw it most, and finishes JSON mode more often than
with compact separators (ops/bench/RESULTS.md, Structured outputs).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from schemas.errors import ErrorCode, SpecbusError
from schemas.generation import StructuredOutputs

FIELD = "sampling.structured_outputs"
# Compiled grammars kept per process (a fresh matcher for each); least recently used dropped.
MAX_CACHED_GRAMMARS = 64
# Tokens an admission probe walks a fresh matcher through (`probe`): a grammar that breaks the
# matcher in its first steps (an Earley row or forced-token search past LIMITS) is refused then.
PROBE_TOKENS = 4
# Bounds on a grammar's compile and per-token work (llguidance's units: fuel ~ 14-50k per ms,
# items ~ 20k per ms): a schema past them is refused at admission, never a stalled step.
LIMITS = dict(initial_lexer_fuel=2_000_000, step_lexer_fuel=400_000, step_max_items=100_000,
              max_lexer_states=100_000, max_grammar_size=200_000, verbose_errors=False)
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


def grammar_of(spec: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON form) of spec; SpecbusError naming the subfield when the
    spec cannot be turned into one (a schema that is not a JSON object)."""
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if spec.json is not None:
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise SpecbusError(ErrorCode.invalid_field, f"not a JSON schema: {exc}", f"{FIELD}.json") from None
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:  # one literal per choice; json.dumps quotes as Lark reads strings
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


def spec_key(spec: StructuredOutputs) -> str:
    """A stable key of spec (sha256 of its canonical JSON), for caches."""
    text = json.dumps(spec.model_dump(mode="json", exclude_none=True), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def llg_tokenizer(tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of a text.tokenizer.Tokenizer whose model has vocab_size logits (rows
    past the tokenizer's own ids are never allowed); its EOS ids end a finished grammar."""
    return llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=vocab_size, eos_token=list(tokenizer.eos_ids) or None)


@dataclass
class Grammars:
    """One process's compiled grammars: a template matcher per spec key, copied for each
    request (copying is far cheaper than compiling), at most MAX_CACHED_GRAMMARS; the specs that
    failed their compile or probe, with their error, as many. Thread-safe (admission compiles
    in a worker thread)."""

    tokenizer: llguidance.LLTokenizer
    templates: OrderedDict = field(default_factory=OrderedDict)
    refused: OrderedDict = field(default_factory=OrderedDict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def matcher(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """A fresh matcher for spec at the start of the output; SpecbusError naming the field
        when the grammar does not compile within LIMITS."""
        key = spec_key(spec)
        with self.lock:
            template = self.templates.get(key)
            if template is None:
                template = self.compile(key, spec)
            self.templates.move_to_end(key)
            return template.deep_copy()

    def compile(self, key: str, spec: StructuredOutputs) -> llguidance.LLMatcher:
        template = llguidance.LLMatcher(self.tokenizer, grammar_of(spec), log_level=0, limits=limits())
        if template.is_error():
            raise SpecbusError(ErrorCode.invalid_field, f"the grammar does not compile: "
                                                        f"{first_line(template.get_error())}", FIELD)
        self.templates[key] = template
        while len(self.templates) > MAX_CACHED_GRAMMARS:
            self.templates.popitem(last=False)
        return template

    def check(self, spec: StructuredOutputs, vocab_size: int) -> None:
        """Admission's check of spec: it compiles within LIMITS and a fresh matcher takes its
        first tokens (`probe`); SpecbusError naming the field otherwise. A spec refused once is
        refused again from memory (the same error, none of the work)."""
        key = spec_key(spec)
        with self.lock:
            error = self.refused.get(key)
        if error is None:
            try:
                probe(self.matcher(spec), vocab_size)
                return
            except SpecbusError as exc:
                error = exc
            with self.lock:
                self.refused[key] = error
                self.templates.pop(key, None)
                while len(self.refused) > MAX_CACHED_GRAMMARS:
                    self.refused.popitem(last=False)
        raise SpecbusError(error.code, error.message, error.field)


def probe(matcher: llguidance.LLMatcher, vocab_size: int) -> None:
    """Walk a fresh matcher through up to PROBE_TOKENS tokens as the verifier would (its mask,
    then the lowest allowed token, which a forced token is): SpecbusError naming the field
    when the matcher fails on the way (a grammar that allows nothing, a schema that only refers
    to itself, an Earley row or forced-token search past LIMITS). Each step's work is bounded by
    LIMITS. The grammar may still fail on a longer path: the verifier then fails that request's
    row alone (gpu_worker/verifier/verifier_grammar.py)."""
    walker = OutputMatcher(matcher)
    bitmask = allocate_token_bitmask(1, vocab_size)
    for _ in range(PROBE_TOKENS):
        fill_next_token_bitmask(matcher, bitmask, 0)
        if matcher.is_error():
            raise grammar_error(matcher, len(walker.consumed))
        if matcher.is_stopped():
            return
        allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab_size])
        if not len(allowed):
            raise SpecbusError(ErrorCode.invalid_field, "the grammar allows no token", FIELD)
        walker.advance([int(allowed[0])])


def grammar_error(matcher: llguidance.LLMatcher, consumed: int) -> SpecbusError:
    """The invalid_field error of a matcher in its error state after `consumed` output tokens."""
    reason = first_line(matcher.get_error().replace("<non-verbose/>", ""))
    reason = "it accepts no output" if reason == "unknown error" else reason
    return SpecbusError(ErrorCode.invalid_field, f"the grammar fails after {consumed} output tokens: {reason}", FIELD)


def first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unknown error"


@dataclass
class OutputMatcher:
    """A matcher and the output tokens it has consumed (`consumed`), so it can be brought to any
    history by rolling back to the common prefix and consuming the rest (`follow`)."""

    matcher: llguidance.LLMatcher
    consumed: list[int] = field(default_factory=list)

    def follow(self, output: list[int]) -> bool:
        """Make the matcher's state the one after output; False when the grammar refuses a token
        of it (the matcher then stands after the tokens it took)."""
        same = 0
        for a, b in zip(self.consumed, output):
            if a != b:
                break
            same += 1
        self.back(len(self.consumed) - same)
        return self.advance(output[same:]) == len(output) - same

    def advance(self, tokens: list[int]) -> int:
        """Consume the longest prefix of tokens the grammar allows; return its length. A refused
        token is never consumed (it would put the matcher in its error state for good).
        SpecbusError naming the field when the matcher fails on an allowed one (its work past
        LIMITS): the grammar's fault, which fails its own request only."""
        take = self.matcher.validate_tokens(list(tokens)) if tokens else 0
        if take and not self.matcher.consume_tokens(list(tokens[:take])):  # a limit of LIMITS, say
            raise grammar_error(self.matcher, len(self.consumed))
        self.consumed.extend(tokens[:take])
        return take

    def back(self, num_tokens: int) -> None:
        """Undo the last num_tokens consumed."""
        if num_tokens:
            self.matcher.rollback(num_tokens)
            del self.consumed[-num_tokens:]

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (none when it allows a choice or is in error)."""
        return [] if self.matcher.is_error() else list(self.matcher.compute_ff_tokens())
