"""Measure the shipped model pair with specbus's own runtime, and show the target writing code.

    python ops/train/measure_models.py [--target models/tiny/target] [--draft models/tiny/draft]

Prints (and writes to models/measure.json):
- median ms of one draft forward of 1 token and one target forward of 5 tokens, both after a
  cache of `--context` tokens, and their ratio (the draft's cost budget: at most 0.15);
- the size of the weight files;
- the target's greedy continuation of the start of a held-out standard-library file.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_models import TINY, read_text, source_files  # noqa: E402

from gpu_worker.runtime.checkpoint import load_model  # noqa: E402
from gpu_worker.runtime.kv_cache import KVCache  # noqa: E402
from gpu_worker.runtime.model import forward  # noqa: E402
from text.tokenizer import load_tokenizer  # noqa: E402


def forward_ms(path: Path, context: int, num_tokens: int, repeats: int, dtype=torch.float32) -> float:
    """Median wall ms of one forward of num_tokens new tokens after `context` cached ones."""
    model, config = load_model(path, dtype=dtype)
    cache = KVCache(config, max_slots=1, max_seq_len=context + num_tokens + 1, dtype=dtype)
    slot = torch.tensor([cache.allocate()])
    prompt = torch.randint(0, config.vocab_size, (1, context))
    forward(model, cache, slot, prompt, torch.tensor([context]), logits_index=torch.tensor([[context - 1]]))
    new = torch.randint(0, config.vocab_size, (1, num_tokens))
    times = []
    for _ in range(repeats):
        cache.truncate(int(slot), context)
        start = time.perf_counter()
        forward(model, cache, slot, new, torch.tensor([num_tokens]))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def greedy_continuation(path: Path, prompt_ids: list[int], max_new: int) -> list[int]:
    model, config = load_model(path)
    cache = KVCache(config, max_slots=1, max_seq_len=len(prompt_ids) + max_new + 1)
    slot = torch.tensor([cache.allocate()])
    tokens = torch.tensor([prompt_ids])
    logits = forward(model, cache, slot, tokens, torch.tensor([len(prompt_ids)]),
                     logits_index=torch.tensor([[len(prompt_ids) - 1]]))
    out = []
    for _ in range(max_new):
        next_id = int(logits[0, -1].argmax())
        out.append(next_id)
        logits = forward(model, cache, slot, torch.tensor([[next_id]]), torch.tensor([1]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=TINY / "target")
    parser.add_argument("--draft", type=Path, default=TINY / "draft")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=160)
    args = parser.parse_args()
    draft_ms = forward_ms(args.draft, args.context, 1, args.repeats)
    target_ms = forward_ms(args.target, args.context, 5, args.repeats)
    sizes = {p.parent.name + "/" + p.name: p.stat().st_size
             for d in (args.target, args.draft) for p in sorted(d.glob("*.safetensors"))}
    result = {
        "threads": torch.get_num_threads(),
        "context": args.context,
        "draft_1_token_ms": round(draft_ms, 3),
        "target_5_tokens_ms": round(target_ms, 3),
        "cost_ratio": round(draft_ms / target_ms, 3),
        "weight_bytes": sizes,
        "weight_mb_total": round(sum(sizes.values()) / 1e6, 2),
    }
    print(json.dumps(result, indent=2))
    (args.target.parent / "measure.json").write_text(json.dumps(result, indent=2) + "\n")

    tokenizer = load_tokenizer(args.target)
    _, held_out = source_files()
    source = read_text(held_out[0])
    prompt_ids = tokenizer.encode(source[:600])
    completion = greedy_continuation(args.target, prompt_ids, args.new_tokens)
    print(f"\n--- greedy continuation of {held_out[0].name} (held out), prompt then model ---")
    print(tokenizer.decode(prompt_ids), end="")
    print("\033[1m" + tokenizer.decode(completion) + "\033[0m" if sys.stdout.isatty()
          else "<<<MODEL>>>" + tokenizer.decode(completion))


if __name__ == "__main__":
    main()
