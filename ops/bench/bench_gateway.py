"""The OpenAI gateway's overhead: tokens/s through HTTP (the official `openai` SDK, streaming)
against the NATS client (services/client.py) on the same stack, at each --batches concurrency.

    PYTHONPATH=. .venv/bin/python ops/bench/bench_gateway.py            # run times: ops/bench/RESULTS.md

One stack (services.launch.stack.Stack: nats-server, one process per service, one gateway), the tiny
pair by default. Every request: a --prompt-tokens-long prompt from --prompts code prompts, greedy,
k=--k, exactly --max-tokens tokens (ignore_eos), streamed. A run keeps `batch` requests in flight
(a new one sent as soon as one finishes) until --requests have finished; tokens/s = completion
tokens / wall time. The two paths alternate run by run (--rounds each, which goes first swapping
every round), so load from other processes on the shared cores falls on both; the ratio is gateway / NATS of the summed tokens and
times. The shared cores make wall-clock ratios noisy, so the run also reports what the gateway
costs whatever the load: CPU time (/proc/<pid>/stat) per 1000 tokens of the gateway process, of
the other service processes (the pipeline), and of the bench process itself (the SDK's SSE parsing
against the NATS client's decoding). On a machine the pipeline keeps busy, tokens/s goes as
1 / CPU per token, so `cpu ratio` = NATS path CPU / gateway path CPU is what the ratio tends to.
Prints a table and writes --out (JSON).
"""

import argparse
import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import openai

from schemas.config import TINY_DRAFT, TINY_TARGET
from services.client import Client, make_request
from services.launch.stack import Stack, StackConfig

PROMPTS = (
    "import os\nimport sys\n\n\ndef main(argv=None):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def read_lines(path, encoding='utf-8'):\n    with open(path, encoding=encoding) as f:\n",
    "for index, value in enumerate(values):\n    if value is None:\n",
)


async def nats_request(client: Client, prompt: str, args: argparse.Namespace) -> int:
    request = make_request(prompt, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                           num_speculative_tokens=args.k, timeout_s=300.0)
    tokens = 0
    async for chunk in client.stream(request):
        tokens += len(chunk.token_ids)
    return tokens


async def http_request(api: openai.AsyncOpenAI, model: str, prompt: str, args: argparse.Namespace) -> int:
    stream = await api.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens, temperature=0.0,
                                          stream=True, stream_options={"include_usage": True},
                                          extra_body={"ignore_eos": True, "num_speculative_tokens": args.k})
    tokens = 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(send: Callable[[str], Awaitable[int]], batch: int, num_requests: int) -> tuple[int, float]:
    """(completion tokens, wall seconds) of num_requests requests, batch of them in flight."""
    queue = list(range(num_requests))
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while queue:
            index = queue.pop()
            done = await send(PROMPTS[index % len(PROMPTS)])  # not `tokens += await ...`: it reads tokens first
            tokens += done

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(batch)))
    return tokens, time.perf_counter() - started


async def bench(args: argparse.Namespace) -> dict:
    config = StackConfig(target_model=str(args.target_model), draft_model=str(args.draft_model), gateways=1,
                         role_args={"scheduler": ["--draft-timeout-s", "5"]})
    results = {"settings": {k: str(v) for k, v in vars(args).items()}, "batches": {}}
    async with Stack(config) as stack, stack.client() as client:
        api = openai.AsyncOpenAI(base_url=stack.openai_base_url, api_key=stack.api_key(), max_retries=0, timeout=300)
        model = (await api.models.list()).data[0].id
        paths = {"nats": lambda prompt: nats_request(client, prompt, args),
                 "gateway": lambda prompt: http_request(api, model, prompt, args)}
        for send in paths.values():  # warm-up: first requests pay for allocations and imports
            await run(send, 2, 2)
        gateway_pid = stack.by_role("gateway")[0].process.pid
        pipeline_pids = [p.process.pid for p in stack.processes.values() if p.role != "gateway"]
        for batch in args.batches:
            totals = {name: {"tokens": 0, "wall_s": 0.0, "gateway_cpu_s": 0.0, "bench_cpu_s": 0.0,
                             "pipeline_cpu_s": 0.0} for name in paths}
            for round_index in range(args.rounds):
                order = list(paths.items()) if round_index % 2 == 0 else list(paths.items())[::-1]
                for name, send in order:
                    cpu_before = cpu_s(gateway_pid), cpu_s(os.getpid()), sum(map(cpu_s, pipeline_pids))
                    tokens, wall_s = await run(send, batch, max(args.requests, batch))
                    total = totals[name]
                    total["tokens"] += tokens
                    total["wall_s"] += wall_s
                    total["gateway_cpu_s"] += cpu_s(gateway_pid) - cpu_before[0]
                    total["bench_cpu_s"] += cpu_s(os.getpid()) - cpu_before[1]
                    total["pipeline_cpu_s"] += sum(map(cpu_s, pipeline_pids)) - cpu_before[2]
            rates = {name: t["tokens"] / t["wall_s"] for name, t in totals.items()}
            cpu_ms = {name: {part: 1e6 * t[f"{part}_cpu_s"] / t["tokens"] for part in ("pipeline", "gateway", "bench")}
                      for name, t in totals.items()}  # per 1000 tokens
            cpu_ratio = sum(cpu_ms["nats"].values()) / sum(cpu_ms["gateway"].values())
            results["batches"][batch] = {"nats_tokens_per_s": rates["nats"], "gateway_tokens_per_s": rates["gateway"],
                                         "ratio": rates["gateway"] / rates["nats"], "cpu_ratio": cpu_ratio,
                                         "cpu_ms_per_1k_tokens": cpu_ms, "totals": totals}
            print(f"batch {batch:>3}: NATS client {rates['nats']:7.1f} tokens/s, gateway {rates['gateway']:7.1f} "
                  f"tokens/s, ratio {rates['gateway'] / rates['nats']:.3f}; CPU ms per 1000 tokens (pipeline / "
                  f"gateway / client): NATS path {cpu_ms['nats']['pipeline']:.0f} / - / {cpu_ms['nats']['bench']:.0f}, "
                  f"gateway path {cpu_ms['gateway']['pipeline']:.0f} / {cpu_ms['gateway']['gateway']:.0f} / "
                  f"{cpu_ms['gateway']['bench']:.0f}, cpu ratio {cpu_ratio:.3f}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target-model", type=Path, default=TINY_TARGET)
    parser.add_argument("--draft-model", type=Path, default=TINY_DRAFT)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=16, help="requests per run (at least the batch)")
    parser.add_argument("--rounds", type=int, default=4, help="runs per path and batch, alternating")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("ops/bench/results/gateway.json"))
    args = parser.parse_args()
    results = asyncio.run(bench(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
