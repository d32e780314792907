"""Record what a fixed set of requests returns through a real stack, to compare two commits byte for byte.

    PYTHONPATH=<checkout> python ops/record_outputs.py OUT.jsonl [--dtype float32|bfloat16]

A refactor that must change no bit is checked by recording at the commit before and after it and
comparing the files (`cmp`). The stack is the tiny pair (models/tiny) with the default scheduler;
the requests cover greedy and seeded sampling at k=0 and k=4, Gumbel and rejection coupling,
logprobs, sampling masks, prompt logprobs (the side channel), penalties, prompt lookup, the
suffix index, trees and grammars (a JSON schema, a regex). Per request, every chunk's fields are
concatenated; what depends on timing (chunk boundaries, from_draft, usage, scheduler ids,
degraded reasons) is left out.
"""

import argparse
import asyncio
import hashlib
import json
import tempfile

from schemas.config import TINY_DRAFT, TINY_TARGET
from services.client import make_request
from services.launch.stack import Stack, StackConfig

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "count": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "count"], "additionalProperties": False}
JOINED = ("token_ids", "logprobs", "sampling_masks")  # per-token fields: concatenated over chunks
LAST = ("finish_reason", "prompt_token_ids", "prompt_logprobs", "error")  # once per request


def requests() -> list[dict]:
    """The recorded requests' make_request options, in order."""
    prompts = [[5 + i, 17, 33 + 2 * i, 90, 4 + i] for i in range(4)] + [list(range(40, 72))]
    out = []
    for i, prompt in enumerate(prompts):
        common = dict(prompt=prompt, ignore_eos=True)
        for k in (0, 4):
            out.append(dict(common, max_tokens=24, num_speculative_tokens=k, temperature=0.0))
            out.append(dict(common, max_tokens=24, num_speculative_tokens=k, temperature=0.9, seed=100 + i,
                            logprobs=3, sampling_mask=True))
            out.append(dict(common, max_tokens=16, num_speculative_tokens=k, temperature=0.7, top_p=0.9, seed=7,
                            coupling="rejection", draft_mode="sample", prompt_logprobs=2))
            out.append(dict(common, max_tokens=16, num_speculative_tokens=k, temperature=0.0, repetition_penalty=1.3,
                            logprobs=1))
        out.append(dict(common, max_tokens=20, num_speculative_tokens=4, draft_method="ngram", temperature=0.0))
        out.append(dict(common, max_tokens=20, num_speculative_tokens=6, temperature=0.8, seed=3))
        out.append(dict(common, max_tokens=20, num_speculative_tokens=4, draft_method="suffix", temperature=0.0))
        for k in (0, 4):
            out.append(dict(common, max_tokens=40, num_speculative_tokens=k, temperature=0.0,
                            structured_outputs={"json": SCHEMA}, logprobs=2))
            out.append(dict(common, max_tokens=40, num_speculative_tokens=k, temperature=0.8, seed=11 + i,
                            structured_outputs={"regex": "[a-z]{2,6}( [0-9]{1,3}){1,4}"}, repetition_penalty=1.2))
    return out


async def record(dtype: str) -> list[str]:
    """One JSON line per request of requests(), through a fresh stack in this dtype."""
    lines = []
    with tempfile.TemporaryDirectory() as logs:
        config = StackConfig(target_model=str(TINY_TARGET), draft_model=str(TINY_DRAFT), dtype=dtype, log_dir=logs)
        async with Stack(config) as stack, stack.client() as client:
            for i, options in enumerate(requests()):
                found = {"i": i, "text": "", **{name: [] for name in JOINED}, **{name: None for name in LAST}}
                async for chunk in client.stream(make_request(**options)):
                    fields = chunk.model_dump(mode="json")
                    found["text"] += fields["text"]
                    for name in JOINED:
                        found[name] += fields[name] or []
                    found |= {name: fields[name] for name in LAST if fields[name] is not None}
                lines.append(json.dumps(found, sort_keys=True))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    text = "\n".join(asyncio.run(record(args.dtype))) + "\n"
    with open(args.out, "w") as file:
        file.write(text)
    print(args.out, text.count("\n"), "requests, sha256", hashlib.sha256(text.encode()).hexdigest())


if __name__ == "__main__":
    main()
