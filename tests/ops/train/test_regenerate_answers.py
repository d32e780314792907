"""ops/train/regenerate_answers.py on the tiny random target with a chat template: the file holds well-formed
conversations (the prompt rendered from the first human turn, the answer after it), greedy rows
are the ids of decoding the prompt alone, an interrupted run resumes to the same file, and
`accumulate --data` reads the file's shards (ops/train/train_eagle.py Shards)."""

import json
from pathlib import Path

import pytest
import torch

from gpu_worker.runtime.checkpoint import load_model
from gpu_worker.runtime.kv_cache import KVCache
from gpu_worker.runtime.model import forward
from tests.ops_scripts import load_ops_script, load_train_eagle
from text.chat_template import render_chat
from text.tokenizer import load_tokenizer

MAX_NEW = 8
CONVS = 14  # positions 0 .. 13 of the seeded order; batches of 4; shards of 4 in the last test


def load_regenerate():
    """A fresh module of ops/train/regenerate_answers.py."""
    return load_ops_script("regenerate_answers")


@pytest.fixture(scope="module")
def target(chatml_pair):
    """The tiny random target with a ChatML template, and its float32 model (loaded before any
    test moves SPECBUS_HOME: the linear kernel's build is there)."""
    return chatml_pair[0], load_model(chatml_pair[0], max_seq_len=256)


@pytest.fixture(scope="module")
def whole(target, tmp_path_factory) -> Path:
    """The file of one uninterrupted run over positions 0 .. CONVS - 1."""
    out = tmp_path_factory.mktemp("whole") / "answers.json"
    regenerate(load_regenerate(), target[0], out)
    return out


def sharegpt(n: int) -> list[dict]:
    """n ShareGPT-like conversations; c3 has no gpt reply to its human turn (skipped)."""
    words = "the quick brown fox jumps over the lazy dog while the cat sleeps".split()
    conversations = []
    for i in range(n):
        human = " ".join(words[i % 5:i % 5 + 3 + i % 7])
        turns = [{"from": "human", "value": human}, {"from": "gpt" if i != 3 else "human", "value": "an answer"}]
        conversations.append({"id": f"c{i}", "conversations": turns})
    return conversations


def regenerate(module, target: Path, out: Path, convs: int = CONVS, log=None) -> dict:
    return module.regenerate(target, out, start=0, convs=convs, batch=4, max_new=MAX_NEW, max_prompt=64,
                             sampled_every=3, conversations=sharegpt(CONVS), exclude=frozenset({"c5"}),
                             log=log or (lambda _: None))


@torch.inference_mode()
def plain_greedy(model, config, prompt: list[int], eos: tuple[int, ...]) -> list[int]:
    """One row alone, one token a forward: the reference for greedy rows."""
    cache = KVCache(config, max_slots=1, max_seq_len=len(prompt) + MAX_NEW)
    slot = torch.tensor([cache.allocate()])
    logits = forward(model, cache, slot, torch.tensor([prompt]), torch.tensor([len(prompt)]))
    out = [int(logits[0, -1].argmax())]
    while out[-1] not in eos and len(out) < MAX_NEW:
        out.append(int(forward(model, cache, slot, torch.tensor([[out[-1]]]), torch.tensor([1]))[0, -1].argmax()))
    return out


def test_conversations_are_well_formed_and_greedy_rows_decode_alone(target, whole):
    path, (model, config) = target
    data = json.loads(whole.read_text())
    tokenizer = load_tokenizer(path)
    eos = tuple(tokenizer.eos_ids)
    rows = data["conversations"]
    assert data["next_position"] == CONVS and len(rows) == CONVS - 2
    assert {r["id"] for r in rows}.isdisjoint({"c3", "c5"}) and [r["position"] for r in rows] == sorted(
        r["position"] for r in rows)
    assert any(r["sampled"] for r in rows) and not all(r["sampled"] for r in rows)
    for r in rows:
        human, gpt = r["conversations"]
        assert (human["from"], gpt["from"]) == ("human", "gpt") and r["sampled"] == (r["position"] % 3 == 0)
        prompt, answer = r["ids"][:r["prompt_len"]], r["ids"][r["prompt_len"]:]
        assert prompt == tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": human["value"]}]))
        assert 0 < len(answer) <= MAX_NEW and (answer[-1] in eos or len(answer) == MAX_NEW)
        assert not any(t in eos for t in answer[:-1])
        assert gpt["value"] == tokenizer.decode([t for t in answer if t not in eos])
        if not r["sampled"]:
            assert answer == plain_greedy(model, config, prompt, eos)


def test_an_interrupted_run_resumes_to_the_same_file(target, whole, tmp_path):
    path, _ = target
    module = load_regenerate()

    def interrupt(_):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        regenerate(module, path, tmp_path / "split.json", log=interrupt)        # stops after its first batch
    first = json.loads((tmp_path / "split.json").read_text())
    assert len(first["conversations"]) == 4 and 0 < first["next_position"] < CONVS
    regenerate(module, path, tmp_path / "split.json", convs=9)                   # a shorter goal, then the rest
    result = regenerate(module, path, tmp_path / "split.json")
    assert json.loads((tmp_path / "split.json").read_text()) == json.loads(whole.read_text())
    assert result["conversations"] == CONVS - 2 and result["run_answer_tokens"] < result["answer_tokens"]
    with pytest.raises(SystemExit, match="was written with"):
        module.regenerate(path, tmp_path / "split.json", start=0, convs=CONVS, max_new=MAX_NEW + 1,
                          conversations=sharegpt(CONVS))


def test_accumulate_reads_the_shards_of_the_file(target, whole, tmp_path, monkeypatch):
    path, (_, config) = target
    monkeypatch.setenv("SPECBUS_HOME", str(tmp_path / "home"))
    train_eagle = load_train_eagle()
    shards = train_eagle.Shards(path, shard_convs=4, max_len=64, device="cpu", keep=8, data=whole)
    written = {r["id"]: r for r in json.loads(whole.read_text())["conversations"]}
    rows = shards.get(0) + shards.get(1) + shards.get(2)                       # positions 12, 13: not a whole shard
    assert shards.get(3) is None and not (tmp_path / "home" / "eagle-data" / "feat-0000.safetensors").exists()
    assert (tmp_path / "home" / "eagle-data" / "regen-answers" / "feat-0002.safetensors").exists()
    assert sorted(r["id"] for r in rows) == sorted(i for i, r in written.items() if r["position"] < 12)
    for r in rows:
        assert r["ids"].tolist() == written[r["id"]]["ids"]
        assert r["features"].shape == (len(r["ids"]), config.hidden_size)
        assert r["start"] < written[r["id"]]["prompt_len"]
