"""What `--weights int8` (weight-only int8: the dense weights quantized to Q8_0 blocks at load,
gpu_worker/runtime/quantized.py `quantize_q8_0`) changes against the same model unquantized, in
float32, on held-out ShareGPT chat prompts (the chat template, greedy):

- teacher-forced over the unquantized model's greedy output: how often the int8 model's argmax is
  the same token, and the mean KL(unquantized || int8) of the next-token distributions;
- free-running: how many of the int8 model's greedy outputs are the same token ids, and the mean
  number of tokens before the first difference;
- the bytes of weights a step reads and a one-token forward's ms after a 128-token context
  (bench_forward's `bench`: the median of --reps after a warm-up),
  against the unquantized model.

    PYTHONPATH=. .venv/bin/python ops/bench/kernels/bench_int8.py --prompts 8 --max-new 64

--weights int8dot measures the same for the GGUF blocks by int8 activation blocks and integer dot
products (llama.cpp's model of the file) against the float32 model of the same blocks (for
SmolLM2 its dense float32 weights are that model, bit for bit).

--model: any model directory with a chat template (default SmolLM2-135M-Instruct, whose dense
weights are the float32 values of its published Q4_1 blocks).
"""

import argparse
import statistics
from pathlib import Path

import torch

from gpu_worker.runtime.checkpoint import load_model
from gpu_worker.runtime.kv_cache import KVCache
from gpu_worker.runtime.model import forward
from ops.bench.kernels.bench_forward import bench, weight_bytes
from ops.train.train_eagle import sharegpt_prompts, speculative_greedy
from schemas.config import default_target_model
from text.tokenizer import load_tokenizer


def logits_over(model, config, sequence: list[int]) -> torch.Tensor:
    """Every position's next-token logits of one prefill over sequence: (len, V) float32."""
    cache = KVCache(config, max_slots=1, max_seq_len=len(sequence), dtype=torch.float32)
    slot = torch.tensor([cache.allocate()])
    return forward(model, cache, slot, torch.tensor([sequence]), torch.tensor([len(sequence)]))[0].float()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(default_target_model()))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--weights", choices=["int8", "int8dot"], default="int8")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    eos = tuple(tokenizer.eos_ids)
    dense, config = load_model(args.model, max_seq_len=2048)
    int8, _ = load_model(args.model, max_seq_len=2048, weights_format=args.weights)
    agree = kl = positions = same = 0
    prefix = []
    for prompt in sharegpt_prompts(tokenizer, args.prompts, 256, split="held_out"):
        out, _ = speculative_greedy(dense, config, None, prompt, args.max_new, 0, eos)
        quantized, _ = speculative_greedy(int8, config, None, prompt, args.max_new, 0, eos)
        same += quantized == out
        prefix.append(next((i for i, (a, b) in enumerate(zip(out, quantized)) if a != b), min(len(out), len(quantized))))
        sequence = prompt + out
        rows = slice(len(prompt) - 1, len(sequence) - 1)  # the positions that predict out's tokens
        p, q = (logits_over(m, config, sequence)[rows].log_softmax(-1) for m in (dense, int8))
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        kl += float((p.exp() * (p - q)).sum())
        positions += len(out)
    print(f"{Path(args.model).name}, float32, {args.threads} thread(s); {args.prompts} held-out ShareGPT prompts, "
          f"{args.max_new} greedy tokens; " + ("int8 = Q8_0 blocks quantized at load" if args.weights == "int8"
                                               else "int8dot = the GGUF blocks by integer dot products"))
    print("| weights | bytes a step | T=1 ms | top-1 agreement (teacher-forced) | mean KL | greedy outputs identical "
          "| mean tokens before the first difference |")
    print("|---|---|---|---|---|---|---|")
    print(f"| dense float32 | {weight_bytes(dense) / 1e6:.0f} MB | {bench(dense, config, [1], 128, args.reps)[1]:.1f} "
          f"| - | - | - | - |")
    print(f"| {args.weights} | {weight_bytes(int8) / 1e6:.0f} MB | {bench(int8, config, [1], 128, args.reps)[1]:.1f} "
          f"| {agree / positions:.4f} ({agree}/{positions}) | {kl / positions:.2e} | {same}/{args.prompts} "
          f"| {statistics.mean(prefix):.1f} |")


if __name__ == "__main__":
    main()
