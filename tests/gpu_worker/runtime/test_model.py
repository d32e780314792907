"""Decoder equivalence with transformers on tiny random checkpoints, and the batched forward."""

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.runtime.checkpoint import load_model
from gpu_worker.runtime.kv_cache import KEY_BLOCK, KVCache
from gpu_worker.runtime.model import (
    MASKED,
    ConfigError,
    ModelConfig,
    attention,
    attention_plan,
    block_attention,
    forward,
    linear,
)
from tests.tiny_checkpoints import write_hf_model

V = 97  # conftest TINY vocab_size


def hf_logits(hf_model, ids):
    """transformers' logits for one full sequence ids (T,) -> (T, V)."""
    with torch.no_grad():
        return hf_model(ids[None]).logits[0]


def append(model, cache, slot, ids):
    """Append ids (T,) to one slot; logits (T, V)."""
    return forward(model, cache, torch.tensor([slot]), ids[None], torch.tensor([len(ids)]))[0]


@pytest.mark.parametrize("family, overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"attention_bias": True, "num_key_value_heads": 4}),
    ("qwen2", {}),
    ("mistral", {"num_key_value_heads": 1, "head_dim": 16}),
])
def test_full_sequence_logits_match_transformers(tmp_path, family, overrides):
    hf = write_hf_model(tmp_path, family, **overrides)
    model, config = load_model(tmp_path)
    ids = torch.randint(0, V, (24,), generator=torch.Generator().manual_seed(1))
    cache = KVCache(config, max_slots=2, max_seq_len=32)
    torch.testing.assert_close(append(model, cache, cache.allocate(), ids), hf_logits(hf, ids),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_incremental_decoding_equals_full_forward(tmp_path, family):
    hf = write_hf_model(tmp_path, family)
    model, config = load_model(tmp_path)
    ids = torch.randint(0, V, (16,), generator=torch.Generator().manual_seed(2))
    cache = KVCache(config, max_slots=1, max_seq_len=16)
    slot = cache.allocate()
    steps = [append(model, cache, slot, ids[:6])]
    steps += [append(model, cache, slot, ids[t:t + 1]) for t in range(6, 16)]
    torch.testing.assert_close(torch.cat(steps), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)
    assert int(cache.lengths[slot]) == 16


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1]], ids=["consecutive", "scattered"])
def test_ragged_batch_equals_each_row_alone(tmp_path, order):
    write_hf_model(tmp_path, "llama")
    model, config = load_model(tmp_path)
    g = torch.Generator().manual_seed(3)
    prefixes = [torch.randint(0, V, (n,), generator=g) for n in (0, 9, 4)]
    new = torch.randint(0, V, (3, 6), generator=g)
    num_new = torch.tensor([6, 5, 0])  # a prefill chunk, a verify row, a row that adds nothing

    alone, batched = KVCache(config, 3, 24), KVCache(config, 3, 24)
    expected = []
    for slot, prefix, row, n in zip(range(3), prefixes, new, num_new.tolist()):
        for cache in (alone, batched):
            assert cache.allocate() == slot
            if len(prefix):
                append(model, cache, slot, prefix)
        expected.append(append(model, alone, slot, row[:n]) if n else None)
    untouched_k = batched.tensors(2)[0][:, :, :24].clone()  # the scratch column 24 may change

    rows = torch.tensor(order)
    logits = forward(model, batched, rows, new[rows], num_new[rows])
    for b, slot in enumerate(order):
        n = int(num_new[slot])
        if n:
            torch.testing.assert_close(logits[b, :n], expected[slot], atol=1e-5, rtol=1e-5)
    assert batched.lengths.tolist() == [6, 14, 4]
    assert torch.equal(batched.tensors(2)[0][:, :, :24], untouched_k)


def test_truncate_then_append_equals_never_appending_rejected(tmp_path):
    write_hf_model(tmp_path, "qwen2")
    model, config = load_model(tmp_path)
    g = torch.Generator().manual_seed(4)
    prefix, drafts, recovered = (torch.randint(0, V, (n,), generator=g) for n in (7, 4, 2))
    spec, plain = KVCache(config, 1, 16), KVCache(config, 1, 16)
    slot = spec.allocate()
    assert plain.allocate() == slot
    append(model, spec, slot, prefix)
    append(model, spec, slot, drafts)
    spec.truncate(slot, 7 + 1)  # one draft accepted, three rejected
    got = append(model, spec, slot, recovered)
    append(model, plain, slot, torch.cat([prefix, drafts[:1]]))
    torch.testing.assert_close(got, append(model, plain, slot, recovered), atol=1e-5, rtol=1e-5)


def test_chunked_prefill_equals_one_shot(tmp_path):
    write_hf_model(tmp_path, "llama")
    model, config = load_model(tmp_path)
    prompt = torch.randint(0, V, (20,), generator=torch.Generator().manual_seed(5))
    chunked, one_shot = KVCache(config, 1, 24), KVCache(config, 1, 24)
    slot = chunked.allocate()
    assert one_shot.allocate() == slot
    last = [append(model, chunked, slot, prompt[i:i + 7])[-1] for i in range(0, 20, 7)][-1]
    torch.testing.assert_close(last, append(model, one_shot, slot, prompt)[-1], atol=1e-5, rtol=1e-5)
    next_token = prompt[:1]
    torch.testing.assert_close(append(model, chunked, slot, next_token),
                               append(model, one_shot, slot, next_token), atol=1e-5, rtol=1e-5)


def test_logits_index_selects_positions(tmp_path):
    write_hf_model(tmp_path, "llama")
    model, config = load_model(tmp_path)
    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(6))
    full_cache, picked_cache = KVCache(config, 2, 8), KVCache(config, 2, 8)
    for cache in (full_cache, picked_cache):
        cache.allocate(), cache.allocate()
    slots, num_new = torch.tensor([0, 1]), torch.tensor([5, 3])
    full = forward(model, full_cache, slots, ids, num_new)
    index = torch.tensor([[4], [2]])  # each row's last new token
    picked = forward(model, picked_cache, slots, ids, num_new, logits_index=index)
    assert picked.shape == (2, 1, V)
    torch.testing.assert_close(picked[:, 0], torch.stack([full[0, 4], full[1, 2]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_returning_the_hidden_states_leaves_the_logits_bit_for_bit(tmp_path, dtype):
    write_hf_model(tmp_path, "llama")
    model, config = load_model(tmp_path, dtype=dtype)
    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(7))
    slots, num_new = torch.tensor([0, 1]), torch.tensor([5, 3])
    for index in (None, torch.tensor([[4, 0], [2, 1]])):
        plain_cache, hidden_cache = KVCache(config, 2, 8, dtype=dtype), KVCache(config, 2, 8, dtype=dtype)
        for cache in (plain_cache, hidden_cache):
            cache.allocate(), cache.allocate()
        plain = forward(model, plain_cache, slots, ids, num_new, logits_index=index)
        logits, hidden = forward(model, hidden_cache, slots, ids, num_new, logits_index=index, return_hidden=True)
        assert hidden.shape == (2, 5, config.hidden_size) and torch.equal(logits, plain)
        rows = hidden if index is None else hidden.gather(1, index.unsqueeze(-1).expand(-1, -1, config.hidden_size))
        assert torch.equal(linear(rows.reshape(-1, config.hidden_size), model.lm_head).view(logits.shape), logits)


@pytest.mark.parametrize("B, T, H, Hkv", [(1, 1, 9, 3), (2, 7, 6, 2), (1, 5, 4, 4)])
def test_attention_over_several_key_blocks_matches_sdpa(B, T, H, Hkv):
    """Each row's key blocks combined (2 to 3 blocks, a row's keys ending in any of them) give
    causal attention; rows ahead of the others, so blocks a row cannot see are in the window."""
    g, D, W = torch.Generator().manual_seed(8), 64, 3 * KEY_BLOCK
    q = torch.randn(B, T, H, D, generator=g)
    k, v = torch.randn(2, B, Hkv, W, D, generator=g)
    pos = torch.tensor([KEY_BLOCK - 3, 2 * KEY_BLOCK + 10][:B]).view(B, 1) + torch.arange(T)
    got = attention(q, k, v, attention_plan(pos, Hkv, H // Hkv, W)).view(B, T, H, D)
    visible = torch.arange(W) <= pos[:, None, :, None]                    # (B, 1, T, W)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible, enable_gqa=True)
    torch.testing.assert_close(got, want.transpose(1, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_attention_bits_do_not_depend_on_the_window(dtype):
    """What the forward's window groups rely on (grouped_attention): rows whose keys end in the
    first or second block give the same bits over a window of their own blocks as over one of
    four blocks (zeros and masked keys after theirs)."""
    g, D, H, Hkv, T = torch.Generator().manual_seed(11), 64, 9, 3, 3
    pos = torch.tensor([[KEY_BLOCK - 4], [KEY_BLOCK + 40]]) + torch.arange(T)   # (2, T): in blocks 1 and 2
    q = torch.randn(2, T, H, D, generator=g).to(dtype)
    k, v = torch.randn(2, 2, Hkv, 4 * KEY_BLOCK, D, generator=g).to(dtype)
    wide = attention(q, k, v, attention_plan(pos, Hkv, H // Hkv, 4 * KEY_BLOCK)).view(2, T * H * D)
    for b, blocks in ((0, 1), (1, 2)):
        W = blocks * KEY_BLOCK
        own = attention(q[b:b + 1], k[b:b + 1, :, :W], v[b:b + 1, :, :W], attention_plan(pos[b:b + 1], Hkv, H // Hkv, W))
        assert torch.equal(own.view(-1), wide[b])


def test_block_attention_matches_the_cpu_flash_kernel():
    """block_attention, attention's path off the CPU, returns what the flash kernel does (rows
    that see no key of the block included: their lse is near MASKED, so their block weighs 0)."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 5, 4, 64, generator=g)
    k, v = torch.randn(2, 2, 5, KEY_BLOCK, 64, generator=g)
    mask = torch.where(torch.rand(2, 5, 4, KEY_BLOCK, generator=g) < 0.5, MASKED, 0.0)
    mask[0, 0, 1] = MASKED                                                # a row that sees nothing
    out, lse = block_attention(q, k, v, mask, 0.125)
    want_out, want_lse = torch._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=0.125)[:2]
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)
    seen = lse > MASKED / 2
    assert not seen.all()
    torch.testing.assert_close(out[seen], want_out[seen], atol=1e-5, rtol=1e-5)


def test_unsupported_architecture_is_named():
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10})


def test_unsupported_rope_scaling_is_refused():
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
          "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
          "max_position_embeddings": 64, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ConfigError, match="yarn"):
        ModelConfig.from_hf(hf)


def test_transformers_4_config_layout():
    config = ModelConfig.from_hf({
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 64, "rope_theta": 1e6,
        "rope_scaling": None, "sliding_window": 32})
    assert (config.rope_theta, config.head_dim, config.qkv_bias, config.o_bias) == (1e6, 4, True, False)


def test_missing_field_is_named():
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 10,
                             "num_attention_heads": 2})
