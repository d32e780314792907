"""This tree's `gpu_worker.runtime.model.forward` against another git revision's, paired in one process.

Runs in separate processes minutes apart swing widely on a shared machine (ops/bench/RESULTS.md,
"Batch-invariant forward"), so the figure
to read is a paired one: both versions' models loaded in this process, `bench_forward.bench`
rounds alternating between them (process CPU time), the median of the per-round ratios
this/other per T. The other revision's `gpu_worker` and `schemas` are extracted with
`git archive` into a temporary directory and imported under other names.

    PYTHONPATH=. .venv/bin/python ops/bench/kernels/bench_forward_pair.py --against f9ba8db
    PYTHONPATH=. .venv/bin/python ops/bench/kernels/bench_forward_pair.py --against f9ba8db --model models/tiny/draft --context 64 --rounds 12
    PYTHONPATH=. .venv/bin/python ops/bench/kernels/bench_forward_pair.py --against e8a04cb --contexts 60 60 60 1000  # a batch
"""

import argparse
import importlib
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import torch

from gpu_worker.runtime.checkpoint import load_model
from gpu_worker.runtime.kv_cache import KVCache
from gpu_worker.runtime.model import forward
from ops.bench.kernels import bench_forward
from schemas.config import default_target_model

PACKAGES = ("gpu_worker", "schemas")
SUFFIX = "_other"


def import_revision(revision: str, into: Path):
    """(load_model, KVCache, forward) of `revision`, its packages renamed with SUFFIX."""
    archive = subprocess.run(["git", "archive", revision, *PACKAGES], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    pattern = re.compile(r"\b(" + "|".join(PACKAGES) + r")\b")
    for package in PACKAGES:
        for source in (into / package).rglob("*.py"):
            source.write_text(pattern.sub(lambda m: m.group(1) + SUFFIX, source.read_text()))
        (into / package).rename(into / (package + SUFFIX))
    sys.path.insert(0, str(into))
    runtime = "runtime." if (into / f"gpu_worker{SUFFIX}" / "runtime").is_dir() else ""  # the layout since 2026-12-03
    module = lambda name: importlib.import_module(f"gpu_worker{SUFFIX}.{runtime}{name}")  # noqa: E731
    return module("checkpoint").load_model, module("kv_cache").KVCache, module("model").forward


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="git revision to compare with")
    parser.add_argument("--model", default=default_target_model())
    parser.add_argument("--format", default="float32", choices=list(bench_forward.FORMATS),
                        help="weight format, as bench_forward.py's --formats")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--contexts", type=int, nargs="+", help="a batch of rows with these contexts (instead of "
                                                                  "one row of --context)")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    contexts = args.contexts or [args.context]
    (dtype, weights), max_seq_len = bench_forward.FORMATS[args.format], max(contexts) + max(args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        other_load, other_cache, other_forward = import_revision(args.against, Path(tmp))
        load = dict(dtype=dtype, max_seq_len=max_seq_len, weights_format=weights)
        versions = {"this": (load_model(args.model, **load), KVCache, forward),
                    args.against: (other_load(args.model, **load), other_cache, other_forward)}
        runs = {name: [] for name in versions}
        for _ in range(args.rounds):
            for name, ((model, config), cache_class, forward_fn) in versions.items():
                bench_forward.KVCache, bench_forward.forward = cache_class, forward_fn
                runs[name].append(bench_forward.bench(model, config, args.tokens, contexts, 3, time.process_time))
    print(f"{args.model}, {args.format}, {args.threads} thread(s), contexts {contexts}, {args.rounds} "
          f"paired rounds; median CPU ms per forward (ratio to T={args.tokens[0]})")
    for name, rounds in runs.items():
        ms = {T: statistics.median(r[T] for r in rounds) for T in args.tokens}
        print(f"{name}: " + " ".join(f"T={T} {ms[T]:.1f} ({ms[T] / ms[args.tokens[0]]:.2f})" for T in args.tokens))
    ratios = {T: statistics.median(a[T] / b[T] for a, b in zip(runs["this"], runs[args.against]))
              for T in args.tokens}
    print(f"this/{args.against}, paired: " + " ".join(f"T={T} {ratios[T]:.2f}" for T in args.tokens))


if __name__ == "__main__":
    main()
