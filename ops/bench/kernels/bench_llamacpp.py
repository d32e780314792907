"""specbus through the stack beside llama.cpp on the same GGUF file and the same cores, one run.

    PYTHONPATH=. .venv/bin/python ops/bench/kernels/bench_llamacpp.py --llama-python /tmp/llamavenv/bin/python

The decode rate at batch 1, greedy, of the default target on held-out chat questions in its chat
template (ops/train/distill_draft.py), the same token ids for both. Per prompt and engine: a warm-up
request, then the wall time of a request for --short + --tokens tokens minus that of one for
--short tokens (EOS ignored in both), so the prompt's prefill and a request's fixed costs cancel
(both timed requests find the prompt cached, in specbus's prefix cache and in llama.cpp's KV) and
what is left is --tokens decode steps; tokens/s = summed tokens / summed differences.

specbus: one Stack (nats-server and one process per service, as `specbus up`; --dtype / --weights
are the verifiers' and drafters' flags, default theirs) at k=0 and at the default speculation (the
request's own default k with the scheduler's adaptive k). llama.cpp: llama-cpp-python's `Llama`
over the GGUF file `specbus models pull` downloaded, at each --llama-threads, run in the
interpreter --llama-python names: llama-cpp-python compiles llama.cpp from source, so it is no
dependency of this project (`python3 -m venv /tmp/llamavenv && /tmp/llamavenv/bin/pip install
llama-cpp-python==0.3.36`, a few minutes). --llama-batch is its n_batch (prompt tokens per
forward); 1 by default because its batched prefill crashed on an Intel Xeon with AMX, and the
difference above leaves prefill out of the figure anyway. Its EOS and the target's are banned by
a logit bias.
Prints the figures and the ratios to llama.cpp's best thread count (ops/bench/RESULTS.md).
Without --llama-python only specbus runs, once per --weights value (e.g. `--weights gguf int8dot`:
the float32 model of the blocks against the integer one), its ratios to the first.
"""

import argparse
import asyncio
import json
import subprocess
import time

from ops.train.distill_draft import held_out_chat_prompts
from schemas.config import default_target_model
from services.client import make_request
from services.commands.models import source_gguf
from services.launch.stack import Stack, StackConfig
from services.runtime.logs import configure_logging
from text.tokenizer import load_tokenizer

REQUEST_TIMEOUT_S = 600.0
LLAMA_TIMEOUT_S = 1800.0

# Run by --llama-python with a job on stdin; prints {threads: [[short_s, long_s], ...]} per prompt.
LLAMA_CHILD = r"""
import json, sys, time
from llama_cpp import Llama
job = json.load(sys.stdin)
timings = {}
for threads in job["threads"]:
    llm = Llama(model_path=job["gguf"], n_ctx=job["n_ctx"], n_batch=job["n_batch"], n_threads=threads,
                n_threads_batch=threads, verbose=False)
    banned = {token: -1e9 for token in {*job["eos"], llm.token_eos()}}
    def timed(ids, tokens):
        start = time.perf_counter()
        result = llm.create_completion(ids, max_tokens=tokens, temperature=0.0, logit_bias=banned)
        assert result["usage"]["completion_tokens"] == tokens, result["usage"]
        return time.perf_counter() - start
    rows = []
    for ids in job["prompts"]:
        timed(ids, job["short"])
        rows.append([timed(ids, job["short"]), timed(ids, job["short"] + job["tokens"])])
    timings[threads] = rows
print(json.dumps(timings))
"""


def decode_rate(pairs: list[tuple[float, float]], tokens: int) -> float:
    """tokens/s of the decode steps between a short and a long request: pairs of (short_s, long_s)."""
    return tokens * len(pairs) / sum(long_s - short_s for short_s, long_s in pairs)


def llama_rates(python: str, prompts: list[list[int]], eos: list[int], args) -> dict[int, float]:
    """llama.cpp's decode rate at each of args.llama_threads, in a child interpreter."""
    job = {"gguf": str(source_gguf()), "prompts": prompts, "eos": eos, "threads": args.llama_threads,
           "n_ctx": max(map(len, prompts)) + args.short + args.tokens + 8, "n_batch": args.llama_batch,
           "short": args.short, "tokens": args.tokens}
    done = subprocess.run([python, "-c", LLAMA_CHILD], input=json.dumps(job), capture_output=True, text=True,
                          timeout=LLAMA_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp child exited {done.returncode}: {done.stderr[-2000:]}")
    timings = json.loads(done.stdout.strip().splitlines()[-1])
    return {int(threads): decode_rate(rows, args.tokens) for threads, rows in timings.items()}


async def specbus_rates(prompts: list[list[int]], args, weights: str | None) -> dict[str, float]:
    """The stack's decode rate at k=0 ("k=0") and at the request's default speculation ("default")."""
    config = StackConfig(dtype=args.dtype, weights=weights)
    ks = {"k=0": 0, "default": None}
    async with Stack(config) as stack, stack.client() as client:
        async def timed(prompt: list[int], tokens: int, k: int | None) -> float:
            request = make_request(prompt, max_tokens=tokens, temperature=0.0, ignore_eos=True,
                                   num_speculative_tokens=k, timeout_s=REQUEST_TIMEOUT_S)
            start = time.perf_counter()
            result = await client.generate(request)
            assert result.usage.completion_tokens == tokens, result.usage
            return time.perf_counter() - start

        pairs: dict[str, list[tuple[float, float]]] = {name: [] for name in ks}
        for prompt in prompts:
            for name, k in ks.items():
                await timed(prompt, args.short, k)
                pairs[name].append((await timed(prompt, args.short, k),
                                    await timed(prompt, args.short + args.tokens, k)))
    return {name: decode_rate(rows, args.tokens) for name, rows in pairs.items()}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-python", help="an interpreter with llama-cpp-python installed (none: specbus only)")
    parser.add_argument("--llama-threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--llama-batch", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128, help="decode steps timed per prompt")
    parser.add_argument("--short", type=int, default=32, help="tokens of the request subtracted")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--weights", nargs="+", default=[None], help="one stack run per value")
    args = parser.parse_args()
    configure_logging(level="warning")
    if source_gguf() is None:
        raise SystemExit("no GGUF file: run `specbus models pull` first")
    tokenizer = load_tokenizer(default_target_model())
    prompts = held_out_chat_prompts(tokenizer, args.prompts)
    llama = llama_rates(args.llama_python, prompts, list(tokenizer.eos_ids), args) if args.llama_python else {}
    ours = {weights: await specbus_rates(prompts, args, weights) for weights in args.weights}
    best = max(llama.values()) if llama else ours[args.weights[0]]["k=0"]
    against = "llama.cpp's best" if llama else f"specbus k=0, weights {args.weights[0] or 'default'}"
    print(f"{source_gguf().name}; {args.prompts} held-out chat prompts, {args.tokens} greedy decode steps each "
          f"(requests of {args.short + args.tokens} minus {args.short} tokens), batch 1; specbus dtype "
          f"{args.dtype or 'default'}")
    print(f"| engine | tokens/s | / {against} |")
    print("|---|---|---|")
    for threads, rate in llama.items():
        print(f"| llama.cpp, {threads} thread{'s' if threads > 1 else ''} | {rate:.1f} | {rate / best:.2f}x |")
    for weights, rates in ours.items():
        for name, rate in rates.items():
            print(f"| specbus {name}, weights {weights or 'default'} | {rate:.1f} | {rate / best:.2f}x |")


if __name__ == "__main__":
    asyncio.run(main())
