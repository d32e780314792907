"""ops/bench/bench_pipeline.py end to end with tiny random models and tiny settings: every
section is in the JSON with sane numbers (no timing assertions), the plot is written, and the
assistant export keeps the draft's greedy choices. Plus the acceptance arithmetic by hand."""

import json
import math

import pytest

from ops.bench.bench_pipeline import acceptance, decode_steps, main
from schemas.streams import StreamChunk

MAX_TOKENS, K = 6, 2


def chunk(num_tokens: int, num_accepted: int, degraded=()) -> StreamChunk:
    return StreamChunk(request_id="r", seq=0, token_ids=list(range(num_tokens)),
                       from_draft=[i < num_accepted for i in range(num_tokens)], degraded=list(degraded))


def test_decode_steps_and_acceptance_by_hand():
    # prefill emits 1; then steps with 2 drafts: all accepted (3 tokens), none (1), one (2);
    # then (3 left of 10) a step flagged draft_timeout: planned 0; then 2 left: 1 draft planned.
    chunks = [chunk(1, 0), chunk(3, 2), chunk(1, 0), chunk(2, 1), chunk(1, 0, ["draft_timeout"]), chunk(1, 0)]
    steps = decode_steps(chunks, k=2, max_tokens=10)
    assert steps == [(2, 2), (2, 0), (2, 1), (0, 0), (1, 0)]
    stats = acceptance(steps, k=2)
    # position 1 reached 4 times (accepted 2), position 2 reached twice (accepted once)
    assert stats["a_per_position"] == [0.5, 0.5]
    assert stats["a"] == pytest.approx(3 / 6)
    assert stats["full_steps"] == 3
    assert stats["measured_tokens_per_step"] == pytest.approx(6 / 3)
    assert stats["predicted_tokens_per_step"] == pytest.approx((1 - 0.5 ** 3) / 0.5)


def test_bench_smoke(tiny_random_pair, tmp_path):
    target, draft = tiny_random_pair
    out = main(["--target-model", str(target), "--draft-model", str(draft), "--prompts", "2",
                "--prompt-tokens", "16", "--max-tokens", str(MAX_TOKENS), "--ks", "0", str(K), "--peer-k", str(K),
                "--overhead-batches", "1", "2", "--scaling-batches", "1", "3", "--kernel-batch", "1",
                "--kernel-k", "1", "--kernel-vocab", "64", "--kernel-reps", "1", "--results", str(tmp_path / "out")])
    result = json.loads((out / "results.json").read_text())
    assert {"settings", "machine", "assistant_export", "peer", "speculation", "theory", "bus_overhead",
            "batch_scaling", "kernels"} <= set(result)
    assert (out / "bench.png").stat().st_size > 1000
    assert "### Theory" in (out / "results.md").read_text()

    export = result["assistant_export"]
    assert export["argmax_agreement"] == 1.0 and export["outside_wins"] == 0

    peer = result["peer"]
    for name in ("hf_plain", "hf_assisted", "specbus"):
        assert peer[name]["tokens"] == 2 * MAX_TOKENS and peer[name]["tokens_per_s"] > 0
    assert peer["specbus_over_hf_plain"] > 0 and peer["specbus_over_hf_assisted"] > 0

    # greedy k=0 and K; sampled k=0, K with draft greedy, K with draft sample
    assert [(r["temperature"] > 0, r["draft_mode"], r["k"]) for r in result["speculation"]] == [
        (False, "greedy", 0), (False, "greedy", K), (True, "greedy", 0), (True, "greedy", K), (True, "sample", K)]
    for row in result["speculation"]:
        assert row["tokens"] == 2 * MAX_TOKENS and row["degraded_steps"] == {}
        assert 1.0 <= row["tokens_per_forward"] <= row["k"] + 1
        assert row["ratio_to_k0"] > 0
    assert len(result["theory"]) == 3
    for row in result["theory"]:
        assert 0.0 <= row["a"] <= 1.0
        assert all(a is None or 0.0 <= a <= 1.0 for a in row["a_per_position"])
        assert 1.0 <= row["predicted_tokens_per_step"] <= K + 1
        assert math.isfinite(row["measured_over_predicted"]) and row["measured_over_predicted"] > 0

    assert [r["batch"] for r in result["bus_overhead"]] == [1, 2]
    for row in result["bus_overhead"]:
        assert row["inprocess_tokens_per_s"] > 0 and row["pipeline_tokens_per_s"] > 0
        assert row["pipeline_steps"] >= row["inprocess_steps"] / 2 > 0
        assert set(row["step_ms"]) == {"schedule", "draft", "verify", "commit", "codec"}
        assert row["step_ms"]["verify"] > 0 and row["step_ms"]["codec"] > 0
    assert [(r["batch"], r["requests"], r["tokens"]) for r in result["batch_scaling"]] == [
        (1, 2, 2 * MAX_TOKENS), (3, 3, 3 * MAX_TOKENS)]
    assert [(r["B"], r["K"], r["V"]) for r in result["kernels"]] == [(1, 1, 64)]
