"""Slot bookkeeping, on-demand storage within a memory budget, and typed errors of the KV cache."""

import pytest
import torch

from gpu_worker.runtime.checkpoint import load_model
from gpu_worker.runtime.kv_cache import (
    ADMISSION_HEADROOM,
    KEY_BLOCK,
    SLOT_BLOCK,
    CacheCapacityError,
    CacheFullError,
    CacheMemoryError,
    KVCache,
    SlotError,
)
from gpu_worker.runtime.model import forward
from tests.tiny_checkpoints import write_hf_model

LONG = 2 * SLOT_BLOCK + 100  # max_seq_len of the growth tests: three blocks


@pytest.fixture
def model_and_config(hf_llama):
    path, _ = hf_llama
    return load_model(path)


@pytest.fixture
def long_model(tmp_path):
    """A tiny model with positions for LONG tokens."""
    write_hf_model(tmp_path, "llama", max_position_embeddings=LONG)
    return load_model(tmp_path, max_seq_len=LONG)


def feed(model, cache, slot, ids, chunk):
    """Append ids (N,) to slot in forwards of `chunk` tokens; the logits (N, V)."""
    out = []
    for begin in range(0, len(ids), chunk):
        piece = ids[begin:begin + chunk]
        out.append(forward(model, cache, torch.tensor([slot]), piece[None], torch.tensor([len(piece)]))[0])
    return torch.cat(out)


def test_allocate_until_full_then_reuse_freed_slot(model_and_config):
    _, config = model_and_config
    cache = KVCache(config, max_slots=3, max_seq_len=8)
    assert [cache.allocate() for _ in range(3)] == [0, 1, 2]
    assert (cache.num_free, cache.free_slots) == (0, [])
    with pytest.raises(CacheFullError, match="all 3"):
        cache.allocate()
    cache.free(1)
    assert (cache.num_free, cache.free_slots) == (1, [1])
    assert cache.allocate() == 1


def test_storage_comes_with_tokens_and_goes_with_the_slot(model_and_config):
    model, config = model_and_config
    cache = KVCache(config, max_slots=3, max_seq_len=8)
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    assert cache.bytes_per_token == per_token
    # default: every slot full, max_seq_len rounded up to a whole key block, and a scratch column
    assert cache.nbytes == 0 and cache.memory_bytes == 3 * (KEY_BLOCK + 1) * per_token
    slot = cache.allocate()
    assert cache.nbytes == 0 and cache.tensors(slot) == (None, None)
    forward(model, cache, torch.tensor([slot]), torch.ones(1, 3, dtype=torch.long), torch.tensor([3]))
    k, v = cache.tensors(slot)
    assert k.shape == v.shape == (config.num_layers, config.num_kv_heads, KEY_BLOCK + 1, config.head_dim)
    assert cache.nbytes == (KEY_BLOCK + 1) * per_token
    cache.free(slot)
    assert cache.nbytes == 0 and cache.tensors(slot) == (None, None)


def test_growth_keeps_the_bits_of_a_cache_sized_up_front(long_model):
    model, config = long_model
    ids = torch.randint(0, config.vocab_size, (SLOT_BLOCK + 40,), generator=torch.Generator().manual_seed(5))
    grown, sized = KVCache(config, 1, LONG), KVCache(config, 1, LONG)
    slot = grown.allocate()
    # max_seq_len rounded up to whole key blocks
    assert sized.allocate(length=LONG) == slot and sized.capacity(slot) == 2 * SLOT_BLOCK + KEY_BLOCK
    # chunks of 24 cross the block boundary inside one forward (504 + 24 > 512)
    logits = feed(model, grown, slot, ids, 24)
    assert grown.capacity(slot) == 2 * SLOT_BLOCK and grown.nbytes == (2 * SLOT_BLOCK + 1) * grown.bytes_per_token
    assert torch.equal(logits, feed(model, sized, slot, ids, 24))
    n = len(ids)
    assert torch.equal(grown.tensors(slot)[0][:, :, :n], sized.tensors(slot)[0][:, :, :n])


def test_budget_refuses_admission_and_growth_changing_nothing(long_model):
    _, config = long_model
    one_block = KVCache(config, 1, LONG).slot_bytes(1)
    cache = KVCache(config, max_slots=4, max_seq_len=LONG, memory_bytes=3 * one_block)
    assert cache.num_admissible == 3
    first = cache.allocate(length=10)  # the first request keeps no headroom
    assert cache.nbytes == one_block and cache.num_admissible == 1
    second = cache.allocate(length=SLOT_BLOCK)
    assert cache.num_admissible == 0
    with pytest.raises(CacheMemoryError, match=f"kept for running requests, {one_block} are free"):
        cache.allocate(length=1)  # one block fits, but not with the headroom
    assert cache.num_free == 2 and cache.nbytes == 2 * one_block
    cache.reserve(first, SLOT_BLOCK + 1)  # growth may use the headroom
    assert cache.capacity(first) == 2 * SLOT_BLOCK
    with pytest.raises(CacheMemoryError, match=f"slot {second} needs"):
        cache.reserve(second, SLOT_BLOCK + 1)
    assert cache.capacity(second) == SLOT_BLOCK and cache.nbytes == cache.slot_bytes(2 * SLOT_BLOCK) + one_block
    with pytest.raises(CacheCapacityError, match=f"exceed max_seq_len {LONG}"):
        cache.reserve(second, LONG + 1)
    cache.free(first)
    assert cache.nbytes == one_block and cache.num_admissible == 1
    assert ADMISSION_HEADROOM * cache.memory_bytes > 0


def test_memory_error_in_forward_writes_nothing(long_model):
    model, config = long_model
    cache = KVCache(config, max_slots=2, max_seq_len=LONG, memory_bytes=KVCache(config, 1, LONG).slot_bytes(1))
    slot = cache.allocate()
    feed(model, cache, slot, torch.ones(SLOT_BLOCK - 2, dtype=torch.long), 255)
    before = cache.tensors(slot)[0].clone()
    with pytest.raises(CacheMemoryError, match="is short"):
        forward(model, cache, torch.tensor([slot]), torch.ones(1, 5, dtype=torch.long), torch.tensor([5]))
    assert int(cache.lengths[slot]) == SLOT_BLOCK - 2 and cache.capacity(slot) == SLOT_BLOCK
    assert torch.equal(cache.tensors(slot)[0], before)
    other = cache.allocate()  # no storage yet: a forward would need a block the budget lacks
    with pytest.raises(CacheMemoryError):
        forward(model, cache, torch.tensor([other]), torch.ones(1, 1, dtype=torch.long), torch.tensor([1]))


def test_capacity_error_names_slot_and_writes_nothing(model_and_config):
    model, config = model_and_config
    cache = KVCache(config, max_slots=2, max_seq_len=8)
    cache.allocate(), cache.allocate()
    forward(model, cache, torch.tensor([1]), torch.ones(1, 6, dtype=torch.long), torch.tensor([6]))
    before = cache.tensors(1)[0].clone()
    with pytest.raises(CacheCapacityError, match="slot 1: committed length 6 \\+ 3 new tokens"):
        forward(model, cache, torch.tensor([0, 1]), torch.ones(2, 3, dtype=torch.long),
                torch.tensor([1, 3]))
    assert cache.lengths.tolist() == [0, 6]
    assert torch.equal(cache.tensors(1)[0], before) and cache.tensors(0) == (None, None)


def test_truncate_only_lowers(model_and_config):
    model, config = model_and_config
    cache = KVCache(config, max_slots=1, max_seq_len=8)
    slot = cache.allocate()
    forward(model, cache, torch.tensor([slot]), torch.ones(1, 5, dtype=torch.long), torch.tensor([5]))
    cache.truncate(slot, 2)
    assert int(cache.lengths[slot]) == 2
    with pytest.raises(SlotError, match="only lowers"):
        cache.truncate(slot, 3)


@pytest.mark.parametrize("slots", [[0, 0], [1]], ids=["repeated", "not-allocated"])
def test_bad_slots_are_refused(model_and_config, slots):
    model, config = model_and_config
    cache = KVCache(config, max_slots=2, max_seq_len=8)
    cache.allocate()
    B = len(slots)
    with pytest.raises(SlotError, match="distinct allocated"):
        forward(model, cache, torch.tensor(slots), torch.ones(B, 1, dtype=torch.long),
                torch.ones(B, dtype=torch.long))


def test_free_unallocated_slot_is_refused(model_and_config):
    _, config = model_and_config
    cache = KVCache(config, max_slots=2, max_seq_len=8)
    with pytest.raises(SlotError, match="slot 1 is not an allocated slot"):
        cache.free(1)


def test_cache_longer_than_model_positions_is_refused(model_and_config):
    _, config = model_and_config
    with pytest.raises(ValueError, match="max_position_embeddings"):
        KVCache(config, max_slots=1, max_seq_len=config.max_position_embeddings + 1)


def test_cache_of_another_dtype_is_refused(model_and_config):
    model, config = model_and_config
    cache = KVCache(config, max_slots=1, max_seq_len=8, dtype=torch.float64)
    with pytest.raises(ValueError, match="cache is torch.float64"):
        forward(model, cache, torch.tensor([cache.allocate()]), torch.ones(1, 1, dtype=torch.long),
                torch.tensor([1]))


def test_rows_are_grouped_by_the_power_of_two_bound_on_their_key_blocks(tmp_path):
    """A forward's rows needing 1, 2, 3, 4 and 5 key blocks (and one of 1 again): groups {1, 1},
    {2}, {3, 4}, {5}, each over its largest need; a group of one row reads views of its slot."""
    write_hf_model(tmp_path, "llama", max_position_embeddings=6 * KEY_BLOCK)
    model, config = load_model(tmp_path, max_seq_len=6 * KEY_BLOCK)
    cache = KVCache(config, 6, 6 * KEY_BLOCK)
    needs = [1, 2, 3, 4, 5, 1]
    slots = [cache.allocate() for _ in needs]
    for slot, blocks in zip(slots, needs):
        cache.lengths[slot] = (blocks - 1) * KEY_BLOCK + 7  # pretend committed: plan only reads lengths
    plan = cache.plan(torch.tensor(slots), torch.ones(6, dtype=torch.int64), 1)
    assert [(g.rows.tolist(), g.window // KEY_BLOCK) for g in plan.groups] == [
        ([0, 5], 1), ([1], 2), ([2, 3], 4), ([4], 5)]
    assert [g.views is not None for g in plan.groups] == [False, True, False, True]
    k, v = cache.window(0, plan.groups[2])
    assert k.shape == v.shape == (2, config.num_kv_heads, 4 * KEY_BLOCK, config.head_dim)
    alone = cache.plan(torch.tensor(slots[:1]), torch.ones(1, dtype=torch.int64), 1)
    assert [(g.rows, g.window) for g in alone.groups] == [(None, KEY_BLOCK)]  # one group: all rows
