"""Fused-feature (EAGLE-3) heads on the tiny target: the forward that keeps the target's layer
inputs, the fused head's inference form against its training form, the loss of a last-feature
head unchanged, save / load, the speculative loop's lossless check, and a short train + held-out
agreement run over prefilled shards."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from gpu_worker.runtime.checkpoint import load_d2t, load_model
from gpu_worker.runtime.eagle import EagleConfig, build_head, head_forward, load_head, load_head_weights, new_cache
from gpu_worker.runtime.kv_cache import KVCache
from gpu_worker.runtime.model import forward, forward_layers
from ops.train.eagle_training import chain_losses, unrolled_forward
from gpu_worker.drafter.eagle_drafter import load_eagle_drafter
from schemas.config import TINY_DRAFT, TINY_TARGET, DrafterConfig, load_config
from schemas.errors import SpecbusError
from tests.ops_scripts import load_ops_script, load_train_eagle

LAYERS = (2, 5, 7)  # fused_layer_choice of the tiny target's 10 layers


@pytest.fixture(scope="module")
def target():
    return load_model(TINY_TARGET, max_seq_len=256)


@pytest.fixture(scope="module")
def ops():
    return load_ops_script("eagle_fused")


def fused_parts(ops, tconfig):
    config = dataclasses.replace(EagleConfig.from_target(tconfig), feature_layers=LAYERS)
    weights = ops.fused_init(config, None, seed=3)
    weights["fuse_norm"] = 1 + 0.1 * torch.randn(weights["fuse_norm"].shape, generator=torch.Generator().manual_seed(4))
    return config, weights, load_d2t(TINY_DRAFT)


def test_forward_layers_is_forward_and_keeps_the_layer_inputs(ops, target):
    model, tconfig = target
    assert ops.fused_layer_choice(tconfig.num_layers) == LAYERS
    ids = torch.randint(3, 300, (1, 30), generator=torch.Generator().manual_seed(1))
    n = torch.tensor([30])
    cache = KVCache(tconfig, max_slots=1, max_seq_len=64)
    logits, hidden = forward(model, cache, torch.tensor([cache.allocate()]), ids, n, return_hidden=True)
    cache = KVCache(tconfig, max_slots=1, max_seq_len=64)
    slot = torch.tensor([cache.allocate()])
    logits2, hidden2, kept = forward_layers(model, cache, slot, ids, n, (0,) + LAYERS)
    assert torch.equal(logits, logits2) and torch.equal(hidden, hidden2)
    E = tconfig.hidden_size
    assert kept.shape == (1, 30, 4 * E) and int(cache.lengths[int(slot)]) == 30
    assert torch.equal(kept[0, :, :E], model.embed[ids[0]])  # the stream entering layer 0 is the embedding


def test_fused_head_inference_matches_the_training_forward(ops, target):
    model, tconfig = target
    config, weights, maps = fused_parts(ops, tconfig)
    head = build_head(config, weights, maps, model, max_seq_len=256)
    g = torch.Generator().manual_seed(0)
    T, E = 24, config.hidden_size
    inputs = torch.randn(1, T, 3 * E, generator=g) * torch.tensor([0.5, 3.0, 20.0]).repeat_interleave(E)
    ids = torch.randint(0, config.target_vocab_size, (1, T), generator=g)
    first = ops.head_input(weights, config, None, inputs)
    steps = unrolled_forward(weights, config, model.embed, first, ids, 3)
    cache = new_cache(head, 1, 256)
    slot = torch.tensor([cache.allocate()])
    _, predicted = head_forward(head, cache, slot, inputs[:, :T - 1], ids[:, 1:], torch.tensor([T - 1]))
    torch.testing.assert_close(predicted, steps[0], atol=1e-4, rtol=1e-4)
    for t in (0, 11):  # a chain after verified pairs 0..t: its later steps read the head's own output
        cache.truncate(int(slot), 0)
        head_forward(head, cache, slot, inputs[:, :t + 1], ids[:, 1:t + 2], torch.tensor([t + 1]))
        _, p2 = head_forward(head, cache, slot, steps[0][:, t:t + 1], ids[:, t + 2:t + 3], torch.tensor([1]), own=True)
        torch.testing.assert_close(p2[0, 0], steps[1][0, t], atol=1e-4, rtol=1e-4)
    with pytest.raises(AssertionError):  # a fused head given last-layer features (the served path's) refuses
        head_forward(head, cache, slot, steps[0][:, :1], ids[:, :1], torch.tensor([1]))


def test_a_last_feature_head_has_chain_losses(ops, target):
    model, tconfig = target
    config = EagleConfig.from_target(tconfig)
    weights = ops.fused_init(config, None, seed=3)
    assert set(weights) == set(ops.weight_names(config)) == set(ops.weight_names())
    maps = load_d2t(TINY_DRAFT)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 300, (2, 20), generator=g)
    feats = torch.randn(2, 20, config.hidden_size, generator=g)
    lengths, starts = torch.tensor([20, 15]), torch.tensor([2, 3])
    lm_rows = model.embed[maps.d2t]
    want = chain_losses(weights, config, model.embed, lm_rows, maps.other_id, ids, feats, lengths, starts, 3)
    got = ops.fused_chain_losses(weights, config, model.embed, lm_rows, maps.other_id, ids, feats, None, lengths,
                                 starts, 3)
    for a, b in zip(want, got):
        assert a[3] == b[3] and all(torch.equal(x, y) for x, y in zip(a[:3], b[:3]))


def test_a_fused_head_round_trips_and_decodes_losslessly(ops, target, tmp_path):
    model, tconfig = target
    config, weights, maps = fused_parts(ops, tconfig)
    ops.export(Path(TINY_TARGET), config, weights, maps, tmp_path / "head")
    assert json.loads((tmp_path / "head" / "eagle_config.json").read_text())["feature_layers"] == list(LAYERS)
    loaded_config, loaded, _ = load_head_weights(tmp_path / "head")
    assert loaded_config == config and set(loaded) == set(weights)
    head = load_head(tmp_path / "head", model, max_seq_len=256)
    prompt = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    train_eagle = load_train_eagle()
    spec, stats = train_eagle.speculative_greedy(model, tconfig, head, prompt, 30, 4, eos_ids=())
    base, _ = train_eagle.speculative_greedy(model, tconfig, head, prompt, 30, 0, eos_ids=())
    assert spec == base and len(base) == 30 and stats["tried"][0] == stats["steps"]
    settings = dict(draft_method="eagle", eagle_head=str(tmp_path / "head"), target_model=str(TINY_TARGET),
                    instance_id="eagle-test", max_slots=2, max_seq_len=256, dtype="float32")
    with pytest.raises(SpecbusError, match="fused target layers") as raised:  # the verifier ships the last layer only
        load_eagle_drafter(load_config(DrafterConfig, env={}, **settings))
    assert raised.value.field == "eagle_head"


def test_train_both_kinds_then_score_the_held_out_shards(ops, target, tmp_path, monkeypatch):
    model, tconfig = target
    monkeypatch.setenv("SPECBUS_HOME", str(tmp_path / "home"))
    data = tmp_path / "answers.json"
    # four shards of 2 positions (shard 3 held out); features prefilled as prefill_fused writes them
    data.write_text(json.dumps({"next_position": 8, "conversations": [{"id": f"c{p}", "position": p} for p in range(8)]}))
    directory = ops.fused_dir(data)
    cache = KVCache(tconfig, max_slots=1, max_seq_len=256)
    g = torch.Generator().manual_seed(7)
    for n in range(4):
        last, fused = [], []
        for p in (2 * n, 2 * n + 1):
            ids = torch.randint(3, 300, (30 + 5 * p,), generator=g)
            slot = cache.allocate()
            _, hidden, kept = forward_layers(model, cache, torch.tensor([slot]), ids.view(1, -1),
                                                torch.tensor([len(ids)]), LAYERS)
            cache.free(slot)
            last.append({"id": f"c{p}", "start": 2, "ids": ids, "features": hidden[0]})
            fused.append({"id": f"c{p}", "start": 2, "ids": ids, "features": kept[0]})
        ops.write_shard(ops.shard_path(n, directory), last)
        ops.write_shard(ops.fused_shard_path(n, directory), fused)
    assert ops.split_shards(ops.file_shards(data, 2)[0], 1) == ([0, 1, 2], [3])
    results = {}
    for kind in ("last", "fused"):
        out = tmp_path / kind
        trained = ops.train_fused(Path(TINY_TARGET), data, kind, 100, 2, 3e-3, 2, 1, 2, "cpu", out, vocab_head=TINY_DRAFT)
        assert trained["steps"] == 2 and trained["tokens"] == 30 + 35 + 40 + 45  # stops at the goal's step
        results[kind] = ops.fused_agreement(Path(TINY_TARGET), data, out, 2, 1, 2, 4, "cpu")
        assert results[kind]["held_out_shards"] == [3] and 0 <= results[kind]["agreement"][0] <= 1
    assert load_head_weights(tmp_path / "fused")[0].feature_layers == LAYERS
    assert results["last"]["positions"] == results["fused"]["positions"] == [58 + 63] * 2  # from each loss start on
