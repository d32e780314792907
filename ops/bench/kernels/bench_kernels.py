"""Time the rejection sampler and the logprob kernels against the memory floor.

For each (B, K, V): time per call of
- rejection_sample with dense proposals (with and without check_values, the NaN / negative
  scan of both probability tensors) and with point-mass proposals,
- gather_logprobs on all B * (K+1) verify positions (the worst case: every draft accepted),
  raw mode with top-5, and processed mode with top-5 and a 50-token candidate set,
and the ratio of each to `target_probs.sum()` over the same [B, K+1, V] tensor in the same run
(one read of target_probs: the memory floor). `log_softmax` over the same logits is shown as
the compute floor of any full-vocabulary logprob on CPU (exp throughput bounds it, not memory).
Best of --reps calls after one warm-up, the kernels interleaved, so that load from other
processes on a shared machine skews no ratio.

glibc hands blocks over 32 MiB back to the kernel on free, so every large temporary is
page-faulted in afresh on each call (what that costs: ops/bench/RESULTS.md). The
MALLOC_* variables keep freed memory in the heap, as a serving process would (or use tcmalloc):

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \
        PYTHONPATH=. .venv/bin/python ops/bench/kernels/bench_kernels.py            # the full grid
    PYTHONPATH=. .venv/bin/python ops/bench/kernels/bench_kernels.py --batch 1 16 --vocab 4096 --reps 20
"""

import argparse
import time

import torch

from gpu_worker.sampling.logprobs import gather_logprobs
from gpu_worker.sampling.rejection import rejection_sample
from gpu_worker.sampling.sampler import ProcessedLogits, SamplingTensors


def time_calls(fns, reps):
    """Best time per call of each fn in {name: fn}. The calls are interleaved and the minimum
    taken, so that load from other processes on a shared machine skews no ratio."""
    best = {name: float("inf") for name in fns}
    for _ in range(reps + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def random_probs(shape, generator):
    probs = torch.rand(shape, generator=generator)
    return probs.div_(probs.sum(-1, keepdim=True))


def bench_one(B, K, V, reps, generator):
    logits = torch.randn(B, K + 1, V, generator=generator)
    target_probs = random_probs((B, K + 1, V), generator)
    draft_probs = random_probs((B, K, V), generator)
    draft_token_ids = torch.randint(0, V, (B, K), generator=generator)
    target_token_ids = torch.randint(0, V, (B, K + 1), generator=generator)
    num_draft = torch.full((B,), K)
    greedy = torch.zeros(B, dtype=torch.bool)
    uniforms = torch.rand(B, K, generator=generator, dtype=torch.float64)
    residual_uniforms = torch.rand(B, K, generator=generator, dtype=torch.float64)
    params = SamplingTensors.build([0.8] * B, top_k=[50] * B)
    top50 = (logits / 0.8).topk(50, dim=-1).indices  # (B, K+1, 50): the sampler's K, in order
    unfiltered = ProcessedLogits(target_probs, top50[..., :1], torch.full((B, K + 1), V))
    filtered = ProcessedLogits(target_probs, top50, torch.full((B, K + 1), 50))
    params_all = SamplingTensors.build([0.8] * B)

    def reject(probs, check_values=True):
        return lambda: rejection_sample(
            draft_token_ids, num_draft, probs, target_probs, target_token_ids, greedy,
            uniforms=uniforms, residual_uniforms=residual_uniforms, check_values=check_values,
        )

    timings = time_calls(
        {
            "sum": lambda: target_probs.sum(),
            "log_softmax": lambda: logits.log_softmax(-1),
            "reject dense": reject(draft_probs),
            "dense unchecked": reject(draft_probs, check_values=False),
            "reject point": reject(None),
            "logprobs raw": lambda: gather_logprobs(
                logits, target_token_ids, params_all, unfiltered, mode="raw", top_n=5
            ),
            "logprobs proc": lambda: gather_logprobs(
                logits, target_token_ids, params, filtered, mode="processed", top_n=5
            ),
        },
        reps,
    )
    return timings.pop("sum"), timings


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--vocab", type=int, nargs="+", default=[4096, 32000, 152064])
    parser.add_argument("--reps", type=int, default=10, help="calls per timing (fewer for large tensors)")
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per call (ratio to target_probs.sum())")
    names = ["reject dense", "dense unchecked", "reject point", "log_softmax", "logprobs raw", "logprobs proc"]
    print("| B | K | V | sum ms | " + " | ".join(names) + " |")
    print("|---|---|---|---|" + "---|" * len(names))
    for V in args.vocab:
        for B in args.batch:
            for K in args.k:
                elements = B * (K + 1) * V
                reps = max(2, min(args.reps, int(args.reps * 2e6 / elements)))
                floor, timings = bench_one(B, K, V, reps, generator)
                cells = [f"{timings[n] * 1e3:.2f} ({timings[n] / floor:.1f}x)" for n in names]
                print(f"| {B} | {K} | {V} | {floor * 1e3:.3f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
