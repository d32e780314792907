"""ops/train/train_eagle.py `accumulate` on the tiny target: a run stopped (between rounds or in the
middle of one) and resumed from its checkpoint file takes bit-identical steps to one that went on
in process; the data position, step and token count advance; a head directory can seed it."""

from pathlib import Path

import pytest
import torch

from gpu_worker.runtime.checkpoint import load_model
from gpu_worker.runtime.kv_cache import KVCache
from ops.train.eagle_training import SERVED_CONVS, accumulate_start, load_state, state_home
from schemas.config import TINY_TARGET
from tests.ops_scripts import load_train_eagle

SHARD_CONVS = 3
SHARDS = 4



@pytest.fixture(scope="module")
def target():
    return load_model(TINY_TARGET, max_seq_len=128)  # before SPECBUS_HOME moves: the kernel's build is there


@pytest.fixture
def ops(tmp_path, monkeypatch, target):
    """train_eagle with SHARDS feature shards of real tiny-target features on disk (so nothing is
    prefilled from ShareGPT), a 512-id draft vocabulary and its head exported under tmp_path."""
    module = load_train_eagle()
    monkeypatch.setenv("SPECBUS_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(module, "OUT", tmp_path / "head")
    monkeypatch.setattr(module, "DRAFT_VOCAB", 512)
    model, tconfig = target
    cache = KVCache(tconfig, max_slots=1, max_seq_len=128)
    g = torch.Generator().manual_seed(3)
    module.data_dir().mkdir(parents=True)
    for n in range(SHARDS):
        rows = []
        for i in range(SHARD_CONVS):
            ids = torch.randint(3, 300, (20 + 7 * i + 3 * n,), generator=g)
            rows.append({"id": f"c{n}-{i}", "start": 2, "ids": ids,
                         "features": module.conversation_features(model, tconfig, cache, ids.tolist(), "cpu")})
        module.write_shard(module.shard_path(n), rows)
    return module


def run(ops, state: Path, tokens: int, stop=None) -> dict:
    return ops.accumulate(TINY_TARGET, tokens, batch=2, lr=3e-3, unroll=2, reg_weight=1.0, replay=1.0, device="cpu",
                          state_dir=state, shard_convs=SHARD_CONVS, max_len=128, vocab_convs=0, save_every_s=0.0,
                          stop=stop)


def shard_tokens(ops, n: int) -> int:
    return sum(len(r["ids"]) for r in ops.load_shards([ops.shard_path(n)]))


def stop_after(calls: int):
    """A stop() that turns true at its calls-th call: accumulate asks after every step."""
    count = [0]

    def stop():
        count[0] += 1
        return count[0] >= calls
    return stop


def test_a_resumed_run_takes_the_steps_of_one_that_went_on(ops, tmp_path):
    total = sum(shard_tokens(ops, n) for n in range(SHARDS))
    whole = run(ops, tmp_path / "whole", total)
    assert whole["position"] == SHARDS * SHARD_CONVS and whole["round_step"] == 0
    assert whole["tokens"] == total == whole["run_tokens"] and whole["step"] == whole["adam_step"] > SHARDS

    first = run(ops, tmp_path / "split", shard_tokens(ops, 0) + shard_tokens(ops, 1))   # stops between rounds
    assert first["position"] == 2 * SHARD_CONVS and first["round_step"] == 0
    middle = run(ops, tmp_path / "split", total, stop=stop_after(3))                    # stops inside round 2
    assert middle["position"] == 2 * SHARD_CONVS and middle["round_step"] == 2
    assert load_state(tmp_path / "split")[3]["step"] == first["step"] + 2
    last = run(ops, tmp_path / "split", total - first["run_tokens"] - middle["run_tokens"])
    assert {k: last[k] for k in ("step", "adam_step", "position", "tokens", "round_step")} == \
        {k: whole[k] for k in ("step", "adam_step", "position", "tokens", "round_step")}

    a, b = load_state(tmp_path / "whole"), load_state(tmp_path / "split")
    assert all(torch.equal(a[0][n], b[0][n]) for n in a[0])                             # weights
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][n], b[1][n]) for n in a[1])  # second moments
    assert torch.equal(a[2].d2t, b[2].d2t)


def test_a_head_directory_seeds_the_first_run(ops, tmp_path):
    run(ops, tmp_path / "seed", shard_tokens(ops, 0))
    _, weights, _, _ = load_state(tmp_path / "seed")
    counters = ops.accumulate(TINY_TARGET, shard_tokens(ops, 0), batch=2, lr=3e-3, unroll=2, reg_weight=1.0, replay=0.0,
                              device="cpu", state_dir=tmp_path / "state", init_head=ops.OUT, shard_convs=SHARD_CONVS,
                              max_len=128, save_every_s=60.0)
    assert counters["position"] == SHARD_CONVS and counters["step"] == counters["adam_step"] == 2
    trained = load_state(tmp_path / "state")[0]
    assert not torch.equal(trained["fc.weight"], weights["fc.weight"])
    with pytest.raises(SystemExit, match="shards of 3 conversations"):
        ops.accumulate(TINY_TARGET, 1, batch=2, lr=3e-3, unroll=2, reg_weight=1.0, replay=0.0, device="cpu",
                       state_dir=tmp_path / "state", shard_convs=4, max_len=128)


def test_the_command_line_resumes_from_specbus_home_else_the_served_head(ops, tmp_path):
    """Training state lives under $SPECBUS_HOME, not in models/: with none there a run seeds from
    the served head at its data position, or a fresh head with --fresh; with one, it resumes it."""
    home_state = tmp_path / "home" / "train" / "smollm2-eagle"
    assert state_home() == home_state
    assert accumulate_start(None, None, 0, False, ops.OUT) == (home_state, ops.OUT, SERVED_CONVS)
    assert accumulate_start(None, None, 0, True, ops.OUT) == (home_state, None, 0)
    run(ops, home_state, shard_tokens(ops, 0))
    assert accumulate_start(None, None, 0, False, ops.OUT) == (home_state, None, 0)
