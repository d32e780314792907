"""Prefix caching in the verifier: the keys, values and target features of finished requests,
kept and copied into new slots whose history starts with the same tokens, so a chat's next turn
(or a request with the same system prompt) computes only what is new.

Where it lives, and why: in the verifier process, beside the slots (gpu_worker/batching/slots.py)
and inside their memory budget (`--kv-cache-memory`). The verifier already receives every token
of a history (the scheduler sends each prefill chunk's ids), so it can key and
find a cached prefix itself: the scheduler plans chunks as before and learns what was skipped
from `VerifyResult.cached_tokens` (its usage's cached_tokens; its step budget counts only the
tokens computed). Nothing about a hit crosses the bus, so a migrated or failed-over request
needs no new protocol: the verifier it lands on hits wherever it holds the prefix. A model
drafter keeps one the same way (gpu_worker/drafter/drafter_core.py `take_hit`: a new request's whole
history reaches it in its first draft row), without features.

Why a hit changes nothing: the forward is batch-invariant (gpu_worker/runtime/model.py; chunked
prefill equals a whole-prompt prefill bit for bit, tests/gpu_worker/runtime/
test_model_batch_invariance.py), so a position's keys, values and features are a function of
the tokens up to it alone; copying them from another slot whose tokens agree up to there gives
the bits a recompute would.

Keys: a history is cut into blocks of PREFIX_BLOCK tokens; block i's key is a hash of block i-1's
key and block i's ids, and block -1's key (`root_key`) hashes the target's model id, dtype,
weights format and the row's cache_salt (the client user, or a group of users the scheduler's
operator lets share one cache: docs/PROTOCOL.md#prefix-caching). So a key names its whole
prefix; a found entry's ids are still compared before use.

Storage: when a slot is released (finished, cancelled, moved away) or idle-evicted, its storage
is not freed but kept as an entry (`keep`, no copy: `KVCache.detach`); an entry whose every
block a newer one also holds is dropped at once (a chat's turns keep only the latest). Entries
are evicted least recently used when admission or growth is short of memory (`reclaim`, the
KVCache's reclaimer). A hit copies positions into the new slot (`take_hit`), so no storage is
shared and nothing needs a reference count.

A hit may start and end anywhere: a chunk that begins inside a cached block takes the rest of
it. A row reuses at most up to its first position whose logits it wants: an emitting row computes
at least its last new token, and a row asking prompt logprobs computes its prompt.
Counters (the verifier's, as metrics): prefix_tokens_looked_up, prefix_tokens_hit (their ratio is
the hit rate), prefix_entries_kept, prefix_entries_evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from gpu_worker.runtime.kv_cache import KVCache

# Tokens a key covers (vLLM's block size): an entry is found by its whole blocks.
PREFIX_BLOCK = 16
KEY_BYTES = 16


def root_key(model_id: str, dtype: torch.dtype, weights: str, salt: str) -> bytes:
    """The key before a history's first block: what else changes the bits, and whose cache."""
    text = "\0".join([model_id, str(dtype), weights, salt])
    return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()


def extend_keys(keys: list[bytes], root: bytes, token_ids: array, end: int) -> None:
    """Append to keys (block keys of token_ids, in order) those of the whole blocks below end."""
    for block in range(len(keys), end // PREFIX_BLOCK):
        previous = keys[-1] if keys else root
        ids = token_ids[block * PREFIX_BLOCK:(block + 1) * PREFIX_BLOCK].tobytes()
        keys.append(hashlib.blake2b(previous + ids, digest_size=KEY_BYTES).digest())


@dataclass(eq=False)
class PrefixEntry:
    """A released slot's storage: keys, values (L, Hkv, C + 1, D), features (C, E) bf16 or None,
    valid for positions below len(token_ids); block_keys of its whole blocks; nbytes charged."""

    keys: torch.Tensor
    values: torch.Tensor
    features: torch.Tensor | None
    token_ids: array
    block_keys: list[bytes]
    nbytes: int


class PrefixCache:
    """Entries by block key, least recently used first (module docstring); the cache's reclaimer."""

    def __init__(self, cache: KVCache, counters: Counter):
        self.cache = cache
        self.counters = counters
        self.entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # id(entry) -> entry, oldest first
        self.index: dict[bytes, PrefixEntry] = {}  # block key -> the newest entry holding that block
        self.held_bytes = 0
        cache.reclaimer = self

    @property
    def evictable_bytes(self) -> int:
        return self.held_bytes

    def reclaim(self, nbytes: int) -> None:
        """Evict least recently used entries until nbytes are handed back, or none is left."""
        freed = 0
        while freed < nbytes and self.entries:
            freed += self.drop(next(iter(self.entries.values())))
            self.counters["prefix_entries_evicted"] += 1

    def drop(self, entry: PrefixEntry) -> int:
        """Remove entry and hand its bytes back; returns them."""
        del self.entries[id(entry)]
        for key in entry.block_keys:
            if self.index.get(key) is entry:
                del self.index[key]
        self.held_bytes -= entry.nbytes
        self.cache.release_bytes(entry.nbytes)
        return entry.nbytes

    def keep(self, slot: int, token_ids: array, block_keys: list[bytes], root: bytes,
             features: torch.Tensor | None) -> None:
        """Free slot, keeping its storage as an entry when it holds a whole block (block_keys:
        the keys of its blocks so far, extended here to its length)."""
        length = min(int(self.cache.lengths[slot]), len(token_ids))
        del block_keys[length // PREFIX_BLOCK:]
        extend_keys(block_keys, root, token_ids, length)
        if not block_keys:
            self.cache.free(slot)
            return
        keys, values, nbytes = self.cache.detach(slot)
        entry = PrefixEntry(keys, values, features, token_ids[:length], block_keys, nbytes)
        displaced = {id(old): old for key in block_keys if (old := self.index.get(key)) is not None}
        for key in block_keys:
            self.index[key] = entry
        self.entries[id(entry)] = entry
        self.held_bytes += nbytes
        self.counters["prefix_entries_kept"] += 1
        for old in displaced.values():  # all its blocks held by the new one too: redundant
            if not any(self.index.get(key) is old for key in old.block_keys):
                self.drop(old)

    def find(self, block_keys: list[bytes], token_ids: array, start: int, end: int) -> tuple[PrefixEntry, int] | None:
        """The entry holding the longest prefix of token_ids up to end that passes start, and
        that prefix's length; None without one. The entry is found by the key of the deepest whole
        block below end; past it, its ids are compared one by one (less than a block)."""
        for block in range(min(end // PREFIX_BLOCK, len(block_keys)), 0, -1):
            entry = self.index.get(block_keys[block - 1])
            stop = block * PREFIX_BLOCK
            if entry is None or entry.token_ids[:stop] != token_ids[:stop]:
                continue
            limit = min(end, len(entry.token_ids))
            while stop < limit and entry.token_ids[stop] == token_ids[stop]:
                stop += 1
            if stop <= start:
                return None
            self.entries.move_to_end(id(entry))
            return entry, stop
        return None
