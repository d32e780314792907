"""gpu_worker/batching/grammar_masks.py: llguidance's bitmask unpacked bit for bit (numpy), and the
in-place mask equal to torch's masked_fill in every dtype."""

import numpy as np
import pytest
import torch

from gpu_worker.batching.grammar_masks import mask_logits, mask_logits_, unpack


@pytest.mark.parametrize("vocab_size", [32, 100, 4096 + 7])
def test_unpack_gives_bit_j_of_word_w_as_token_32w_plus_j(vocab_size):
    words = np.random.default_rng(vocab_size).integers(-2**31, 2**31, size=(3, (vocab_size + 31) // 32),
                                                       dtype=np.int64).astype(np.int32)
    expected = torch.tensor([[bool((int(w) >> (t % 32)) & 1) for t in range(vocab_size) for w in [row[t // 32]]]
                             for row in words])
    allowed = unpack(words, vocab_size)
    assert allowed.dtype == torch.bool and torch.equal(allowed, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_in_place_mask_is_masked_fill(dtype):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 300, generator=generator).to(dtype)
    allowed = torch.rand(5, 300, generator=generator) < 0.3
    expected = mask_logits(logits[1], allowed)
    mask_logits_(logits[1], allowed)  # a view of a bigger tensor, as the verifier passes it
    assert torch.equal(logits[1], expected) and torch.isinf(logits[1][~allowed]).all()
