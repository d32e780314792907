"""Structured outputs on the default stack, batch 1, through the gateway with the openai SDK:
held-out ShareGPT chat prompts, each with a JSON schema of SCHEMAS in turn (objects, arrays,
enums, nested objects, required fields), greedy, run as free text at k=0, under the schema at
k=0 and under the schema at k (the default speculation, forced tokens included), one prompt
after the other with the three runs of a prompt back to back (so machine noise hits all three
alike). Then each prompt once more in JSON mode (json_object) at k.

Prints: the share of schema outputs that parse and validate (jsonschema), of json_object outputs
that parse, whether k and k=0 gave the same tokens under each schema, and per run kind tokens/s
end to end (completion tokens / request wall time) and decoding (after the first token), with
the ratios of the decode rates: grammar overhead = schema k=0 / free k=0, speculation = schema
k / schema k=0. Streams, as a chat client does. --out writes it all as JSON.

    PYTHONPATH=. .venv/bin/python ops/bench/bench_structured.py --prompts 50
"""

import argparse
import asyncio
import json
import time
from pathlib import Path

import jsonschema
import openai

from schemas.config import DEFAULT_DRAFT, default_target_model
from services.commands.bench_serve_core import load_sharegpt, sample_sharegpt
from services.launch.stack import Stack, StackConfig
from text.tokenizer import load_tokenizer

SCHEMAS = [
    {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 100},
                                      "confidence": {"enum": ["low", "medium", "high"]}},
     "required": ["answer", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"topics": {"type": "array", "items": {"type": "string", "maxLength": 40},
                                                 "minItems": 1, "maxItems": 3}},
     "required": ["topics"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60},
                                      "author": {"type": "object",
                                                 "properties": {"name": {"type": "string", "maxLength": 40},
                                                                "expert": {"type": "boolean"}},
                                                 "required": ["name", "expert"], "additionalProperties": False},
                                      "rating": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["title", "author", "rating"], "additionalProperties": False},
    {"type": "object", "properties": {"steps": {"type": "array", "maxItems": 4, "items": {
        "type": "object", "properties": {"action": {"type": "string", "maxLength": 60},
                                         "minutes": {"type": "integer", "minimum": 0, "maximum": 600}},
        "required": ["action", "minutes"], "additionalProperties": False}}},
     "required": ["steps"], "additionalProperties": False},
    {"type": "object", "properties": {"language": {"enum": ["english", "spanish", "french", "german", "other"]},
                                      "question": {"type": "boolean"},
                                      "summary": {"type": "string", "maxLength": 120}},
     "required": ["language", "question", "summary"], "additionalProperties": False},
]


async def one(api, model: str, prompt: str, k: int, max_tokens: int, response_format: dict | None) -> dict:
    """One streamed greedy chat request: its text, tokens (logprobs), and times."""
    kwargs = {"response_format": response_format} if response_format else {}
    started = time.perf_counter()
    first = None
    text, tokens, usage, finish, speculation = [], [], None, None, {}
    stream = await api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=max_tokens,
        logprobs=True, stream=True, stream_options={"include_usage": True},
        extra_body={"num_speculative_tokens": k}, **kwargs)
    async for chunk in stream:
        if chunk.usage is not None:
            usage, speculation = chunk.usage, (chunk.model_extra or {}).get("speculation") or {}
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.perf_counter()
                text.append(choice.delta.content)
            if choice.logprobs and choice.logprobs.content:
                tokens += [t.token for t in choice.logprobs.content]
            finish = choice.finish_reason or finish
    ended = time.perf_counter()
    return {"text": "".join(text), "tokens": tokens, "completion_tokens": usage.completion_tokens,
            "seconds": ended - started, "decode_s": ended - (first or ended), "finish_reason": finish,
            "steps": speculation.get("steps"), "draft_tokens_accepted": speculation.get("draft_tokens_accepted"),
            "draft_tokens_proposed": speculation.get("draft_tokens_proposed")}


def schema_format(schema: dict, index: int) -> dict:
    return {"type": "json_schema", "json_schema": {"name": f"answer{index % len(SCHEMAS)}", "schema": schema,
                                                   "strict": True}}


def rate(runs: list[dict]) -> float:
    """Completion tokens per second of request wall time."""
    return sum(r["completion_tokens"] for r in runs) / sum(r["seconds"] for r in runs)


def decode_rate(runs: list[dict]) -> float:
    """Tokens after the first per second after the first: the decode speed, without the prefill
    (a schema's outputs are shorter than free text, so end-to-end rates would weigh it more)."""
    return sum(r["completion_tokens"] - 1 for r in runs) / sum(r["decode_s"] for r in runs)


def valid(text: str, schema: dict | None) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if schema is None:
        return isinstance(value, dict)
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


async def bench(args: argparse.Namespace) -> dict:
    tokenizer = load_tokenizer(args.target_model)
    samples = sample_sharegpt(load_sharegpt(), tokenizer.encode, args.prompts, args.seed)
    prompts = [s.prompt + "\n\nAnswer in JSON." for s in samples]
    config = StackConfig(target_model=str(args.target_model), draft_model=str(args.draft_model), gateways=1,
                         drafters=args.drafters, log_dir=args.log_dir)
    runs = {"free_k0": [], "schema_k0": [], "schema_k": [], "object_k": []}
    async with Stack(config) as stack:
        api = openai.AsyncOpenAI(base_url=stack.openai_base_url, api_key=stack.api_key(), max_retries=0, timeout=600)
        model = (await api.models.list()).data[0].id
        await one(api, model, "Hello", 0, 4, None)  # warm-up
        for i, prompt in enumerate(prompts):
            schema = SCHEMAS[i % len(SCHEMAS)]
            runs["free_k0"].append(await one(api, model, prompt, 0, args.max_tokens, None))
            runs["schema_k0"].append(await one(api, model, prompt, 0, args.max_tokens, schema_format(schema, i)))
            runs["schema_k"].append(await one(api, model, prompt, args.k, args.max_tokens, schema_format(schema, i)))
            print(f"{i + 1}/{len(prompts)} schema {i % len(SCHEMAS)}: {runs['schema_k'][-1]['text'][:100]!r}",
                  flush=True)
        for prompt in prompts:
            runs["object_k"].append(await one(api, model, prompt, args.k, args.max_tokens, {"type": "json_object"}))
    schema_of = [SCHEMAS[i % len(SCHEMAS)] for i in range(len(prompts))]
    summary = {
        "prompts": len(prompts), "k": args.k, "max_tokens": args.max_tokens,
        "schema_valid": sum(valid(r["text"], s) for r, s in zip(runs["schema_k"], schema_of)),
        "schema_k0_valid": sum(valid(r["text"], s) for r, s in zip(runs["schema_k0"], schema_of)),
        "object_parses": sum(valid(r["text"], None) for r in runs["object_k"]),
        "object_length_cut": sum(r["finish_reason"] == "length" for r in runs["object_k"]),
        "identical_k_k0": sum(a["tokens"] == b["tokens"] for a, b in zip(runs["schema_k"], runs["schema_k0"])),
        "tokens_per_s": {name: rate(r) for name, r in runs.items()},
        "decode_tokens_per_s": {name: decode_rate(r) for name, r in runs.items()},
    }
    summary["tokens_per_step"] = {name: sum(x["completion_tokens"] for x in r) / max(1, sum(x["steps"] or 0 for x in r))
                                  for name, r in runs.items()}
    decode = summary["decode_tokens_per_s"]
    summary["grammar_overhead"] = decode["schema_k0"] / decode["free_k0"]
    summary["speculation"] = decode["schema_k"] / decode["schema_k0"]
    summary["speculation_end_to_end"] = summary["tokens_per_s"]["schema_k"] / summary["tokens_per_s"]["schema_k0"]
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-model", default=default_target_model())
    parser.add_argument("--draft-model", default=str(DEFAULT_DRAFT))
    parser.add_argument("--drafters", type=int, default=1, help="0: speculation by forced tokens alone")
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--out", default=None)
    summary = asyncio.run(bench(parser.parse_args()))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
