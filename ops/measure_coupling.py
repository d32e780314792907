"""Acceptance of Gumbel-max coupling against rejection sampling on a real pair.

Starts a stack (default: SmolLM2-135M-Instruct and the shipped draft), sends the first turns of
held-out ShareGPT conversations as chats, sampled (temperature 0.8, top-p 0.95, seeded), k=4,
once with `coupling: "rejection"` and once with `"gumbel"`, and prints draft tokens accepted per
proposed for each, and whether every gumbel run equals its k=0 run (drafter invariance).

    PYTHONPATH=. .venv/bin/python ops/measure_coupling.py --prompts 8 --max-tokens 48
"""

import argparse
import asyncio

from schemas.config import DEFAULT_DRAFT, default_target_model
from services.client import make_request
from services.commands.bench_serve_core import first_exchange, load_sharegpt
from services.launch.stack import Stack, StackConfig


def held_out_prompts(count: int) -> list[str]:
    prompts = []
    for conversation in load_sharegpt():
        exchange = first_exchange(conversation)  # load_sharegpt keeps the held-out split only
        if exchange is not None and len(exchange[0]) < 1500:
            prompts.append(exchange[0])
        if len(prompts) == count:
            break
    return prompts


async def measure(args) -> None:
    config = StackConfig(target_model=args.target_model, draft_model=args.draft_model, dtype=args.dtype,
                         role_args={"scheduler": ["--draft-timeout-s", "30"]})
    prompts = held_out_prompts(args.prompts)
    async with Stack(config) as stack, stack.client(idle_timeout_s=300) as client:
        def request(prompt, seed, k, coupling):
            return make_request(messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens,
                                temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True, num_speculative_tokens=k,
                                draft_mode="sample", coupling=coupling, timeout_s=600)

        for coupling in ("rejection", "gumbel"):
            proposed = accepted = same = 0
            for i, prompt in enumerate(prompts):
                result = await client.generate(request(prompt, 100 + i, 4, coupling))
                proposed += result.usage.draft_tokens_proposed
                accepted += result.usage.draft_tokens_accepted
                if coupling == "gumbel":
                    plain = await client.generate(request(prompt, 100 + i, 0, coupling))
                    same += plain.token_ids == result.token_ids
            rate = accepted / proposed if proposed else 0.0
            line = f"{coupling:9s}: {accepted}/{proposed} draft tokens accepted = {rate:.3f}"
            if coupling == "gumbel":
                line += f"; k=4 == k=0 for {same}/{len(prompts)} prompts"
            print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-model", default=str(default_target_model()))
    parser.add_argument("--draft-model", default=str(DEFAULT_DRAFT))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    asyncio.run(measure(parser.parse_args()))


if __name__ == "__main__":
    main()
