"""Batch invariance of `forward`: a position's logits are the same bits however it is computed.

Whole-prompt prefill is the reference; chunked prefill, one-token decode steps and verify steps
of T = 2..9, each alone and batched with other rows (other lengths and cache fills, ragged
num_new, padding columns, consecutive and scattered slots, windows of several key blocks), must
give `torch.equal` logits, in both dtypes the runtime serves, at 1 and 2 torch threads (a library
may pick its kernel or its split by thread count). The sequences pass a key block boundary, so
a row's keys end in either of two blocks, and a batched neighbour runs blocks ahead of them.
"""

import itertools
from pathlib import Path

import pytest
import torch

from gpu_worker.runtime import linear_kernel
from gpu_worker.runtime.checkpoint import load_model
from gpu_worker.runtime.kv_cache import KEY_BLOCK, KVCache
from gpu_worker.runtime.model import forward
from schemas.config import TINY_TARGET, default_target_model

DTYPES = [torch.float32, torch.bfloat16]
AHEAD = 2 * KEY_BLOCK + 20  # a batched neighbour this far ahead: windows of three, then four key blocks


def cycle(length: int, sizes, start=()) -> list[int]:
    """Step sizes from `start` then `sizes` repeated, the last one cut so they sum to length."""
    steps = list(start)
    for size in itertools.cycle(sizes):
        if sum(steps) >= length:
            return steps[:-1] + [length - sum(steps[:-1])]
        steps.append(size)


def schedules(length: int, verify_from: int, decode_from: int) -> dict[str, list[int]]:
    """Ways to compute a sequence of `length` tokens, as forward step sizes."""
    return {
        "chunked_16": cycle(length, [16]),
        "chunked_64": cycle(length, [64]),
        "decode": cycle(length, [1], [decode_from]),
        "verify": cycle(length, range(2, 10), [verify_from]),   # T = k+1 for k = 1..8
    }


def run_steps(model, config, ids, steps, batched: bool, max_seq_len: int, ahead: int, seed=0):
    """Feed ids (L,) to one cache slot in `steps`; return its (L, V) logits.

    batched: every step also carries two other rows, slot 0 `ahead` tokens ahead of ours and
    slot 2 starting empty, each adding 0..T tokens; our row gets 0..2 padding columns; the batch
    order alternates between consecutive slots (a view of the cache) and scattered (a gather).
    """
    g = torch.Generator().manual_seed(seed)
    V = config.vocab_size
    cache = KVCache(config, max_slots=3, max_seq_len=max_seq_len, dtype=model.embed.dtype)
    slots = [cache.allocate() for _ in range(3)]
    if batched:
        forward(model, cache, torch.tensor([0]), torch.randint(0, V, (1, ahead), generator=g),
                torch.tensor([ahead]))
    out, start = [], 0
    for i, size in enumerate(steps):
        new = ids[start:start + size]
        start += size
        if not batched:
            out.append(forward(model, cache, torch.tensor([1]), new[None], torch.tensor([size]))[0])
            continue
        T = size + int(torch.randint(0, 3, (), generator=g))
        rows = torch.randint(0, V, (3, T), generator=g)
        rows[1, :size] = new
        num_new = torch.randint(0, T + 1, (3,), generator=g)
        num_new[1] = size
        order = [0, 1, 2] if i % 2 else [2, 1, 0]
        logits = forward(model, cache, torch.tensor([slots[b] for b in order]), rows[order],
                         num_new[order])
        out.append(logits[order.index(1), :size])
    return torch.cat(out)


def check_invariance(model, config, length: int, verify_from: int, decode_from: int, runs=None,
                     ahead: int = AHEAD):
    """runs: (schedule name, batched) pairs to compare with the whole prefill; default all, and
    decode in a cache just as long as the sequence (the window passes its end: padded)."""
    ids = torch.randint(0, config.vocab_size, (length,), generator=torch.Generator().manual_seed(7))
    big = ahead + 2 * length  # room for the neighbour: its window is a view of the cache
    reference = run_steps(model, config, ids, [length], False, big, ahead)
    plans = schedules(length, verify_from, decode_from)
    if runs is None:
        runs = [(name, batched, big) for name, batched in itertools.product(plans, (False, True))]
        runs.append(("decode", False, length))
    else:
        runs = [(name, batched, big) for name, batched in runs]
    failures = []
    for name, batched, max_seq_len in runs:
        logits = run_steps(model, config, ids, plans[name], batched, max_seq_len, ahead)
        if not torch.equal(logits, reference):
            rows = (logits != reference).any(-1).nonzero().flatten().tolist()
            diff = (logits.float() - reference.float()).abs().max().item()
            failures.append(f"{name}{' batched' if batched else ''}"
                            f"{' small cache' if max_seq_len == length else ''}: {len(rows)} "
                            f"positions differ (first {rows[:5]}), max |diff| {diff:.3g}")
    assert not failures, "\n".join(failures)


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


# At 2 threads fewer runs: each op is a parallel region, slow where other processes share cores.
TWO_THREAD_RUNS = [("chunked_64", False), ("verify", True)]


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tiny_target_logits_do_not_depend_on_batching(dtype, threads):
    model, config = load_model(TINY_TARGET, dtype=dtype, max_seq_len=2048)
    # KEY_BLOCK + 40 positions: two key blocks, and a prefill above torch's parallel grain (so 2
    # threads split elementwise ops); the verify and decode steps cross the block boundary.
    length = KEY_BLOCK + 40
    if threads == 1:
        check_invariance(model, config, length=length, verify_from=length - 64, decode_from=length - 48)
    else:
        check_invariance(model, config, length=length, verify_from=length - 46, decode_from=length - 44,
                         runs=TWO_THREAD_RUNS)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_without_our_kernel_the_logits_still_do_not_depend_on_batching(dtype, monkeypatch):
    """The fallback where our kernel cannot run (no compiler, a CPU without AVX2; here turned
    off): oneDNN's float32 GEMM, torch's norm and flash attention."""
    monkeypatch.setenv("SPECBUS_LINEAR_KERNEL", "0")
    linear_kernel.load.cache_clear()
    try:
        model, config = load_model(TINY_TARGET, dtype=dtype, max_seq_len=2048)
        length = KEY_BLOCK + 40
        check_invariance(model, config, length=length, verify_from=length - 64, decode_from=length - 48,
                         runs=[("chunked_16", True), ("chunked_64", False), ("verify", True)])
    finally:
        linear_kernel.load.cache_clear()


@pytest.fixture(scope="module")
def smollm2() -> Path:
    path = Path(default_target_model())
    if not (path / "config.json").exists():
        pytest.skip(f"SmolLM2 is not pulled into {path}: run `specbus models pull` "
                    f"(`make test` does)")
    return path


@pytest.mark.real_model
@pytest.mark.parametrize("threads", [1], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_smollm2_logits_do_not_depend_on_batching(smollm2, dtype, threads):
    model, config = load_model(smollm2, dtype=dtype, max_seq_len=1024)
    # Fewer, shorter runs than the tiny test (a SmolLM2 forward costs ~30x a tiny one) at one
    # thread, as the services run; the neighbour a key block ahead: windows of two blocks.
    check_invariance(model, config, length=40, verify_from=26, decode_from=36, ahead=KEY_BLOCK + 20,
                     runs=[("chunked_16", False), ("verify", True), ("decode", True)])


@pytest.mark.real_model
@pytest.mark.parametrize("threads", [1], indirect=True)
def test_smollm2_by_integer_dot_products_does_not_depend_on_batching(smollm2, threads):
    """weights int8dot (the GGUF blocks by int8 activation blocks, integer dot products): another
    model than the float32 one, with the same identities."""
    model, config = load_model(smollm2, max_seq_len=1024, weights_format="int8dot")
    check_invariance(model, config, length=40, verify_from=26, decode_from=36, ahead=KEY_BLOCK + 20,
                     runs=[("chunked_16", False), ("verify", True), ("decode", True)])
