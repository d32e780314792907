"""Loading HF checkpoint directories, model ids and d2t maps."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.runtime.checkpoint import (CheckpointError, load_d2t, load_model, model_id, save_d2t,
                                   weight_files)
from gpu_worker.runtime.kv_cache import KVCache
from gpu_worker.runtime.model import forward
from tests.tiny_checkpoints import write_hf_model

IDS = torch.arange(10)[None] * 7 % 97


def our_logits(path, dtype=torch.float32):
    model, config = load_model(path, dtype=dtype)
    cache = KVCache(config, 1, 16, dtype=dtype)
    return forward(model, cache, torch.tensor([cache.allocate()]), IDS, torch.tensor([10]))[0]


def test_sharded_checkpoint_loads_through_index(tmp_path):
    hf = write_hf_model(tmp_path, "llama", seed=0)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")  # overwrite with several shards
    (tmp_path / "model.safetensors").unlink()
    assert len(weight_files(tmp_path)) > 1
    with torch.no_grad():
        torch.testing.assert_close(our_logits(tmp_path), hf(IDS).logits[0], atol=1e-4, rtol=1e-4)


def test_tied_checkpoint_without_lm_head(tmp_path):
    hf = write_hf_model(tmp_path, "llama", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(our_logits(tmp_path), hf(IDS).logits[0], atol=1e-4, rtol=1e-4)


def test_half_precision_file_is_upcast(tmp_path):
    hf = write_hf_model(tmp_path, "qwen2")
    hf.half().save_pretrained(tmp_path)
    assert load_file(tmp_path / "model.safetensors")["model.norm.weight"].dtype == torch.float16
    logits = our_logits(tmp_path)
    assert logits.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(logits, hf.float()(IDS).logits[0], atol=1e-4, rtol=1e-4)


def test_missing_and_unexpected_tensors_are_listed(tmp_path):
    write_hf_model(tmp_path, "llama")
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.extra.weight"] = tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors \['layers.1.w_up'\], unexpected "
                                              r"tensors \['model.layers.0.mlp.extra.weight'\]"):
        load_model(tmp_path)


def test_directory_without_weights_lists_its_files(tmp_path):
    write_hf_model(tmp_path, "llama")
    (tmp_path / "model.safetensors").rename(tmp_path / "model.bin")
    with pytest.raises(CheckpointError, match="found: .*model.bin"):
        load_model(tmp_path)


def test_model_id_is_stable_and_tracks_config(tmp_path):
    write_hf_model(tmp_path, "llama")
    first = model_id(tmp_path)
    assert first == model_id(tmp_path) and first.startswith(tmp_path.name + "-")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert model_id(tmp_path) != first


def small_d2t():
    """Draft vocabulary of 4: ids 0..2 are target ids 5, 1, 8; draft id 3 is `other`."""
    d2t = torch.tensor([5, 1, 8, 0])
    t2d = torch.full((10,), 3)
    t2d[torch.tensor([5, 1, 8])] = torch.tensor([0, 1, 2])
    return d2t, t2d


def test_d2t_round_trip_and_absent(tmp_path):
    assert load_d2t(tmp_path) is None
    d2t, t2d = small_d2t()
    save_d2t(tmp_path, d2t, t2d, other_id=3)
    loaded = load_d2t(tmp_path)
    assert torch.equal(loaded.d2t, d2t) and torch.equal(loaded.t2d, t2d)
    assert (loaded.other_id, loaded.draft_vocab_size, loaded.target_vocab_size) == (3, 4, 10)


@pytest.mark.parametrize("change, message", [
    (lambda d2t, t2d: (d2t, t2d, 4), "other_id 4 outside"),
    (lambda d2t, t2d: (d2t.index_fill(0, torch.tensor([0]), 10), t2d, 3), "d2t values"),
    (lambda d2t, t2d: (d2t, t2d.index_fill(0, torch.tensor([0]), 7), 3), "t2d values"),
    (lambda d2t, t2d: (d2t, t2d.index_fill(0, torch.tensor([2]), 0), 3), r"target ids \[2\]"),
    (lambda d2t, t2d: (d2t.int(), t2d, 3), "int64"),
])
def test_d2t_validation(tmp_path, change, message):
    with pytest.raises(CheckpointError, match=message):
        save_d2t(tmp_path, *change(*small_d2t()))


def test_d2t_must_match_draft_vocabulary(tmp_path):
    write_hf_model(tmp_path, "llama")  # vocab_size 97, d2t has 4 draft ids
    save_d2t(tmp_path, *small_d2t(), other_id=3)
    with pytest.raises(CheckpointError, match="4 draft ids but config.json vocab_size is 97"):
        load_d2t(tmp_path)


def test_d2t_file_is_not_taken_for_weights(tmp_path):
    write_hf_model(tmp_path, "llama")
    save_d2t(tmp_path, *small_d2t(), other_id=3)
    assert [f.name for f in weight_files(tmp_path)] == ["model.safetensors"]
