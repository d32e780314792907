"""The shipped SmolLM2 draft (models/smollm2-draft, made by ops/train/distill_draft.py): its files load
as a drafter and its vocabulary map is consistent; on the pulled target, greedy decoding with k=4
drafts gives exactly the tokens of k=0, and a fair share of the drafts is accepted."""

import json

import pytest
import torch

from gpu_worker.runtime.checkpoint import load_d2t, read_config
from gpu_worker.drafter.drafter_core import load_drafter
from text.tokenizer import tokenizer_id
from ops.bench.inprocess import load_inprocess, run_requests
from schemas.config import DrafterConfig
from services.client import make_request

SMOLLM2_VOCAB = 49152
MAX_TOKENS = 24
REQUEST_TIMEOUT_S = 600.0  # a loaded machine is slow; the test is about tokens, not speed
QUESTIONS = ["What is the capital of France?", "Write a Python function that returns the square of a number."]


def test_draft_files_load_as_a_drafter(smollm2_draft):
    drafter = load_drafter(DrafterConfig(draft_model=str(smollm2_draft), dtype="float32", max_slots=1))
    maps = load_d2t(smollm2_draft)
    config = read_config(smollm2_draft)
    assert maps.draft_vocab_size == config.vocab_size
    assert maps.target_vocab_size == SMOLLM2_VOCAB == drafter.target_vocab_size
    proposable = torch.ones(maps.draft_vocab_size, dtype=torch.bool)
    proposable[maps.other_id] = False
    # every proposable draft id is a distinct target token, and comes back through t2d
    assert maps.d2t[proposable].unique().numel() == int(proposable.sum())
    assert bool((maps.t2d[maps.d2t[proposable]] == torch.nonzero(proposable).flatten()).all())
    # the end-of-turn token can be drafted, so answers can end on a drafted token
    eos = json.loads((smollm2_draft / "config.json").read_text())["eos_token_id"]
    assert int(maps.t2d[eos]) != maps.other_id
    weight_mb = sum(p.stat().st_size for p in smollm2_draft.glob("*.safetensors")) / 1e6
    assert weight_mb < 60, f"{weight_mb:.1f} MB of weights in git"


@pytest.mark.real_model
@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_greedy_k4_equals_k0_on_the_real_pair(smollm2_target, smollm2_draft, dtype, monkeypatch):
    """The tests' dtype float32: the target is the float32 model of its GGUF blocks; auto (the
    default stack): those blocks by integer dot products (weights int8dot), a bfloat16 draft."""
    monkeypatch.setenv("SPECBUS_DTYPE", dtype)
    assert tokenizer_id(smollm2_draft) == tokenizer_id(smollm2_target), "draft and target tokenizers differ"
    # a slot per request of both rounds: a slot is released with the next batch a model receives
    loop = load_inprocess(str(smollm2_target), str(smollm2_draft), max_slots=2 * len(QUESTIONS))
    outputs, accepted, drafted = {}, 0, 0
    for k in (0, 4):
        requests = [make_request(messages=[{"role": "user", "content": q}], max_tokens=MAX_TOKENS, temperature=0.0,
                                 num_speculative_tokens=k, ignore_eos=True, timeout_s=REQUEST_TIMEOUT_S)
                    for q in QUESTIONS]
        run = run_requests(loop, requests, concurrency=2)
        outputs[k] = [[t for c in run.chunks[r.request_id] for t in c.token_ids] for r in requests]
        if k:
            flags = [f for r in requests for c in run.chunks[r.request_id] for f in c.from_draft]
            accepted, drafted = sum(flags), len(flags)
    assert all(len(ids) == MAX_TOKENS for ids in outputs[0])
    assert outputs[4] == outputs[0]
    # with the shipped draft 16 of these 48 tokens came from accepted drafts (0.33); an
    # untrained draft (acceptance ~0.04) would be far below this floor
    assert accepted / drafted > 0.2, (accepted, drafted)
