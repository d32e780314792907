"""Grammar libraries for structured outputs, measured on the default target's tokenizer: per
schema of ops/bench/bench_structured.py SCHEMAS, compile time, then the time to compute the
next-token mask at every position of a valid compact JSON answer (median and max), and the
process's resident memory after each library has compiled them all. llguidance (the one
text/grammar.py uses) always; xgrammar when it imports (it is not a dependency: `pip install
--no-deps xgrammar apache-tvm-ffi` adds it without its GPU stack, and its Python API here is
0.2's).

    PYTHONPATH=. .venv/bin/python ops/bench/bench_grammar.py
"""

import json
import resource
import statistics
import time
from pathlib import Path

import llguidance
import llguidance.numpy

from ops.bench.bench_structured import SCHEMAS
from schemas.config import default_target_model
from text.grammar import llg_tokenizer
from text.tokenizer import load_tokenizer

ANSWERS = [
    {"answer": "Paris is the capital of France.", "confidence": "high"},
    {"topics": ["history", "cooking", "travel"]},
    {"title": "A short guide", "author": {"name": "Ada", "expert": True}, "rating": 4},
    {"steps": [{"action": "boil water", "minutes": 5}, {"action": "add pasta", "minutes": 9}]},
    {"language": "english", "question": False, "summary": "A note about pointers in C."},
]


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(compile_one, mask_and_take, tokenizer) -> dict:
    """compile_one(schema) -> matcher; mask_and_take(matcher, token) computes the mask then takes token."""
    compile_ms, mask_us = [], []
    for schema, answer in zip(SCHEMAS, ANSWERS):
        started = time.perf_counter()
        matcher = compile_one(schema)
        compile_ms.append(1e3 * (time.perf_counter() - started))
        for token in tokenizer.encode(json.dumps(answer, separators=(",", ":"))):
            started = time.perf_counter()
            mask_and_take(matcher, token)
            mask_us.append(1e6 * (time.perf_counter() - started))
    return {"compile_ms": [round(ms, 2) for ms in compile_ms], "mask_us_median": round(statistics.median(mask_us), 1),
            "mask_us_max": round(max(mask_us), 1), "positions": len(mask_us), "rss_mb_after": round(rss_mb(), 1)}


def bench_llguidance(tokenizer, vocab_size: int) -> dict:
    started = time.perf_counter()
    llg = llg_tokenizer(tokenizer, vocab_size)
    setup_ms = 1e3 * (time.perf_counter() - started)
    bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
    options = {"whitespace_flexible": False}

    def mask_and_take(matcher, token):
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        assert matcher.consume_token(token), matcher.get_error()

    result = measure(lambda schema: llguidance.LLMatcher(llg, llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults=options)), mask_and_take, tokenizer)
    return {"tokenizer_setup_ms": round(setup_ms, 1), **result}


def bench_xgrammar(tokenizer, vocab_size: int) -> dict | None:
    try:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    started = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf),
                                                   vocab_size=vocab_size, stop_token_ids=list(tokenizer.eos_ids))
    compiler = xgrammar.GrammarCompiler(info)
    setup_ms = 1e3 * (time.perf_counter() - started)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def mask_and_take(matcher, token):
        matcher.fill_next_token_bitmask(bitmask)
        assert matcher.accept_token(token)

    result = measure(lambda schema: xgrammar.GrammarMatcher(compiler.compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(",", ":"))), mask_and_take, tokenizer)
    return {"tokenizer_setup_ms": round(setup_ms, 1), **result}


def main() -> None:
    target = default_target_model()
    tokenizer = load_tokenizer(target)
    vocab_size = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    print(json.dumps({"rss_mb_start": round(rss_mb(), 1), "llguidance": bench_llguidance(tokenizer, vocab_size),
                      "xgrammar": bench_xgrammar(tokenizer, vocab_size)}, indent=1))


if __name__ == "__main__":
    main()
