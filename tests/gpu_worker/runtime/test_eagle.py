"""The EAGLE head on the tiny target: inference (slot cache, chain) against the training forward,
rollback, batch invariance, save/load; and ops/train/train_eagle.py: a few training steps on real
tiny-target features, and the speculative loop's lossless check (greedy == k=0)."""

import json
from pathlib import Path

import pytest
import torch

from gpu_worker.runtime.checkpoint import load_d2t, load_model
from gpu_worker.runtime.eagle import (EagleConfig, build_head, draft_chain, draft_tree, head_forward, load_head,
                                      load_head_weights, new_cache, pack_features, unpack_features)
from gpu_worker.runtime.tree_draft import DraftNode, preorder
from gpu_worker.runtime.kv_cache import KVCache
from gpu_worker.runtime.model import ConfigError
from ops.train.eagle_training import init_weights, save_head, unrolled_forward
from schemas.arrays import ROOT_PARENT
from schemas.config import TINY_DRAFT, TINY_TARGET
from schemas.steps import tree_depths
from tests.ops_scripts import load_train_eagle




@pytest.fixture(scope="module")
def target():
    return load_model(TINY_TARGET, max_seq_len=256)


@pytest.fixture(scope="module")
def head_parts(target):
    _, tconfig = target
    config = EagleConfig.from_target(tconfig)
    return config, init_weights(config, seed=1), load_d2t(TINY_DRAFT)


def test_inference_matches_the_unrolled_training_forward(target, head_parts):
    model, _ = target
    config, weights, maps = head_parts
    head = build_head(config, weights, maps, model, max_seq_len=256)
    g = torch.Generator().manual_seed(0)
    T = 24
    feats = torch.randn(1, T, config.hidden_size, generator=g)
    ids = torch.randint(0, config.target_vocab_size, (1, T), generator=g)
    steps = unrolled_forward(weights, config, model.embed, feats, ids, 3)
    assert [s.shape for s in steps] == [(1, T - 1, config.hidden_size)] * 3
    cache = new_cache(head, 1, 256)
    slot = torch.tensor([cache.allocate()])
    _, predicted = head_forward(head, cache, slot, feats[:, :T - 1], ids[:, 1:], torch.tensor([T - 1]))
    torch.testing.assert_close(predicted, steps[0], atol=1e-4, rtol=1e-4)
    for t in (0, 7, 19):  # a chain after verified pairs 0..t: steps 2 and 3 at row t
        cache.truncate(int(slot), 0)
        head_forward(head, cache, slot, feats[:, :t + 1], ids[:, 1:t + 2], torch.tensor([t + 1]))
        _, p2 = head_forward(head, cache, slot, steps[0][:, t:t + 1], ids[:, t + 2:t + 3], torch.tensor([1]))
        _, p3 = head_forward(head, cache, slot, p2, ids[:, t + 3:t + 4], torch.tensor([1]))
        torch.testing.assert_close(p2[0, 0], steps[1][0, t], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(p3[0, 0], steps[2][0, t], atol=1e-4, rtol=1e-4)


def test_draft_chain_rolls_back_and_a_row_does_not_depend_on_its_neighbour(target, head_parts):
    model, _ = target
    config, weights, maps = head_parts
    head = build_head(config, weights, maps, model, max_seq_len=256)
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(2, 9, config.hidden_size, generator=g)
    ids = torch.randint(0, config.target_vocab_size, (2, 9), generator=g)
    num_new = torch.tensor([9, 4])
    cache = new_cache(head, 4, 64)
    slots = torch.tensor([cache.allocate(), cache.allocate()])
    drafts, logits = draft_chain(head, cache, slots, feats, ids, num_new, k=4)
    assert drafts.shape == (2, 4) and logits.shape == (2, 4, maps.draft_vocab_size)
    assert cache.lengths[slots].tolist() == [9, 4]                  # drafted pairs rolled back
    assert torch.isin(drafts, maps.d2t[:-1]).all()                    # never "other"
    assert torch.equal(maps.d2t[logits.argmax(-1)], drafts)
    alone = new_cache(head, 1, 64)
    slot = torch.tensor([alone.allocate()])
    one, one_logits = draft_chain(head, alone, slot, feats[1:, :4], ids[1:, :4], torch.tensor([4]), k=4)
    assert torch.equal(one, drafts[1:]) and torch.equal(one_logits, logits[1:])
    # a second step continues from the verified pairs, as after an all-accepted verify
    more, _ = draft_chain(head, alone, slot, feats[1:, 4:6], ids[1:, 4:6], torch.tensor([2]), k=2)
    assert more.shape == (1, 2) and int(alone.lengths[int(slot)]) == 6


def tree_by_paths(head, cache, slot, feats, ids, depth, max_nodes, topk):
    """draft_tree's EAGLE-2 tree the slow way: every expanded node's path fed again as a chain of
    its own pairs (head_forward), then rolled back."""
    slots = torch.tensor([slot])
    logits, predicted = head_forward(head, cache, slots, feats[None], ids[None], torch.tensor([len(ids)]),
                                     logits_index=torch.tensor([[len(ids) - 1]]))
    committed, nodes, inputs = int(cache.lengths[slot]), [], []

    def expand(parent, logits, predicted, score, level):
        logprobs, draft = torch.log_softmax(logits.float(), -1).topk(topk)
        start = len(nodes)
        for lp, i in zip(logprobs.tolist(), draft.tolist()):
            nodes.append(DraftNode(score + lp, level, parent, i))
            inputs.append(predicted)                     # the feature of the node's own pair
        return list(range(start, len(nodes)))

    children = expand(ROOT_PARENT, logits[0, 0], predicted[0, 0], 0.0, 1)
    for level in range(2, depth + 1):
        chosen, children = sorted(sorted(children, key=lambda n: -nodes[n].score)[:topk]), []
        for n in chosen:
            path = [n]
            while nodes[path[-1]].parent != ROOT_PARENT:
                path.append(nodes[path[-1]].parent)
            path.reverse()
            logits, predicted = head_forward(head, cache, slots, torch.stack([inputs[m] for m in path])[None],
                                             head.d2t[torch.tensor([[nodes[m].draft_id for m in path]])],
                                             torch.tensor([len(path)]), logits_index=torch.tensor([[len(path) - 1]]),
                                             own=True)
            cache.truncate(slot, committed)
            children += expand(n, logits[0, 0], predicted[0, 0], nodes[n].score, level)
    kept = sorted(sorted(range(len(nodes)), key=lambda n: (-nodes[n].score, nodes[n].depth))[:max_nodes])
    return preorder(nodes, kept, head.d2t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("topk, depth, max_nodes", [(1, 4, 4), (2, 4, 8), (3, 4, 12), (4, 5, 16), (2, 1, 3)])
def test_draft_tree_is_eagle2_by_paths_and_rolls_back(target, head_parts, dtype, topk, depth, max_nodes):
    """One head step a level over the tree's columns gives the tree of feeding every path alone
    (the same ids and parents), the slot ends with the verified pairs, and topk 1 is the chain."""
    model = target[0] if dtype == torch.float32 else load_model(TINY_TARGET, dtype=dtype, max_seq_len=256)[0]
    config, weights, maps = head_parts
    head = build_head(config, weights, maps, model, max_seq_len=256)
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(7, config.hidden_size, generator=g)
    ids = torch.randint(0, config.target_vocab_size, (7,), generator=g)
    cache, reference = new_cache(head, 2, 64), new_cache(head, 2, 64)
    slot, other = cache.allocate(), reference.allocate()
    # a history first, so the tree's columns attend over pairs of earlier steps too
    head_forward(head, cache, torch.tensor([slot]), feats[None, :3], ids[None, :3], torch.tensor([3]))
    head_forward(head, reference, torch.tensor([other]), feats[None, :3], ids[None, :3], torch.tensor([3]))
    tokens, parents = draft_tree(head, cache, slot, feats[3:], ids[3:], depth, max_nodes, topk)
    assert (tokens, parents) == tree_by_paths(head, reference, other, feats[3:], ids[3:], depth, max_nodes, topk)
    assert int(cache.lengths[slot]) == 7 and len(tokens) == min(max_nodes, topk * depth)
    assert int(tree_depths(torch.tensor(parents, dtype=torch.int32).numpy()).max()) <= depth
    if topk == 1:
        again = new_cache(head, 1, 64)
        one = again.allocate()
        chain, _ = draft_chain(head, again, torch.tensor([one]), feats[None], ids[None], torch.tensor([7]), k=depth)
        assert tokens == chain[0].tolist() and parents == [ROOT_PARENT] + list(range(depth - 1))
    # the next step continues from the verified pairs: the same tree as a fresh slot fed them all
    more = draft_tree(head, cache, slot, feats[:1], ids[:1], depth, max_nodes, topk)
    fresh = new_cache(head, 1, 64)
    assert more == draft_tree(head, fresh, fresh.allocate(), torch.cat([feats, feats[:1]]),
                              torch.cat([ids, ids[:1]]), depth, max_nodes, topk)


def test_save_and_load_round_trip_in_bf16(tmp_path, target, head_parts):
    model, _ = target
    config, weights, maps = head_parts
    save_head(tmp_path, config, weights, maps)
    config2, weights2, maps2 = load_head_weights(tmp_path)
    assert config2 == config and torch.equal(maps2.d2t, maps.d2t)
    assert all(torch.equal(weights2[n], weights[n].to(torch.bfloat16).float()) for n in weights)
    assert load_head(tmp_path, model).lm_rows is not None
    data = json.loads((tmp_path / "eagle_config.json").read_text())
    (tmp_path / "eagle_config.json").write_text(json.dumps({**data, "num_heads": 0}))
    with pytest.raises(ConfigError, match="num_heads must be positive"):
        load_head_weights(tmp_path)


def test_features_travel_as_bf16_bytes():
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(3))
    data = pack_features(x)
    assert len(data) == 5 * 576 * 2
    assert torch.equal(unpack_features(data, (5, 576)), x.to(torch.bfloat16))
    with pytest.raises(ValueError, match="rows.features: 5760 bytes"):
        unpack_features(data, (4, 576), field="rows.features")


def test_a_few_training_steps_learn_and_the_speculative_loop_is_lossless(tmp_path, monkeypatch, target):
    ops = load_train_eagle()
    model, tconfig = target
    monkeypatch.setenv("SPECBUS_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(ops, "WORK", tmp_path / "work")
    monkeypatch.setattr(ops, "OUT", tmp_path / "head")
    monkeypatch.setattr(ops, "DRAFT_VOCAB", 512)
    # real tiny-target features of a few token sequences (the tiny tokenizer has no chat template)
    cache = KVCache(tconfig, max_slots=1, max_seq_len=256)
    g = torch.Generator().manual_seed(2)
    rows = []
    for i in range(6):
        ids = torch.randint(3, 300, (40 + 10 * i,), generator=g)
        rows.append({"id": f"c{i}", "start": 2, "ids": ids,
                     "features": ops.conversation_features(model, tconfig, cache, ids.tolist(), "cpu")})
    ops.data_dir().mkdir(parents=True)
    ops.write_shard(ops.data_dir() / "feat-0000.safetensors", rows[:3])
    ops.write_shard(ops.data_dir() / "feat-0001.safetensors", rows[3:])
    assert [r["id"] for r in ops.load_shards(ops.shard_paths())] == [r["id"] for r in rows]

    ops.train(Path(TINY_TARGET), steps=12, batch=3, peak_lr=3e-3, unroll=2, reg_weight=1.0, init_layer=None,
              resume=False, follow=False, device="cpu", vocab_text_convs=0)
    ckpt = torch.load(ops.WORK / "head.pt", weights_only=False)
    assert ckpt["step"] == 12 and (ops.OUT / "model.safetensors").exists()
    config, weights, maps = load_head_weights(ops.OUT)
    assert maps.draft_vocab_size == 512

    def loss(w):
        batch = ops.batch_tensors(rows, "cpu")
        lm_rows = model.embed[maps.d2t]
        with torch.no_grad():
            return sum(ce.item() for _, ce, _, _ in ops.chain_losses(w, config, model.embed, lm_rows, maps.other_id,
                                                                     *batch, steps=2))
    assert loss(weights) < loss(init_weights(config, ops.target_weights(Path(TINY_TARGET)), seed=ops.SEED))

    ops.train(Path(TINY_TARGET), steps=14, batch=3, peak_lr=3e-3, unroll=2, reg_weight=1.0, init_layer=None,
              resume=True, follow=False, device="cpu", vocab_text_convs=0)
    assert torch.load(ops.WORK / "head.pt", weights_only=False)["step"] == 14

    head = load_head(ops.OUT, model, max_seq_len=256)
    prompt = rows[0]["ids"][:20].tolist()
    spec, stats = ops.speculative_greedy(model, tconfig, head, prompt, 30, 4, eos_ids=())
    base, base_stats = ops.speculative_greedy(model, tconfig, head, prompt, 30, 0, eos_ids=())
    assert spec == base and len(base) == 30
    assert base_stats["steps"] == 29 and stats["steps"] <= 29
    assert stats["tried"][0] == stats["steps"] and all(a <= t for a, t in zip(stats["accepted"], stats["tried"]))
