"""Adaptive speculation length through a real stack: k=4 against k=0, batch 1, for a model
pair and the same pair with a useless draft (its embedding rows shuffled, so nothing it proposes
is accepted), with the scheduler's adaptive_k on and off.

    PYTHONPATH=. .venv/bin/python ops/bench/drafts/bench_adaptive_k.py --pair tiny           # models/tiny (run time: ops/bench/RESULTS.md)
    PYTHONPATH=. .venv/bin/python ops/bench/drafts/bench_adaptive_k.py --pair smollm2        # the default pair (pulled)

Per stack (one per draft and adaptive setting): --warmup requests first (the scheduler measures its
step costs on its first steps, services/scheduler/drafts/adaptive_k.py), then per prompt a k=0 request and
a k=4 request, alternating which goes first, one at a time; tokens/s = completion tokens / summed
request wall time of that k. Prints per stack tokens/s at k=0 and k=4, their ratio, the acceptance
and the speculative lengths the k=4 requests ran with (usage.speculative_lengths, summed).
Prompts: --prompt-tokens tokens of held-out stdlib files (tiny), held-out chat questions (smollm2).
Greedy unless --temperature (then seeded per prompt, the same seed at k=0 and k=4, --top-p, and
--coupling, default the server's, "gumbel": adaptive k serves rejection-sampled rows their k as asked,
docs/PROTOCOL.md#adaptive-k).
"""

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from text.tokenizer import load_tokenizer
from ops.bench.bench_pipeline import held_out_prompts
from ops.train.distill_draft import held_out_chat_prompts
from schemas.config import DEFAULT_DRAFT, TINY_DRAFT, TINY_TARGET, default_target_model
from services.client import make_request
from services.launch.stack import Stack, StackConfig
from services.runtime.logs import configure_logging

EMBEDDING = "model.embed_tokens.weight"
REQUEST_TIMEOUT_S = 600.0


def write_useless_draft(draft_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    """A copy of draft_dir whose embedding rows (tied to its output head) are shuffled: same
    tokenizer, vocabulary and cost as the draft, proposals the target (almost) never accepts."""
    shutil.copytree(draft_dir, out_dir)
    for path in out_dir.glob("*.safetensors"):
        tensors = load_file(path)
        if EMBEDDING in tensors:
            order = torch.randperm(tensors[EMBEDDING].shape[0], generator=torch.Generator().manual_seed(seed))
            tensors[EMBEDDING] = tensors[EMBEDDING][order].contiguous()
            save_file(tensors, path, metadata={"format": "pt"})
            return out_dir
    raise ValueError(f"{draft_dir}: no {EMBEDDING} in its safetensors files")


async def run_stack(target: str, draft: str, adaptive: bool, prompts: list[list[int]], max_tokens: int,
                    warmup: int, dtype: str, draft_dtype: str | None = None, temperature: float = 0.0,
                    top_p: float = 1.0, coupling: str | None = None) -> dict:
    role_args = {"scheduler": ["--adaptive-k", str(adaptive).lower(), "--draft-timeout-s", "5",
                               "--max-tokens-cap", "4096"]}
    if draft_dtype:
        role_args["drafter"] = ["--dtype", draft_dtype]
    # prefix caching off: the k=0 and k=4 runs of a prompt would otherwise share one prefill
    config = StackConfig(target_model=target, draft_model=draft, dtype=dtype, role_args=role_args, prefix_caching=False)
    totals = {k: {"tokens": 0, "wall_s": 0.0, "proposed": 0, "accepted": 0, "lengths": []} for k in (0, 4)}
    async with Stack(config) as stack, stack.client() as client:
        async def one(prompt, k, seed=0):
            request = make_request(prompt, max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                                   top_p=top_p, seed=seed if temperature else None, coupling=coupling,
                                   num_speculative_tokens=k, timeout_s=REQUEST_TIMEOUT_S)
            start = time.perf_counter()
            result = await client.generate(request)
            return result, time.perf_counter() - start

        for i in range(warmup):
            await one(prompts[i % len(prompts)], 4)
            await one(prompts[i % len(prompts)], 0)
        for index, prompt in enumerate(prompts):
            for k in ((0, 4) if index % 2 == 0 else (4, 0)):
                result, wall_s = await one(prompt, k, seed=index)
                total, usage = totals[k], result.usage
                total["tokens"] += usage.completion_tokens
                total["wall_s"] += wall_s
                total["proposed"] += usage.draft_tokens_proposed
                total["accepted"] += usage.draft_tokens_accepted
                lengths = total["lengths"]
                lengths += [0] * (len(usage.speculative_lengths) - len(lengths))
                for j, count in enumerate(usage.speculative_lengths):
                    lengths[j] += count
    rate = {k: t["tokens"] / t["wall_s"] for k, t in totals.items()}
    four = totals[4]
    return {"k0_tokens_per_s": rate[0], "k4_tokens_per_s": rate[4], "ratio": rate[4] / rate[0],
            "acceptance": four["accepted"] / four["proposed"] if four["proposed"] else 0.0,
            "speculative_lengths": four["lengths"]}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2, help="k=4 and k=0 requests per stack before measuring")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--draft-dtype", default=None, help="the drafter's --dtype (default: --dtype)")
    parser.add_argument("--adaptive", choices=("both", "on", "off"), default="both")
    parser.add_argument("--drafts", choices=("both", "shipped", "useless"), default="both")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--coupling", choices=("rejection", "gumbel"), default=None,
                        help="default: the request's default (gumbel)")
    args = parser.parse_args()
    configure_logging(level="warning")
    target, draft = (TINY_TARGET, TINY_DRAFT) if args.pair == "tiny" else (default_target_model(), DEFAULT_DRAFT)
    tokenizer = load_tokenizer(target)
    prompts = held_out_prompts(target, args.prompts, args.prompt_tokens) if args.pair == "tiny" \
        else held_out_chat_prompts(tokenizer, args.prompts)
    settings = {"both": (True, False), "on": (True,), "off": (False,)}[args.adaptive]
    coupling = args.coupling or "default (gumbel)"
    print(f"pair {args.pair}, dtype {args.dtype}, draft dtype {args.draft_dtype or args.dtype}, {args.prompts} "
          f"prompts x {args.max_tokens} tokens, "
          f"{f'temperature {args.temperature}, top-p {args.top_p}, coupling {coupling}' if args.temperature else 'greedy'}, "
          f"batch 1, "
          f"{args.warmup} warm-up pairs per stack")
    print("| draft | adaptive_k | k=0 tok/s | k=4 tok/s | k=4 / k=0 | acceptance | k=4 speculative_lengths |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        useless = write_useless_draft(Path(draft), Path(scratch) / "useless-draft")
        for name, draft_dir in (("shipped", draft), ("useless", useless)):
            if args.drafts not in ("both", name):
                continue
            for adaptive in settings:
                row = await run_stack(str(target), str(draft_dir), adaptive, prompts, args.max_tokens, args.warmup,
                                      args.dtype, args.draft_dtype, args.temperature, args.top_p, args.coupling)
                print(f"| {name} | {'on' if adaptive else 'off'} | {row['k0_tokens_per_s']:.1f} | "
                      f"{row['k4_tokens_per_s']:.1f} | {row['ratio']:.2f}x | {row['acceptance']:.2f} | "
                      f"{row['speculative_lengths']} |", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
