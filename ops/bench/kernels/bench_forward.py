"""Time one target forward (`gpu_worker.runtime.model.forward`) of T new tokens at batch 1.

For each weight format (float32, bfloat16, gguf: the GGUF blocks as stored with float32
activations, where the model directory has them; int8: the dense weights as Q8_0 blocks, a
changed model; int8dot: the GGUF blocks by int8 activation blocks and integer dot products,
llama.cpp's model of the file) and torch thread count: ms per forward appending T = 1, 2, 5, 9 tokens to a slot
holding a 128-token context (the slot is truncated back after each call, so every call sees the
same context), the median of --reps calls after a warm-up round, and its ratio to T = 1. The T
values are timed round-robin, so load from other processes on a shared machine skews no ratio.
Last column: the bytes of weights a T=1 step reads over its time, against the machine's copy
bandwidth at the same threads (a 256 MiB torch copy, bytes read plus written per second, by
the same clock).
Default model: SmolLM2-135M-Instruct when pulled, else the tiny target.

    PYTHONPATH=. .venv/bin/python ops/bench/kernels/bench_forward.py
    PYTHONPATH=. .venv/bin/python ops/bench/kernels/bench_forward.py --model models/tiny/target --reps 20
    PYTHONPATH=. .venv/bin/python ops/bench/kernels/bench_forward.py --formats int8dot --projections --clock cpu

--clock cpu times the process's CPU seconds instead of wall time: on a machine shared with other
work it is far less noisy (with 2 threads it is the sum over both). To compare with another
version of the forward, run this file against that version's tree:
`PYTHONPATH=<other checkout> .venv/bin/python ops/bench/kernels/bench_forward.py --clock cpu`.
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

from gpu_worker.runtime.checkpoint import load_model
from gpu_worker.runtime.kv_cache import KVCache
from gpu_worker.runtime.model import forward
from gpu_worker.runtime.quantized import IntWeight, QuantizedWeight, block_linear, has_blocks
from schemas.config import TINY_TARGET, default_target_model

# name -> (activation dtype, weights format)
FORMATS = {"float32": (torch.float32, "dense"), "bfloat16": (torch.bfloat16, "dense"), "gguf": (torch.float32, "gguf"),
           "int8": (torch.float32, "int8"), "int8dot": (torch.float32, "int8dot")}


def weight_bytes(model) -> int:
    """Bytes of the projection weights and lm_head one step reads (the embedding: a row a token)."""
    def size(w):
        if isinstance(w, IntWeight):  # the file's bytes (its padding rows are never read)
            return w.rows * w.packed.shape[1] // 16
        return w.blocks.numel() if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()
    layers = sum(size(w) for layer in model.layers for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down))
    return layers + size(model.lm_head)


def copy_bandwidth(threads: int, size: int = 256 << 20, reps: int = 5, clock=time.perf_counter) -> float:
    """Bytes read plus written per second by a torch copy of `size` bytes at this thread count (per
    CPU second with the cpu clock: the forward's own measure on a shared machine)."""
    torch.set_num_threads(threads)
    src, dst = torch.ones(size // 4), torch.empty(size // 4)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src), clock) for _ in range(reps))
    return 2 * size / best


def _timed(fn, clock=time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def bench(model, config, tokens: list[int], context: int | list[int], reps: int,
          clock=time.perf_counter) -> dict[int, float]:
    """{T: median ms} of forwards appending T tokens to a `context`-token slot, or with a list of
    contexts, to a batch of one slot per context (rows of several lengths)."""
    contexts = [context] if isinstance(context, int) else list(context)
    B, longest = len(contexts), max(contexts) + max(tokens)
    cache = KVCache(config, max_slots=B, max_seq_len=longest, dtype=model.embed.dtype)
    slots = torch.tensor([cache.allocate() for _ in contexts])
    ids = torch.randint(0, config.vocab_size, (B, longest), generator=torch.Generator().manual_seed(0))
    for b, n in enumerate(contexts):
        forward(model, cache, slots[b:b + 1], ids[b:b + 1, :n], torch.tensor([n]))
    times = {T: [] for T in tokens}
    for rep in range(reps + 1):
        for T in tokens:
            new = torch.stack([ids[b, n:n + T] for b, n in enumerate(contexts)])
            start = clock()
            forward(model, cache, slots, new, torch.full((B,), T))
            elapsed = clock() - start
            for slot, n in zip(slots.tolist(), contexts):
                cache.truncate(slot, n)
            if rep:  # round 0 warms up (caches; oneDNN, where it serves, builds its kernel per row count)
                times[T].append(elapsed)
    return {T: statistics.median(t) * 1e3 for T, t in times.items()}


def projections(model, tokens: list[int], reps: int, clock=time.perf_counter) -> dict[int, float]:
    """{T: median ms} of the projections alone (each layer's four and lm_head, as a forward calls
    them, on random rows): a forward's time less this is the work around the weights."""
    weights = [w for layer in model.layers for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
    weights.append(model.lm_head)
    times = {T: [] for T in tokens}
    for rep in range(reps + 1):
        for T in tokens:
            xs = [torch.randn(T, w.shape[1]) for w in weights]
            start = clock()
            for x, w in zip(xs, weights):
                block_linear(x, w)
            if rep:
                times[T].append(clock() - start)
    return {T: statistics.median(t) * 1e3 for T, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    pulled = Path(default_target_model())
    parser.add_argument("--model", default=str(pulled if (pulled / "config.json").exists()
                                               else TINY_TARGET))
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS),
                        help="weight formats (gguf, int8dot: skipped where the model has no GGUF blocks)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 5, 9])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall", help="wall time or process CPU time")
    parser.add_argument("--projections", action="store_true",
                        help="also time the block formats' projections alone at each T (random rows)")
    args = parser.parse_args()

    print(f"{args.model}; torch {torch.__version__}; batch 1, {args.context}-token context; "
          f"median {args.clock} ms per forward of {args.reps} (ratio to T={args.tokens[0]})")
    copy = {threads: copy_bandwidth(threads, clock=CLOCKS[args.clock]) for threads in args.threads}
    print(f"copy bandwidth ({args.clock} clock): " + ", ".join(f"{t} threads {copy[t] / 1e9:.1f} GB/s" for t in args.threads))
    print("| weights | threads | " + " | ".join(f"T={T}" for T in args.tokens) + " | weights read at T=1 |")
    print("|---|---|" + "---|" * len(args.tokens) + "---|")
    for name in args.formats:
        dtype, weights = FORMATS[name]
        if weights in ("gguf", "int8dot") and not has_blocks(args.model):
            print(f"| {name} | | {args.model} has no GGUF blocks |")
            continue
        model, config = load_model(args.model, dtype=dtype, max_seq_len=args.context + max(args.tokens),
                                   weights_format=weights)
        for threads in args.threads:
            torch.set_num_threads(threads)
            ms = bench(model, config, args.tokens, args.context, args.reps, CLOCKS[args.clock])
            cells = [f"{ms[T]:.1f} ({ms[T] / ms[args.tokens[0]]:.2f})" for T in args.tokens]
            rate = weight_bytes(model) / (ms[args.tokens[0]] / 1e3)
            read = f"{weight_bytes(model) / 1e6:.0f} MB, {rate / 1e9:.1f} GB/s ({rate / copy[threads]:.0%} of copy)"
            print(f"| {name} | {threads} | " + " | ".join(cells) + f" | {read} |", flush=True)
            if args.projections and weights in ("gguf", "int8", "int8dot"):
                ms = projections(model, args.tokens, args.reps, CLOCKS[args.clock])
                cells = [f"{ms[T]:.1f} ({ms[T] / ms[args.tokens[0]]:.2f})" for T in args.tokens]
                print(f"| {name}, projections only | {threads} | " + " | ".join(cells) + " | |", flush=True)


if __name__ == "__main__":
    main()
