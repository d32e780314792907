"""Where a step goes through the stack: per decode step at batch 1, the wall
time, the verifier's and drafter's batch time (the model thread's work: forwards, sampling,
acceptance), and the CPU time of every process of the stack (nats-server, scheduler, verifier,
drafter, postprocessor and this client), for each k.

The stack is started once (services.launch.stack.Stack: its own nats-server and one process per
service, threads per role by its rule unless --verifier-threads / --drafter-threads give them,
adaptive k off so that every step drafts k). Then, --rounds times, every k in turn: --prompts
greedy requests one after another (exactly --max-tokens tokens each, ignore_eos), with each
process's CPU seconds (/proc/<pid>/stat utime + stime) and the model services' $SRV.STATS read
before and after. A step is a chunk the client received (one per scheduler step of the request).

Reading the table: `verifier batch` and `drafter batch` are the model thread's time in the
service's handler (its batch_seconds); `around` = wall - both: the bus both ways, each service's
Python outside the model thread (decode, validate, encode), the scheduler's planning and commit,
and waiting for a core. CPU per process per step over wall per step above 1 for a model service
means its torch threads spin (OpenMP) while another process needs the core. Default model pair:
the pulled SmolLM2-135M-Instruct with the shipped draft, chat prompts; `--target-model
models/tiny/target --draft-model models/tiny/draft` is the tiny pair (stdlib windows);
`--input-grounded` sends bench_ngram's prompts (for `--draft-method ngram`). Prefix caching is
off (the rounds repeat the prompts).

    PYTHONPATH=. .venv/bin/python ops/bench/kernels/bench_step.py
    PYTHONPATH=. .venv/bin/python ops/bench/kernels/bench_step.py --target-model models/tiny/target --draft-model models/tiny/draft
"""

import argparse
import asyncio
import json
import os
import time
from collections import defaultdict
from pathlib import Path

from ops.bench.bench_gateway import cpu_s
from ops.bench.bench_pipeline import held_out_prompts
from ops.bench.drafts.bench_ngram import input_grounded_prompts
from ops.train.distill_draft import chat_ids, held_out_chat_prompts
from schemas.config import DEFAULT_DRAFT, TINY_TARGET, default_target_model
from schemas.draft_kinds import DEFAULT_DRAFT_METHOD, DRAFT_METHODS
from services.client import make_request
from services.launch.stack import Stack, StackConfig, role_threads, usable_cores
from text.tokenizer import load_tokenizer

MODEL_ROLES = ("verifier", "drafter")
CPU_COLUMNS = ("nats-server", "scheduler", "verifier", "drafter", "postprocessor", "client")


def process_ids(stack: Stack) -> dict[str, int]:
    """{column: pid} of the stack's processes (one instance per role) and this client."""
    pids = {process.role: process.process.pid for process in stack.processes.values()}
    return {"nats-server": stack.server.process.pid, **pids, "client": os.getpid()}


async def batch_seconds(stack: Stack) -> dict[str, float]:
    """{role: seconds its model thread has spent in batches so far} from $SRV.STATS."""
    seconds = {}
    for role in MODEL_ROLES:
        msg = await stack.nc.request(f"$SRV.STATS.{role}", b"", timeout=10.0)
        seconds[role] = sum(float(e.get("data", {}).get("batch_seconds_sum", 0.0)) for e in json.loads(msg.data)["endpoints"])
    return seconds


async def run_requests(client, requests: list) -> tuple[int, int]:
    """Every request in turn (batch 1): (tokens, steps) received."""
    tokens = steps = 0
    for request in requests:
        async for chunk in client.stream(request):
            if chunk.error is not None:
                raise RuntimeError(f"request {chunk.request_id} failed: {chunk.error.code}: {chunk.error.message}")
            tokens, steps = tokens + len(chunk.token_ids), steps + 1
    return tokens, steps


async def measure(stack: Stack, client, requests: list, totals: dict) -> None:
    """Run requests once, adding wall, tokens, steps, CPU and batch seconds to totals."""
    pids = process_ids(stack)
    cpu_before, batch_before = {n: cpu_s(p) for n, p in pids.items()}, await batch_seconds(stack)
    start = time.perf_counter()
    tokens, steps = await run_requests(client, requests)
    totals["wall"] += time.perf_counter() - start
    batch_after = await batch_seconds(stack)
    for name, pid in pids.items():
        totals[f"cpu {name}"] += cpu_s(pid) - cpu_before[name]
    for role in MODEL_ROLES:
        totals[f"{role} batch"] += batch_after[role] - batch_before[role]
    totals["tokens"] += tokens
    totals["steps"] += steps


def row(k: int, totals: dict) -> list[str]:
    steps = totals["steps"]
    ms = {key: 1e3 * value / steps for key, value in totals.items() if key not in ("tokens", "steps")}
    around = ms["wall"] - ms["verifier batch"] - ms["drafter batch"]
    return [str(k), f"{totals['tokens'] / totals['wall']:.1f}", f"{totals['tokens'] / steps:.2f}", f"{ms['wall']:.2f}",
            f"{ms['verifier batch']:.2f}", f"{ms['drafter batch']:.2f}", f"{around:.2f}",
            *(f"{ms.get('cpu ' + name, 0.0):.2f}" for name in CPU_COLUMNS)]


def table(rows: list[list[str]]) -> str:
    headers = ["k", "tokens/s", "tokens/step", "wall ms/step", "verifier batch", "drafter batch", "around",
               *(f"CPU {name}" for name in CPU_COLUMNS)]
    return "\n".join("| " + " | ".join(r) + " |" for r in [headers, ["---"] * len(headers), *rows])


async def run(args: argparse.Namespace) -> str:
    tiny = Path(args.target_model).resolve() == Path(TINY_TARGET).resolve()
    if args.input_grounded:
        tokenizer = load_tokenizer(args.target_model)
        prompts = [chat_ids(tokenizer, prompt) for _, prompt in input_grounded_prompts(args.prompts)]
    elif tiny:
        prompts = held_out_prompts(args.target_model, args.prompts, 64)
    else:
        prompts = held_out_chat_prompts(load_tokenizer(args.target_model), args.prompts)
    config = StackConfig(target_model=args.target_model, draft_model=args.draft_model, draft_method=args.draft_method,
                         log_level="warning", dtype=args.dtype, prefix_caching=False,
                         verifier_threads=args.verifier_threads, drafter_threads=args.drafter_threads,
                         role_args={"scheduler": ["--adaptive-k", "false",
                                                  "--max-tree-nodes", str(args.max_tree_nodes)]})
    totals = {k: defaultdict(float) for k in args.ks}
    async with Stack(config) as stack:
        async with stack.client() as client:
            for k in args.ks:  # a warm-up request per k (first forwards, allocations)
                await run_requests(client, [make_request(prompts[0], max_tokens=8, temperature=0.0,
                                                         num_speculative_tokens=k, timeout_s=600)])
            for _ in range(args.rounds):
                for k in args.ks:  # k in turn, so load from elsewhere hits every k alike
                    requests = [make_request(p, max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0,
                                             num_speculative_tokens=k, timeout_s=600) for p in prompts]
                    await measure(stack, client, requests, totals[k])
    threads = ", ".join(f"{role} {role_threads(role, config, usable_cores())}" for role in MODEL_ROLES)
    return f"torch threads: {threads}\n" + table([row(k, totals[k]) for k in args.ks])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-model", default=default_target_model())
    parser.add_argument("--draft-model", default=str(DEFAULT_DRAFT))
    parser.add_argument("--draft-method", choices=DRAFT_METHODS, default=DEFAULT_DRAFT_METHOD,
                        help="the drafter's: the draft model, the shipped EAGLE head over the target's features, "
                             "or prompt lookup")
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 4])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--input-grounded", action="store_true",
                        help="ops/bench/drafts/bench_ngram.py's prompts (a text to fix, rewrite, translate) as chats")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tree-nodes", type=int, default=0, help="the scheduler's: every k > 0 step asks a tree")
    parser.add_argument("--verifier-threads", type=int, default=0, help="0: the stack's rule (role_threads)")
    parser.add_argument("--drafter-threads", type=int, default=0, help="0: the stack's rule (role_threads)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    draft = args.draft_model if args.draft_method == DEFAULT_DRAFT_METHOD else args.draft_method
    print(f"{args.target_model} + {draft}; greedy, batch 1, {args.prompts} prompts x {args.max_tokens} "
          f"tokens x {args.rounds} rounds; ms per step (a chunk the client received); CPU ms per step per process")
    print(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
