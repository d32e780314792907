"""Prefix caching (gpu_worker/batching/prefix_cache.py): a hit is a recompute, bit for bit.

The forward level: keys and values copied from a kept slot give `torch.equal` logits to a slot
that computed every position (the real tiny target, both dtypes). The verifier level (the tiny
random Llama of verifier_steps.py, both dtypes): a chat's second turn, prefilled in chunks as the
scheduler sends them, then decoded with drafts (seeded sampling and logprobs), gives the same
tokens and logprobs from a verifier whose prefix cache holds the first turn as from one with
prefix caching off, and so does the turn moved to another verifier halfway (migration) and
resumed by another scheduler (failover); another user's salt finds nothing; an entry is evicted
when admission needs its memory.
"""

import time
from array import array
from collections import Counter

import pytest
import torch

from gpu_worker.batching.prefix_cache import PREFIX_BLOCK, PrefixCache, extend_keys, root_key
from gpu_worker.verifier.verifier_core import verify_batch
from gpu_worker.runtime.checkpoint import load_model
from gpu_worker.runtime.kv_cache import KVCache
from gpu_worker.runtime.model import forward
from schemas.config import TINY_TARGET
from schemas.generation import LogprobOptions
from schemas.steps import VerifyRequest
from tests.gpu_worker.verifier.verifier_steps import SAMPLED, V, new_verifier, vrow

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TURN_1 = [(7 * i + 3) % V for i in range(37)]
USER = "user:alice"
K = 3
CHUNK = 20  # the scheduler's prefill chunk in these tests: hits start and end inside chunks
# a slot of the tiny random Llama: 256 positions (its max_seq_len in whole key blocks) and the
# scratch column, of keys and values (2 layers x 2 heads x 8 x 4 bytes, twice) and a bf16 feature row
SLOT_BYTES = 257 * (256 + 64)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=str)
def test_copied_keys_and_values_give_the_logits_of_a_recompute(dtype):
    model, config = load_model(TINY_TARGET, dtype=dtype, max_seq_len=512)
    cache = KVCache(config, max_slots=3, max_seq_len=512, dtype=dtype)
    prefix = PrefixCache(cache, Counter())
    ids = torch.randint(1, config.vocab_size, (300,), generator=torch.Generator().manual_seed(3))
    tokens = array("i", ids.tolist())
    root = root_key("tiny", dtype, "dense", USER)

    def run(slot, start, end):
        return forward(model, cache, torch.tensor([slot]), ids[None, start:end], torch.tensor([end - start]))[0]

    kept = cache.allocate()
    run(kept, 0, 200)
    prefix.keep(kept, tokens[:200], [], root, None)
    reference = cache.allocate()
    whole = run(reference, 0, 300)  # (300, V): every position computed here
    hit = cache.allocate(300)
    keys: list[bytes] = []
    extend_keys(keys, root, tokens, 300)
    entry, end = prefix.find(keys, tokens, 0, 299)
    assert end == 200
    cache.copy_prefix(hit, entry.keys, entry.values, end)
    assert torch.equal(run(hit, end, 300), whole[end:])
    assert prefix.find(keys, tokens, 0, 299) is not None
    other: list[bytes] = []
    extend_keys(other, root_key("tiny", dtype, "dense", "user:bob"), tokens, 300)
    assert prefix.find(other, tokens, 0, 299) is None  # another user's cache


def step(verifier, scheduler_id, row, batch_id):
    request = VerifyRequest(batch_id=batch_id, scheduler_id=scheduler_id, deadline=time.time() + 30, rows=[row])
    response, records = verify_batch(verifier, request)
    assert response.rows[0].error is None and not response.rows[0].need_resync, response.rows[0]
    return response.rows[0], (records[0][1] if records else None)


def drafts_for(history):
    return [(history[-1] * 5 + i) % V for i in range(K)]


def converse(verifier, request_id, history, prompt_len, until, scheduler_id="sched-test", salt=USER, step_no=0):
    """A scheduler's loop over one request from position 0: the history in prefill chunks of CHUNK
    (one token short when it holds output), then decode steps with K drafts until the history is
    `until` long. Returns (history, logprob records, cached tokens)."""
    history, records, cached, fed = list(history), [], 0, 0
    options = dict(logprobs=LogprobOptions(logprobs=2), cache_salt=salt, **SAMPLED)
    while len(history) < until:
        resumed = len(history) > prompt_len
        end = min(fed + CHUNK, len(history) - resumed)
        decode = fed == len(history) - 1 and resumed or fed + CHUNK >= len(history) and not resumed
        end = len(history) if decode else end
        drafts = drafts_for(history) if decode else []
        result, record = step(verifier, scheduler_id, vrow(
            request_id, history[fed:end], fed, drafts, step=step_no, prompt_len=prompt_len, emit=decode,
            **options), step_no)
        step_no += 1
        cached += result.cached_tokens
        fed = end + result.num_accepted
        history += result.token_ids.tolist()
        records += [] if record is None else [record]
    return history[:until], records, cached


def same_records(a, b):
    assert [r.token_ids.tolist() for r in a] == [r.token_ids.tolist() for r in b]
    assert all(x.logprobs == y.logprobs for x, y in zip(a, b))


def verifiers(target, dtype, **overrides):
    """A verifier holding the first turn in its prefix cache, and one with prefix caching off."""
    cached = new_verifier(target, dtype=dtype, **overrides)
    plain = new_verifier(target, dtype=dtype, prefix_caching=False, **overrides)
    for verifier in (cached, plain):
        first, _, _ = converse(verifier, "turn-1", TURN_1, len(TURN_1), len(TURN_1) + 12)
        verify_batch(verifier, VerifyRequest(batch_id=100, scheduler_id="sched-test", deadline=time.time() + 30,
                                             rows=[], release=["turn-1"]))
    return cached, plain, first + [11, 12, 13, 14, 15]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_second_turn_from_the_cache_is_the_turn_computed(target, dtype):
    cached, plain, turn_2 = verifiers(target, dtype)
    assert cached.counters["prefix_entries_kept"] == 1 and plain.prefix is None
    until = len(turn_2) + 16
    hit = converse(cached, "turn-2", turn_2, len(turn_2), until)
    computed = converse(plain, "turn-2", turn_2, len(turn_2), until)
    assert hit[0] == computed[0]
    same_records(hit[1], computed[1])
    assert hit[2] == len(TURN_1) + 12 - 1 and computed[2] == 0  # the first turn's last token was never fed
    assert cached.counters["prefix_tokens_hit"] == hit[2]
    stranger = converse(cached, "turn-2-bob", turn_2, len(turn_2), until, salt="user:bob")
    assert stranger[2] == 0 and stranger[0] == computed[0]
    assert converse(cached, "no-salt", turn_2, len(turn_2), until, salt=None)[2] == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_turn_moved_to_another_verifier_or_scheduler_hits_and_ends_the_same(target, dtype):
    cached, plain, turn_2 = verifiers(target, dtype)
    until = len(turn_2) + 16
    reference, records, _ = converse(plain, "turn-2", turn_2, len(turn_2), until)
    halfway, _, _ = converse(plain, "moved", turn_2, len(turn_2), len(turn_2) + 6)
    # migration: the scheduler re-prefills the history on the verifier it moves to
    migrated, _, hit = converse(cached, "moved", halfway, len(turn_2), until, step_no=50)
    assert migrated == reference and hit > 0
    # failover: another scheduler resumes it on a verifier whose cache holds the first turn (and,
    # under the old scheduler's id, the request's own slot)
    resumed, _, hit = converse(cached, "moved", halfway, len(turn_2), until, scheduler_id="sched-2", step_no=50)
    assert resumed == reference and hit > 0


def test_an_entry_is_evicted_when_admission_needs_its_memory(target):
    verifier = new_verifier(target, max_slots=2, kv_cache_memory=str(2 * SLOT_BYTES + 20_000))
    converse(verifier, "a", TURN_1, len(TURN_1), len(TURN_1) + 4)
    verify_batch(verifier, VerifyRequest(batch_id=1, scheduler_id="sched-test", deadline=time.time() + 30, rows=[],
                                         release=["a"]))
    assert verifier.prefix.held_bytes > 0 and verifier.cache.num_admissible == 2
    converse(verifier, "b", [9] * 30, 30, 34, salt="user:bob")
    converse(verifier, "c", [8] * 30, 30, 34, salt="user:bob")
    assert verifier.counters["prefix_entries_evicted"] == 1 and verifier.prefix.held_bytes == 0
