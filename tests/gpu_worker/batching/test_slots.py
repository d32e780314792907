"""Request slots (gpu_worker/batching/slots.py) over the KV cache of a tiny random Llama written to disk."""

import time
from collections import Counter

import pytest
import torch

from gpu_worker.batching.slots import evict_idle, instance_heartbeat, load_model_and_cache, release
from schemas.config import DrafterConfig, VerifierConfig, load_config, parse_bytes
from schemas.errors import SpecbusError
from tests.slot_owner import MAX_SLOTS, config, take


def test_release_frees_named_slots_and_counts_unknown_ids(owner):
    now = time.monotonic()
    take(owner, "a", now)
    take(owner, "b", now)
    release(owner, ["a", "never-seen"])
    assert sorted(owner.requests) == ["b"] and owner.cache.num_free == MAX_SLOTS - 1
    assert owner.counters == Counter(slots_released=1, release_unknown=1)


def test_evict_idle_frees_only_slots_idle_past_the_ttl(owner):
    now = time.monotonic()
    take(owner, "old", now - 61)
    take(owner, "fresh", now - 59)
    assert evict_idle(owner, now) == 1
    assert sorted(owner.requests) == ["fresh"] and owner.counters["slots_evicted"] == 1
    assert evict_idle(owner, now + 2) == 1 and owner.cache.num_free == MAX_SLOTS


def test_heartbeat_reports_capacity_load_and_free_slots(owner):
    take(owner, "a", time.monotonic())
    beat = instance_heartbeat(owner, "verifier", 0.5)
    assert (beat.role, beat.instance_id, beat.capacity, beat.load, beat.free_slots) == \
        ("verifier", "owner-test", MAX_SLOTS, 1, MAX_SLOTS - 1)
    assert beat.model_ids == {"target": "tiny"} and beat.interval_s == 0.5


def test_torch_threads_is_applied_at_load(model_dir):
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # so the test fails if loading leaves the count alone
    try:
        load_model_and_cache(str(model_dir), config(model_dir, torch_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("setting, value", [("dtype", "float8"), ("prefill_chunk", 0), ("torch_threads", -1)])
def test_bad_settings_are_refused_by_field(model_dir, setting, value):
    with pytest.raises(SpecbusError, match=setting) as raised:
        load_model_and_cache(str(model_dir), config(model_dir, **{setting: value}))
    assert raised.value.field == setting


def test_drafter_config_has_prefill_chunk_and_torch_threads_from_env():
    drafter = load_config(DrafterConfig, env={"SPECBUS_TORCH_THREADS": "1", "SPECBUS_PREFILL_CHUNK": "64"})
    assert (drafter.prefill_chunk, drafter.torch_threads) == (64, 1)
    assert load_config(VerifierConfig, env={}).torch_threads == 0  # 0: torch's default


def test_kv_cache_memory_is_the_cache_budget(model_dir):
    _, cache = load_model_and_cache(str(model_dir), config(model_dir, kv_cache_memory="1MiB"))
    assert cache.memory_bytes == 2**20 and cache.nbytes == 0  # nothing held before a request
    assert load_config(DrafterConfig, env={"SPECBUS_KV_CACHE_MEMORY": "512MB"}).kv_cache_memory == "512MB"
    assert parse_bytes(load_config(VerifierConfig, env={}).kv_cache_memory, "kv_cache_memory") == 2 * 2**30


@pytest.mark.parametrize("text, size", [("2GiB", 2 * 2**30), ("2G", 2 * 2**30), ("1.5GB", 1_500_000_000),
                                        ("512 MiB", 512 * 2**20), ("4096", 4096), ("64k", 65536)])
def test_sizes_parse(text, size):
    assert parse_bytes(text, "kv_cache_memory") == size


@pytest.mark.parametrize("text", ["lots", "-1GiB", "0", "2 parsecs", ""])
def test_bad_kv_cache_memory_is_refused_by_field(text):
    with pytest.raises(SpecbusError, match="kv_cache_memory: .* is not a positive size") as raised:
        load_config(VerifierConfig, env={}, kv_cache_memory=text)
    assert raised.value.field == "kv_cache_memory"
