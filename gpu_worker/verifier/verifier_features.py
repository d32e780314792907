"""The target's features a verifier keeps and ships (docs/PROTOCOL.md#feature-level-drafts):
every forward's final-normed hidden states, kept per slot as bf16 (`store_features`), and the
block of them a row asks with features_from (`feature_block`, at most MAX_FEATURE_BLOCK_BYTES).
"""

from __future__ import annotations

import torch

from gpu_worker.verifier.verifier_state import Verifier, VerifierSlot
from gpu_worker.runtime.eagle import pack_features
from gpu_worker.runtime.kv_cache import KVCache
from schemas.bus.protocol import MAX_FEATURE_BLOCK_BYTES
from schemas.steps import FeatureBlock

FEATURE_BYTES = 2  # a feature value is kept as bfloat16


def max_feature_rows(verifier: Verifier) -> int:
    """Positions of one FeatureBlock at most (MAX_FEATURE_BLOCK_BYTES of bf16)."""
    return MAX_FEATURE_BLOCK_BYTES // (FEATURE_BYTES * verifier.model.config.hidden_size)


def store_features(state: VerifierSlot, start: int, hidden: torch.Tensor, cache: KVCache) -> None:
    """Keep hidden (n, E), the target's features at positions start..start+n-1, in the slot's
    bf16 buffer, which grows as the slot's cache does (`cache.capacity_for`: the cache's memory
    budget pays for these rows, `load_verifier`)."""
    end, E = start + hidden.shape[0], hidden.shape[1]
    buffer = state.features
    if buffer is None or buffer.shape[0] < end:
        grown = hidden.new_empty((cache.capacity_for(end), E), dtype=torch.bfloat16)
        if buffer is not None:
            grown[:buffer.shape[0]] = buffer
        state.features = buffer = grown
    buffer[start:end] = hidden


def feature_block(verifier: Verifier, state: VerifierSlot, features_from: int | None,
                  committed: int) -> FeatureBlock | None:
    """The features of positions features_from .. committed - 1 the slot holds, at most
    max_feature_rows of them; None when none is asked or there are none."""
    if features_from is None or features_from >= committed:
        return None
    stop = min(committed, features_from + max_feature_rows(verifier))
    rows = state.features[features_from:stop]  # (n, E): every position below committed was computed here
    verifier.counters["feature_rows_sent"] += stop - features_from
    return FeatureBlock(start=features_from, shape=list(rows.shape), data=pack_features(rows))

