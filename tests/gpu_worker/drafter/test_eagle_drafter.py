"""The EAGLE drafter (gpu_worker/drafter/eagle_drafter.py) without NATS, on the tiny target with a
random-but-seeded head and the features a verifier (gpu_worker/verifier/verifier_core.py) returns:
the drafter drafts what the head drafts on them, and the receiver rule's need_resync,
short-of-features and repeated-step paths. The helpers serve
tests/gpu_worker/verifier/test_verifier_features.py too."""

import time

import numpy as np
import pytest
import torch

from gpu_worker.runtime.checkpoint import load_d2t, read_config
from gpu_worker.runtime.eagle import EagleConfig, draft_chain, draft_tree, load_head, new_cache, unpack_features
from ops.train.eagle_training import init_weights, save_head
from gpu_worker.drafter.drafter_core import draft_batch
from gpu_worker.drafter.eagle_drafter import load_eagle_drafter
from gpu_worker.runtime.kv_cache import KVCache
from gpu_worker.runtime.model import forward
from gpu_worker.verifier.verifier_core import load_verifier, verify_batch
from schemas.config import TINY_DRAFT, TINY_TARGET, DrafterConfig, VerifierConfig, load_config
from schemas.errors import ErrorCode, SpecbusError
from schemas.generation import RowSampling
from schemas.steps import DraftRequest, DraftRow, FeatureBlock, VerifyRequest, VerifyRow, check_drafts

PROMPT = [(i * 37 + 11) % 4000 + 3 for i in range(40)]  # 40 tokens: a feed longer than SHORT_FEED
SHORT_PROMPT = PROMPT[:9]
MAX_SEQ_LEN = 256


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle")
    config = EagleConfig.from_target(read_config(TINY_TARGET))
    save_head(path, config, init_weights(config, seed=1), load_d2t(TINY_DRAFT))
    return path


def new_verifier(**overrides):
    settings = dict(target_model=str(TINY_TARGET), instance_id="verifier-test", max_slots=4, max_seq_len=MAX_SEQ_LEN,
                    dtype="float32", prefill_chunk=16)
    return load_verifier(load_config(VerifierConfig, env={}, **{**settings, **overrides}))


def new_drafter(head_dir, **overrides):
    settings = dict(draft_method="eagle", eagle_head=str(head_dir), target_model=str(TINY_TARGET),
                    instance_id="eagle-test", max_slots=4, max_seq_len=MAX_SEQ_LEN, dtype="float32", prefill_chunk=16)
    return load_eagle_drafter(load_config(DrafterConfig, env={}, **{**settings, **overrides}))


def verify(verifier, request_id, history, cached_len, drafts=(), features_from=None, step=0, **options):
    row = VerifyRow(request_id=request_id, row=0, step=step, cached_len=cached_len,
                    new_token_ids=history[cached_len:], draft_token_ids=list(drafts),
                    sampling=RowSampling(temperature=0), prompt_len=len(PROMPT), features_from=features_from,
                    **options)
    request = VerifyRequest(batch_id=step, scheduler_id="sched-test", deadline=time.time() + 30, rows=[row])
    response, records = verify_batch(verifier, request)
    return response.rows[0], records


def draft(drafter, *rows):
    request = DraftRequest(batch_id=1, scheduler_id="sched-test", deadline=time.time() + 30,
                           rows=[r.model_copy(update={"row": i}) for i, r in enumerate(rows)])
    return {r.request_id: r for r in draft_batch(drafter, request).rows}


def drow(request_id, history, cached_len=0, features=None, num_draft=4, **sampling):
    return DraftRow(request_id=request_id, row=0, step=0, cached_len=cached_len, new_token_ids=history[cached_len:],
                    num_draft=num_draft, features=features,
                    sampling=RowSampling(**{"temperature": 0, **sampling}))


def hidden_states(target, tokens) -> torch.Tensor:
    """The target's final-normed hidden states of a whole-sequence prefill, (T, E) bf16."""
    cache = KVCache(target.config, 1, MAX_SEQ_LEN)
    _, hidden = forward(target, cache, torch.tensor([cache.allocate()]), torch.tensor([tokens]),
                        torch.tensor([len(tokens)]), return_hidden=True)
    return hidden[0].to(torch.bfloat16)


def rows_of(block: FeatureBlock) -> torch.Tensor:
    return unpack_features(block.data, tuple(block.shape))


def head_drafts(head_dir, target, tokens, k=4) -> list[int]:
    """What the head drafts after `tokens` on the target's own features, alone (eagle.draft_chain)."""
    head = load_head(head_dir, target, MAX_SEQ_LEN)
    cache = new_cache(head, 1, MAX_SEQ_LEN)
    N = len(tokens)
    feats = hidden_states(target, tokens)[:N - 1][None]
    drafts, _ = draft_chain(head, cache, torch.tensor([cache.allocate()]), feats, torch.tensor([tokens[1:]]),
                            torch.tensor([N - 1]), k)
    return drafts[0].tolist()


def prefill(verifier, request_id, prompt):
    """Prefill prompt asking every feature; (history after the first token, its features block)."""
    result, _ = verify(verifier, request_id, prompt, 0, features_from=0)
    return prompt + result.token_ids.tolist(), result.features


def test_the_drafter_drafts_what_the_head_drafts_on_the_targets_features(head_dir, tiny_target_model):
    verifier, drafter = new_verifier(), new_drafter(head_dir)
    long_history, long_block = prefill(verifier, "long", PROMPT)
    short_history, short_block = prefill(verifier, "short", SHORT_PROMPT)
    results = draft(drafter, drow("long", long_history, features=long_block),
                    drow("short", short_history, features=short_block, num_draft=2))
    assert results["long"].draft_token_ids.tolist() == head_drafts(head_dir, tiny_target_model, long_history)
    assert results["short"].draft_token_ids.tolist() == head_drafts(head_dir, tiny_target_model, short_history, k=2)
    assert results["long"].proposal.kind == "point_mass" and not results["long"].need_resync
    slot = drafter.requests[("sched-test", "long")].slot
    assert int(drafter.cache.lengths[slot]) == len(long_history) - 1  # the drafted pairs rolled back
    # the step repeated (its verify was lost): the last pair is fed again, the same drafts come
    again = draft(drafter, drow("long", long_history, cached_len=len(long_history)))
    assert again["long"].draft_token_ids.tolist() == results["long"].draft_token_ids.tolist()


def test_short_of_features_it_feeds_and_drafts_nothing_until_they_come(head_dir, tiny_target_model):
    verifier, drafter = new_verifier(), new_drafter(head_dir)
    history, block = prefill(verifier, "r", PROMPT)
    first = FeatureBlock(start=0, shape=[20, 192], data=block.data[:20 * 192 * 2])
    rest = FeatureBlock(start=15, shape=[len(PROMPT) - 15, 192], data=block.data[15 * 192 * 2:])  # overlaps
    assert len(draft(drafter, drow("r", history, features=first))["r"].draft_token_ids) == 0
    assert drafter.counters["rows_short_of_features"] == 1
    later = draft(drafter, drow("r", history, cached_len=len(history), features=rest))
    assert later["r"].draft_token_ids.tolist() == head_drafts(head_dir, tiny_target_model, history)


def test_missing_features_answer_need_resync(head_dir):
    verifier, drafter = new_verifier(), new_drafter(head_dir)
    history, block = prefill(verifier, "r", PROMPT)
    assert draft(drafter, drow("r", history, cached_len=5))["r"].need_resync  # a restarted drafter
    gap = FeatureBlock(start=3, shape=[2, 192], data=block.data[3 * 384:5 * 384])
    assert draft(drafter, drow("r", history, features=gap))["r"].need_resync  # pairs 0..2 are missing
    assert drafter.counters["slots_feature_gap"] == 1 and not drafter.requests
    assert len(draft(drafter, drow("r", history, features=block))["r"].draft_token_ids) == 4  # resynced


def test_a_block_of_another_width_refuses_the_batch_naming_the_field(head_dir):
    drafter = new_drafter(head_dir)
    wide = FeatureBlock(start=0, shape=[2, 64], data=bytes(256))
    with pytest.raises(SpecbusError, match="width 64") as raised:
        draft(drafter, drow("ok", PROMPT[:3]), drow("bad", PROMPT[:3], features=wide))
    assert (raised.value.code, raised.value.field) == (ErrorCode.invalid_field, "rows[1].features.shape")
    assert not drafter.requests


def test_sampled_rows_propose_the_head_distribution_and_gumbel_rows_the_coupled_draw(head_dir):
    verifier, drafter = new_verifier(), new_drafter(head_dir)
    history, block = prefill(verifier, "r", PROMPT)
    sampled = dict(temperature=0.8, top_p=0.9, seed=7)
    rows = [drow("s", history, features=block, coupling="rejection", **sampled),
            drow("g", history, features=block, coupling="gumbel", **sampled)]
    results = draft(drafter, *[r.model_copy(update={"draft_mode": "sample"}) for r in rows])
    assert results["g"].proposal.kind == "point_mass" and len(results["g"].draft_token_ids) == 4  # read by no one
    for result in [results["s"]]:
        proposal, drafts = result.proposal, result.draft_token_ids
        assert proposal.kind == "sparse" and len(drafts) == 4
        assert np.allclose(proposal.probs.sum(1), 1.0, atol=1e-5)
        assert all(d in ids[p > 0] for d, ids, p in zip(drafts, proposal.ids, proposal.probs))
    # the same seed and history draw the same drafts again (uniforms keyed by position)
    again = draft(new_drafter(head_dir), *[r.model_copy(update={"draft_mode": "sample"}) for r in rows])
    assert all(again[k].draft_token_ids.tolist() == results[k].draft_token_ids.tolist() for k in results)


def asks(row: DraftRow, max_nodes: int, draft_mode: str = "greedy") -> DraftRow:
    return DraftRow.model_validate({**row.model_dump(), "max_nodes": max_nodes, "draft_mode": draft_mode})


def test_a_row_that_asks_a_tree_gets_the_heads_eagle2_tree_and_the_verifier_takes_it(head_dir, tiny_target_model):
    verifier, drafter = new_verifier(), new_drafter(head_dir)
    history, block = prefill(verifier, "t", PROMPT)
    results = draft(drafter, asks(drow("t", history, features=block), 12))
    tree = results["t"]
    head = load_head(head_dir, tiny_target_model, MAX_SEQ_LEN)
    cache = new_cache(head, 1, MAX_SEQ_LEN)
    N = len(history)
    expected = draft_tree(head, cache, cache.allocate(), hidden_states(tiny_target_model, history)[:N - 1],
                          torch.tensor(history[1:]), 4, 12, 3)           # topk ceil(12 / 4)
    assert (tree.draft_token_ids.tolist(), tree.parents.tolist()) == expected
    assert len(expected[0]) == 12 and tree.proposal.kind == "point_mass" and drafter.counters["rows_tree"] == 1
    check_drafts(tree.draft_token_ids, tree.proposal, tree.parents)
    slot = drafter.requests[("sched-test", "t")].slot
    assert int(drafter.cache.lengths[slot]) == N - 1                       # the drafted pairs rolled back
    again = draft(drafter, asks(drow("t", history, cached_len=N), 12))    # the step repeated
    assert again["t"].draft_token_ids.tolist() == expected[0] and again["t"].parents.tolist() == expected[1]
    # the verifier's tree path takes it: greedy accepts the path the target's argmax follows
    result, _ = verify(verifier, "t", history, N, drafts=expected[0], parents=np.array(expected[1], dtype=np.int32))
    assert 1 <= len(result.token_ids) <= 5
    # a Gumbel-coupled row asks a tree too; a rejection-sampled or penalised row, or max_nodes == num_draft, a chain
    sampled = dict(features=block, temperature=0.8, seed=3)
    rows = [drow("g", history, coupling="gumbel", **sampled), drow("s", history, coupling="rejection", **sampled),
            drow("p", history, features=block, repetition_penalty=1.2), drow("c", history, features=block)]
    answers = draft(new_drafter(head_dir), *[asks(r, 4 if r.request_id == "c" else 12, "sample" if
                                                   r.sampling.temperature else "greedy") for r in rows])
    assert answers["g"].parents is not None and len(answers["g"].draft_token_ids) == 12
    # a Gumbel-coupled row's tree ranks by log q + the target's noise: its first path starts as its chain
    chain = draft(new_drafter(head_dir), asks(rows[0], 0, "sample"))["g"].draft_token_ids
    assert answers["g"].draft_token_ids[:2].tolist() == chain[:2].tolist() and answers["g"].parents[1] == 0
    assert all(answers[k].parents is None and len(answers[k].draft_token_ids) == 4 for k in "spc")


def test_a_head_for_another_target_is_refused_naming_both(tmp_path, head_dir):
    config = EagleConfig.from_target(read_config(TINY_TARGET))
    wrong = EagleConfig(**{**config.__dict__, "hidden_size": 64, "num_heads": 1})
    save_head(tmp_path, wrong, init_weights(wrong, seed=1), load_d2t(TINY_DRAFT))
    with pytest.raises(SpecbusError, match="hidden size 64 .*; the target has hidden size 192") as raised:
        new_drafter(tmp_path)
    assert raised.value.field == "eagle_head"
