"""Threads per role and idle memory: specbus through the stack against transformers, one run.

    PYTHONPATH=. .venv/bin/python ops/bench/kernels/bench_threads.py                       # run time: ops/bench/RESULTS.md
    PYTHONPATH=. .venv/bin/python ops/bench/kernels/bench_threads.py --verifier-threads 1 2 --ks 0 4 --prompts 6

1. memory: the first stack (`specbus up` defaults: gateway included, verifier threads from the
   machine) idle after start: resident memory (RSS) and proportional share (PSS, shared pages
   split between the processes mapping them) of every process: nats-server, scheduler,
   verifier, drafter, postprocessor, gateway; then the same after one request.
2. threads: one stack per --verifier-threads value (drafter threads from the machine), all
   started before any is measured. Per held-out chat prompt (ops/train/distill_draft.py), greedy,
   exactly --max-tokens tokens, batch 1: transformers `generate` in each of --hf-dtypes at each
   of --hf-threads, then every stack at every k in --ks, so load from other processes on a shared
   machine hits every configuration alike. tokens/s = completion tokens / summed wall time;
   the ratio to transformers' best dtype.
"""

import argparse
import asyncio
import time
from pathlib import Path

import torch

from text.tokenizer import load_tokenizer
from ops.train.distill_draft import held_out_chat_prompts
from schemas.config import DEFAULT_DRAFT, default_target_model
from services.client import make_request
from services.launch.stack import Stack, StackConfig, role_threads, usable_cores

REQUEST_TIMEOUT_S = 600.0


def proc_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of pid in KiB."""
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    pss = next((int(line.split()[1]) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
                if line.startswith("Pss:")), 0)
    return rss, pss


def stack_memory(stack: Stack) -> list[tuple[str, int, int]]:
    """(name, RSS MiB, PSS MiB) of the stack's nats-server and every service process."""
    pids = {"nats-server": stack.server.process.pid}
    pids.update({instance_id: p.process.pid for instance_id, p in stack.processes.items() if p.running})
    rows = []
    for name, pid in pids.items():
        rss, pss = proc_kib(pid)
        rows.append((name, rss // 1024, pss // 1024))
    return rows


def print_memory(title: str, rows: list[tuple[str, int, int]]) -> None:
    print(f"\n{title}\n| process | RSS MiB | PSS MiB |\n|---|---|---|")
    for name, rss, pss in rows:
        print(f"| {name} | {rss} | {pss} |")
    print(f"| total | {sum(r[1] for r in rows)} | {sum(r[2] for r in rows)} |")


def hf_generate(model, prompt: list[int], max_tokens: int) -> tuple[int, float]:
    eos = model.generation_config.eos_token_id
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         min_new_tokens=max_tokens, do_sample=False,
                         pad_token_id=eos[0] if isinstance(eos, list) else eos)
    return out.shape[1] - ids.shape[1], time.perf_counter() - start


async def stack_generate(client, prompt: list[int], max_tokens: int, k: int) -> tuple[int, float]:
    request = make_request(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                           num_speculative_tokens=k, timeout_s=REQUEST_TIMEOUT_S)
    start = time.perf_counter()
    result = await client.generate(request)
    return len(result.token_ids), time.perf_counter() - start


async def main(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    cores = usable_cores()
    tokenizer = load_tokenizer(args.target_model)
    prompts = held_out_chat_prompts(tokenizer, args.prompts)
    print(f"cores {cores}, torch {torch.__version__}, prompts {len(prompts)} (mean {sum(map(len, prompts)) / len(prompts):.0f} "
          f"tokens), {args.max_tokens} tokens each, greedy, batch 1")
    if args.memory_only:
        args.verifier_threads = args.verifier_threads[:1]
    configs = [StackConfig(target_model=args.target_model, draft_model=args.draft_model, gateways=1 if i == 0 else 0,
                           verifier_threads=threads, log_level="warning")
               for i, threads in enumerate(args.verifier_threads)]
    stacks = []
    try:
        for config in configs:
            stacks.append(await Stack(config).start())
        await asyncio.sleep(args.idle_s)
        print_memory(f"idle stack (specbus up defaults, verifier threads {role_threads('verifier', configs[0], cores)}, "
                     f"drafter threads {role_threads('drafter', configs[0], cores)})", stack_memory(stacks[0]))
        clients = [await stack.client().__aenter__() for stack in stacks]
        for client in clients:  # warm-up
            await stack_generate(client, prompts[0], 4, 0)
        print_memory("the same stack after one request (its slot released)", stack_memory(stacks[0]))
        if args.memory_only:
            return
        models = {name: AutoModelForCausalLM.from_pretrained(args.target_model, dtype=dtype).eval()
                  for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)) if name in args.hf_dtypes}
        for model in models.values():
            hf_generate(model, prompts[0], 4)
        totals: dict[str, list[float]] = {}

        def add(name, tokens, wall):
            totals.setdefault(name, [0, 0.0])
            totals[name][0] += tokens
            totals[name][1] += wall

        for index, prompt in enumerate(prompts):
            for name, model in models.items():
                for threads in args.hf_threads:
                    torch.set_num_threads(threads)
                    add(f"transformers {name}, {threads} threads", *hf_generate(model, prompt, args.max_tokens))
            for config, client in zip(configs, clients):
                for k in args.ks:
                    name = f"specbus k={k}, verifier threads {role_threads('verifier', config, cores)}"
                    add(name, *await stack_generate(client, prompt, args.max_tokens, k))
            print(f"prompt {index + 1}/{len(prompts)} done", flush=True)
        best = max(tokens / wall for name, (tokens, wall) in totals.items() if name.startswith("transformers"))
        print("\n| run | tokens | wall s | tokens/s | / transformers best |\n|---|---|---|---|---|")
        for name, (tokens, wall) in totals.items():
            print(f"| {name} | {int(tokens)} | {wall:.1f} | {tokens / wall:.2f} | {tokens / wall / best:.2f} |")
        for client in clients:
            await client.__aexit__(None, None, None)
    finally:
        for stack in stacks:
            await stack.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-model", default=default_target_model())
    parser.add_argument("--draft-model", default=str(DEFAULT_DRAFT))
    parser.add_argument("--verifier-threads", type=int, nargs="+", default=[0, 1],
                        help="one stack per value (0: from the machine)")
    parser.add_argument("--ks", type=int, nargs="+", default=[0])
    parser.add_argument("--hf-threads", type=int, nargs="+", default=[usable_cores()])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--memory-only", action="store_true", help="section 1 only (one stack)")
    parser.add_argument("--hf-dtypes", nargs="+", default=["float32", "bfloat16"])
    asyncio.run(main(parser.parse_args()))
