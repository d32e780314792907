"""The sampling pipeline's steps 2-5 (top-k / top-p / min-p, `sampler.select_candidates`) on the
target's own logits: the candidate set sizes, and the cost with the ranked window against
ranking the whole vocabulary.

    PYTHONPATH=. .venv/bin/python ops/bench/kernels/bench_sampling.py                  # SmolLM2, 4 prompts
    PYTHONPATH=. .venv/bin/python ops/bench/kernels/bench_sampling.py --top-p 0.9 --top-k 50

Logits: the first human turns of --prompts held-out ShareGPT conversations (the chat template, at
most 300 tokens), --max-new tokens sampled by transformers' `generate` at --temperature / --top-p
(the positions a sampled request reads). Per configuration the mean time of `select_candidates`
per position, positions taken one at a time (a decode step) and five at a time (a k=4 verify),
window RANK_WINDOW against the whole vocabulary in the same run; then K's median, 90th percentile,
maximum and the share of positions whose K is past the window (ranked whole).
"""

import argparse
import statistics
import time

import torch

from gpu_worker.sampling.sampler import RANK_WINDOW, SamplingTensors, scale_logits, select_candidates
from ops.train.train_eagle import sharegpt_prompts
from schemas.config import default_target_model
from text.tokenizer import load_tokenizer


def sampled_logits(model, prompt: list[int], max_new: int, temperature: float, top_p: float) -> torch.Tensor:
    """(1, n, V) float32 logits of the positions of a sampled continuation."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=True, temperature=temperature,
                         top_p=top_p, output_logits=True, return_dict_in_generate=True)
    return torch.stack(out.logits, 1).float()


def per_call_ms(scaled: torch.Tensor, params: SamplingTensors, window: int, group: int) -> float:
    """Mean ms of select_candidates over scaled (1, n, V), `group` positions a call."""
    start, calls = time.perf_counter(), 0
    for i in range(0, scaled.shape[1] - group + 1, group):
        select_candidates(scaled[:, i:i + group], params, window=window)
        calls += 1
    return (time.perf_counter() - start) / calls * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)  # generate's draws
    from transformers import AutoModelForCausalLM

    path = default_target_model()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    params = SamplingTensors.build([args.temperature], top_k=[args.top_k], top_p=[args.top_p])
    sizes, times = [], {}
    for prompt in sharegpt_prompts(load_tokenizer(path), args.prompts, 300):
        scaled = scale_logits(sampled_logits(model, list(prompt), args.max_new, args.temperature, args.top_p),
                              params.temperature)
        sizes += select_candidates(scaled, params, window=scaled.shape[-1])[1].flatten().tolist()
        for window in (RANK_WINDOW, scaled.shape[-1]):
            for group in (1, 5):
                times.setdefault((window, group), []).append(per_call_ms(scaled, params, window, group))
    V = scaled.shape[-1]
    print(f"temperature {args.temperature}, top-p {args.top_p}, top-k {args.top_k}, {len(sizes)} positions, "
          f"{args.threads} threads")
    print("| positions a call | window 256 ms | whole vocabulary ms | ratio |\n|---|---|---|---|")
    for group in (1, 5):
        fast, whole = statistics.mean(times[RANK_WINDOW, group]), statistics.mean(times[V, group])
        print(f"| {group} | {fast:.2f} | {whole:.2f} | {whole / fast:.1f}x |")
    sizes.sort()
    print(f"K: median {statistics.median(sizes)}, 90th percentile {sizes[int(0.9 * len(sizes))]}, max {sizes[-1]}, "
          f"past the window {sum(k >= RANK_WINDOW for k in sizes) / len(sizes):.1%}")


if __name__ == "__main__":
    main()
