"""Time one target forward (`gpu_worker.runtime.model.forward`) of T new tokens at batch 1.

For each dtype and torch thread count: ms per forward appending T = 1, 2, 5, 9 tokens to a slot
holding a 128-token context (the slot is truncated back after each call, so every call sees the
same context), the median of --reps calls after a warm-up round, and its ratio to T = 1. The T
values are timed round-robin, so load from other processes on a shared machine skews no ratio.
Default model: SmolLM2-135M-Instruct when pulled, else the tiny target.

    PYTHONPATH=. .venv/bin/python ops/bench/bench_forward.py
    PYTHONPATH=. .venv/bin/python ops/bench/bench_forward.py --model models/tiny/target --reps 20

--clock cpu times the process's CPU seconds instead of wall time: on a machine shared with other
work it is far less noisy (with 2 threads it is the sum over both). To compare with another
version of the forward, run this file against that version's tree:
`PYTHONPATH=<other checkout> .venv/bin/python ops/bench/bench_forward.py --clock cpu`.
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

from gpu_worker.runtime.checkpoint import load_model
from gpu_worker.runtime.kv_cache import KVCache
from gpu_worker.runtime.model import forward
from schemas.config import TINY_TARGET, default_target_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def bench(model, config, tokens: list[int], context: int, reps: int, clock=time.perf_counter) -> dict[int, float]:
    """{T: median ms} of forwards appending T tokens to a `context`-token slot."""
    cache = KVCache(config, max_slots=1, max_seq_len=context + max(tokens),
                    dtype=model.embed.dtype)
    slot = cache.allocate()
    ids = torch.randint(0, config.vocab_size, (1, context + max(tokens)),
                        generator=torch.Generator().manual_seed(0))
    forward(model, cache, torch.tensor([slot]), ids[:, :context], torch.tensor([context]))
    times = {T: [] for T in tokens}
    for rep in range(reps + 1):
        for T in tokens:
            start = clock()
            forward(model, cache, torch.tensor([slot]), ids[:, context:context + T],
                    torch.tensor([T]))
            elapsed = clock() - start
            cache.truncate(slot, context)
            if rep:  # round 0 warms up (caches; oneDNN, where it serves, builds its kernel per row count)
                times[T].append(elapsed)
    return {T: statistics.median(t) * 1e3 for T, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    pulled = Path(default_target_model())
    parser.add_argument("--model", default=str(pulled if (pulled / "config.json").exists()
                                               else TINY_TARGET))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 5, 9])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall", help="wall time or process CPU time")
    args = parser.parse_args()

    print(f"{args.model}; torch {torch.__version__}; batch 1, {args.context}-token context; "
          f"median {args.clock} ms per forward of {args.reps} (ratio to T={args.tokens[0]})")
    print("| dtype | threads | " + " | ".join(f"T={T}" for T in args.tokens) + " |")
    print("|---|---|" + "---|" * len(args.tokens))
    for name in args.dtypes:
        model, config = load_model(args.model, dtype=DTYPES[name],
                                   max_seq_len=args.context + max(args.tokens))
        for threads in args.threads:
            torch.set_num_threads(threads)
            ms = bench(model, config, args.tokens, args.context, args.reps, CLOCKS[args.clock])
            cells = [f"{ms[T]:.1f} ({ms[T] / ms[args.tokens[0]]:.2f})" for T in args.tokens]
            print(f"| {name} | {threads} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
