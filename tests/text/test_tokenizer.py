"""Tokenizer loading and incremental detokenization on a tiny byte-level BPE."""

import dataclasses
import json
import subprocess
import sys

import msgpack
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from text.tokenizer import (DetokenizerState, detokenize_step, draft_misfit, eagle_misfit, load_tokenizer,
                                  new_detokenizer_state)
from schemas.config import DEFAULT_DRAFT, DEFAULT_EAGLE_HEAD, TINY_DRAFT, TINY_TARGET

LINES = ["héllo wörld ✓ 日本語", "def f(x):\n    return x  # ✓ done", "naïve café 😀 日本"]


@pytest.fixture
def tokenizer_dir(tmp_path):
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(LINES, trainer)
    hf.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_special_ids_prefer_tokenizer_config(tokenizer_dir):
    (tokenizer_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": [1, 0]}))
    assert load_tokenizer(tokenizer_dir).eos_ids == (1, 0)
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<s>"}))
    tokenizer = load_tokenizer(tokenizer_dir)
    assert (tokenizer.bos_id, tokenizer.eos_ids) == (0, (0,))


def test_encode_decode_round_trip(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    for line in LINES:
        assert tokenizer.decode(tokenizer.encode(line)) == line


def stream(tokenizer, ids, chunk=1, state=None):
    """Feed ids `chunk` at a time; (final state, text deltas)."""
    state, deltas = state or new_detokenizer_state(), []
    for i in range(0, len(ids), chunk):
        state, delta = detokenize_step(tokenizer, state, ids[i:i + chunk])
        deltas.append(delta)
    return state, deltas


@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_never_splits_a_character(tokenizer_dir, chunk):
    tokenizer = load_tokenizer(tokenizer_dir)
    text = " ".join(LINES) + " ✓✓ 語"  # unseen pairs: characters spread over several tokens
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode(ids[:n]) for n in range(len(ids)))  # test has teeth
    _, deltas = stream(tokenizer, ids, chunk)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text


def test_final_step_flushes_incomplete_character(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    ids = tokenizer.encode("ok 😺")  # not in the training lines: one token per byte
    cut = next(n for n in range(len(ids), 0, -1) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    state, deltas = stream(tokenizer, ids[:cut])
    state, last = detokenize_step(tokenizer, state, [], final=True)
    assert "".join(deltas) + last == tokenizer.decode(ids[:cut])


def test_state_survives_msgpack_between_postprocessors(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    ids = tokenizer.encode(LINES[0] + LINES[2])
    state, first = stream(tokenizer, ids[:7])
    resumed = DetokenizerState(**msgpack.unpackb(msgpack.packb(dataclasses.asdict(state))))
    _, rest = stream(tokenizer, ids[7:], state=resumed)
    assert "".join(first) + "".join(rest) == tokenizer.decode(ids)


def test_tokenizer_module_does_not_import_torch():
    code = "import text.tokenizer, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)



def test_a_draft_fits_its_target_and_a_misfit_is_named():
    assert draft_misfit(TINY_TARGET, TINY_DRAFT) is None
    why = draft_misfit(TINY_TARGET, DEFAULT_DRAFT)
    assert str(TINY_TARGET) in why and str(DEFAULT_DRAFT) in why and "tokenizer" in why


def test_an_eagle_head_fits_only_a_target_of_its_shape_and_a_misfit_names_both():
    why = eagle_misfit(TINY_TARGET, DEFAULT_EAGLE_HEAD)
    assert str(TINY_TARGET) in why and str(DEFAULT_EAGLE_HEAD) in why
    assert "hidden size 576 and vocabulary 49152" in why and "hidden size 192 and vocabulary 4096" in why


def test_the_shipped_eagle_head_fits_the_default_target(smollm2_target):
    assert eagle_misfit(smollm2_target, DEFAULT_EAGLE_HEAD) is None
