"""Prompt lookup (`--draft-method ngram`) against plain decoding on an input-grounded workload.

    PYTHONPATH=. .venv/bin/python ops/bench/drafts/bench_ngram.py                 # SmolLM2, fp32, 12 prompts
    PYTHONPATH=. .venv/bin/python ops/bench/drafts/bench_ngram.py --prompts 4 --max-tokens 32   # a quick look

Workload: held-out ShareGPT conversations (services.commands.bench_serve_core.load_sharegpt, the
sha1(id) % 10 == 0 split), first human turn, kept when (INPUT_GROUNDED) its first or last 200
characters ask to fix, rewrite, rephrase, paraphrase, translate, refactor, convert, proofread,
improve, or correct / edit "this" / "the following" / "my", and it is 300-3000 characters long
(a given text or code block to work on); the first --prompts of them in file order, sent as a
one-turn chat (the target's chat template).

Runs through the real stack (services.launch.stack.Stack: nats-server, one process per
service; the drafter runs --draft-method ngram, no draft model), batch 1, greedy (--temperature:
sampled, Gumbel-coupled, seeded per prompt; --max-tree-nodes: the scheduler may ask trees), the
model's own ending (EOS) or --max-tokens. Per prompt, k=0 and then k=--k on the same prompt next
to each other in time (the cores are shared; load from other processes would otherwise decide
the ratio), prefix caching off (each run prefills its prompt). The outputs must be identical
(greedy, and Gumbel-coupled sampled: checked, exit 1 otherwise), so the offline replay below is
exact for both.

Printed per configuration: completion tokens, wall seconds, tokens/s (completion tokens / the
requests' end-to-end time, prefill included), decode tokens/s ((tokens - 1) / (end-to-end - time
to the first token): the part speculation can speed up), tokens per target step
(usage.completion_tokens / usage.steps, the prefill step included: k=0 gives 1.0), the draft
acceptance (accepted / proposed), and the ratios of k to k=0. Then `replay_table`: prompt lookup
replayed offline on the k=0 outputs at each ngram_min (greedy output does not depend on k, so
the drafts and their acceptance are exact; only the time is not measured). `--replay FILE`
prints that table for a saved --json result without running anything.
"""

import argparse
import asyncio
import dataclasses
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from gpu_worker.drafter.ngram import propose_ngram
from schemas.config import default_target_model
from services.client import make_request
from services.commands.bench_serve_core import first_exchange, load_sharegpt
from services.launch.stack import Stack, StackConfig

INPUT_GROUNDED = re.compile(r"\b(fix|rewrite|re-write|rephrase|paraphrase|translate|refactor|convert|proofread|improve"
                            r"|correct (?:this|the following|my|these|it)|edit (?:this|the following|my))\b", re.I)
MIN_CHARS, MAX_CHARS, ASK_WINDOW = 300, 3000, 200


def input_grounded_prompts(count: int) -> list[tuple[str, str]]:
    """(conversation id, first human turn) of the first `count` held-out conversations that pass
    the module docstring's filter."""
    found = []
    for conversation in load_sharegpt():
        exchange = first_exchange(conversation)
        if exchange is None:
            continue
        prompt = exchange[0]
        asks = INPUT_GROUNDED.search(prompt[:ASK_WINDOW]) or INPUT_GROUNDED.search(prompt[-ASK_WINDOW:])
        if asks and MIN_CHARS <= len(prompt) <= MAX_CHARS:
            found.append((str(conversation.get("id")), prompt))
        if len(found) == count:
            return found
    raise SystemExit(f"only {len(found)} held-out conversations pass the filter, {count} asked")


async def timed(client, request) -> dict:
    """One request streamed: its result figures and times."""
    start = time.perf_counter()
    first_at, token_ids, usage, prompt_ids = None, [], None, None
    async for chunk in client.stream(request):
        if len(chunk.token_ids) and first_at is None:
            first_at = time.perf_counter()
        if chunk.prompt_token_ids is not None:
            prompt_ids = chunk.prompt_token_ids.tolist()
        token_ids += chunk.token_ids.tolist()
        usage = chunk.usage or usage
    end = time.perf_counter()
    return {"prompt_token_ids": prompt_ids, "token_ids": token_ids, "e2e_s": end - start, "decode_s": end - (first_at or end),
            "steps": usage.steps, "proposed": usage.draft_tokens_proposed, "accepted": usage.draft_tokens_accepted}


def replay(prompt_ids: list[int], output_ids: list[int], k: int, max_n: int, min_n: int) -> dict:
    """Greedy speculation with prompt lookup replayed offline on a greedy output (which k does not
    change): per step the drafts from the history, the accepted ones (the common prefix with the
    output that follows), then one target token. Steps count the prefill step (it emits the
    first token), as usage.steps does."""
    history, position, steps, proposed, accepted = list(prompt_ids), 0, 0, 0, 0
    while position < len(output_ids):
        drafts = [] if position == 0 else propose_ngram(np.array(history), min(k, len(output_ids) - position - 1),
                                                        max_n, min_n)
        matched = 0
        while matched < len(drafts) and drafts[matched] == output_ids[position + matched]:
            matched += 1
        emitted = matched + 1
        history += output_ids[position:position + emitted]
        position += emitted
        steps, proposed, accepted = steps + 1, proposed + len(drafts), accepted + matched
    return {"steps": steps, "proposed": proposed, "accepted": accepted}


def totals(runs: list[dict]) -> dict:
    tokens = sum(len(r["token_ids"]) for r in runs)
    e2e_s, decode_s = sum(r["e2e_s"] for r in runs), sum(r["decode_s"] for r in runs)
    proposed, accepted = sum(r["proposed"] for r in runs), sum(r["accepted"] for r in runs)
    return {"tokens": tokens, "e2e_s": e2e_s, "tokens_per_s": tokens / e2e_s,
            "decode_tokens_per_s": (tokens - len(runs)) / decode_s if decode_s else 0.0,
            "tokens_per_step": tokens / sum(r["steps"] for r in runs),
            "acceptance": accepted / proposed if proposed else 0.0, "proposed": proposed, "accepted": accepted}


async def paired_runs(config: StackConfig, prompts: list[tuple[str, dict]], k: int, max_tokens: int,
                      json_path: Path | None = None, temperature: float = 0.0,
                      top_p: float = 1.0) -> dict[int, list[dict]]:
    """Through a stack of config, batch 1, greedy (or sampled at temperature, top_p, seeded by the
    prompt's index, Gumbel-coupled: the output does not depend on k either): each prompt (an id,
    make_request's prompt arguments) at k=0 and then at k, next to each other in time (the cores
    are shared); the `timed` figures of each run, by k. Kept in json_path as it goes. Prefix
    caching is off: the second run of a prompt would otherwise find the first one's prompt cached
    and skip its prefill, which is not speculation's doing."""
    runs: dict[int, list[dict]] = {0: [], k: []}
    async with Stack(dataclasses.replace(config, prefix_caching=False)) as stack, stack.client() as client:
        warm = make_request(messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0.0)
        await client.generate(warm)  # first-call costs (allocations, page faults) out of the figures
        for index, (prompt_id, prompt) in enumerate(prompts):
            for num_draft in (0, k):
                request = make_request(**prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                       seed=index if temperature else None, coupling="gumbel",
                                       num_speculative_tokens=num_draft, timeout_s=1800)
                runs[num_draft].append(await timed(client, request))
            plain, spec = runs[0][-1], runs[k][-1]
            same = plain["token_ids"] == spec["token_ids"]
            print(f"[{index + 1}/{len(prompts)}] {prompt_id}: {len(plain['token_ids'])} tokens, "
                  f"k=0 {plain['e2e_s']:.1f}s, k={k} {spec['e2e_s']:.1f}s "
                  f"({len(spec['token_ids']) / spec['steps']:.2f} tokens/step){'' if same else ' OUTPUT DIFFERS'}",
                  flush=True)
            if json_path:  # kept as it goes: a run cut short still leaves its prompts' figures
                json_path.write_text(json.dumps({"runs": {str(n): runs[n] for n in runs}}))
    return runs


def summary(runs: dict[int, list[dict]], k: int, **settings) -> dict:
    """The totals of k=0 and k, their ratios and whether every output was identical."""
    result = {**settings, "k": k, "k0": totals(runs[0]), "spec": totals(runs[k]),
              "runs": {str(n): runs[n] for n in runs},
              "identical": all(a["token_ids"] == b["token_ids"] for a, b in zip(runs[0], runs[k]))}
    result["ratio_tokens_per_s"] = result["spec"]["tokens_per_s"] / result["k0"]["tokens_per_s"]
    result["ratio_decode_tokens_per_s"] = result["spec"]["decode_tokens_per_s"] / result["k0"]["decode_tokens_per_s"]
    return result


async def bench(args: argparse.Namespace) -> dict:
    prompts = input_grounded_prompts(args.prompts)
    config = StackConfig(target_model=args.target_model, draft_method="ngram", dtype=args.dtype,
                         log_dir=args.log_dir or tempfile.mkdtemp(prefix="bench-ngram-"),
                         # batch 1 needs few slots; the default 64 x 2048 tokens is a 6 GB fp32 KV cache
                         role_args={"scheduler": ["--draft-timeout-s", "5", "--verify-timeout-s", "120",
                                                  "--max-tree-nodes", str(args.max_tree_nodes)],
                                    "verifier": ["--max-slots", "4"],
                                    "drafter": ["--max-slots", "4", "--ngram-max", str(args.ngram_max),
                                                "--ngram-min", str(args.ngram_min)]})
    runs = await paired_runs(config, [(cid, {"messages": [{"role": "user", "content": prompt}]})
                                      for cid, prompt in prompts], args.k, args.max_tokens, args.json,
                             args.temperature, args.top_p)
    return summary(runs, args.k, prompts=[cid for cid, _ in prompts], max_tokens=args.max_tokens, dtype=args.dtype,
                   ngram=[args.ngram_min, args.ngram_max], temperature=args.temperature, top_p=args.top_p,
                   max_tree_nodes=args.max_tree_nodes)


def report(result: dict, label: str = "ngram") -> str:
    k = result["k"]
    rows = [("k=0", result["k0"]), (f"k={k} {label}", result["spec"])]
    lines = ["| config | tokens | wall s | tokens/s | decode tokens/s | tokens/step | acceptance |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {name} | {r['tokens']} | {r['e2e_s']:.1f} | {r['tokens_per_s']:.2f} | {r['decode_tokens_per_s']:.2f} "
              f"| {r['tokens_per_step']:.2f} | {r['acceptance']:.2f} |" for name, r in rows]
    lines.append(f"ratio k={k} / k=0: tokens/s {result['ratio_tokens_per_s']:.2f}x, decode tokens/s "
                 f"{result['ratio_decode_tokens_per_s']:.2f}x; outputs identical: {result['identical']}")
    return "\n".join(lines)


def replay_table(runs: list[dict], k: int, max_n: int) -> str:
    """Prompt lookup replayed on the k=0 outputs (`replay`) at each ngram_min: what the drafts
    would give without the machine's timing noise. drafts/step is what the verifier pays for."""
    lines = [f"replayed on the k=0 outputs, k={k}, ngram_max={max_n}:",
             "| ngram_min | tokens/step | drafts/step | acceptance |", "|---|---|---|---|"]
    for min_n in range(1, max_n + 1):
        outs = [replay(r["prompt_token_ids"], r["token_ids"], k, max_n, min_n) for r in runs]
        steps, proposed = sum(o["steps"] for o in outs), sum(o["proposed"] for o in outs)
        accepted, tokens = sum(o["accepted"] for o in outs), sum(len(r["token_ids"]) for r in runs)
        lines.append(f"| {min_n} | {tokens / steps:.2f} | {proposed / steps:.2f} | {accepted / max(proposed, 1):.2f} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-model", default=default_target_model())
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--ngram-min", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy; else sampled, Gumbel-coupled (outputs still identical at every k)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-tree-nodes", type=int, default=0, help="the scheduler's (0: chains only)")
    parser.add_argument("--log-dir", default=None, help="the stack's logs (default: a new temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    parser.add_argument("--replay", type=Path, default=None,
                        help="no run: print the offline replay of the k=0 outputs in this --json file")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replay:
        print(replay_table(json.loads(args.replay.read_text())["runs"]["0"], args.k, args.ngram_max))
        return 0
    result = asyncio.run(bench(args))
    print(report(result))
    print(replay_table(result["runs"]["0"], args.k, args.ngram_max))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
