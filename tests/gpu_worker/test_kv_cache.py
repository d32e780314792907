"""Slot bookkeeping and typed errors of the KV cache."""

import pytest
import torch

from gpu_worker.checkpoint import load_model
from gpu_worker.kv_cache import CacheCapacityError, CacheFullError, KVCache, SlotError
from gpu_worker.model import forward


@pytest.fixture
def model_and_config(hf_llama):
    path, _ = hf_llama
    return load_model(path)


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


def test_layout_and_budget(model_and_config):
    _, config = model_and_config
    cache = KVCache(config, max_slots=3, max_seq_len=8)
    shape = (config.num_layers, 3, config.num_kv_heads, 8 + 1, config.head_dim)
    assert cache.k.shape == cache.v.shape == shape
    assert cache.nbytes == 2 * 4 * torch.Size(shape).numel()


def test_capacity_error_names_slot_and_writes_nothing(model_and_config):
    model, config = model_and_config
    cache = KVCache(config, max_slots=2, max_seq_len=8)
    cache.allocate(), cache.allocate()
    forward(model, cache, torch.tensor([1]), torch.ones(1, 6, dtype=torch.long), torch.tensor([6]))
    before = cache.k.clone()
    with pytest.raises(CacheCapacityError, match="slot 1: committed length 6 \\+ 3 new tokens"):
        forward(model, cache, torch.tensor([0, 1]), torch.ones(2, 3, dtype=torch.long),
                torch.tensor([1, 3]))
    assert cache.lengths.tolist() == [0, 6]
    assert torch.equal(cache.k, before)


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
