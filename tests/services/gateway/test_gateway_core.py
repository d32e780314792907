"""The gateway's NATS-free logic: bodies and their mapping, errors, keys, chat templates, token
texts and the response shapes built from StreamChunks (the HTTP side is tests/system/test_gateway.py)."""

import json

import numpy as np
import pytest
from pydantic import ValidationError

from text.tokenizer import load_tokenizer
from schemas.config import TINY_TARGET
from schemas.errors import ErrorCode, SpecbusError
from schemas.streams import StreamChunk, TokenLogprob, Usage
from services.gateway.gateway_core import MAX_CHOICES, MAX_MESSAGE_CHARS, NEG_INF_LOGPROB, ApiError, ChatBody, Choice, CompletionBody, Login, TokenTexts, VerifierLimits, chat_plans, clip, completion_plans, declared_length, framework_error, gateway_logins, merge_pieces, needs_api_key, speculation_json, usage_json, user_for_key, validation_error
from services.runtime.auth import api_key_env, generate_api_keys


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_TARGET)


def errors_of(model, body):
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    return validation_error([dict(e, loc=("body", *e["loc"])) for e in caught.value.errors()])  # as FastAPI has them


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "prompt": "x", "temperature": 0, "best_of": 2, "frequency_penalty": "high"}, "frequency_penalty"),
    ({"model": "m", "prompt": "x", "logit_bias": {"5": "ban"}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "tools": []}, "tools"),
    ({"model": "m", "prompt": {"text": "x"}}, "prompt"),
    ({"model": "m", "prompt": "x", "n": 0}, "n"),
    ({"model": "m"}, "prompt"),
])
def test_a_bad_completion_body_names_the_field(body, param):
    error = errors_of(CompletionBody, body)
    assert (error.status, error.param) == (400, param) and error.message.startswith(param)


def test_a_bad_chat_message_names_its_index_and_field():
    error = errors_of(ChatBody, {"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": ""}]})
    assert error.param == "messages[1].role"
    assert errors_of(ChatBody, {"model": "m", "messages": []}).param == "messages"


def test_specbus_errors_map_to_statuses_and_the_bodys_names():
    error = ApiError.from_specbus(SpecbusError(ErrorCode.invalid_field, "bad", "logprobs.logprobs"),
                                  {"logprobs": "top_logprobs"})
    assert (error.status, error.param, error.type) == (400, "top_logprobs", "invalid_request_error")
    statuses = {code: ApiError.from_specbus(SpecbusError(code, "m")).status for code in ErrorCode}
    assert statuses[ErrorCode.overloaded] == 429 and statuses[ErrorCode.unavailable] == 503
    assert statuses[ErrorCode.timeout] == 504 and statuses[ErrorCode.not_found] == 404
    assert ApiError(401, "no").to_json() == {"error": {"message": "no", "type": "invalid_request_error",
                                                       "param": None, "code": None}}


def test_completion_plans_give_n_choices_per_prompt_with_derived_seeds(tokenizer):
    body = CompletionBody(model="m", prompt=[[4, 9], [5, 6]], n=2, seed=7, echo=True, logprobs=1, max_tokens=3)
    plans = completion_plans(body, TokenTexts(tokenizer), timeout_s=30.0)
    assert [p.index for p in plans] == [0, 1, 2, 3]
    assert [p.request.sampling.seed for p in plans] == [7, 8, 7, 8]
    assert plans[2].request.prompt_token_ids.tolist() == [5, 6] and plans[2].echo_text == tokenizer.decode([5, 6])
    assert plans[0].request.logprobs.prompt_logprobs == 1 and plans[0].request.timeout_s == 30.0
    assert CompletionBody(model="m", prompt="a").n == 1
    assert completion_plans(CompletionBody(prompt="a"), TokenTexts(tokenizer), 30.0)[0].request.sampling.max_tokens == 16


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["a"] * (MAX_CHOICES + 1)}, "n"),
    ({"prompt": "a", "top_p": 0.0}, "top_p"),
    ({"prompt": [], "n": 1}, "prompt"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "draft_mode": "sample", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),  # only with stream
    ({"prompt": "a", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),  # vLLM: not in a stream
])
def test_completion_plans_refuse_what_specbus_cannot_do_naming_the_field(tokenizer, body, param):
    with pytest.raises(ApiError) as caught:
        completion_plans(CompletionBody(model="m", **body), TokenTexts(tokenizer), 30.0)
    assert (caught.value.status, caught.value.param) == (400, param)


def test_chat_plans_send_the_messages_and_map_max_completion_tokens_and_top_logprobs():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                  {"type": "text", "text": "b"}]}]
    body = ChatBody(model="m", messages=messages, max_completion_tokens=5, logprobs=True, top_logprobs=3, n=2)
    plans = chat_plans(body, default_max_tokens=99, timeout_s=30.0)
    request = plans[1].request
    assert [(m.role, m.content) for m in request.messages] == [("system", "S"), ("user", "ab")]
    assert (request.sampling.max_tokens, request.logprobs.logprobs, plans[1].index) == (5, 3, 1)
    hi = [{"role": "user", "content": "hi"}]
    assert chat_plans(ChatBody(model="m", messages=hi), 99, 30.0)[0].request.sampling.max_tokens == 99
    with pytest.raises(ApiError) as caught:
        chat_plans(ChatBody(model="m", messages=hi, top_logprobs=2), 99, 30.0)
    assert caught.value.param == "top_logprobs"
    with pytest.raises(ApiError) as caught:
        chat_plans(ChatBody(model="m", messages=hi, max_completion_tokens=10**6), 99, 30.0)
    assert caught.value.param == "max_completion_tokens"


def test_api_keys_come_from_the_environment_and_are_checked(monkeypatch):
    keys = generate_api_keys(["alice", "bob-2"])
    assert set(keys) == {"SPECBUS_ALICE_API_KEY", "SPECBUS_BOB_2_API_KEY"} and api_key_env("bob-2") in keys
    env = {"SPECBUS_CLIENT_USERS": "alice,bob-2", "SPECBUS_ALICE_NATS_PASSWORD": "p1",
           "SPECBUS_BOB_2_NATS_PASSWORD": "p2", **keys}
    logins = gateway_logins(env)
    assert [(login.user, login.password) for login in logins] == [("alice", "p1"), ("bob-2", "p2")]
    assert user_for_key(logins, f"Bearer {keys['SPECBUS_BOB_2_API_KEY']}") == "bob-2"
    for header in (None, "", "Bearer ", "Basic abc", f"Bearer {keys['SPECBUS_ALICE_API_KEY']}x"):
        with pytest.raises(ApiError) as caught:
            user_for_key(logins, header)
        assert (caught.value.status, caught.value.code) == (401, "invalid_api_key")
    with pytest.raises(SpecbusError) as caught:
        gateway_logins({k: v for k, v in env.items() if k != "SPECBUS_BOB_2_API_KEY"})
    assert caught.value.field == "SPECBUS_BOB_2_API_KEY"
    assert user_for_key([Login("a", "p", "k")], "bearer k") == "a"


def test_token_texts_keep_the_exact_bytes_of_a_split_character(tokenizer):
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("é€")
    raw = b"".join(texts.get(i)[0] for i in ids)
    assert raw == "é€".encode()
    assert all(texts.text(i) == tokenizer.decode([i]) for i in tokenizer.encode("def main():\n    return 1"))
    assert texts.text(tokenizer.eos_ids[0]) == "<|endoftext|>"


def chunk(seq, ids, *, final=None, logprobs=True, **fields):
    entries = [TokenLogprob(token_id=i, logprob=-0.5 * (k + 1), top_ids=np.array([i, 7]),
                            top_logprobs=np.array([-0.5 * (k + 1), float("-inf")])) for k, i in enumerate(ids)]
    return StreamChunk(request_id="r", seq=seq, token_ids=np.array(ids), text="".join(f"<{i}>" for i in ids),
                       from_draft=[False] * len(ids), logprobs=entries if logprobs else None, finish_reason=final,
                       usage=Usage(prompt_tokens=3, completion_tokens=len(ids), draft_tokens_proposed=4,
                                   draft_tokens_accepted=2, steps=1, speculative_lengths=[0, 0, 0, 0, 1])
                       if final else None, **fields)


def test_completion_pieces_carry_openai_logprobs_offsets_and_degraded(tokenizer):
    choice = Choice(0, TokenTexts(tokenizer), top_n=1)
    ids = tokenizer.encode("ab cd")
    first = choice.completion_piece(chunk(0, ids[:1], degraded=["draft_timeout"]))
    last = choice.completion_piece(chunk(1, ids[1:], final="eos"))
    assert first["finish_reason"] is None and last["finish_reason"] == "stop"
    assert first["degraded"] == ["draft_timeout"] and "degraded" not in last
    merged = merge_pieces("completion", [first, last])
    assert merged["degraded"] == ["draft_timeout"] and merged["finish_reason"] == "stop"
    tokens = [tokenizer.decode([i]) for i in ids]
    assert merged["logprobs"]["tokens"] == tokens
    assert merged["logprobs"]["text_offset"] == [sum(len(t) for t in tokens[:k]) for k in range(len(ids))]
    assert merged["logprobs"]["top_logprobs"][0] == {tokens[0]: -0.5}
    assert usage_json([choice], n=1) == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                         "completion_tokens_details": {"accepted_prediction_tokens": 2,
                                                                       "audio_tokens": 0, "reasoning_tokens": 0,
                                                                       "rejected_prediction_tokens": 2}}
    assert speculation_json([choice]) == {"draft_tokens_proposed": 4, "draft_tokens_accepted": 2,
                                          "acceptance_rate": 0.5, "steps": 1, "speculative_lengths": [0, 0, 0, 0, 1]}
    other = Choice(1, TokenTexts(tokenizer), top_n=1)
    other.finish(StreamChunk(request_id="s", seq=0, finish_reason="length", usage=Usage(steps=3,
                                                                                    speculative_lengths=[2, 1])))
    assert speculation_json([choice, other])["speculative_lengths"] == [2, 1, 0, 0, 1]  # summed per k


def test_chat_logprobs_write_minus_infinity_as_a_finite_number(tokenizer):
    choice = Choice(0, TokenTexts(tokenizer), top_n=2)
    piece = choice.chat_piece(chunk(0, [tokenizer.encode("x")[0]], final="length"), delta=False)
    entry = piece["logprobs"]["content"][0]
    assert entry["token"] == "x" and entry["bytes"] == [ord("x")] and entry["logprob"] == -0.5
    assert [t["logprob"] for t in entry["top_logprobs"]] == [-0.5, NEG_INF_LOGPROB]
    assert piece["message"] == {"role": "assistant", "content": piece["message"]["content"]}
    json.dumps(piece, allow_nan=False)


def test_a_timed_out_request_is_a_504_and_usage_counts_each_prompt_once(tokenizer):
    with pytest.raises(ApiError) as caught:
        Choice(0, TokenTexts(tokenizer), None).completion_piece(chunk(0, [], final="timeout"))
    assert caught.value.status == 504
    choices = [Choice(i, TokenTexts(tokenizer), None) for i in range(4)]
    for c in choices:
        c.completion_piece(chunk(0, [1, 2], final="length"))
    usage = usage_json(choices, n=2)  # 2 prompts x 2 choices
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (6, 8, 14)


def test_custom_roles_and_extra_message_fields_are_taken_and_the_template_gets_role_and_content():
    messages = [{"role": "tool", "content": "42", "tool_call_id": "c1"},
                {"role": "assistant", "content": None, "tool_calls": [], "name": "bot"},
                {"role": "user", "content": [{"type": "text", "text": "x"}], "name": "ann"}]
    plans = chat_plans(ChatBody(messages=messages), 99, 30.0)
    assert [(m.role, m.content) for m in plans[0].request.messages] == [("tool", "42"), ("assistant", ""),
                                                                        ("user", "x")]
    assert errors_of(ChatBody, {"messages": [{"role": "r" * 65, "content": "x"}]}).param == "messages[0].role"
    assert errors_of(ChatBody, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).param \
        .startswith("messages[0].content")


def test_echoed_prompt_ids_are_their_tokens_text_and_offsets_agree_with_it(tokenizer):
    """Special tokens included (the echoed prompt keeps them; generated text leaves them out,
    so there they take no room), and a character split across tokens begins in the first."""
    texts = TokenTexts(tokenizer)
    eos = tokenizer.eos_ids[0]
    prompt = [eos, eos, *tokenizer.encode("é€ x")]
    body = CompletionBody(prompt=prompt, echo=True, logprobs=0, max_tokens=4)
    [plan] = completion_plans(body, texts, 30.0)
    assert plan.echo_text == texts.join(prompt) == "<|endoftext|><|endoftext|>é€ x"
    choice = Choice(0, texts, top_n=0, echo_text=plan.echo_text)
    euro, tail = tokenizer.encode("-€"), [eos, *tokenizer.encode("y")]
    assert any("\ufffd" in texts.text(i) for i in euro)  # the tokenizer splits the character
    first = chunk(0, euro, prompt_token_ids=np.array(prompt), prompt_logprobs=[None] * len(prompt))
    last = chunk(1, tail, final="length")
    pieces = [choice.completion_piece(first.model_copy(update={"text": "-€"})),
              choice.completion_piece(last.model_copy(update={"text": "y"}))]
    merged = merge_pieces("completion", pieces)
    text, tokens, offsets = merged["text"], merged["logprobs"]["tokens"], merged["logprobs"]["text_offset"]
    assert text == "<|endoftext|><|endoftext|>é€ x-€y"
    ids = [*prompt, *euro, *tail]
    spans = [text[start:end] for start, end in zip(offsets, offsets[1:] + [len(text)])]
    assert "".join(spans) == text
    for position, (token_id, token, span) in enumerate(zip(ids, tokens, spans)):
        if position >= len(prompt) and token_id == eos:
            assert span == ""  # a generated special token is not in the text
        elif "\ufffd" not in token:
            assert span == token, (position, token, span)


def test_prompt_logprobs_have_vllms_shape(tokenizer):
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("ab cd")
    entries = [None] + [TokenLogprob(token_id=i, logprob=-1.0, rank=3, top_ids=np.array([7, 8]),
                                     top_logprobs=np.array([-0.5, float("-inf")])) for i in ids[1:]]
    choice = Choice(0, texts, top_n=None, prompt_top_n=1)
    piece = choice.completion_piece(chunk(0, [], final="length", logprobs=False,
                                          prompt_token_ids=np.array(ids), prompt_logprobs=entries))
    scored = piece["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    assert scored[1] == {"7": {"logprob": -0.5, "rank": 1, "decoded_token": texts.text(7)},
                         str(ids[1]): {"logprob": -1.0, "rank": 3, "decoded_token": texts.text(ids[1])}}
    assert merge_pieces("completion", [piece])["prompt_logprobs"] == scored
    body = CompletionBody(prompt="a", echo=True, logprobs=2, prompt_logprobs=4)
    assert completion_plans(body, texts, 30.0)[0].request.logprobs.prompt_logprobs == 4
    assert body.param_names() == {"prompt_token_ids": "prompt"}


def test_echoed_inputs_and_whole_messages_are_clipped():
    assert clip("m" * 8_000_000) == "m" * 64 + "... (8000000 characters)"
    error = ApiError(404, "x" * 10_000, param="p" * 10_000)
    assert len(error.message) < MAX_MESSAGE_CHARS + 30 and len(error.param) < 200
    named = validation_error([{"type": "extra_forbidden", "loc": ("body", "k" * 1000), "msg": "Extra inputs"}])
    assert len(named.message) < 200


def test_framework_errors_and_unparsable_bodies_are_openai_errors():
    assert framework_error(404, "GET", "/v1/nothing").to_json()["error"] == {
        "message": "no such route: GET /v1/nothing", "type": "not_found_error", "param": None, "code": "not_found"}
    assert framework_error(405, "DELETE", "/v1/models", "GET").code == "method_not_allowed"
    assert framework_error(400, "POST", "/v1/completions").code == "invalid_json"
    error = validation_error([{"type": "json_invalid", "loc": ("body", 12), "msg": "JSON decode error",
                               "ctx": {"error": "Expecting value"}}])
    assert (error.status, error.param, error.code) == (400, None, "invalid_json") and "character 12" in error.message


def test_limits_before_work():
    assert needs_api_key("/v1/models") and needs_api_key("/v1/anything") and not needs_api_key("/health")
    assert declared_length([(b"content-length", b"10")], 100) == 10
    assert declared_length([(b"transfer-encoding", b"chunked")], 100) is None
    with pytest.raises(ApiError) as caught:
        declared_length([(b"content-length", b"300000000")], 8 << 20)
    assert (caught.value.status, caught.value.code) == (413, "request_too_large")
    with pytest.raises(ApiError) as caught:
        declared_length([(b"content-length", b"ten")], 100)
    assert caught.value.status == 400


def test_max_model_len_is_the_smallest_live_verifiers():
    from types import SimpleNamespace

    def beat(instance_id, limit, role="verifier"):
        return SimpleNamespace(instance_id=instance_id, role=role, model_ids={"max_seq_len": str(limit)},
                               interval_s=1.0)

    limits = VerifierLimits()
    assert limits.max_model_len(now=0.0) is None
    limits.observe(beat("v0", 2048), now=0.0)
    limits.observe(beat("v1", 1024), now=1.0)
    limits.observe(beat("d0", 64, role="drafter"), now=1.0)
    assert limits.max_model_len(now=2.0) == 1024
    assert limits.max_model_len(now=3.5) == 1024 and limits.max_model_len(now=4.5) is None  # 3 intervals silent
