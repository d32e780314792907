"""The drafter's prefix cache (gpu_worker/drafter/drafter_core.py `take_hit`): a new request whose
history starts with a released one's feeds only the rest, and drafts, proposals and the slot's
keys and values are bit for bit those of a drafter that feeds everything, in float32 and bfloat16."""

import time

import pytest
import torch

from gpu_worker.drafter.drafter_core import draft_batch, load_drafter
from schemas.config import DrafterConfig, load_config
from schemas.generation import RowSampling
from schemas.steps import DraftRequest, DraftRow
from tests.tiny_checkpoints import write_tiny_pair

TURN1 = [5, 17, 42, 8, 99, 23, 61, 3, 77, 12, 50, 31, 6, 17, 200, 17, 9, 300, 41, 2]  # 20 tokens: a block and 4
TURN2 = TURN1 + [64, 8, 130, 7, 7, 500, 21, 99, 3, 12, 40, 11]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return write_tiny_pair(tmp_path_factory.mktemp("pair"))[1]


def drafter_of(draft_dir, dtype, prefix_caching):
    return load_drafter(load_config(DrafterConfig, env={}, draft_model=str(draft_dir), instance_id="drafter-test",
                                    max_slots=4, max_seq_len=64, dtype=dtype, prefix_caching=prefix_caching))


def draft(drafter, request_id, history, mode, salt="user:a", release=()):
    sampling = RowSampling(temperature=1.0, seed=7, coupling="rejection") if mode == "sample" else \
        RowSampling(temperature=0)
    row = DraftRow(request_id=request_id, row=0, step=0, cached_len=0, new_token_ids=history, num_draft=4,
                   draft_mode=mode, sampling=sampling, prompt_len=len(history) - 3, cache_salt=salt)
    request = DraftRequest(batch_id=1, scheduler_id="s", deadline=time.time() + 30, rows=[row], release=list(release))
    return draft_batch(drafter, request).rows[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_a_next_turn_feeds_only_what_is_new_and_drafts_the_same_bits(draft_dir, dtype, mode):
    on, off = drafter_of(draft_dir, dtype, True), drafter_of(draft_dir, dtype, False)
    results = {}
    for drafter in (on, off):
        draft(drafter, "turn1", TURN1, mode)
        results[id(drafter)] = draft(drafter, "turn2", TURN2, mode, release=["turn1"])
    assert on.counters["prefix_tokens_hit"] == len(TURN1)  # turn 1's committed history, drafts left out
    assert on.counters["fed_tokens"] == off.counters["fed_tokens"] - len(TURN1)
    got, want = results[id(on)], results[id(off)]
    assert got.draft_token_ids.tolist() == want.draft_token_ids.tolist()
    if mode == "sample":
        assert torch.equal(torch.as_tensor(got.proposal.ids), torch.as_tensor(want.proposal.ids))
        assert torch.equal(torch.as_tensor(got.proposal.probs), torch.as_tensor(want.proposal.probs))
    slot_on, slot_off = on.requests[("s", "turn2")].slot, off.requests[("s", "turn2")].slot
    length = int(on.cache.lengths[slot_on])
    assert length == int(off.cache.lengths[slot_off]) >= len(TURN2)
    for mine, theirs in zip(on.cache.tensors(slot_on), off.cache.tensors(slot_off)):  # keys, values
        assert torch.equal(mine[:, :, :length], theirs[:, :, :length])


def test_another_users_history_is_not_found(draft_dir):
    drafter = drafter_of(draft_dir, "float32", True)
    draft(drafter, "turn1", TURN1, "greedy", salt="user:a")
    draft(drafter, "turn2", TURN2, "greedy", salt="user:b", release=["turn1"])
    draft(drafter, "plain", TURN2, "greedy", salt=None)  # a row without a salt: computed whole
    assert drafter.counters["prefix_tokens_hit"] == 0
    assert drafter.counters["prefix_entries_kept"] == 1
