"""EAGLE drafts (`--draft-method eagle`) against plain decoding, through the served path.

    PYTHONPATH=. .venv/bin/python ops/bench/drafts/bench_eagle.py                  # SmolLM2 + models/smollm2-eagle, fp32
    PYTHONPATH=. .venv/bin/python ops/bench/drafts/bench_eagle.py --prompts 2 --max-tokens 16   # a quick look

Workload: ops/train/train_eagle.py `eval`'s, so the figures compare with models/smollm2-eagle/eval.json:
the first human turn of held-out ShareGPT conversations (the sha1(id) % 10 == 0 split, which the
head never trained on; seeded order), in the target's chat template, at most --max-prompt tokens,
sent as token ids; greedy (--temperature: sampled, Gumbel-coupled, seeded per prompt), up to
--max-tokens, ending at the model's EOS. --max-tree-nodes N: the scheduler asks trees of N nodes
as deep as k (every step with adaptive k off; where it expects them to pay with it on), which the
head answers as EAGLE-2 trees (gpu_worker/runtime/eagle.py `draft_tree`).

Runs through the real stack (services.launch.stack.Stack: nats-server, one process per service;
the drafter runs --draft-method eagle with --eagle-head, the verifier returns the target's
features with every step), batch 1; per prompt k=0 and then k=--k next to each other in time (the
cores are shared). The scheduler's adaptive k is off unless --adaptive-k: every step drafts k, as
the offline eval does. The outputs must be identical (checked: exit 1 otherwise).

Printed (ops/bench/drafts/bench_ngram.py's table): completion tokens, wall seconds, tokens/s, decode
tokens/s, tokens per target step (usage.completion_tokens / usage.steps, the prefill step
included: k=0 gives 1.0), the draft acceptance, the ratios of k to k=0; then decode tokens per
step ((tokens - 1) / (steps - 1): the prefill left out, as the offline eval counts them).
"""

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from text.tokenizer import load_tokenizer
from ops.bench.drafts.bench_ngram import paired_runs, report, summary
from ops.train.train_eagle import sharegpt_prompts
from schemas.config import DEFAULT_EAGLE_HEAD, default_target_model
from services.launch.stack import StackConfig


def decode_tokens_per_step(runs: list[dict]) -> float:
    """Tokens per target step after the prefill (which emits the first token)."""
    return sum(len(r["token_ids"]) - 1 for r in runs) / max(1, sum(r["steps"] - 1 for r in runs))


async def bench(args: argparse.Namespace) -> dict:
    tokenizer = load_tokenizer(args.target_model)
    prompts = sharegpt_prompts(tokenizer, args.prompts, args.max_prompt)
    config = StackConfig(target_model=args.target_model, draft_method="eagle", eagle_head=args.eagle_head,
                         dtype=args.dtype, log_dir=args.log_dir or tempfile.mkdtemp(prefix="bench-eagle-"),
                         # batch 1 needs few slots; the default 64 x 2048 tokens is a 6 GB fp32 KV cache
                         role_args={"scheduler": ["--draft-timeout-s", "5", "--verify-timeout-s", "120",
                                                  "--adaptive-k", str(args.adaptive_k).lower(),
                                                  "--max-tree-nodes", str(args.max_tree_nodes)],
                                    "verifier": ["--max-slots", "4"], "drafter": ["--max-slots", "4"]})
    runs = await paired_runs(config, [(f"held-out-{i}", {"prompt": ids}) for i, ids in enumerate(prompts)], args.k,
                             args.max_tokens, args.json, args.temperature, args.top_p)
    result = summary(runs, args.k, prompts=len(prompts), max_tokens=args.max_tokens, dtype=args.dtype,
                     head=str(args.eagle_head), adaptive_k=args.adaptive_k, temperature=args.temperature,
                     top_p=args.top_p, max_tree_nodes=args.max_tree_nodes)
    result["decode_tokens_per_step"] = {"k0": decode_tokens_per_step(runs[0]),
                                        "spec": decode_tokens_per_step(runs[args.k])}
    return result


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-model", default=default_target_model())
    parser.add_argument("--eagle-head", default=str(DEFAULT_EAGLE_HEAD))
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--adaptive-k", action="store_true", help="the scheduler's adaptive k on (default off)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-tree-nodes", type=int, default=0,
                        help="the scheduler's (0: chains only); the head answers EAGLE-2 trees of that many nodes")
    parser.add_argument("--log-dir", default=None, help="the stack's logs (default: a new temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = asyncio.run(bench(args))
    print(report(result, label="eagle"))
    steps = result["decode_tokens_per_step"]
    print(f"decode tokens per target step (prefill left out): k=0 {steps['k0']:.3f}, k={args.k} {steps['spec']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
